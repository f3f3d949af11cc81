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


def window_keep(s: int, causal: bool, window: tuple[int, int]) -> torch.Tensor:
    """``[s, s]``: query ``i`` keeps key ``j`` (the definition, written out)."""
    i, j = torch.arange(s)[:, None], torch.arange(s)[None, :]
    keep = torch.ones(s, s, dtype=torch.bool)
    if causal:
        keep &= j <= i
    if window[0] >= 0:
        keep &= j >= i - window[0]
    if window[1] >= 0:
        keep &= j <= i + window[1]
    return keep


def reference(q, k, v, dout, causal: bool, window: tuple[int, int], scale: float):
    q, k, v = (t.detach().double().requires_grad_() for t in (q, k, v))
    s, g = q.shape[0], q.shape[2] // k.shape[2]
    keep = window_keep(s, causal, window)
    kk, vv = k.repeat_interleave(g, 2), v.repeat_interleave(g, 2)
    sc = torch.einsum("sbhd,tbhd->bhst", q, kk) * scale
    sc = sc.masked_fill(~keep, float("-inf"))
    lse = torch.logsumexp(sc, -1)
    out = torch.einsum("bhst,tbhd->sbhd", torch.softmax(sc, -1), vv)
    out.backward(dout.double())
    return out.detach(), lse.detach(), q.grad, k.grad, v.grad


def real_rows_errors(local, mask, ref, got) -> dict[str, float]:
    """Relative errors of a packed call's ``got`` (out, lse, dq, dk, dv) against the
    full-sequence float64 ``ref`` on this rank's real (unpadded) rows: ``local`` takes a
    rank's rows, ``mask`` marks the real ones (``packed_cases.local_rows``)."""
    want = [local(ref[0]), local(ref[1].t()).t(), local(ref[2]), local(ref[3]), local(ref[4])]
    errs = {}
    for name, g, w in zip(("out", "lse", "dq", "dk", "dv"), got, want):
        g, w = (g[:, mask], w[:, mask]) if name == "lse" else (g[mask], w[mask])
        errs[name] = rel_err(g, w)
    return errs


def run_sbhd(rank: int, world: int, cases: list[tuple]) -> dict:
    """Per case ``(algo, topology, causal, dtype, hkv, left, right)``: this rank's relative
    errors of out, lse, dq, dk, dv against float64."""
    results = {}
    # Inputs and this rank's part of the float64 reference per (mask, dtype, kv heads,
    # window): made once however many algorithms share them (the cases run on copies).
    inputs: dict[tuple, tuple] = {}
    s, b, hq, d = 8 * world, 2, 4, 16
    for case in cases:
        algo, topology, causal, dtype, hkv, left, right = case
        dt = DTYPES[dtype]
        key = (causal, dtype, hkv, left, right)
        if key not in inputs:
            q, k, v, dout = (t.to(dt).double() for t in make_inputs(13, s, b, hq, hkv, d))
            ref = reference(q, k, v, dout, causal, (left, right), d ** -0.5)
            inputs[key] = (q, k, v, dout, local_reference(ref, rank, world, causal))
        q, k, v, dout, want = inputs[key]
        ql, kl, vl = (local_part(t, rank, world, causal).to(dt).requires_grad_()
                      for t in (q, k, v))
        out, lse = cp_attention(ql, kl, vl, algo=algo, topology=topology, causal=causal,
                                return_lse=True, window_size=(left, right))
        out.backward(local_part(dout, rank, world, causal).to(dt))
        got = [out, lse, ql.grad, kl.grad, vl.grad]
        results[case] = {n: rel_err(a, w) for n, a, w in
                         zip(("out", "lse", "dq", "dk", "dv"), got, want)}
    return results


def _doc_reference(q, k, v, dout, real: list[int], causal: bool, window, scale: float):
    """float64 out, lse [hq, T], dq, dk, dv of the unpadded packed sequence, each document
    attending inside itself under the window (in its own positions)."""
    q, k, v = (t.detach().double().requires_grad_() for t in (q, k, v))
    outs, lses, start = [], [], 0
    for n in real:
        o, m, *_ = _attend(q[start:start + n], k[start:start + n], v[start:start + n],
                           causal, window, scale)
        outs.append(o)
        lses.append(m)
        start += n
    out, lse = torch.cat(outs), torch.cat(lses, 1)
    out.backward(dout.double())
    return out.detach(), lse.detach(), q.grad, k.grad, v.grad


def _attend(q, k, v, causal, window, scale):
    """One document ``[n, h, d]`` with the window's mask: ``(out [n, hq, d], lse [hq, n])``."""
    n, g = q.shape[0], q.shape[1] // k.shape[1]
    keep = window_keep(n, causal, window)
    kk, vv = k.repeat_interleave(g, 1), v.repeat_interleave(g, 1)
    sc = torch.einsum("shd,thd->hst", q, kk) * scale
    sc = sc.masked_fill(~keep, float("-inf"))
    return torch.einsum("hst,thd->shd", torch.softmax(sc, -1), vv), torch.logsumexp(sc, -1)


def run_thd(rank: int, world: int, cases: list[tuple]) -> dict:
    """Per case ``(algo, topology, causal, dtype, hkv, docs, left, right)``: this rank's errors
    of out, lse, dq, dk, dv (real rows) against float64, and whether padding stayed zero."""
    import packed_cases

    results = {}
    hq, d = 4, 8
    for case in cases:
        algo, topology, causal, dtype, hkv, docs, left, right = case
        dt = DTYPES[dtype]
        real, padded = packed_cases.doc_lengths(docs, world)
        gen = torch.Generator().manual_seed(7)
        q, k, v, dout = (torch.randn(sum(real), h, d, generator=gen, dtype=torch.float64)
                         .to(dt) for h in (hq, hkv, hkv, hq))
        ref = _doc_reference(q, k, v, dout, real, causal, (left, right), d ** -0.5)
        local, mask = packed_cases.local_rows(real, padded, rank, world)
        ql, kl, vl = (local(t).to(dt).requires_grad_() for t in (q, k, v))
        out, lse = cp_attention(
            ql, kl, vl, algo=algo, topology=topology, causal=causal, return_lse=True,
            cu_seqlens=packed_cases.cumulative(real),
            cu_seqlens_padded=None if padded is None else packed_cases.cumulative(padded),
            window_size=(left, right))
        out.backward(local(dout).to(dt))
        errs = real_rows_errors(local, mask, ref, (out, lse, ql.grad, kl.grad, vl.grad))
        errs["padding"] = 0.0 if all(bool((t[~mask] == 0).all())
                                     for t in (out, ql.grad, kl.grad, vl.grad)) else 1.0
        results[case] = errs
    return results
