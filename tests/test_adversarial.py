"""Issue 42: what an adversarial user broke, each case in its own ranks under a hard bound."""

import importlib.util
import os
import time

import adversarial_cases as cases
import pytest

from charm_megatron import local_ranks
from charm_megatron.local_ranks import RankFailure, run_ranks

JOB_S = 120


@pytest.mark.parametrize("world,cases_", [
    (2, [("ring", None, False, 9, 3, 0), ("rmplus", None, False, 9, 3, 0),
         ("charm", "2x1", False, 9, 3, 0), ("auto", None, False, 9, 3, 0),
         ("a2a+p2p", "2x1", False, 9, 3, 0), ("ring", None, False, 7, 1, 2),
         ("charm", "2x1", False, 5, -1, 2)]),
    (4, [("ring", None, False, 9, 3, 0), ("charm", "2x2", False, 9, 3, 0),
         ("charm", "2x2", False, 7, 4, 4), ("rmplus", None, False, 11, 6, 1)]),
], ids=["2-ranks", "4-ranks"])
def test_odd_local_lengths_under_a_window_match_float64(world, cases_):
    """An odd number of rows per rank without a causal mask: the executor's half buffers
    hold the second half's extra row (it used to send five rows into a four-row buffer, and
    gloo killed the receiving rank)."""
    for res in run_ranks(cases.odd_rows_under_a_window, world, cases_, timeout_s=JOB_S):
        for case, err in res.items():
            assert err < 1e-5, (case, err)


@pytest.mark.parametrize("big_mb", [0, 64])
def test_run_ranks_reports_a_rank_gloo_aborted(big_mb):
    """Item 8: a rank that gloo aborts is reported (its exit code), never waited on, also
    while another rank hands back a large result."""
    t0 = time.monotonic()
    with pytest.raises(RankFailure, match=r"exited without a result|failed"):
        run_ranks(cases.gloo_kills_a_rank, 3, big_mb, timeout_s=JOB_S, pg_timeout_s=20)
    assert time.monotonic() - t0 < 40


def test_run_ranks_reports_an_aborted_rank_while_the_others_block():
    t0 = time.monotonic()
    with pytest.raises(RankFailure, match=r"ranks \[1\] exited without a result.*-6"):
        run_ranks(cases.abort_at_once, 2, timeout_s=JOB_S, pg_timeout_s=30)
    assert time.monotonic() - t0 < 20


def test_every_rank_starts_with_the_preloaded_modules():
    """What ``local_ranks.preload`` added (conftest.py: megatron-core) is imported once, in the
    forkserver: every rank starts with each module of the list that imports here; adding to
    the list once the server runs is refused (it would be silently ignored)."""
    want = [m for m in local_ranks._PRELOAD if importlib.util.find_spec(m.split(".")[0])]
    assert "megatron.core" in want or importlib.util.find_spec("megatron") is None \
        or os.environ.get("MEGATRON_LM_PATH", "").strip()
    for got in run_ranks(cases.loaded, 2, list(local_ranks._PRELOAD), timeout_s=JOB_S):
        assert got == want
    with pytest.raises(RuntimeError, match="after the first run_ranks"):
        local_ranks.preload("json")
    assert "json" not in local_ranks._PRELOAD
