"""Backend choice: by device and availability, overridable with ``CHARM_ATTN_BACKEND``."""

from __future__ import annotations

import functools
import os
from collections.abc import Mapping

import torch

from charm_megatron.kernels.base import AttentionBackend

BACKENDS = ("torch", "flash_attn", "reference")


@functools.cache
def _make(name: str) -> AttentionBackend:
    if name == "torch":
        from charm_megatron.kernels.torch_backend import TorchBackend

        return TorchBackend()
    if name == "flash_attn":
        from charm_megatron.kernels.flash_attn_backend import FlashAttnBackend

        return FlashAttnBackend()
    if name == "reference":
        from charm_megatron.kernels.reference import ReferenceBackend

        return ReferenceBackend(torch.float32)  # float64 blocks still compute in float64
    raise ValueError(
        f"unknown attention backend {name!r}; CHARM_ATTN_BACKEND must be one of {', '.join(BACKENDS)}"
    )


@functools.cache
def _flash_attn_importable() -> bool:
    try:
        import flash_attn  # noqa: F401
    except Exception:  # noqa: BLE001 - any import failure means "not usable"
        return False
    return True


def available_backends(device: torch.device | str = "cpu") -> list[str]:
    """Backends usable for tensors on ``device``."""
    dev = torch.device(device)
    names = ["torch", "reference"]
    if dev.type == "cuda" and _flash_attn_importable():
        names.insert(0, "flash_attn")
    return names


def get_backend(
    device: torch.device | str = "cpu", dtype: torch.dtype | None = None, name: str | None = None,
    environ: Mapping[str, str] | None = None,
) -> AttentionBackend:
    """The backend for tensors on ``device``: ``name``, else ``CHARM_ATTN_BACKEND`` in
    ``environ`` (``os.environ``; ``cp_attention`` passes ``{}``: it resolved the variable into
    its options already), else automatic.

    Automatic: ``flash_attn`` on CUDA for fp16/bf16 when importable, else ``torch``.
    """
    env = os.environ if environ is None else environ
    name = name or env.get("CHARM_ATTN_BACKEND") or None
    if name is not None:
        if name == "flash_attn" and not _flash_attn_importable():
            raise ValueError("CHARM_ATTN_BACKEND=flash_attn but flash_attn cannot be imported; "
                             "install it (pip install flash-attn) or unset the variable")
        return _make(name)
    dev = torch.device(device)
    if dev.type == "cuda" and dtype in (torch.float16, torch.bfloat16) and _flash_attn_importable():
        return _make("flash_attn")
    return _make("torch")
