"""Issue 26 item 6: an algorithm with a setting of its own, added in one builder and one
registry entry (tests/toy_with_setting.py, nothing else), is seen by cp_attention and its
options, the agreement check, ``charm-megatron plan``, the model, ``auto`` and the bench."""

from __future__ import annotations

import pytest
import toy_with_setting as toy

from charm_megatron import CPOptions
from charm_megatron.cli import main as cli_main
from charm_megatron.lab.bench.config import parse_settings
from charm_megatron.lab.bench.contenders import PlanContender
from charm_megatron.local_ranks import run_ranks
from charm_megatron.model import choose_algo, predict, variants
from charm_megatron.model.cluster import default_cluster_for
from charm_megatron.ops.options import ENV_VARS
from charm_megatron.plan import registry
from charm_megatron.plan.cost import Problem

GROUPS = ((0, 1, 2, 3),)
PROBLEM = Problem(1, 16384, 8, 8, 64, 2)


@pytest.fixture
def registered():
    toy.ensure_registered()
    try:
        yield toy.NAME
    finally:
        registry.unregister(toy.NAME)


def test_the_setting_is_an_option_a_variable_and_a_flag(registered, capsys):
    assert CPOptions(toy_overlap="on").toy_overlap is toy.Overlap.ON
    assert CPOptions().setting("toy_overlap") is toy.Overlap.AUTO  # its declared default
    assert CPOptions.from_env({"CHARM_TOY_OVERLAP": "off"}).toy_overlap is toy.Overlap.OFF
    assert ENV_VARS["CHARM_TOY_OVERLAP"][0] == "toy_overlap"
    with pytest.raises(ValueError, match="toy_overlap='sometimes' \\(CHARM_TOY_OVERLAP\\)"):
        CPOptions(toy_overlap="sometimes")
    printouts = {}
    for mode in ("on", "off"):
        assert cli_main(["plan", "--cp", "4", "--algo", registered, "--rank", "1",
                         "--toy-overlap", mode]) == 0
        printouts[mode] = capsys.readouterr().out
    # on: the next exchange is posted before the tile that waits for the previous one
    assert "toy.kv1" in printouts["on"] and "toy.kv1" not in printouts["off"]


def test_the_model_and_auto_weigh_its_variant(registered):
    cluster = default_cluster_for(GROUPS)
    on, off = (predict(registered, GROUPS, PROBLEM, cluster, True, toy_overlap=m)
               for m in ("on", "off"))
    assert on.forward.time_s < off.forward.time_s  # the premise of the picks below
    assert variants(registered, GROUPS, PROBLEM, cluster)[0].overlap  # auto: the model's pick
    tuned = predict(registered, GROUPS, PROBLEM, cluster, True, tune=True)
    assert tuned.forward.time_s == on.forward.time_s
    untuned = predict(registered, GROUPS, PROBLEM, cluster, True)  # no profile: auto is off
    assert untuned.forward.time_s == off.forward.time_s
    # auto's candidates include it, each weighed with the variant it would run
    totals = {a: predict(a, GROUPS, PROBLEM, cluster, True, tune=True).total_s
              for a in registry.names()}
    assert choose_algo(GROUPS, PROBLEM, cluster) == min(totals, key=totals.get)
    assert choose_algo(GROUPS, PROBLEM, cluster, algos=(registered,)) == registered


def test_the_bench_passes_it_to_every_contender(registered):
    settings = parse_settings(["toy_overlap=on"])
    contender = PlanContender(registered, None, True, settings=settings)
    assert contender.options.toy_overlap is toy.Overlap.ON
    assert contender.ablated("compute_only").options.toy_overlap is toy.Overlap.ON
    with pytest.raises(SystemExit, match="toy_overlap"):
        parse_settings(["toy_overlap=sometimes"])
    with pytest.raises(SystemExit, match="NAME one of .*toy_overlap"):
        parse_settings(["overlap=on"])


def test_it_runs_on_gloo_ranks_and_the_ranks_agree_on_it():
    for mode in ("on", "off"):
        for rank, res in enumerate(run_ranks(toy.run_registered, 4, [mode] * 4,
                                             timeout_s=120)):
            assert res[0] == "ok" and res[1] < 1e-5, (mode, rank, res)
            assert res[2] is (mode == "on"), (mode, rank, res)
    for rank, res in enumerate(run_ranks(toy.run_registered, 4, ["on"] * 3 + ["off"],
                                         timeout_s=120)):
        assert res[0] == "CPMismatchError" and "toy_overlap" in res[1], (rank, res)
