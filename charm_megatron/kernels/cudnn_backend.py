"""cuDNN attention through torch's own SDPA operators (no extra dependency: a CUDA build of torch
has them): ``_scaled_dot_product_cudnn_attention`` and its backward, on Hopper the fused
attention TransformerEngine runs too.

fp16 / bf16 on CUDA only (:func:`usable` says why not otherwise). The operators take equal head
counts, so GQA kv is expanded (one copy of the block, summed back in backward), as the torch
backend's CUDA path does. Not yet run on a GPU by this project: the selection
(:mod:`~charm_megatron.kernels.selection`) self-checks it against plain math on first use per
dtype, head dim and mask, and never uses it where that fails (docs/gpu-check.md).
"""

from __future__ import annotations

import torch

from charm_megatron.kernels.base import check_block_shapes
from charm_megatron.kernels.torch_backend import _bhsd, _expand_kv, _fold_kv_grad, _sbhd


def usable(device: torch.device, dtype: torch.dtype) -> str | None:
    """Why this backend cannot run blocks on ``device`` in ``dtype`` (``None``: it can)."""
    if device.type != "cuda":
        return "cuDNN attention runs on CUDA only"
    if dtype not in (torch.float16, torch.bfloat16):
        return f"cuDNN attention takes fp16 / bf16, not {dtype}"
    if not hasattr(torch.ops.aten, "_scaled_dot_product_cudnn_attention"):
        return "this torch build has no cuDNN attention operator"
    return None


class CudnnBackend:
    """Block attention with lse on cuDNN's fused kernels (see module docstring)."""

    name = "cudnn"

    def forward(self, q, k, v, causal, scale):
        check_block_shapes(q, k, v, causal)
        groups = q.shape[2] // k.shape[2]
        qb = _bhsd(q)
        kb, vb = _expand_kv(_bhsd(k), groups), _expand_kv(_bhsd(v), groups)
        res = torch.ops.aten._scaled_dot_product_cudnn_attention(
            qb, kb, vb, None, True, 0.0, causal, False, scale=scale)
        out, lse = res[0], res[1]
        # Some cuDNN versions return lse as [b, h, s, 1].
        lse = lse.reshape(q.shape[1], q.shape[2], q.shape[0])
        return _sbhd(out), lse.float()

    def backward(self, dout, q, k, v, out, lse, causal, scale):
        check_block_shapes(q, k, v, causal)
        groups = q.shape[2] // k.shape[2]
        sq, sk = q.shape[0], k.shape[0]
        qb = _bhsd(q)
        kb, vb = _expand_kv(_bhsd(k), groups), _expand_kv(_bhsd(v), groups)
        dob, ob = _bhsd(dout).to(q.dtype), _bhsd(out).to(q.dtype)
        empty = torch.empty(0, device=q.device)
        # No dropout: the philox seed and offset are never read; no cumulative lengths: dense.
        dq, dk, dv = torch.ops.aten._scaled_dot_product_cudnn_attention_backward(
            dob, qb, kb, vb, ob, lse.float().contiguous(), empty, empty, None, empty, empty,
            sq, sk, 0.0, causal, scale=scale)
        return _sbhd(dq), _sbhd(_fold_kv_grad(dk, groups)), _sbhd(_fold_kv_grad(dv, groups))
