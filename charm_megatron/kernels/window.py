"""Sliding-window attention on a tile of a CP plan: which (query, key) pairs a window keeps,
from the tile's global positions, and plain-math kernels that take that mask.

A window ``(left, right)`` is flash-attn's and megatron-core's: query ``i`` sees key ``j`` iff
``i - left <= j <= i + right`` in global positions (``-1``: unbounded on that side), and, for a
causal call, ``j <= i``. A plan's tile holds rows of two ranks' blocks; their global
positions follow Megatron's layout (:func:`positions`), so the mask of every tile, sub-tile
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

import functools
from dataclasses import dataclass

import torch

from charm_megatron.plan.core import TileSpec
from charm_megatron.plan.tile_rule import WindowGeometry
from charm_megatron.plan.vocab import Half

__all__ = ["Window", "keep", "masked_backward", "masked_forward", "positions"]


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
class Window:
    """A call's window and what places its rows: ``left``, ``right`` (``-1``: unbounded), the
    CP size ``n``, rows per rank ``s_local`` and whether the call is causal (its shards then
    load-balanced, else contiguous)."""

    left: int
    right: int
    n: int
    s_local: int
    causal: bool

    def allowed(self, q_owner: int, q_half: Half, kv_owner: int, kv_half: Half,
                device: torch.device) -> torch.Tensor:
        """``[sq, sk]`` bool: the pairs of this tile the window (and the causal mask) keep."""
        qp = positions(q_owner, q_half, self.s_local, self.n, self.causal, device)
        kp = positions(kv_owner, kv_half, self.s_local, self.n, self.causal, device)
        return keep(qp[:, None] - kp[None, :], self.causal, self.left, self.right)

    @property
    def geometry(self) -> WindowGeometry:
        return WindowGeometry(self.left, self.right, self.n, self.s_local, self.causal)

    def needs_mask(self, spec: TileSpec) -> bool:
        """False where the window keeps every pair the tile's own mask keeps: the fused
        kernel (causal on the diagonal, else none) computes it exactly."""
        return not _fully_kept(self.geometry, spec)

    def fraction(self, spec: TileSpec) -> float:
        """The share of the tile's own pairs the window keeps (what a windowed kernel pays)."""
        return _fraction(self.geometry, spec)


@functools.lru_cache(maxsize=4096)
def _fully_kept(geometry: WindowGeometry, spec: TileSpec) -> bool:
    return geometry.fully_kept(spec)


@functools.lru_cache(maxsize=4096)
def _fraction(geometry: WindowGeometry, spec: TileSpec) -> float:
    return geometry.fraction(spec)


def positions(owner: int, half: Half, s_local: int, n: int, load_balanced: bool,
              device: torch.device | str = "cpu") -> torch.Tensor:
    """Global positions of rows ``half`` of rank ``owner``'s block: chunks ``owner`` and
    ``2n-1-owner`` of ``2n`` (load-balanced) or rows ``owner*s_local ...`` (contiguous)."""
    c = s_local // 2
    if load_balanced:
        first = torch.arange(owner * c, owner * c + c, device=device)
        second = torch.arange((2 * n - 1 - owner) * c, (2 * n - owner) * c, device=device)
    else:
        base = owner * s_local
        first = torch.arange(base, base + c, device=device)
        second = torch.arange(base + c, base + s_local, device=device)
    if half is Half.FIRST:
        return first
    if half is Half.SECOND:
        return second
    return torch.cat([first, second])


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
