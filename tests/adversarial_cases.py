"""Rank functions for tests/test_adversarial.py (issue 42): what an adversarial user found.

Module level so that the forkserver can pickle them. Every call passes a short explicit bound.
"""

from __future__ import annotations

import time

import torch

from charm_megatron import cp_attention
from charm_megatron.ops.options import CPOptions
from dist_cases import local_part, local_reference, make_inputs, rel_err
from window_cases import reference as window_reference

TIMEOUT_S = 3.0


def _opts(**kw) -> CPOptions:
    return CPOptions(timeout_s=kw.pop("timeout_s", TIMEOUT_S), **kw)


def odd_rows_under_a_window(rank: int, world: int, cases: list[tuple]) -> dict:
    """Per case ``(algo, topology, causal, rows per rank, left, right)``: this rank's largest
    relative error of out, lse, dq, dk, dv against float64 (the full sequence, one batch,
    GQA 4 / 2 heads)."""
    results = {}
    for case in cases:
        algo, topology, causal, rows, left, right = case
        s, b, hq, hkv, d = rows * world, 1, 4, 2, 8
        q, k, v, dout = make_inputs(7, s, b, hq, hkv, d)
        ref = window_reference(q, k, v, dout, causal, (left, right), d ** -0.5)
        ql, kl, vl = (local_part(t, rank, world, causal).float().requires_grad_()
                      for t in (q, k, v))
        out, lse = cp_attention(ql, kl, vl, algo=algo, topology=topology, causal=causal,
                                return_lse=True, window_size=(left, right), options=_opts())
        out.backward(local_part(dout, rank, world, causal).float())
        want = local_reference(ref, rank, world, causal)
        got = [out, lse, ql.grad, kl.grad, vl.grad]
        results[case] = max(rel_err(a, w) for a, w in zip(got, want))
    return results


def gloo_kills_a_rank(rank: int, world: int, big_result_mb: int):
    """Rank 0 returns a large result at once; the others post all-reduces of different sizes
    on one group, which gloo answers by aborting a process (SIGABRT, "op.preamble.length <=
    op.nbytes"), as it did for the odd-length bug of item 1."""
    import torch.distributed as dist

    if rank == 0:
        return torch.ones(big_result_mb * 262144)  # fp32: 4 bytes per element
    sub = dist.new_group(list(range(1, world)))
    dist.all_reduce(torch.ones(4 + rank), group=sub)
    return None


def abort_at_once(rank: int, world: int):
    """The last rank aborts before doing anything; the others wait in a barrier."""
    import os

    import torch.distributed as dist

    if rank == world - 1:
        os.abort()
    dist.barrier()
    time.sleep(60)


def loaded(rank: int, world: int, modules: list[str]) -> list[str]:
    """Which of ``modules`` this rank has imported when it starts (this module imports none
    of megatron's: what it finds of those, the forkserver imported)."""
    import sys

    return [m for m in modules if m in sys.modules]
