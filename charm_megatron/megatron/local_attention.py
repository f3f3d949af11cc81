"""Attention over one rank's whole sequence, what ``CharmDotProductAttention`` runs at CP size 1
(no context parallelism, so nothing to exchange)."""

from __future__ import annotations

import torch
from torch import Tensor

from charm_megatron.kernels.window import keep


def local_attention(q: Tensor, k: Tensor, v: Tensor, causal: bool, scale: float,
                     offset: Tensor | None = None,
                     window: tuple[int, int] | None = None) -> Tensor:
    """Attention over one rank's whole sequence (no CP): ``[s, b, h, d]`` in and out; with a
    softmax ``offset`` ``[h]`` as an extra logit per head in every denominator, or a sliding
    ``window`` (plain math in fp32, as megatron-core's unfused softmax does it)."""
    qb, kb, vb = (t.permute(1, 2, 0, 3) for t in (q, k, v))  # [b, h, s, d]
    if offset is None and window is None:
        out = torch.nn.functional.scaled_dot_product_attention(
            qb, kb, vb, is_causal=causal, scale=scale, enable_gqa=kb.shape[1] != qb.shape[1]
        )
        return out.permute(2, 0, 1, 3)
    g = qb.shape[1] // kb.shape[1]
    kb, vb = kb.repeat_interleave(g, 1), vb.repeat_interleave(g, 1)
    scores = (qb.float() @ kb.float().transpose(-1, -2)) * scale
    i = torch.arange(scores.shape[-1], device=q.device)
    left, right = window if window is not None else (-1, -1)
    scores = scores.masked_fill(~keep(i[:, None] - i[None, :], causal, left, right),
                                float("-inf"))
    if offset is not None:
        sink = offset.float().view(1, -1, 1, 1).expand(*scores.shape[:3], 1)
        probs = torch.softmax(torch.cat([scores, sink], -1), -1)[..., :-1]
    else:
        probs = torch.softmax(scores, -1)
    return (probs @ vb.float()).to(q.dtype).permute(2, 0, 1, 3)
