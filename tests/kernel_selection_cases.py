"""Rank function of tests/test_kernel_selection.py (module level, for the forkserver)."""

from __future__ import annotations

import warnings

import torch
import toy_kernel  # noqa: F401  (registers the wrong backend in this rank process)

from charm_megatron import CPOptions, cp_attention
from charm_megatron.kernels.selection import AutoBackend, choices
from dist_cases import local_part, local_reference, make_inputs, reference, rel_err


def wrong_kernel_is_not_used(rank: int, world: int) -> dict:
    s, b, hq, hkv, d = 64, 1, 4, 2, 32
    q, k, v, dout = make_inputs(5, s, b, hq, hkv, d)
    ref = reference(q, k, v, dout, True, d ** -0.5)
    ql, kl, vl = (local_part(t, rank, world, True).float().requires_grad_() for t in (q, k, v))
    opts = CPOptions(backend=AutoBackend(("toy-wrong-dk", "torch")))
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        out, lse = cp_attention(ql, kl, vl, algo="ring", causal=True, return_lse=True,
                                options=opts)
        out.backward(local_part(dout, rank, world, True).float())
    want = local_reference(ref, rank, world, True)
    got = [out, lse, ql.grad, kl.grad, vl.grad]
    errors = {n: rel_err(g, w) for n, g, w in zip(("out", "lse", "dq", "dk", "dv"), got, want)}
    return {"errors": errors, "warned": [str(w.message) for w in seen
                                        if issubclass(w.category, RuntimeWarning)],
            "picked": sorted({c.picked for c in choices()}),
            "dtype": str(torch.float32)}
