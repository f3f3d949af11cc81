"""Softmax offsets (sinks) and sliding windows against adversarial inputs, on real gloo ranks
against float64 references (tests/adversarial_sink_window_cases.py):

* offset values that differ between ranks, or hold a NaN / an inf on one rank, are refused on
  every rank before any data moves, naming ``softmax_offset``; a learnable sink that changes
  every step still passes the forward's and the backward's agreement;
* packed THD with a sink: padding rows keep ``lse = -inf``, zero outputs and gradients, and
  add nothing to the sink's gradient (``dout`` non-zero there);
* the per-rank sink gradient is the share of the rank's own query rows under every algorithm
  (the head all-to-alls included);
* windows written differently that are the same mask (causal's right side, ``(-1, -1)`` and
  ``None``, a side reaching the whole sequence) run as one; windows that differ are refused.
"""

import adversarial_sink_window_cases as cases
import pytest

from charm_megatron.local_ranks import run_ranks

JOB_S = 240
F64 = 1e-10


# ------------------------------------------------------------------ issue 3: offset values
@pytest.mark.parametrize("algo,topology,world", [("ring", None, 2), ("a2a", None, 2),
                                                 ("charm", "2x2", 4)])
def test_offset_values_that_differ_raise_on_every_rank_before_data_moves(algo, topology, world):
    res = run_ranks(cases.offset_values_differ, world, algo, topology, "values",
                    timeout_s=JOB_S)
    for rank, r in enumerate(res):
        assert r["kind"] == "CPMismatchError", (rank, r)
        assert "softmax_offset values" in r["text"], (rank, r["text"])
        assert r["transfers"] == 0, (rank, r)  # refused before any data moved
        assert all(e < F64 for e in r["after"].values()), (rank, r["after"])


@pytest.mark.parametrize("bad", ["nan", "inf"])
def test_a_non_finite_offset_is_refused_on_its_rank_and_quoted_on_the_others(bad):
    res = run_ranks(cases.offset_values_differ, 2, "ring", None, bad, timeout_s=JOB_S)
    for rank, r in enumerate(res):
        if rank == 1:
            assert r["kind"] == "ValueError", r
        else:
            assert r["kind"] == "CPMismatchError" and "rank 1" in r["text"], r
        assert "softmax_offset" in r["text"] and "non-finite" in r["text"], (rank, r["text"])
        assert f"head 2: {bad}" in r["text"], (rank, r["text"])  # the head and value quoted
        assert r["transfers"] == 0, (rank, r)
        assert all(e < F64 for e in r["after"].values()), (rank, r["after"])


@pytest.mark.parametrize("algo,topology,world", [("ring", None, 2), ("a2a+p2p", "2x2", 4)])
def test_a_learnable_sink_that_changes_every_step_passes_both_agreements(algo, topology,
                                                                         world):
    res = run_ranks(cases.learnable_sink_steps, world, algo, topology, 3, timeout_s=JOB_S)
    for rank, steps in enumerate(res):
        assert len(steps) == 3
        for step, errs in enumerate(steps):
            assert all(e < F64 for e in errs.values()), (rank, step, errs)


# ---------------------------------------------------------- issue 4: THD padding with a sink
PACKED = {2: [("ring", None), ("a2a", None)],
          4: [("ring", None), ("rmplus", None), ("charm", "2x2"), ("allgather", None),
              ("a2a+p2p", "2x2")]}


@pytest.mark.parametrize("world", sorted(PACKED))
def test_packed_padding_rows_with_a_sink_are_empty_and_add_nothing_to_its_gradient(world):
    todo = [(algo, topo, causal, docs) for algo, topo in PACKED[world]
            for causal in (True, False) for docs in ("unequal", "short")]
    res = run_ranks(cases.packed_sink_padding, world, todo, timeout_s=JOB_S)
    bad = [f"{c} rank {r}: {n} {e:.3g}" for r, per in enumerate(res) for c, errs in per.items()
           for n, e in errs.items() if not e < F64]
    assert not bad, "\n".join(bad)


