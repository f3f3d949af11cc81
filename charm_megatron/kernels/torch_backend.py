"""Attention through PyTorch's fused aten kernels (no extra dependency).

* CPU: ``_scaled_dot_product_flash_attention_for_cpu`` and its backward (fp16/bf16/fp32 and
  float64; float64 blocks keep a float64 lse). GQA is native (kv with
  fewer heads; backward returns group-summed dk/dv), strided ``[b, h, s, d]`` views are accepted,
  so sbhd tensors go in as permuted views without copies. Causal square blocks (every rank's
  own tile under the load-balanced layout) are cut into pieces the kernels compute with less
  masked work (:mod:`~charm_megatron.kernels.causal_split`): backward here, forward through
  :meth:`TorchBackend.forward_cut`, whose pieces the executor merges into its accumulator.
* CUDA: ``_scaled_dot_product_flash_attention`` (fp16/bf16) or
  ``_scaled_dot_product_efficient_attention`` (fp32, or head dims flash does not take). These
  need equal head counts, so GQA kv is expanded there (``expand`` + ``reshape``: one copy of the
  block, summed back in backward). float64 goes to the plain-math reference kernels (exact,
  slower): no fused CUDA kernel takes it.
"""

from __future__ import annotations

import torch

from charm_megatron.kernels import causal_split
from charm_megatron.kernels.base import check_block_shapes
from charm_megatron.kernels.reference import ReferenceBackend


def _bhsd(x: torch.Tensor) -> torch.Tensor:
    return x.permute(1, 2, 0, 3)


def _sbhd(x: torch.Tensor) -> torch.Tensor:
    return x.permute(2, 0, 1, 3)


def _expand_kv(x: torch.Tensor, groups: int) -> torch.Tensor:
    # [b, h_kv, s, d] -> [b, h_kv * groups, s, d], each kv head serving `groups` query heads.
    if groups == 1:
        return x
    b, h, s, d = x.shape
    return x.unsqueeze(2).expand(b, h, groups, s, d).reshape(b, h * groups, s, d)


