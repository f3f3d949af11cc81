"""The kernel interface shared by all attention backends."""

from __future__ import annotations

from typing import Protocol

import torch


class AttentionBackend(Protocol):
    """Block attention with log-sum-exp on ``[s, b, h, d]`` tensors (see package docstring)."""

    name: str

    def forward(
        self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, causal: bool, scale: float
    ) -> tuple[torch.Tensor, torch.Tensor]: ...

    def backward(
        self,
        dout: torch.Tensor,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        out: torch.Tensor,
        lse: torch.Tensor,
        causal: bool,
        scale: float,
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]: ...


def check_block_shapes(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, causal: bool) -> None:
    """Raise ``ValueError`` unless q, k, v form a valid ``[s, b, h, d]`` block (GQA allowed)."""
    if q.dim() != 4 or k.dim() != 4 or v.dim() != 4:
        raise ValueError("attention blocks must be 4-D [s, b, h, d]")
    if k.shape != v.shape:
        raise ValueError(f"k {tuple(k.shape)} and v {tuple(v.shape)} must have the same shape")
    if q.shape[1] != k.shape[1] or q.shape[3] != k.shape[3]:
        raise ValueError(f"q {tuple(q.shape)} and k {tuple(k.shape)} differ in batch or head dim")
    if q.shape[2] % k.shape[2]:
        raise ValueError(f"h_q={q.shape[2]} is not a multiple of h_kv={k.shape[2]}")
    if causal and q.shape[0] != k.shape[0]:
        raise ValueError("causal blocks need equal q and kv lengths")
