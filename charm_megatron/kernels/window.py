"""Sliding-window attention on a tile of a CP plan: which (query, key) pairs a window keeps,
from the tile's global positions, and plain-math kernels that take that mask.

A window ``(left, right)`` is flash-attn's and megatron-core's: query ``i`` sees key ``j`` iff
``i - left <= j <= i + right`` in global positions (``-1``: unbounded on that side), and, for a
causal call, ``j <= i``. A plan's tile holds rows of two ranks' blocks; their global
positions follow Megatron's layout (:meth:`Window.positions`), so the mask of every tile, sub-tile
and half is exact. Rows a tile leaves without any key get ``lse = -inf`` and a zero output,
which the log-sum-exp merge ignores.

Plans hold only the tiles a window needs (plan/prune.py). Of those, a tile the window keeps
whole runs on the backend's fused kernel (:meth:`Window.needs_mask` is False); the others
run here in fp32 (float64 for float64 inputs) with the mask materialised: correct on every
device, and slower than a fused kernel, which takes no arbitrary mask with a log-sum-exp
here. A backend with ``forward_masked`` / ``backward_masked`` (the emulator's timed device)
takes them instead.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from charm_megatron.plan.core import TileSpec
from charm_megatron.plan.tile_rule import WindowGeometry
from charm_megatron.plan.vocab import Half

__all__ = ["Window", "keep", "masked_backward", "masked_forward"]


def keep(diff: torch.Tensor, causal: bool, left: int, right: int) -> torch.Tensor:
    """Which pairs a window keeps, from ``diff = query position - key position``: ``diff``
    within ``[-right, left]`` (``-1``: that side unbounded) and, when ``causal``, ``>= 0``."""
    kept = torch.ones_like(diff, dtype=torch.bool)
    if causal:
        kept &= diff >= 0
    if left >= 0:
        kept &= diff <= left
    if right >= 0:
        kept &= -diff <= right
    return kept


@dataclass(frozen=True)
class Window(WindowGeometry):
    """A call's window and what places its rows (:class:`WindowGeometry`: ``left``,
    ``right``, the CP size ``n``, ``rows`` per rank, causal and so load-balanced or not),
    with the mask of a tile's rows."""

    def allowed(self, q_owner: int, q_half: Half, kv_owner: int, kv_half: Half,
                device: torch.device) -> torch.Tensor:
        """``[sq, sk]`` bool: the pairs of this tile the window (and the causal mask) keep."""
        qp = self.positions(q_owner, q_half, device)
        kp = self.positions(kv_owner, kv_half, device)
        return keep(qp[:, None] - kp[None, :], self.causal, self.left, self.right)

    def needs_mask(self, spec: TileSpec) -> bool:
        """False where the window keeps every pair the tile's own mask keeps: the fused
        kernel (causal on the diagonal, else none) computes it exactly."""
        return not self.fully_kept(spec)

    def positions(self, owner: int, half: Half,
                  device: torch.device | str = "cpu") -> torch.Tensor:
        """Global positions of rows ``half`` of rank ``owner``'s block (chunks ``owner`` and
        ``2n-1-owner`` of ``2n`` when load-balanced, else contiguous rows)."""
        parts = [torch.arange(self.start(owner, h), self.start(owner, h) + self.size(h),
                              device=device)
                 for h in ((Half.FIRST, Half.SECOND) if half is Half.FULL else (half,))]
        return parts[0] if len(parts) == 1 else torch.cat(parts)


def _wide(dtype: torch.dtype) -> torch.dtype:
    return torch.float64 if dtype == torch.float64 else torch.float32


def _heads_first(x: torch.Tensor, groups: int, wide: torch.dtype) -> torch.Tensor:
    """``[s, b, h, d]`` -> ``[b, h * groups, s, d]`` in ``wide`` (kv heads repeated for GQA)."""
    x = x.to(wide).permute(1, 2, 0, 3)
    return x.repeat_interleave(groups, 1) if groups > 1 else x


def masked_forward(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, allowed: torch.Tensor,
                   scale: float) -> tuple[torch.Tensor, torch.Tensor]:
    """``(out [sq, b, hq, dv] in q's dtype, lse [b, hq, sq])`` of the pairs ``allowed``."""
    wide, g = _wide(q.dtype), q.shape[2] // k.shape[2]
    qh, kh, vh = _heads_first(q, 1, wide), _heads_first(k, g, wide), _heads_first(v, g, wide)
    s = (qh @ kh.transpose(-1, -2)) * scale
    s = s.masked_fill(~allowed, float("-inf"))
    lse = torch.logsumexp(s, -1)  # -inf where a row keeps no key
    p = torch.where(allowed, torch.exp(s - lse.unsqueeze(-1)), torch.zeros((), dtype=wide))
    out = (p @ vh).permute(2, 0, 1, 3)
    return out.to(q.dtype), lse


def masked_backward(dout: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                    out: torch.Tensor, lse: torch.Tensor, allowed: torch.Tensor,
                    scale: float) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``(dq, dk, dv)`` of the pairs ``allowed``; ``lse [b, hq, sq]`` the rows' final one."""
    wide, g = _wide(q.dtype), q.shape[2] // k.shape[2]
    qh, kh, vh = _heads_first(q, 1, wide), _heads_first(k, g, wide), _heads_first(v, g, wide)
    doh, oh = _heads_first(dout, 1, wide), _heads_first(out, 1, wide)
    s = (qh @ kh.transpose(-1, -2)) * scale
    p = torch.where(allowed, torch.exp(s - lse.to(wide).unsqueeze(-1)),
                    torch.zeros((), dtype=wide))
    dvh = p.transpose(-1, -2) @ doh
    dp = doh @ vh.transpose(-1, -2)
    delta = (doh * oh).sum(-1, keepdim=True)
    ds = p * (dp - delta)
    dqh = (ds @ kh) * scale
    dkh = (ds.transpose(-1, -2) @ qh) * scale

    def fold(x: torch.Tensor, like: torch.Tensor) -> torch.Tensor:
        b, hg, sk, d = x.shape
        if g > 1:
            x = x.view(b, hg // g, g, sk, d).sum(2)
        return x.permute(2, 0, 1, 3).to(like.dtype)

    return dqh.permute(2, 0, 1, 3).to(q.dtype), fold(dkh, k), fold(dvh, v)
