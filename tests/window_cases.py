"""Rank functions for the sliding-window tests (module level: the forkserver pickles them).

The reference is written from the definition: float64 softmax attention over the whole
sequence with the window's mask (query ``i`` sees key ``j`` iff ``i - left <= j <= i + right``,
``-1`` unbounded, and ``j <= i`` when causal), gradients by float64 autograd.
"""

from __future__ import annotations

import torch

from charm_megatron import cp_attention
from dist_cases import local_part, local_reference, make_inputs, rel_err
from packed_cases import DTYPES

TOL = {"fp32": 1e-5, "bf16": 2e-2, "fp64": 1e-12}


def reference(q, k, v, dout, causal: bool, window: tuple[int, int], scale: float):
    q, k, v = (t.detach().double().requires_grad_() for t in (q, k, v))
    s, g = q.shape[0], q.shape[2] // k.shape[2]
    i = torch.arange(s)[:, None]
    j = torch.arange(s)[None, :]
    keep = torch.ones(s, s, dtype=torch.bool)
    if causal:
        keep &= j <= i
    if window[0] >= 0:
        keep &= j >= i - window[0]
    if window[1] >= 0:
        keep &= j <= i + window[1]
    kk, vv = k.repeat_interleave(g, 2), v.repeat_interleave(g, 2)
    sc = torch.einsum("sbhd,tbhd->bhst", q, kk) * scale
    sc = sc.masked_fill(~keep, float("-inf"))
    lse = torch.logsumexp(sc, -1)
    out = torch.einsum("bhst,tbhd->sbhd", torch.softmax(sc, -1), vv)
    out.backward(dout.double())
    return out.detach(), lse.detach(), q.grad, k.grad, v.grad


def run_sbhd(rank: int, world: int, cases: list[tuple]) -> dict:
    """Per case ``(algo, topology, causal, dtype, hkv, left, right)``: this rank's relative
    errors of out, lse, dq, dk, dv against float64."""
    results = {}
    s, b, hq, d = 8 * world, 2, 4, 16
    for case in cases:
        algo, topology, causal, dtype, hkv, left, right = case
        dt = DTYPES[dtype]
        q, k, v, dout = (t.to(dt).double() for t in make_inputs(13, s, b, hq, hkv, d))
        ref = reference(q, k, v, dout, causal, (left, right), d ** -0.5)
        ql, kl, vl = (local_part(t, rank, world, causal).to(dt).requires_grad_()
                      for t in (q, k, v))
        out, lse = cp_attention(ql, kl, vl, algo=algo, topology=topology, causal=causal,
                                return_lse=True, window_size=(left, right))
        out.backward(local_part(dout, rank, world, causal).to(dt))
        want = local_reference(ref, rank, world, causal)
        got = [out, lse, ql.grad, kl.grad, vl.grad]
        results[case] = {n: rel_err(a, w) for n, a, w in
                         zip(("out", "lse", "dq", "dk", "dv"), got, want)}
    return results


def packed_window_refused(rank: int, world: int) -> str:
    """A window on a packed (THD) call: every rank must raise the same clear error."""
    import packed_cases

    q, k, v = (torch.randn(8, 2, 8) for _ in range(3))
    cu = packed_cases.cumulative([8 * world])
    try:
        cp_attention(q, k, v, cu_seqlens=cu, window_size=(4, 0))
    except Exception as exc:  # noqa: BLE001 - the test reads what was raised
        return f"{type(exc).__name__}: {exc}"
    return "no error"
