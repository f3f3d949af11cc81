"""Backend choice: a name, or by device and availability. The name comes from the caller
(``CPOptions.backend``, which the API edge reads from ``CHARM_ATTN_BACKEND``); this module reads
no environment variable."""

from __future__ import annotations

import functools

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
        f"unknown attention backend {name!r} (CHARM_ATTN_BACKEND / CPOptions.backend); "
        f"choose one of {', '.join(BACKENDS)}"
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
) -> AttentionBackend:
    """The backend for tensors on ``device``: ``name`` (one of :data:`BACKENDS`), else
    automatic: ``flash_attn`` on CUDA for fp16/bf16 when importable, else ``torch``."""
    if name is not None:
        if name == "flash_attn" and not _flash_attn_importable():
            raise ValueError("attention backend flash_attn (CHARM_ATTN_BACKEND / "
                             "CPOptions.backend) cannot be imported; install it (pip install "
                             "flash-attn) or choose torch")
        return _make(name)
    dev = torch.device(device)
    if dev.type == "cuda" and dtype in (torch.float16, torch.bfloat16) and _flash_attn_importable():
        return _make("flash_attn")
    return _make("torch")
