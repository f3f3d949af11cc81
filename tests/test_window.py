"""Sliding windows (``cp_attention(window_size=(left, right))``) on real gloo ranks against a
float64 reference of the full sequence with the window's mask: out, lse, dq, dk, dv for every
algorithm (the head all-to-alls where the heads divide); windows inside a chunk, spanning several chunks and longer than the sequence;
causal with a left window and full attention with both sides; MHA and GQA; packed documents
(THD), the window measured inside each document."""

import pytest

import window_cases
from charm_megatron.local_ranks import run_ranks
from charm_megatron.plan.registry import CallTraits, refusal
from charm_megatron.topology import Topology

# (causal, left, right) at 8 rows per rank (chunks of 4 under the causal layout).
WINDOWS = ((True, 2, 0), (True, 9, 0), (True, 100, -1), (True, 1, 0),
           (False, 3, 5), (False, -1, 2), (False, 7, 7))
SETUPS = {
    1: [("ring", None)],
    2: [("a2a", None)],
    3: [("ring", None), ("rmplus", None), ("allgather", None)],
    4: [("ring", None), ("rmplus", None), ("charm", "2x2"), ("allgather", None),
        ("a2a", None), ("a2a+p2p", "2x2")],
}


def _legal(algo, topo, world, hkv):
    """Whether the algorithm's own check takes the case (the head all-to-alls split the kv
    heads over their group; window_cases runs 4 q heads)."""
    groups = Topology.parse(topo, world).groups if topo else (tuple(range(world)),)
    return refusal(algo, CallTraits(tuple(map(tuple, groups)), 4, hkv, windowed=True)) is None


@pytest.mark.parametrize("world", sorted(SETUPS))
def test_sbhd_matches_float64_reference(world):
    cases = [(algo, topo, causal, dtype, hkv, left, right)
             for algo, topo in SETUPS[world] for causal, left, right in WINDOWS
             for dtype, hkv in (("fp64", 2), ("fp32", 4), ("bf16", 4))
             if _legal(algo, topo, world, hkv)]
    res = run_ranks(window_cases.run_sbhd, world, cases, timeout_s=300)
    bad = [f"{c} rank {r}: {n} {e:.3g}" for r, per in enumerate(res) for c, errs in per.items()
           for n, e in errs.items() if not e < window_cases.TOL[c[3]]]
    assert not bad, "\n".join(bad)


# (causal, left, right) on packed documents: inside a chunk, across chunks, beyond documents.
THD_WINDOWS = ((True, 1, 0), (True, 5, 0), (True, 100, -1), (False, 2, 3), (False, -1, 0))
THD_SETUPS = {2: [("ring", None), ("rmplus", None), ("allgather", None), ("a2a", None)],
              4: [("ring", None), ("charm", "2x2"), ("a2a+p2p", "2x2")]}


@pytest.mark.parametrize("world", sorted(THD_SETUPS))
def test_thd_windows_match_each_documents_float64_reference(world):
    # Each document sees its own keys only, the window measured in its own positions;
    # documents of very unequal lengths with padding, GQA, fp64 and bf16.
    cases = [(algo, topo, causal, dtype, hkv, "unequal", left, right)
             for algo, topo in THD_SETUPS[world] for causal, left, right in THD_WINDOWS
             for dtype, hkv in (("fp64", 2), ("fp32", 4), ("bf16", 4))]
    res = run_ranks(window_cases.run_thd, world, cases, timeout_s=300)
    bad = [f"{c} rank {r}: {n} {e:.3g}" for r, per in enumerate(res) for c, errs in per.items()
           for n, e in errs.items()
           if not e < (window_cases.TOL[c[3]] if n != "padding" else 0.5)]
    assert not bad, "\n".join(bad)
