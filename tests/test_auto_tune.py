"""A measured ``auto`` (CPOptions.auto_tune / CHARM_AUTO_TUNE, ops/auto_tune.py): the model's
shortlist timed once per shape on the call's own inputs, the ranks' times shared, the pick
whose slowest rank was fastest run from then on (issue 24: auto within 5 % of the fastest)."""

import math

import auto_tune_cases as cases
import pytest

from charm_megatron.local_ranks import run_ranks
from charm_megatron.ops import auto_tune
from charm_megatron.ops.options import DEFAULT_TUNE_MARGIN, CPOptions


def test_shortlist_keeps_the_predictions_within_the_margin_in_model_order():
    ranked = ((1.0, "a2a"), (1.28, "charm"), (1.6, "ring"))
    assert auto_tune.shortlist(ranked, 1.0) == ("a2a",)
    assert auto_tune.shortlist(ranked, 1.3) == ("a2a", "charm")
    assert auto_tune.shortlist(ranked, math.inf) == ("a2a", "charm", "ring")


def test_pick_is_the_candidate_whose_slowest_rank_was_fastest():
    short = ("a2a", "charm", "ring")
    # a2a is fastest on rank 0 but slowest on rank 1; charm's worst rank beats the others'.
    assert auto_tune.pick(short, [(1.0, 1.2, 2.0), (1.5, 1.3, 2.0)]) == "charm"
    # A candidate that failed on one rank (inf) never wins; ties go to the model's order.
    assert auto_tune.pick(short, [(1.0, 1.0, 1.0), (math.inf, 1.0, 1.0)]) == "charm"
    with pytest.raises(ValueError, match="failed"):
        auto_tune.pick(short[:1], [(math.inf,), (1.0,)])


@pytest.mark.parametrize("value, margin", [(None, None), ("off", None), ("0", None),
                                           ("on", DEFAULT_TUNE_MARGIN), (True, 1.5),
                                           ("1.3", 1.3), (2, 2.0), ("all", math.inf)])
def test_auto_tune_option_values(value, margin):
    assert CPOptions(auto_tune=value).auto_tune == margin
    if isinstance(value, str):
        assert CPOptions.from_env({"CHARM_AUTO_TUNE": value}).auto_tune == margin


@pytest.mark.parametrize("value", ["0.5", "fast", -1, math.nan])
def test_bad_auto_tune_names_the_variable(value):
    with pytest.raises(ValueError, match="CHARM_AUTO_TUNE"):
        CPOptions(auto_tune=value)


def test_measured_pick_overrules_the_model_on_every_rank_and_is_correct():
    res = run_ranks(cases.measured_pick, 4, timeout_s=240)
    first = res[0]
    picks = {r["pick"] for r in res} | {r["resolved"] for r in res}
    expected = next(a for a in cases.ALGOS if a not in (first["model"], first["failing"]))
    assert picks == {expected}, res
    for r in res:
        # Each candidate measured once, at the first call only; the second layer reused it.
        assert sorted(r["measured_first"]) == sorted(cases.ALGOS)
        assert r["measured_total"] == len(cases.ALGOS)
        assert max(r["errors"]) < 1e-5, r["errors"]
        # Every rank read the same table: rank 1's slow model pick, rank 2's failure.
        assert r["seconds"] == first["seconds"]
    model_i = first["shortlist"].index(first["model"])
    fail_i = first["shortlist"].index(first["failing"])
    assert first["seconds"][1][model_i] > 30 and math.isinf(first["seconds"][2][fail_i])


def test_a_rank_that_lost_its_picks_is_named_not_run():
    res = run_ranks(cases.lost_picks, 4, timeout_s=240)
    for outcome, err, measured in res:
        assert "auto-tune picks held" in outcome, outcome
        assert err < 1e-5 and measured


def test_a_peer_silent_before_the_times_are_shared_gives_an_error_not_a_hang():
    res = run_ranks(cases.peer_stalls_while_measuring, 4, timeout_s=180)
    for rank, r in enumerate(res):
        if rank == 1:
            continue
        outcome, seconds = r
        assert outcome == "CPAttentionError", r
        assert seconds < 60, r
