"""Different head dims for q / k and v (multi-latent attention: q, k 192, v 128) on kernels
that take one head dim.

The fused kernels (aten's CPU flash attention, flash-attn 2) require q, k and v to share a
head dim. Zero columns change nothing: padding q and k with zeros leaves every score
``q . k`` as it was (the scale is passed explicitly, never derived from the padded width), and
padding v with zeros adds output columns that are zero and are dropped. So a tile runs at the
common width ``max(d, dv)`` and its results are cut back: ``out`` and ``dv`` to ``dv`` columns,
``dq`` and ``dk`` to ``d``. Only the kernel call pays the padding; blocks, messages and
accumulators keep their real widths (docs/algorithm.md, plan bytes count ``dv``).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from charm_megatron.kernels.base import AttentionBackend

__all__ = ["HeadDimPadding", "pad_to", "widths"]


def widths(q: torch.Tensor, v: torch.Tensor) -> tuple[int, int, int]:
    """``(d, dv, common)``: the q / k head dim, the v head dim and the width a kernel runs."""
    d, dv = q.shape[-1], v.shape[-1]
    return d, dv, max(d, dv)


def pad_to(x: torch.Tensor, width: int) -> torch.Tensor:
    """``x`` with zero columns appended to its last dim up to ``width`` (itself if there)."""
    return x if x.shape[-1] == width else F.pad(x, (0, width - x.shape[-1]))


class HeadDimPadding:
    """A kernel backend for ``dv != d`` over one that takes a single head dim (see module)."""

    def __init__(self, inner: AttentionBackend) -> None:
        self.inner = inner
        self.name = inner.name

    def __getattr__(self, name: str):
        # The inner backend's optional hooks (forward_cut, a timed device's ...).
        if name.startswith("__") or name == "inner":
            raise AttributeError(name)
        return getattr(self.inner, name)

    def forward(self, q, k, v, causal, scale):
        d, dv, w = widths(q, v)
        if d == dv:
            return self.inner.forward(q, k, v, causal, scale)
        out, lse = self.inner.forward(pad_to(q, w), pad_to(k, w), pad_to(v, w), causal, scale)
        return out[..., :dv].contiguous(), lse

    def backward(self, dout, q, k, v, out, lse, causal, scale):
        d, dv, w = widths(q, v)
        if d == dv:
            return self.inner.backward(dout, q, k, v, out, lse, causal, scale)
        dq, dk, dvv = self.inner.backward(pad_to(dout, w), pad_to(q, w), pad_to(k, w),
                                          pad_to(v, w), pad_to(out, w), lse, causal, scale)
        return dq[..., :d].contiguous(), dk[..., :d].contiguous(), dvv[..., :dv].contiguous()
