"""Rank functions for the MLA head-dim tests (q / k head dim ``d``, v head dim ``dv``; module
level: the forkserver pickles them).

The reference is written from the definition: float64 softmax attention over the whole
sequence with einsum, kv heads repeated for GQA, gradients by float64 autograd; sbhd, and
packed THD document by document.
"""

from __future__ import annotations

import functools

import torch

import packed_cases
from charm_megatron import cp_attention
from dist_cases import local_part, local_reference, rel_err
from packed_cases import DTYPES

TOL = {"fp32": 1e-5, "bf16": 2e-2, "fp64": 1e-12}


def _inputs(seed: int, s: int, b: int, hq: int, hkv: int, d: int, dv: int, dt):
    g = torch.Generator().manual_seed(seed)
    shapes = ((s, b, hq, d), (s, b, hkv, d), (s, b, hkv, dv), (s, b, hq, dv))
    return [torch.randn(sh, generator=g, dtype=torch.float64).to(dt).double() for sh in shapes]


def _attend(q, k, v, causal: bool, scale: float):
    """q ``[n, hq, d]``, k ``[n, hkv, d]``, v ``[n, hkv, dv]`` -> out ``[n, hq, dv]``, lse
    ``[hq, n]``."""
    g = q.shape[1] // k.shape[1]
    k, v = k.repeat_interleave(g, 1), v.repeat_interleave(g, 1)
    s = torch.einsum("ihd,jhd->hij", q, k) * scale
    if causal:
        n = s.shape[-1]
        s = s.masked_fill(torch.ones(n, n, dtype=torch.bool).triu(1), float("-inf"))
    return torch.einsum("hij,jhd->ihd", torch.softmax(s, -1), v), torch.logsumexp(s, -1)


def run_sbhd(rank: int, world: int, cases: list[tuple]) -> dict:
    """Per case ``(algo, topology, causal, dtype, hkv, d, dv)``: this rank's relative errors
    of out, lse, dq, dk, dv against float64."""
    results = {}
    for case in cases:
        algo, topology, causal, dtype, hkv, d, dv = case
        dt = DTYPES[dtype]
        s, b, hq = 8 * world, 2, 4
        q, k, v, dout = _inputs(1, s, b, hq, hkv, d, dv, dt)
        qr, kr, vr = (t.clone().requires_grad_() for t in (q, k, v))
        outs, lses = zip(*(_attend(qr[:, i], kr[:, i], vr[:, i], causal, d ** -0.5)
                           for i in range(b)))
        out, lse = torch.stack(outs, 1), torch.stack(lses, 0)
        out.backward(dout)
        ql, kl, vl = (local_part(t, rank, world, causal).to(dt).requires_grad_()
                      for t in (q, k, v))
        o, lse_got = cp_attention(ql, kl, vl, algo=algo, topology=topology, causal=causal,
                                  return_lse=True)
        assert o.shape == (ql.shape[0], b, hq, dv), o.shape
        o.backward(local_part(dout, rank, world, causal).to(dt))
        want = local_reference((out.detach(), lse.detach(), qr.grad, kr.grad, vr.grad), rank,
                               world, causal)
        got = [o, lse_got, ql.grad, kl.grad, vl.grad]
        results[case] = {n: rel_err(a, w) for n, a, w in
                         zip(("out", "lse", "dq", "dk", "dv"), got, want)}
    return results


def run_packed(rank: int, world: int, cases: list[tuple]) -> dict:
    """Packed (THD) cases ``(algo, topology, causal, dtype, docs, d, dv)``: errors as
    :func:`run_sbhd`'s, padding rows excluded."""
    results = {}
    for case in cases:
        algo, topology, causal, dtype, docs, d, dv = case
        dt = DTYPES[dtype]
        real, padded = packed_cases.doc_lengths(docs, world)
        q, k, v, dout = (t[:, 0] for t in _inputs(2, sum(real), 1, 4, 2, d, dv, dt))
        qr, kr, vr = (t.clone().requires_grad_() for t in (q, k, v))
        ref_out, ref_lse = packed_cases.by_document(
            functools.partial(_attend, causal=causal, scale=d ** -0.5), qr, kr, vr, real)
        ref_out.backward(dout)
        local, mask = packed_cases.local_rows(real, padded, rank, world)

        ql, kl, vl = (local(t).to(dt).requires_grad_() for t in (q, k, v))
        o, lse_got = cp_attention(
            ql, kl, vl, algo=algo, topology=topology, causal=causal, return_lse=True,
            cu_seqlens=packed_cases.cumulative(real),
            cu_seqlens_padded=None if padded is None else packed_cases.cumulative(padded))
        o.backward(local(dout).to(dt))
        want = [local(ref_out.detach()), local(ref_lse.detach().t()).t(), local(qr.grad),
                local(kr.grad), local(vr.grad)]
        got = [o, lse_got, ql.grad, kl.grad, vl.grad]
        full = [ref_out, ref_lse, qr.grad, kr.grad, vr.grad]
        errs = {}
        for name, a, w, whole in zip(("out", "lse", "dq", "dk", "dv"), got, want, full):
            a, w = (a[:, mask], w[:, mask]) if name == "lse" else (a[mask], w[mask])
            # Floored at a rank's share of the whole tensor's norm: a shard's true dq is
            # exactly zero where its documents are one token long.
            floor = whole.detach().norm().item() / world ** 0.5
            errs[name] = ((a.double() - w).norm() / max(w.norm().item(), floor)).item()
        results[case] = errs
    return results
