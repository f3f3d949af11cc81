"""Plain-math attention (no fused kernel): the independent reference for tests.

Computes in ``compute_dtype`` (float64 by default; never below the inputs' precision) and never repeats kv heads in memory: query
heads are viewed as ``[h_kv, group]`` so one kv head serves its ``group`` query heads.
"""

from __future__ import annotations

import torch

from charm_megatron.kernels.base import check_block_shapes


def _grouped(q: torch.Tensor, h_kv: int) -> torch.Tensor:
    # [s, b, hq, d] -> [b, h_kv, g, s, d]
    s, b, hq, d = q.shape
    return q.permute(1, 2, 0, 3).reshape(b, h_kv, hq // h_kv, s, d)


def _ungrouped(x: torch.Tensor) -> torch.Tensor:
    # [b, h_kv, g, s, d] -> [s, b, hq, d]
    b, hkv, g, s, d = x.shape
    return x.reshape(b, hkv * g, s, d).permute(2, 0, 1, 3)


def _scores(q, k, causal, scale):
    h_kv = k.shape[2]
    qg = _grouped(q, h_kv)
    kk = k.permute(1, 2, 0, 3).unsqueeze(2)  # [b, h_kv, 1, sk, d]
    s = torch.matmul(qg, kk.transpose(-1, -2)) * scale  # [b, h_kv, g, sq, sk]
    if causal:
        sq, sk = q.shape[0], k.shape[0]
        mask = torch.ones(sq, sk, dtype=torch.bool, device=q.device).triu(1)
        s = s.masked_fill(mask, float("-inf"))
    return s


class ReferenceBackend:
    """Plain matmul-softmax attention in ``compute_dtype`` (results cast back to q's dtype)."""

    name = "reference"

    def __init__(self, compute_dtype: torch.dtype = torch.float64) -> None:
        self.compute_dtype = compute_dtype

    def _ct(self, dtype: torch.dtype) -> torch.dtype:
        return torch.float64 if dtype == torch.float64 else self.compute_dtype

    def forward(self, q, k, v, causal, scale):
        check_block_shapes(q, k, v, causal)
        ct = self._ct(q.dtype)
        qc, kc, vc = q.to(ct), k.to(ct), v.to(ct)
        s = _scores(qc, kc, causal, scale)
        lse = torch.logsumexp(s, dim=-1)  # [b, h_kv, g, sq]
        p = torch.exp(s - lse.unsqueeze(-1)).nan_to_num(0.0)
        out = torch.matmul(p, vc.permute(1, 2, 0, 3).unsqueeze(2))
        b, hkv, g, sq = lse.shape
        lse = lse.reshape(b, hkv * g, sq).to(torch.float32 if ct != torch.float64 else ct)
        return _ungrouped(out).to(q.dtype), lse

    def backward(self, dout, q, k, v, out, lse, causal, scale):
        check_block_shapes(q, k, v, causal)
        ct = self._ct(q.dtype)
        h_kv = k.shape[2]
        qc, kc, vc = q.to(ct), k.to(ct), v.to(ct)
        s = _scores(qc, kc, causal, scale)
        b, hq, sq = lse.shape
        L = lse.to(ct).reshape(b, h_kv, hq // h_kv, sq, 1)
        p = torch.exp(s - L).nan_to_num(0.0)  # probabilities under the *given* (global) lse
        do = _grouped(dout.to(ct), h_kv)
        o = _grouped(out.to(ct), h_kv)
        vv = vc.permute(1, 2, 0, 3).unsqueeze(2)
        kk = kc.permute(1, 2, 0, 3).unsqueeze(2)
        dp = torch.matmul(do, vv.transpose(-1, -2))
        delta = (do * o).sum(-1, keepdim=True)
        ds = p * (dp - delta)
        dq = torch.matmul(ds, kk) * scale  # [b, h_kv, g, sq, d]
        dk = (torch.matmul(ds.transpose(-1, -2), _grouped(qc, h_kv)) * scale).sum(2)
        dv = torch.matmul(p.transpose(-1, -2), do).sum(2)  # [b, h_kv, sk, d]
        return (
            _ungrouped(dq).to(q.dtype),
            dk.permute(2, 0, 1, 3).to(k.dtype),
            dv.permute(2, 0, 1, 3).to(v.dtype),
        )
