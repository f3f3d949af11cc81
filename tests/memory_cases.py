"""Rank function of the peak-memory test (module level so the forkserver can pickle it)."""

from __future__ import annotations

import torch
import torch.distributed as dist

from charm_megatron import cp_attention
from charm_megatron.bench.memory import PeakMeter


def measure_peaks(rank: int, world: int, cases, s: int, b: int, hq: int, d: int):
    """Peak growth (bytes) of the forward and of forward+backward of one call, per case
    ``(algo, topology, causal, hkv, roles)``, each after a warm-up call (the first call also
    builds plans and communicators)."""
    g = torch.Generator().manual_seed(rank)
    out = {}
    for case in cases:
        algo, topology, causal, hkv, roles = case
        sl = s // world
        q = torch.randn(sl, b, hq, d, generator=g).requires_grad_()
        k = torch.randn(sl, b, hkv, d, generator=g).requires_grad_()
        v = torch.randn(sl, b, hkv, d, generator=g).requires_grad_()
        dout = torch.randn(sl, b, hq, d, generator=g)
        for _ in range(2):
            meter = PeakMeter(torch.device("cpu"))
            dist.barrier()
            with meter.phase("fwd"):
                o = cp_attention(q, k, v, algo=algo, topology=topology, causal=causal,
                                 roles=roles)
            dist.barrier()
            with meter.phase("fwdbwd"):
                o.backward(dout)
            del o
            q.grad = k.grad = v.grad = None
        out[case] = dict(meter.peaks)
    return out
