"""Block attention over *segments*: several independent documents inside one tile.

A packed (THD) tile is q rows ``[sq, 1, hq, d]`` against kv rows ``[sk, 1, hkv, d]`` where only
some rows take part and each query row may only see the keys of its own document.
:class:`Segments` lists, per document, the q rows and the kv rows of the tile that are real
tokens (gathered in position order), and whether the document's part of the tile is causal
(then its q rows and kv rows are the same positions). Rows not listed (padding, or documents
with nothing on the other side of the tile) get ``out = 0``, ``lse = -inf`` and zero gradients.

How a tile is computed:

* **CUDA, fp16/bf16**: the listed rows are gathered into packed tensors and one varlen flash
  call covers all documents: ``flash_attn``'s ``_flash_attn_varlen_forward/_backward`` when the
  package imports, else aten's ``_flash_attention_forward/_backward`` with cumulative lengths.
* **Everything else** (CPU, fp32/fp64 on CUDA, ``CHARM_ATTN_BACKEND`` forcing a backend): one
  call of the block backend per document on the gathered rows. Per-document calls compute the
  same sums as one masked call, so the result is exact (and deterministic: same calls in the
  same order every time).
"""

from __future__ import annotations

import functools
import inspect
from dataclasses import dataclass

import torch

from charm_megatron.kernels.base import AttentionBackend
from charm_megatron.kernels.head_dims import pad_to, widths
from charm_megatron.kernels.window import keep, masked_backward, masked_forward


@dataclass(frozen=True)
class Segments:
    """Which rows of a tile form which document (see module docstring)."""

    q_index: torch.Tensor  # long [nq]: gathered q rows (document after document)
    k_index: torch.Tensor  # long [nk]
    cu_q: tuple[int, ...]  # cumulative q rows per document (len = documents + 1)
    cu_k: tuple[int, ...]
    causal: bool
    cu_q_dev: torch.Tensor  # int32 copies of cu_q / cu_k on the tensors' device (varlen)
    cu_k_dev: torch.Tensor

    @property
    def max_q(self) -> int:
        return max((b - a for a, b in zip(self.cu_q, self.cu_q[1:])), default=0)

    @property
    def max_k(self) -> int:
        return max((b - a for a, b in zip(self.cu_k, self.cu_k[1:])), default=0)


def lse_dtype(dtype: torch.dtype) -> torch.dtype:
    """The log-sum-exp's dtype for inputs of ``dtype``: fp32, float64 for float64 inputs."""
    return torch.float64 if dtype == torch.float64 else torch.float32


def _use_varlen(q: torch.Tensor, varlen: bool) -> bool:
    # varlen=False: the caller forced a block backend (CPOptions.backend / CHARM_ATTN_BACKEND,
    # resolved at the API edge), which then runs every document itself.
    return varlen and q.device.type == "cuda" and q.dtype in (torch.float16, torch.bfloat16)


def segmented_forward(backend: AttentionBackend, q: torch.Tensor, k: torch.Tensor,
                      v: torch.Tensor, seg: Segments, scale: float, *, varlen: bool = True,
                      masks: list[torch.Tensor] | None = None
                      ) -> tuple[torch.Tensor, torch.Tensor]:
    """``(out [sq, 1, hq, d], lse [1, hq, sq])`` of the tile, by document (lse in fp32, or
    float64 for float64 inputs: float64 end to end); ``varlen`` allows the one-call CUDA varlen
    kernel (fp16/bf16 on CUDA), else ``backend`` per document; ``masks``: a sliding window's
    pairs per document (:func:`window_masks`), each document then in the masked plain-math
    kernel (kernels/window.py)."""
    sq, _, hq, _ = q.shape
    _, d_v, width = widths(q, v)
    out = q.new_zeros((*q.shape[:-1], d_v))
    lse = torch.full((1, hq, sq), float("-inf"), dtype=lse_dtype(q.dtype), device=q.device)
    if seg.q_index.numel() == 0:
        return out, lse
    # One width for the kernels (MLA's v is narrower: kernels/head_dims.py); cut back below.
    qg, kg, vg = (pad_to(t, width) for t in (q[seg.q_index], k[seg.k_index], v[seg.k_index]))
    if masks is None and _use_varlen(q, varlen):
        og, lg = _cuda_varlen().forward(qg, kg, vg, seg, scale)
    else:
        og = torch.empty_like(qg)
        lg = torch.empty((1, hq, qg.shape[0]), dtype=lse.dtype, device=q.device)
        for i, ((a, b), (c, e)) in enumerate(zip(zip(seg.cu_q, seg.cu_q[1:]),
                                                 zip(seg.cu_k, seg.cu_k[1:]))):
            if masks is None:
                o, m = backend.forward(qg[a:b], kg[c:e], vg[c:e], seg.causal, scale)
            else:
                o, m = masked_forward(qg[a:b], kg[c:e], vg[c:e], masks[i], scale)
            og[a:b] = o
            lg[..., a:b] = m
    out.index_copy_(0, seg.q_index, og[..., :d_v].to(out.dtype))
    lse.index_copy_(2, seg.q_index, lg.to(lse.dtype))
    return out, lse