def _fold_kv_grad(x: torch.Tensor, groups: int) -> torch.Tensor:
    if groups == 1:
        return x
    b, hq, s, d = x.shape
    return x.reshape(b, hq // groups, groups, s, d).sum(2)


_FLOAT64_MATH = ReferenceBackend(torch.float64)


class TorchBackend:
    """aten fused attention; the CPU or CUDA kernel pair is picked per call from q's device."""

    name = "torch"

    # ----------------------------------------------------------------------------- forward
    def forward(self, q, k, v, causal, scale):
        check_block_shapes(q, k, v, causal)
        if q.device.type == "cuda":
            return self._forward_cuda(q, k, v, causal, scale)
        out, lse = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(
            _bhsd(q), _bhsd(k), _bhsd(v), 0.0, causal, scale=scale
        )
        return _sbhd(out), lse

    def forward_cut(self, q: torch.Tensor, k: torch.Tensor,
                    causal: bool) -> list[tuple[slice, slice, bool]] | None:
        """The pieces (q rows, key rows, causal) an accumulated forward tile is better computed
        in, each piece one :meth:`forward` call (``None``: whole). The CPU kernel computes
        most of a causal square block's masked half, so such a block is cut
        (:mod:`~charm_megatron.kernels.causal_split`); the CUDA kernels skip it themselves."""
        if q.device.type != "cpu" or not causal_split.worth_cutting_forward(
                q.shape[0], k.shape[0], causal, q.shape[-1]):
            return None
        return causal_split.forward_pieces(q.shape[0])

    def _use_flash(self, q: torch.Tensor) -> bool:
        # aten's flash kernels take fp16 / bf16 with a head dim that is a multiple of 8, at
        # most 256; anything else goes to the memory-efficient kernel.
        d = q.shape[-1]
        return q.dtype in (torch.float16, torch.bfloat16) and d <= 256 and d % 8 == 0

    def _forward_cuda(self, q, k, v, causal, scale):
        if q.dtype == torch.float64:  # no fused CUDA kernel takes float64: exact plain math
            return _FLOAT64_MATH.forward(q, k, v, causal, scale)
        groups = q.shape[2] // k.shape[2]
        qb = _bhsd(q)
        kb, vb = _expand_kv(_bhsd(k), groups), _expand_kv(_bhsd(v), groups)
        if self._use_flash(q):
            res = torch.ops.aten._scaled_dot_product_flash_attention(
                qb, kb, vb, 0.0, causal, False, scale=scale
            )
            out, lse = res[0], res[1]
        else:
            res = torch.ops.aten._scaled_dot_product_efficient_attention(
                qb, kb, vb, None, True, 0.0, causal, scale=scale
            )
            out, lse = res[0], res[1]
            # The efficient kernel pads lse's sequence dim to a multiple of 32.
            lse = lse[:, :, : q.shape[0]]
        return _sbhd(out), lse.float()

    # ---------------------------------------------------------------------------- backward
    def backward(self, dout, q, k, v, out, lse, causal, scale):
        check_block_shapes(q, k, v, causal)
        if q.device.type == "cuda":
            return self._backward_cuda(dout, q, k, v, out, lse, causal, scale)
        # The CPU kernel wants lse in the inputs' dtype when that is float64 (its forward
        # returns it so), fp32 otherwise; the CP merge keeps lse in its accumulator dtype.
        lse = lse.to(torch.float64 if q.dtype == torch.float64 else torch.float32)
        qb, kb = _bhsd(q), _bhsd(k)
        if causal_split.worth_cutting(qb, kb, causal):
            dq, dk, dv = causal_split.backward(_bhsd(dout), qb, kb, _bhsd(v), _bhsd(out), lse,
                                               scale)
        else:
            dq, dk, dv = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward(
                _bhsd(dout), qb, kb, _bhsd(v), _bhsd(out), lse, 0.0, causal, scale=scale
            )
        return _sbhd(dq), _sbhd(dk), _sbhd(dv)

    def _backward_cuda(self, dout, q, k, v, out, lse, causal, scale):
        if q.dtype == torch.float64:
            return _FLOAT64_MATH.backward(dout, q, k, v, out, lse, causal, scale)
        groups = q.shape[2] // k.shape[2]
        sq, sk = q.shape[0], k.shape[0]
        qb = _bhsd(q)
        kb, vb = _expand_kv(_bhsd(k), groups), _expand_kv(_bhsd(v), groups)
        # The CUDA kernels want contiguous-last-dim inputs in the query's dtype.
        dob = _bhsd(dout).to(q.dtype)
        ob = _bhsd(out).to(q.dtype)
        lse = lse.float().contiguous()
        if self._use_flash(q):
            # No cumulative sequence lengths (None, as the dense forward returns them): given
            # any, the kernel takes the varlen path and reads [b, h, s, d] as [total, h, d]
            # (seen on an H200 with torch 2.11, docs/gpu-check.md). Without dropout the
            # philox seed and offset are never read.
            empty = torch.empty((), dtype=torch.int64, device=q.device)
            dq, dk, dv = torch.ops.aten._scaled_dot_product_flash_attention_backward(
                dob, qb, kb, vb, ob, lse, None, None, sq, sk, 0.0, causal, empty, empty,
                scale=scale,
            )
        else:
            empty = torch.empty((), dtype=torch.int64, device=q.device)
            dq, dk, dv, _ = torch.ops.aten._scaled_dot_product_efficient_attention_backward(
                dob, qb, kb, vb, None, ob, lse, empty, empty, 0.0, [True, True, True, False],
                causal, scale=scale,
            )
        return _sbhd(dq), _sbhd(_fold_kv_grad(dk, groups)), _sbhd(_fold_kv_grad(dv, groups))