# ------------------------------------------------- issue 5: the per-rank sink gradient rule
def test_each_ranks_sink_gradient_is_its_own_rows_share_under_every_algorithm():
    todo = [(algo, topo, causal)
            for algo, topo in (("ring", None), ("rmplus", None), ("charm", "2x2"),
                               ("allgather", None), ("a2a", None), ("a2a+p2p", "2x2"))
            for causal in (True, False)]
    res = run_ranks(cases.per_rank_sink_grad, 4, todo, timeout_s=JOB_S)
    bad = [f"{c} rank {r}: {n} {e:.3g}" for r, per in enumerate(res) for c, errs in per.items()
           for n, e in errs.items() if not e < F64]
    assert not bad, "\n".join(bad)


# --------------------------------------------------------- issue 7: equivalent windows
# (causal, rank 0's window, the others', the mask both mean) at 8 rows per rank (S = 8 * world:
# a side >= S - 1 reaches every key).
EQUIVALENT = [
    (True, (2, 5), (2, 0), (2, 0)),  # any right side under causal
    (True, (2, -1), (2, 0), (2, 0)),
    (True, (-1, -1), None, (-1, -1)),
    (False, (-1, -1), None, (-1, -1)),
    (True, (100, 0), None, (-1, -1)),  # a left side beyond the sequence
    (True, (15, 3), (-1, -1), (-1, -1)),  # S - 1 = 15 at 2 ranks: every key
    (False, (15, 3), (-1, 3), (-1, 3)),
    (False, (3, 100), (3, -1), (3, -1)),
]
DIFFERENT = [
    (True, (2, 0), (3, 0)),
    (False, (2, 5), (2, 0)),  # the right side matters without causal
    (False, (14, 0), (-1, 0)),  # S - 2 = 14: query 15 loses key 0
]


def _ids(case) -> str:
    causal, mine, others = case[:3]
    return f"{'causal' if causal else 'full'}-{mine}-vs-{others}".replace(" ", "")


@pytest.mark.parametrize("algo,topology", [("ring", None), ("a2a", None)])
@pytest.mark.parametrize("causal,mine,others,ref", EQUIVALENT, ids=map(_ids, EQUIVALENT))
def test_windows_of_one_mask_run_as_one(algo, topology, causal, mine, others, ref):
    res = run_ranks(cases.window_variants, 2, algo, topology, causal, mine, others, ref,
                    timeout_s=JOB_S)
    for rank, r in enumerate(res):
        assert r["kind"] == "ok", (rank, r)
        assert all(e < F64 for e in r["errs"].values()), (rank, r["errs"])
        assert r["after"] < F64, (rank, r)


def test_windows_of_one_mask_run_as_one_on_charm():
    res = run_ranks(cases.window_variants, 4, "charm", "2x2", True, (3, 7), (3, 0), (3, 0),
                    timeout_s=JOB_S)
    for rank, r in enumerate(res):
        assert r["kind"] == "ok", (rank, r)
        assert all(e < F64 for e in r["errs"].values()), (rank, r["errs"])


@pytest.mark.parametrize("causal,mine,others", DIFFERENT, ids=map(_ids, DIFFERENT))
def test_windows_that_differ_are_refused_on_every_rank(causal, mine, others):
    res = run_ranks(cases.window_variants, 2, "ring", None, causal, mine, others, None,
                    timeout_s=JOB_S)
    for rank, r in enumerate(res):
        assert r["kind"] == "CPMismatchError" and "window_size" in r["text"], (rank, r)
        assert r["transfers"] == 0, (rank, r)
        assert r["after"] < F64, (rank, r)


def test_packed_windows_reaching_the_longest_document_are_unbounded():
    # "unequal" at 2 ranks: the longest document has 27 tokens, so a left side of 26 keeps
    # every key of every document; 25 does not.
    res = run_ranks(cases.thd_window_variants, 2, "ring", None, True, (26, 4), None,
                    (-1, -1), timeout_s=JOB_S)
    for rank, r in enumerate(res):
        assert r["kind"] == "ok", (rank, r)
        assert all(e < F64 for e in r["errs"].values()), (rank, r["errs"])
    res = run_ranks(cases.thd_window_variants, 2, "ring", None, True, (25, 0), None,
                    None, timeout_s=JOB_S)
    for rank, r in enumerate(res):
        assert r["kind"] == "CPMismatchError" and "window_size" in r["text"], (rank, r)
