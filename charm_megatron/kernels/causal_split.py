"""Causal square blocks on the CPU backward kernel, cut into pieces it computes with less waste.

PyTorch's CPU flash-attention backward kernel computes most of the masked half of a causal
block anyway. Under Megatron's load-balanced layout every rank's own tile is such a block (both
local chunks against themselves, docs/algorithm.md, notation), at every step of every algorithm.

A causal square block is its two diagonal halves (causal, each half the size) plus the unmasked
lower-left quarter (the second half of the rows against the first half of the keys); each level
of that cut leaves 3/4 of the previous work, and halves are cut again while their halves are
at least :data:`MIN_HALF` rows. Measured (1 thread, b=2, 8 q / 2 kv heads, d=64, fp32, ms,
whole → cut): 384 rows 18.4 → 13.5, 1024 rows 101 → 80, 2048 rows 338 → 293.

Each piece is the kernel's own backward with the block's merged output and log-sum-exp (which
is what makes per-piece gradients exact); the pieces' gradients of shared rows are summed.

Forward, the CPU kernel wastes the masked half too: it skips masked keys only in whole
512-key splits (1 thread, b=2, 8 q / 2 kv heads, d=64, fp32: a causal 384-row block takes as
long as an unmasked one, 10.2 ms). :func:`forward_pieces` gives the same cut as row and key
ranges; the executor runs the forward kernel on each and lse-merges every piece straight into
the tile's accumulator (ops/executor.py), so no piece lives beside a whole-block output and the
peak is lower than the whole block's. Measured, cut / whole time (merges included, 1 thread,
fp32, 8 q / 2 kv heads):

=========  ======  ======  =======  =======
head dim   256     512     1024     2048 rows
=========  ======  ======  =======  =======
32         0.97    0.76    0.93     0.99
64         0.86    0.80    0.90     0.96
128        0.82    0.71    0.90     0.95
16 (4/2)   1.08    0.94    0.94     1.04
=========  ======  ======  =======  =======

(d=64, 384 rows: 10.2 → 7.4 ms.) Below :data:`MIN_HEAD_DIM_FORWARD` the kernel is cheap per
key and the pieces' extra calls and merges cancel the saving, so such blocks stay whole.

All tensors here are ``[b, h, s, d]`` (or ``[b, h, s]`` for the log-sum-exp), any strides.
"""

from __future__ import annotations

import torch

MIN_HALF = 96  # smaller pieces cost more in kernel calls than the masked work they save
MIN_HEAD_DIM_FORWARD = 32  # forward: narrower heads gain nothing from the cut (table above)

_backward_op = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward


def _cuts(s_q: int, s_k: int, causal: bool) -> bool:
    """A causal square block long enough that its halves are worth a kernel call each."""
    return causal and s_q == s_k and s_q % 2 == 0 and s_q // 2 >= MIN_HALF


def worth_cutting(q: torch.Tensor, k: torch.Tensor, causal: bool) -> bool:
    """True for a causal square block whose cut pieces the backward kernel computes faster."""
    return _cuts(q.shape[2], k.shape[2], causal)


def worth_cutting_forward(s_q: int, s_k: int, causal: bool, head_dim: int) -> bool:
    """True for a causal square block of ``s_q`` rows that the CPU forward kernel computes
    faster in the pieces of :func:`forward_pieces`."""
    return _cuts(s_q, s_k, causal) and head_dim >= MIN_HEAD_DIM_FORWARD


def forward_pieces(s: int) -> list[tuple[slice, slice, bool]]:
    """The pieces of a causal square block of ``s`` rows as ``(q rows, key rows, causal)``:
    every (row, key) pair at or below the diagonal is in exactly one piece."""
    out: list[tuple[slice, slice, bool]] = []

    def cut(lo: int, hi: int) -> None:
        if not _cuts(hi - lo, hi - lo, True):
            out.append((slice(lo, hi), slice(lo, hi), True))
            return
        mid = (lo + hi) // 2
        cut(lo, mid)
        out.append((slice(mid, hi), slice(lo, mid), False))  # unmasked lower-left quarter
        cut(mid, hi)

    cut(0, s)
    return out


def backward(dout: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
             out: torch.Tensor, lse: torch.Tensor,
             scale: float | None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``(dq, dk, dv)`` of the causal block, given its (merged) ``out`` and ``lse``."""
    if not worth_cutting(q, k, True):
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
