"""Causal square blocks on the CPU kernel, cut into pieces the kernel computes without waste.

PyTorch's CPU flash-attention kernel skips masked keys only in steps of its 512-key split, so a
causal block of up to 512 rows and keys costs as much as an unmasked one: half of that work is
masked away. Under Megatron's load-balanced layout every rank's own tile is such a block (both
local chunks against themselves, ALGORITHM.md §5), at every step of every algorithm.

A causal square block is its two diagonal halves (causal, each half the size) plus the unmasked
lower-left quarter (the second half of the rows against the first half of the keys); each level
of that cut leaves 3/4 of the previous work, and halves are cut again while their halves are
at least :data:`MIN_HALF` rows. The backward kernel wastes masked work at every size; the
forward one skips whole 512-key splits by itself, so forward blocks longer than
:data:`FORWARD_MAX_ROWS` go whole. Measured (1 thread, b=2, 8 q / 2 kv heads, d=64, fp32, ms,
whole → cut): forward 384 rows 7.9 → 6.2, 1024 rows 38.7 → 35.8, 2048 rows 127 (whole);
backward 384 rows 18.4 → 13.5, 1024 rows 101 → 80, 2048 rows 338 → 293.

The pieces give the block's exact result: the forward merges the two partials of the second
half's rows by log-sum-exp (in fp32); the backward is the kernel's own backward per piece
(with the block's merged output and log-sum-exp, which is what makes per-piece gradients
exact) and sums the pieces' gradients of shared rows.

All tensors here are ``[b, h, s, d]`` (or ``[b, h, s]`` for the log-sum-exp), any strides.
"""

from __future__ import annotations

import torch

MIN_HALF = 96  # smaller pieces cost more in kernel calls than the masked work they save
FORWARD_MAX_ROWS = 1024  # beyond this the forward kernel's own skipping does as well

_forward_op = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu
_backward_op = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward


def worth_cutting(q: torch.Tensor, k: torch.Tensor, causal: bool, backward: bool = False) -> bool:
    """True for a causal square block whose cut pieces the kernel computes faster."""
    s = q.shape[2]
    return (causal and s == k.shape[2] and s % 2 == 0 and s // 2 >= MIN_HALF
            and (backward or s <= FORWARD_MAX_ROWS))


def forward(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
            scale: float | None) -> tuple[torch.Tensor, torch.Tensor]:
    """``(out, lse)`` of causal ``q`` against ``k, v`` (same length), as the kernel's."""
    if not worth_cutting(q, k, True):
        return _forward_op(q, k, v, 0.0, True, scale=scale)
    h = q.shape[2] // 2
    first, second = slice(0, h), slice(h, None)
    out_a, lse_a = forward(q[:, :, first], k[:, :, first], v[:, :, first], scale)
    out_b, lse_b = _forward_op(q[:, :, second], k[:, :, first], v[:, :, first], 0.0, False,
                               scale=scale)
    out_c, lse_c = forward(q[:, :, second], k[:, :, second], v[:, :, second], scale)
    out = torch.empty(q.shape, dtype=out_a.dtype, device=q.device)
    lse = torch.empty(q.shape[:3], dtype=lse_a.dtype, device=q.device)
    out[:, :, first] = out_a
    lse[:, :, first] = lse_a
    # Every row of a causal block sees at least its own key, so both lse are finite.
    merged = torch.logaddexp(lse_b, lse_c)
    weight = torch.exp(lse_c - merged).unsqueeze(-1).to(torch.promote_types(lse_c.dtype,
                                                                            torch.float32))
    out[:, :, second] = torch.lerp(out_b.to(weight.dtype), out_c.to(weight.dtype), weight)
    lse[:, :, second] = merged
    return out, lse


def backward(dout: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
             out: torch.Tensor, lse: torch.Tensor,
             scale: float | None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``(dq, dk, dv)`` of the causal block, given its (merged) ``out`` and ``lse``."""
    if not worth_cutting(q, k, True, backward=True):
        return _backward_op(dout, q, k, v, out, lse, 0.0, True, scale=scale)
    h = q.shape[2] // 2
    first, second = slice(0, h), slice(h, None)

    def rows(x: torch.Tensor, part: slice) -> torch.Tensor:
        return x[:, :, part]

    lse_first, lse_second = rows(lse, first).contiguous(), rows(lse, second).contiguous()
    dq_a, dk_a, dv_a = backward(rows(dout, first), rows(q, first), rows(k, first),
                                rows(v, first), rows(out, first), lse_first, scale)
    dq_b, dk_b, dv_b = _backward_op(rows(dout, second), rows(q, second), rows(k, first),
                                    rows(v, first), rows(out, second), lse_second, 0.0, False,
                                    scale=scale)
    dq_c, dk_c, dv_c = backward(rows(dout, second), rows(q, second), rows(k, second),
                                rows(v, second), rows(out, second), lse_second, scale)
    dq = torch.empty(q.shape, dtype=dq_a.dtype, device=q.device)
    dk = torch.empty(k.shape, dtype=dk_a.dtype, device=q.device)
    dv = torch.empty(v.shape, dtype=dv_a.dtype, device=q.device)
    dq[:, :, first] = dq_a
    _sum_into(dq[:, :, second], dq_b, dq_c)
    _sum_into(dk[:, :, first], dk_a, dk_b)
    dk[:, :, second] = dk_c
    _sum_into(dv[:, :, first], dv_a, dv_b)
    dv[:, :, second] = dv_c
    return dq, dk, dv


def _sum_into(dst: torch.Tensor, a: torch.Tensor, b: torch.Tensor) -> None:
    # Low-precision pieces are summed in fp32 and rounded once, as the whole-block kernel does.
    if a.dtype in (torch.float32, torch.float64):
        torch.add(a, b, out=dst)
    else:
        dst.copy_(a.float() + b.float())
