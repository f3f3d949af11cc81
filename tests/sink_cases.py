"""Rank functions for the softmax-offset (attention sink) tests (module level: the forkserver
pickles them).

The reference is written from the definition, independent of ops/softmax_offset.py: float64
softmax over the scores with one extra column per query head holding the offset (a sink
with no value vector), gradients of q, k, v and the offset by float64 autograd, on the whole
sequence (sbhd) or document by document (packed THD).
"""

from __future__ import annotations

import functools

import torch
import torch.distributed as dist

import packed_cases
from charm_megatron import cp_attention
from dist_cases import local_part, local_reference, make_inputs, rel_err
from packed_cases import DTYPES

TOL = {"fp32": 1e-5, "bf16": 2e-2, "fp64": 1e-12}


def _attend_with_sink(q, k, v, offset, causal: bool, scale: float):
    """q ``[n, hq, d]``, k, v ``[n, hkv, d]``, offset ``[hq]`` -> out ``[n, hq, d]``, lse
    ``[hq, n]``."""
    g = q.shape[1] // k.shape[1]
    qd, kd, vd = (t.transpose(0, 1) for t in (q, k.repeat_interleave(g, 1),
                                               v.repeat_interleave(g, 1)))
    s = qd @ kd.transpose(1, 2) * scale  # [hq, n, n]
    n = s.shape[-1]
    if causal:
        s = s.masked_fill(torch.ones(n, n, dtype=torch.bool).triu(1), float("-inf"))
    sink = offset.view(-1, 1, 1).expand(-1, n, 1)
    full = torch.cat([s, sink], -1)
    p = torch.softmax(full, -1)[..., :n]
    return (p @ vd).transpose(0, 1), torch.logsumexp(full, -1)


def sbhd_reference(q, k, v, dout, offset, causal: bool, scale: float):
    """float64 out ``[s, b, hq, d]``, lse ``[b, hq, s]``, dq, dk, dv, d offset."""
    q, k, v, offset = (t.detach().double().requires_grad_() for t in (q, k, v, offset))
    outs, lses = zip(*(_attend_with_sink(q[:, i], k[:, i], v[:, i], offset, causal, scale)
                       for i in range(q.shape[1])))
    out, lse = torch.stack(outs, 1), torch.stack(lses, 0)
    out.backward(dout.double())
    return out.detach(), lse.detach(), q.grad, k.grad, v.grad, offset.grad


def run_sbhd(rank: int, world: int, cases: list[tuple]) -> dict:
    """Per case ``(algo, topology, causal, dtype, hkv, learnable)``: relative errors of out,
    lse, dq, dk, dv on this rank and of the offset's gradient summed over the ranks."""
    results = {}
    s, b, hq, d = 8 * world, 2, 4, 16
    for case in cases:
        algo, topology, causal, dtype, hkv, learnable = case
        dt = DTYPES[dtype]
        q, k, v, dout = (t.to(dt).double() for t in make_inputs(11, s, b, hq, hkv, d))
        gen = torch.Generator().manual_seed(5)
        offset = (torch.randn(hq, generator=gen, dtype=torch.float64) * 2 if learnable
                  else torch.zeros(hq, dtype=torch.float64))  # off-by-one: zeros
        offset = offset.to(dt).double()
        ref = sbhd_reference(q, k, v, dout, offset, causal, d ** -0.5)
        ql, kl, vl = (local_part(t, rank, world, causal).to(dt).requires_grad_()
                      for t in (q, k, v))
        off = offset.to(dt).requires_grad_(learnable)
        out, lse = cp_attention(ql, kl, vl, algo=algo, topology=topology, causal=causal,
                                return_lse=True, softmax_offset=off)
        out.backward(local_part(dout, rank, world, causal).to(dt))
        want = local_reference(ref, rank, world, causal)
        got = [out, lse, ql.grad, kl.grad, vl.grad]
        errs = {n: rel_err(g_, w) for n, g_, w in zip(("out", "lse", "dq", "dk", "dv"), got, want)}
        if learnable:
            total = off.grad.double().clone()
            dist.all_reduce(total)  # each rank holds its tokens' share
            errs["doffset"] = rel_err(total, ref[5])
        else:
            errs["no_grad"] = 0.0 if off.grad is None else 1.0
        results[case] = errs
    return results


def run_packed(rank: int, world: int, cases: list[tuple]) -> dict:
    """Packed (THD) cases ``(algo, topology, causal, dtype, docs)``: the documents of
    ``packed_cases.doc_lengths``, a learnable offset; errors as :func:`run_sbhd`'s (padding
    rows excluded)."""
    results = {}
    for algo, topology, causal, dtype, docs in cases:
        dt = DTYPES[dtype]
        real, padded = packed_cases.doc_lengths(docs, world)
        hq, hkv, d = 4, 2, 8
        gen = torch.Generator().manual_seed(3)
        q, k, v, dout = (torch.randn(sum(real), h, d, generator=gen, dtype=torch.float64)
                         .to(dt).double() for h in (hq, hkv, hkv, hq))
        offset = (torch.randn(hq, generator=gen, dtype=torch.float64) * 2).to(dt).double()
        qr, kr, vr, orr = (t.detach().requires_grad_() for t in (q, k, v, offset))
        attend = functools.partial(_attend_with_sink, offset=orr, causal=causal,
                                   scale=d ** -0.5)
        ref_out, ref_lse = packed_cases.by_document(attend, qr, kr, vr, real)
        ref_out.backward(dout)
        local, mask = packed_cases.local_rows(real, padded, rank, world)

        ql, kl, vl = (local(t).to(dt).requires_grad_() for t in (q, k, v))
        off = offset.to(dt).requires_grad_()
        out, lse = cp_attention(
            ql, kl, vl, algo=algo, topology=topology, causal=causal, return_lse=True,
            cu_seqlens=packed_cases.cumulative(real), softmax_offset=off,
            cu_seqlens_padded=None if padded is None else packed_cases.cumulative(padded))
        out.backward(local(dout).to(dt))
        want = [local(ref_out.detach()), local(ref_lse.detach().t()).t(), local(qr.grad),
                local(kr.grad), local(vr.grad)]
        got = [out, lse, ql.grad, kl.grad, vl.grad]
        errs = {}
        for name, g_, w in zip(("out", "lse", "dq", "dk", "dv"), got, want):
            g_, w = (g_[:, mask], w[:, mask]) if name == "lse" else (g_[mask], w[mask])
            errs[name] = rel_err(g_, w)
        total = off.grad.double().clone()
        dist.all_reduce(total)
        errs["doffset"] = rel_err(total, orr.grad)
        results[(algo, topology, causal, dtype, docs)] = errs
    return results


def offset_on_one_rank_only(rank: int, world: int) -> str:
    """Rank 1 passes a softmax offset, the others do not: every rank must raise (the
    agreement names the field), none may return attention with a different softmax."""
    q, k, v = (torch.randn(4, 1, 2, 8) for _ in range(3))
    offset = torch.zeros(2) if rank == 1 else None
    try:
        cp_attention(q, k, v, algo="ring", softmax_offset=offset)
    except Exception as exc:  # noqa: BLE001 - the test reads what was raised
        return f"{type(exc).__name__}: {exc}"
    return "no error"
