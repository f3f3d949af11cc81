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


FLOAT_DTYPES = (torch.float16, torch.bfloat16, torch.float32, torch.float64)


_LAYOUTS = {  # layout -> (tensor rank, how the shape reads, the hint for a wrong rank)
    "sbhd": (4, "[s, b, heads, head_dim]", "Megatron's sbhd layout"),
    "thd": (3, "[t_local, heads, head_dim]", "packed THD, with cu_seqlens"),
}


def check_qkv(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *, causal: bool,
              equal_lengths: bool, who: str = "attention", layout: str = "sbhd") -> None:
    """The one check of attention inputs (``cp_attention`` sbhd and packed, the kernels, the
    Megatron layer).

    sbhd: ``q [s_q, b, h_q, d]``, ``k [s_k, b, h_kv, d]``, ``v [s_k, b, h_kv, d_v]``; thd
    (packed documents, no batch dimension): ``q [t_q, h_q, d]``, ``k [t_k, h_kv, d]``,
    ``v [t_k, h_kv, d_v]``; ``d_v`` may differ from ``d`` (multi-latent attention). One float
    dtype and device, ``h_q`` a multiple of ``h_kv``; equal q and kv lengths when ``equal_lengths`` or
    ``causal``. Raises ``TypeError`` / ``ValueError`` whose message starts with ``who``.
    """
    dims, form, hint = _LAYOUTS[layout]
    for name, t in (("q", q), ("k", k), ("v", v)):
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"{who}: {name} must be a torch.Tensor, got {type(t).__name__}")
        if t.dim() != dims:
            raise ValueError(f"{who}: {name} must be {dims}-D {form} ({hint}), got shape "
                             f"{tuple(t.shape)}")
        if t.dtype not in FLOAT_DTYPES:
            raise TypeError(f"{who}: {name} has dtype {t.dtype}; use float16, bfloat16, "
                            "float32 or float64")
    if not (q.dtype == k.dtype == v.dtype):
        raise TypeError(f"{who}: q, k, v dtypes differ ({q.dtype}, {k.dtype}, {v.dtype}); "
                        "cast them to one dtype")
    if not (q.device == k.device == v.device):
        raise ValueError(f"{who}: q, k, v are on different devices ({q.device}, {k.device}, "
                         f"{v.device}); move them to one device")
    if k.shape[:-1] != v.shape[:-1]:
        raise ValueError(f"{who}: k {tuple(k.shape)} and v {tuple(v.shape)} must have the "
                         "same shape but for the head dim (v may have its own: MLA)")
    if (equal_lengths or causal) and q.shape[0] != k.shape[0]:
        what = "causal blocks need equal q and kv lengths" if causal and not equal_lengths else (
            "all three must be this rank's shard of one sequence")
        raise ValueError(f"{who}: q has {q.shape[0]} tokens but k/v have {k.shape[0]}; {what}")
    if layout == "sbhd" and q.shape[1] != k.shape[1]:
        raise ValueError(f"{who}: batch sizes differ (q {q.shape[1]}, k/v {k.shape[1]})")
    # Heads and head dim are the last two axes in both layouts.
    if q.shape[-1] != k.shape[-1]:
        raise ValueError(f"{who}: head dims differ (q {q.shape[-1]}, k {k.shape[-1]}); q and k "
                         "share one head dim (v may have its own, as in MLA)")
    if q.shape[-2] % k.shape[-2]:
        raise ValueError(f"{who}: h_q={q.shape[-2]} is not a multiple of h_kv={k.shape[-2]}; "
                         "GQA needs each kv head to serve a whole group of query heads (set "
                         "num_query_groups to a divisor of the head count)")


def check_block_shapes(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, causal: bool) -> None:
    """Raise unless q, k, v form a valid block for a kernel (:func:`check_qkv`)."""
    check_qkv(q, k, v, causal=causal, equal_lengths=False, who="attention block")
