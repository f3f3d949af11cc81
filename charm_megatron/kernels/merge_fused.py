"""The log-sum-exp merge of :mod:`charm_megatron.kernels.merge` as one Triton kernel (CUDA).

PyTorch's elementwise ops run the merge as five kernels (the partial widened to fp32, the
``logaddexp``, the weight, the ``lerp``, the lse copy), each a pass over memory: on one H200
that merged 235 GB/s of bf16 partial (docs/gpu-check.md), so a merge cost about 40 % of the
attention tile it follows at the paper's Table 5 shapes. This kernel reads the accumulator and
the partial once and writes the accumulator once, computing the same formulas in fp32 (torch's
``logaddexp`` and its two-sided ``lerp``), so results match the unfused path to fp32 rounding.

Used by :func:`~charm_megatron.kernels.merge.merge_into` for CUDA accumulators when Triton imports
(it ships with PyTorch's CUDA builds); imported lazily, never at module import. The partial and
its lse may have any strides (the kernels' ``[b, h, s, d]`` results arrive as permuted views);
the accumulator must be contiguous, which a row range of a ``[s, b, h, d]`` buffer is.
"""

from __future__ import annotations

import functools

import torch

from charm_megatron.kernels.merge import _FLOOR  # the clamp of the unfused path, one value


@functools.cache
def triton_available() -> bool:
    """Whether Triton imports here (cached; any failure means "use the torch path")."""
    try:
        import triton  # noqa: F401
        import triton.language  # noqa: F401
    except Exception:  # noqa: BLE001 - a broken install is the same as none
        return False
    return True


def usable(acc_out: torch.Tensor, acc_lse: torch.Tensor, out: torch.Tensor) -> bool:
    """Whether :func:`merge_into` takes these tensors: a CUDA fp32 contiguous accumulator, a
    partial on the same device, and Triton."""
    return (acc_out.is_cuda and out.device == acc_out.device
            and acc_out.dtype == torch.float32 and acc_lse.dtype == torch.float32
            and acc_out.is_contiguous() and acc_lse.is_contiguous()
            and out.dim() == 4 and acc_out.numel() > 0 and triton_available())


@functools.cache
def _kernel():
    import triton
    import triton.language as tl

    @triton.jit
    def lse_merge(acc_ptr, acc_lse_ptr, out_ptr, lse_ptr, M, B, H, D,
                  so_s, so_b, so_h, so_d, sl_s, sl_b, sl_h, floor,
                  BLOCK_M: tl.constexpr, BLOCK_D: tl.constexpr):
        # One program: BLOCK_M rows (flat (s, b, h) index) of D columns.
        rows = tl.program_id(0).to(tl.int64) * BLOCK_M + tl.arange(0, BLOCK_M)
        rmask = rows < M
        hh = rows % H
        bb = (rows // H) % B
        ss = rows // (H * B)
        a_l = tl.load(acc_lse_ptr + rows, mask=rmask, other=float("-inf"))
        p_l = tl.load(lse_ptr + ss * sl_s + bb * sl_b + hh * sl_h, mask=rmask,
                      other=float("-inf")).to(tl.float32)
        hi = tl.maximum(a_l, p_l)
        lo = tl.minimum(a_l, p_l)
        # logaddexp as torch computes it; equal infinities (rows no key reached yet, on both
        # sides) stay what they are instead of becoming NaN.
        same_inf = (a_l == p_l) & (tl.abs(a_l) == float("inf"))
        new_l = tl.where(same_inf, a_l, hi + tl.log(1.0 + tl.exp(lo - hi)))
        w = tl.exp(p_l - tl.maximum(new_l, floor))[:, None]
        cols = tl.arange(0, BLOCK_D)
        m2 = rmask[:, None] & (cols < D)[None, :]
        acc_off = rows[:, None] * D + cols[None, :]
        a = tl.load(acc_ptr + acc_off, mask=m2, other=0.0)
        o = tl.load(out_ptr + ss[:, None] * so_s + bb[:, None] * so_b + hh[:, None] * so_h
                    + cols[None, :] * so_d, mask=m2, other=0.0).to(tl.float32)
        # torch's lerp: from the nearer end, so w = 1 gives the partial exactly.
        res = tl.where(w < 0.5, a + w * (o - a), o - (o - a) * (1.0 - w))
        tl.store(acc_ptr + acc_off, res, mask=m2)
        tl.store(acc_lse_ptr + rows, new_l, mask=rmask)

    return lse_merge


def merge_into(acc_out: torch.Tensor, acc_lse: torch.Tensor, out: torch.Tensor,
               lse: torch.Tensor) -> None:
    """``merge.merge_into`` without its ``rows`` (the caller slices): the accumulator
    ``[r, b, h, d]`` fp32 contiguous and ``acc_lse [r, b, h]``; ``out [r, b, h, d]`` and ``lse
    [r, b, h]`` any dtype and strides. Check :func:`usable` first."""
    r, b, h, d = acc_out.shape
    if tuple(out.shape) != (r, b, h, d) or tuple(lse.shape) != (r, b, h):
        raise ValueError(f"fused merge: partial {tuple(out.shape)} / lse {tuple(lse.shape)} "
                         f"do not match the accumulator {tuple(acc_out.shape)}")
    block_d = max(16, 1 << (d - 1).bit_length())
    block_m = max(1, 4096 // block_d)
    m = r * b * h
    grid = ((m + block_m - 1) // block_m,)
    _kernel()[grid](acc_out, acc_lse, out, lse, m, b, h, d, *out.stride(), *lse.stride(),
                    _FLOOR, BLOCK_M=block_m, BLOCK_D=block_d, num_warps=4)
