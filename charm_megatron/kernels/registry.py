"""The kernel backends by name, and the choice among them. The name comes from the caller
(``CPOptions.backend``, which the API edge reads from ``CHARM_ATTN_BACKEND``); this module reads
no environment variable.

Adding a backend is one file plus one line: a class with ``name``, ``forward`` and ``backward``
(:class:`~charm_megatron.kernels.base.AttentionBackend`) and
``register_backend(name, factory, usable)``; it can then be forced by name, and where its
``usable`` says it runs, the automatic choice self-checks and times it beside the others
(:mod:`~charm_megatron.kernels.selection`).
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from dataclasses import dataclass

import torch

from charm_megatron.kernels.base import AttentionBackend

#: ``(device, dtype) -> why it cannot run there, or None``.
Usable = Callable[[torch.device, torch.dtype], "str | None"]


@dataclass(frozen=True)
class BackendEntry:
    name: str
    factory: Callable[[], AttentionBackend]
    usable: Usable
    automatic: bool  # a candidate of the automatic choice (the reference is not: tests only)


_ENTRIES: dict[str, BackendEntry] = {}


def register_backend(name: str, factory: Callable[[], AttentionBackend],
                     usable: Usable | None = None, *, automatic: bool = True) -> None:
    """Add a backend: ``factory()`` makes it (once per process, on first use); ``usable(device,
    dtype)`` says why it cannot run there (``None``: everywhere). ``automatic``: the automatic
    choice may pick it (after its self-check)."""
    if name in _ENTRIES or name == "auto":
        raise ValueError(f"attention backend {name!r} is already registered (or reserved)")
    _ENTRIES[name] = BackendEntry(name, factory, usable or (lambda d, t: None), automatic)
    _make.cache_clear()


def unregister_backend(name: str) -> None:
    """Remove a registered backend (tests)."""
    _ENTRIES.pop(name, None)
    _make.cache_clear()


def backend_names() -> tuple[str, ...]:
    """Every registered backend's name, in registration order."""
    return tuple(_ENTRIES)


def why_not(name: str, device: torch.device | str, dtype: torch.dtype) -> str | None:
    """Why backend ``name`` cannot run blocks on ``device`` in ``dtype`` (``None``: it can)."""
    return _entry(name).usable(torch.device(device), dtype)


def _entry(name: str) -> BackendEntry:
    try:
        return _ENTRIES[name]
    except KeyError:
        raise ValueError(f"unknown attention backend {name!r} (CHARM_ATTN_BACKEND / "
                         f"CPOptions.backend); choose one of {', '.join(_ENTRIES)}") from None


@functools.cache
def _make(name: str) -> AttentionBackend:
    return _entry(name).factory()


def make_backend(name: str) -> AttentionBackend:
    """The process's instance of backend ``name``."""
    return _make(name)


def automatic_candidates(device: torch.device | str, dtype: torch.dtype) -> tuple[str, ...]:
    """The backends the automatic choice weighs for ``device`` and ``dtype``."""
    dev = torch.device(device)
    return tuple(e.name for e in _ENTRIES.values() if e.automatic and e.usable(dev, dtype) is None)


# ----------------------------------------------------------------------------- built-ins
def _torch() -> AttentionBackend:
    from charm_megatron.kernels.torch_backend import TorchBackend

    return TorchBackend()


def _flash_attn() -> AttentionBackend:
    from charm_megatron.kernels.flash_attn_backend import FlashAttnBackend

    return FlashAttnBackend()


def _reference() -> AttentionBackend:
    from charm_megatron.kernels.reference import ReferenceBackend

    return ReferenceBackend(torch.float32)  # float64 blocks still compute in float64


def _cudnn() -> AttentionBackend:
    from charm_megatron.kernels.cudnn_backend import CudnnBackend

    return CudnnBackend()


@functools.cache
def _flash_attn_importable() -> bool:
    try:
        import flash_attn  # noqa: F401
    except Exception:  # noqa: BLE001 - any import failure means "not usable"
        return False
    return True


def _flash_attn_usable(device: torch.device, dtype: torch.dtype) -> str | None:
    if device.type != "cuda" or dtype not in (torch.float16, torch.bfloat16):
        return "flash_attn runs fp16 / bf16 on CUDA only"
    if not _flash_attn_importable():
        return "flash_attn cannot be imported (pip install flash-attn)"
    return None


def _cudnn_usable(device: torch.device, dtype: torch.dtype) -> str | None:
    from charm_megatron.kernels.cudnn_backend import usable

    return usable(device, dtype)


register_backend("torch", _torch)
register_backend("flash_attn", _flash_attn, _flash_attn_usable)
register_backend("cudnn", _cudnn, _cudnn_usable)
register_backend("reference", _reference, automatic=False)

#: The built-in backends' names (:func:`backend_names` also lists those registered later).
BACKENDS = backend_names()


def available_backends(device: torch.device | str = "cpu",
                       dtype: torch.dtype | None = None) -> list[str]:
    """Backends usable for tensors on ``device`` (in ``dtype``; ``None``: the device's fastest
    half precision on CUDA, float32 on CPU), the automatic candidates first."""
    dev = torch.device(device)
    dt = dtype or (torch.bfloat16 if dev.type == "cuda" else torch.float32)
    names = [n for n in automatic_candidates(dev, dt)]
    return [*names, *(n for n in _ENTRIES if n not in names and why_not(n, dev, dt) is None)]


def get_backend(
    device: torch.device | str = "cpu", dtype: torch.dtype | None = None, name: str | None = None,
) -> AttentionBackend:
    """The backend for tensors on ``device``: ``name`` (a registered backend), else automatic:
    on CUDA in fp16 / bf16, the fastest of the usable backends that pass their self-check,
    measured on first use per dtype, head dim and mask (:class:`~charm_megatron.kernels.
    selection.AutoBackend`); anywhere else ``torch`` (CPU keeps one path: its kernel is the
    only automatic candidate there). A backend forced by name on CUDA is self-checked too."""
    if name is not None:
        why = why_not(name, device, dtype or torch.float32) if name == "flash_attn" else None
        if why is not None and "import" in why:
            raise ValueError(f"attention backend flash_attn (CHARM_ATTN_BACKEND / "
                             f"CPOptions.backend): {why}, or choose torch")
        backend = make_backend(name)
        if torch.device(device).type == "cuda" and name != "reference":
            from charm_megatron.kernels.selection import AutoBackend

            # Forced, and still self-checked on first use per key: a kernel wrong on this
            # driver raises (naming itself) instead of training on wrong numbers.
            return AutoBackend((name,))
        return backend
    dev = torch.device(device)
    if dev.type == "cuda" and dtype in (torch.float16, torch.bfloat16):
        from charm_megatron.kernels.selection import AutoBackend

        return AutoBackend.for_device(dev)
    return make_backend("torch")
