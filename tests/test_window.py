"""Sliding windows (``cp_attention(window_size=(left, right))``) on real gloo ranks against a
float64 reference of the full sequence with the window's mask: out, lse, dq, dk, dv for every
algorithm; windows inside a chunk, spanning several chunks and longer than the sequence;
causal with a left window and full attention with both sides; MHA and GQA; and the settings
the call refuses, on every rank."""

import pytest

import window_cases
from charm_megatron.local_ranks import run_ranks

# (causal, left, right) at 8 rows per rank (chunks of 4 under the causal layout).
WINDOWS = ((True, 2, 0), (True, 9, 0), (True, 100, -1), (True, 1, 0),
           (False, 3, 5), (False, -1, 2), (False, 7, 7))
SETUPS = {
    1: [("ring", None)],
    3: [("ring", None), ("rmplus", None), ("allgather", None)],
    4: [("ring", None), ("rmplus", None), ("charm", "2x2"), ("allgather", None)],
}


@pytest.mark.parametrize("world", sorted(SETUPS))
def test_sbhd_matches_float64_reference(world):
    cases = [(algo, topo, causal, dtype, hkv, left, right)
             for algo, topo in SETUPS[world] for causal, left, right in WINDOWS
             for dtype, hkv in (("fp64", 2), ("bf16", 4))]
    res = run_ranks(window_cases.run_sbhd, world, cases, timeout_s=300)
    bad = [f"{c} rank {r}: {n} {e:.3g}" for r, per in enumerate(res) for c, errs in per.items()
           for n, e in errs.items() if not e < window_cases.TOL[c[3]]]
    assert not bad, "\n".join(bad)


def test_a_window_on_packed_sequences_is_refused_on_every_rank():
    texts = run_ranks(window_cases.packed_window_refused, 2, timeout_s=120)
    assert all("window_size" in t and "packed" in t for t in texts), texts
