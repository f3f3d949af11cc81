"""The fp32 log-sum-exp merge of partial attention outputs.

Two partials of the same query rows, ``(O_a, L_a)`` over one key set and ``(O_b, L_b)`` over a
disjoint one, combine into the result over the union::

    L = logaddexp(L_a, L_b),   O = O_a + exp(L_b − L) · (O_b − O_a)

(the one-pass ``lerp`` form: one read-modify-write of the accumulator instead of two scaled
sums; measured ~3× cheaper than the naive form). Rows that saw no key have ``L = −inf``; the
weight is computed against a clamped ``L`` so such rows give weight 0, never NaN.

On CUDA with Triton the merge is one fused kernel (:mod:`charm_megatron.kernels.merge_fused`, the
same formulas); elsewhere these PyTorch ops.

Layouts: accumulator ``out`` is ``[s, b, h, d]`` fp32 and ``lse`` ``[s, b, h]`` fp32, so that a
contiguous row range (e.g. the second half under causal masking) is a contiguous slice.
"""

from __future__ import annotations

import torch

_FLOOR = torch.finfo(torch.float32).min


def merge_into(
    acc_out: torch.Tensor,
    acc_lse: torch.Tensor,
    out: torch.Tensor,
    lse: torch.Tensor,
    rows: slice | None = None,
) -> None:
    """Merge partial ``(out, lse)`` into the accumulator in place, optionally into ``rows`` only.

    ``acc_out [s, b, h, d]`` fp32, ``acc_lse [s, b, h]`` fp32; ``out [r, b, h, d]`` (any float
    dtype, any strides), ``lse [r, b, h]`` where ``r`` is the length of ``rows``.
    """
    if rows is not None:
        acc_out, acc_lse = acc_out[rows], acc_lse[rows]
    if acc_out.is_cuda:
        from charm_megatron.ops import merge_fused  # lazy: Triton only where CUDA is

        if merge_fused.usable(acc_out, acc_lse, out):
            merge_fused.merge_into(acc_out, acc_lse, out, lse)
            return
    merge_into_unfused(acc_out, acc_lse, out, lse)


def merge_into_unfused(acc_out: torch.Tensor, acc_lse: torch.Tensor, out: torch.Tensor,
                       lse: torch.Tensor) -> None:
    """:func:`merge_into` in PyTorch elementwise ops (CPU, and CUDA without Triton)."""
    lse = lse.to(acc_lse.dtype)
    new_lse = torch.logaddexp(acc_lse, lse)
    weight = torch.exp(lse - new_lse.clamp(min=_FLOOR)).unsqueeze(-1)
    acc_out.lerp_(out.to(acc_out.dtype), weight)
    acc_lse.copy_(new_lse)


def merge_pair(
    out_a: torch.Tensor, lse_a: torch.Tensor, out_b: torch.Tensor, lse_b: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """Out-of-place merge of two partials (fp32 result), same layouts as :func:`merge_into`."""
    acc_out, acc_lse = out_a.float().clone(), lse_a.float().clone()
    merge_into(acc_out, acc_lse, out_b, lse_b)
    return acc_out, acc_lse