def segmented_backward(backend: AttentionBackend, dout: torch.Tensor, q: torch.Tensor,
                       k: torch.Tensor, v: torch.Tensor, out: torch.Tensor, lse: torch.Tensor,
                       seg: Segments, scale: float, *, varlen: bool = True,
                       masks: list[torch.Tensor] | None = None
                       ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``(dq, dk, dv)`` of the tile (zeros at unlisted rows); ``lse [1, hq, sq]``; ``varlen``
    and ``masks`` as in :func:`segmented_forward`."""
    dq, dk, dv = torch.zeros_like(q), torch.zeros_like(k), torch.zeros_like(v)
    if seg.q_index.numel() == 0:
        return dq, dk, dv
    qi, ki = seg.q_index, seg.k_index
    d_qk, d_v, width = widths(q, v)
    qg, dog, og = (pad_to(t[qi], width) for t in (q, dout, out))
    lg = lse.index_select(2, qi)
    kg, vg = pad_to(k[ki], width), pad_to(v[ki], width)
    if masks is None and _use_varlen(q, varlen):
        dqg, dkg, dvg = _cuda_varlen().backward(dog, qg, kg, vg, og, lg, seg, scale)
    else:
        dqg, dkg, dvg = torch.empty_like(qg), torch.empty_like(kg), torch.empty_like(vg)
        for i, ((a, b), (c, e)) in enumerate(zip(zip(seg.cu_q, seg.cu_q[1:]),
                                                 zip(seg.cu_k, seg.cu_k[1:]))):
            if masks is None:
                g = backend.backward(dog[a:b], qg[a:b], kg[c:e], vg[c:e], og[a:b],
                                     lg[..., a:b], seg.causal, scale)
            else:
                g = masked_backward(dog[a:b], qg[a:b], kg[c:e], vg[c:e], og[a:b],
                                    lg[..., a:b], masks[i], scale)
            dqg[a:b], dkg[c:e], dvg[c:e] = g
    dq.index_copy_(0, qi, dqg[..., :d_qk].to(dq.dtype))
    dk.index_copy_(0, ki, dkg[..., :d_qk].to(dk.dtype))
    dv.index_copy_(0, ki, dvg[..., :d_v].to(dv.dtype))
    return dq, dk, dv


# ------------------------------------------------------------------------ sliding windows
def window_masks(seg: Segments, q_pos: torch.Tensor, k_pos: torch.Tensor, causal: bool,
                 left: int, right: int) -> list[torch.Tensor]:
    """Per document of the tile, ``[nq, nk]``: the pairs a sliding window keeps, from the
    gathered rows' positions inside the document (``q_pos`` / ``k_pos``; kernels/window.keep);
    what :func:`segmented_forward` / :func:`segmented_backward` take as ``masks``."""
    return [keep(q_pos[a:b, None] - k_pos[None, c:e], causal, left, right)
            for (a, b), (c, e) in zip(zip(seg.cu_q, seg.cu_q[1:]), zip(seg.cu_k, seg.cu_k[1:]))]


# ---------------------------------------------------------------------------- CUDA varlen
@functools.cache
def _cuda_varlen() -> _FlashAttnVarlen | _AtenVarlen:
    try:
        return _FlashAttnVarlen()
    except ImportError:
        return _AtenVarlen()


def _lse_unpadded(lse: torch.Tensor, seg: Segments) -> torch.Tensor:
    """Varlen kernels return lse ``[h, total_q]`` (newer) or ``[docs, h, max_q]`` (older)."""
    if lse.dim() == 2:
        return lse.float().unsqueeze(0)
    parts = [lse[i, :, : b - a] for i, (a, b) in enumerate(zip(seg.cu_q, seg.cu_q[1:]))]
    return torch.cat(parts, dim=1).float().unsqueeze(0)


def _lse_like_kernel(lse: torch.Tensor, seg: Segments, padded: bool) -> torch.Tensor:
    """``lse [1, h, total_q]`` in the layout the kernel's forward produced."""
    if not padded:
        return lse[0].float().contiguous()
    docs = len(seg.cu_q) - 1
    full = lse.new_zeros((docs, lse.shape[1], seg.max_q), dtype=torch.float32)
    for i, (a, b) in enumerate(zip(seg.cu_q, seg.cu_q[1:])):
        full[i, :, : b - a] = lse[0, :, a:b]
    return full


class _AtenVarlen:
    """aten's ``_flash_attention_forward/_backward`` with cumulative lengths (GQA native)."""

    def __init__(self) -> None:
        self.padded_lse = False

    def forward(self, qg, kg, vg, seg, scale):
        res = torch.ops.aten._flash_attention_forward(
            qg[:, 0], kg[:, 0], vg[:, 0], seg.cu_q_dev, seg.cu_k_dev, seg.max_q, seg.max_k,
            0.0, seg.causal, False, scale=scale)
        out, lse = res[0], res[1]
        self.padded_lse = lse.dim() == 3
        return out.unsqueeze(1), _lse_unpadded(lse, seg)

    def backward(self, dog, qg, kg, vg, og, lg, seg, scale):
        # No dropout: the rng state is not read (as in torch_backend's flash backward).
        rng = unused = torch.empty((), dtype=torch.int64, device=qg.device)
        dq, dk, dv = torch.ops.aten._flash_attention_backward(
            dog[:, 0].to(qg.dtype).contiguous(), qg[:, 0], kg[:, 0], vg[:, 0],
            og[:, 0].to(qg.dtype).contiguous(), _lse_like_kernel(lg, seg, self.padded_lse),
            seg.cu_q_dev, seg.cu_k_dev, seg.max_q, seg.max_k, 0.0, seg.causal, rng, unused,
            scale=scale)
        return dq.unsqueeze(1), dk.unsqueeze(1), dv.unsqueeze(1)


class _FlashAttnVarlen:
    """``flash_attn``'s private varlen functions; arguments by name after inspecting the
    installed signature (window / softcap arguments changed across 2.x releases)."""

    def __init__(self) -> None:
        from flash_attn import flash_attn_interface as fai  # lazy: never at module import

        self._fwd = fai._flash_attn_varlen_forward
        self._bwd = fai._flash_attn_varlen_backward
        self._fwd_params = set(inspect.signature(self._fwd).parameters)
        self._bwd_params = set(inspect.signature(self._bwd).parameters)
        self.padded_lse = False

    @staticmethod
    def _optional(params: set[str]) -> dict:
        extra: dict = {}
        if "window_size_left" in params:
            extra.update(window_size_left=-1, window_size_right=-1)
        elif "window_size" in params:
            extra["window_size"] = (-1, -1)
        for name, value in (("softcap", 0.0), ("alibi_slopes", None), ("block_table", None)):
            if name in params:
                extra[name] = value
        return extra

    def forward(self, qg, kg, vg, seg, scale):
        kwargs = dict(cu_seqlens_q=seg.cu_q_dev, cu_seqlens_k=seg.cu_k_dev,
                      max_seqlen_q=seg.max_q, max_seqlen_k=seg.max_k, dropout_p=0.0,
                      softmax_scale=scale, causal=seg.causal, return_softmax=False)
        kwargs.update(self._optional(self._fwd_params))
        res = self._fwd(qg[:, 0].contiguous(), kg[:, 0].contiguous(), vg[:, 0].contiguous(),
                        **kwargs)
        # 2.6+: (out, lse, S, rng); older: (out, q, k, v, out_padded, lse, S, rng)
        out, lse = (res[0], res[1]) if len(res) == 4 else (res[0], res[5])
        self.padded_lse = lse.dim() == 3
        return out.unsqueeze(1), _lse_unpadded(lse, seg)

    def backward(self, dog, qg, kg, vg, og, lg, seg, scale):
        q, k, v = qg[:, 0].contiguous(), kg[:, 0].contiguous(), vg[:, 0].contiguous()
        dq, dk, dv = torch.empty_like(q), torch.empty_like(k), torch.empty_like(v)
        kwargs = dict(cu_seqlens_q=seg.cu_q_dev, cu_seqlens_k=seg.cu_k_dev,
                      max_seqlen_q=seg.max_q, max_seqlen_k=seg.max_k, dropout_p=0.0,
                      softmax_scale=scale, causal=seg.causal)
        kwargs.update(self._optional(self._bwd_params))
        kwargs.pop("block_table", None)
        if "deterministic" in self._bwd_params:
            kwargs["deterministic"] = True
        if "rng_state" in self._bwd_params:
            kwargs["rng_state"] = None
        self._bwd(dog[:, 0].to(q.dtype).contiguous(), q, k, v,
                  og[:, 0].to(q.dtype).contiguous(),
                  _lse_like_kernel(lg, seg, self.padded_lse), dq, dk, dv, **kwargs)
        return dq.unsqueeze(1), dk.unsqueeze(1), dv.unsqueeze(1)
