"""Attention through the ``flash_attn`` package's private forward/backward functions.

Imported only when this backend is asked for. The private API changed across releases:

* 2.6+ : ``_flash_attn_forward(q, k, v, dropout_p, softmax_scale, causal, window_size_left,
  window_size_right, softcap, alibi_slopes, return_softmax)`` -> ``(out, lse, S, rng_state)``;
* 2.3–2.5: ``window_size=(l, r)`` tuple (and ``softcap`` from 2.5) -> ``(out, q, k, v,
  out_padded, lse, S, rng_state)``;
* backward similarly takes ``window_size_left/right`` or ``window_size`` and writes into
  ``dq, dk, dv`` it is given.

Arguments are passed by name after inspecting the installed signature, so both shapes work.
flash-attn wants ``[b, s, h, d]`` with a contiguous last dim, fp16/bf16, and supports GQA.
"""

from __future__ import annotations

import inspect

import torch

from charm_megatron.kernels.base import check_block_shapes


def _bshd(x: torch.Tensor) -> torch.Tensor:
    return x.transpose(0, 1).contiguous()


def _sbhd(x: torch.Tensor) -> torch.Tensor:
    return x.transpose(0, 1)


def _window_kwargs(params: set[str]) -> dict:
    if "window_size_left" in params:
        return {"window_size_left": -1, "window_size_right": -1}
    if "window_size" in params:
        return {"window_size": (-1, -1)}
    return {}


class FlashAttnBackend:
    """Backend over ``flash_attn.flash_attn_interface`` (raises ImportError if absent)."""

    name = "flash_attn"

    def __init__(self) -> None:
        from flash_attn import flash_attn_interface as fai  # lazy: never at module import

        self._fwd = fai._flash_attn_forward
        self._bwd = fai._flash_attn_backward
        self._fwd_params = set(inspect.signature(self._fwd).parameters)
        self._bwd_params = set(inspect.signature(self._bwd).parameters)

    def _optional(self, params: set[str]) -> dict:
        extra = _window_kwargs(params)
        if "softcap" in params:
            extra["softcap"] = 0.0
        if "alibi_slopes" in params:
            extra["alibi_slopes"] = None
        return extra

    def forward(self, q, k, v, causal, scale):
        check_block_shapes(q, k, v, causal)
        kwargs = dict(dropout_p=0.0, softmax_scale=scale, causal=causal, return_softmax=False)
        kwargs.update(self._optional(self._fwd_params))
        res = self._fwd(_bshd(q), _bshd(k), _bshd(v), **kwargs)
        # 2.6+: (out, lse, S, rng); older: (out, q, k, v, out_padded, lse, S, rng)
        out, lse = (res[0], res[1]) if len(res) == 4 else (res[0], res[5])
        return _sbhd(out), lse.float()

    def backward(self, dout, q, k, v, out, lse, causal, scale):
        check_block_shapes(q, k, v, causal)
        qb, kb, vb = _bshd(q), _bshd(k), _bshd(v)
        dq, dk, dv = torch.empty_like(qb), torch.empty_like(kb), torch.empty_like(vb)
        kwargs = dict(dropout_p=0.0, softmax_scale=scale, causal=causal)
        kwargs.update(self._optional(self._bwd_params))
        if "deterministic" in self._bwd_params:
            kwargs["deterministic"] = True
        if "rng_state" in self._bwd_params:
            kwargs["rng_state"] = None
        self._bwd(
            _bshd(dout).to(q.dtype), qb, kb, vb, _bshd(out).to(q.dtype), lse.float().contiguous(),
            dq, dk, dv, **kwargs,
        )
        return _sbhd(dq), _sbhd(dk), _sbhd(dv)
