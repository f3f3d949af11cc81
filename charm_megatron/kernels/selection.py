"""The automatic kernel choice: per device, dtype, head dim and mask, the fastest of the usable
backends that pass their self-check (:mod:`~charm_megatron.kernels.selfcheck`), measured once
per process on a block of the call's kind.

:class:`AutoBackend` is what a call gets when no backend is forced on CUDA in fp16 / bf16: each
tile goes to the backend chosen for its key, chosen on the first tile of that key. A backend
that fails its self-check is reported once (a ``RuntimeWarning`` naming it and its error) and
never used; if none passes, the call fails with that list instead of training on wrong numbers.
:func:`choices` lists what was measured (for gpu_check and the profiles).
"""

from __future__ import annotations

import time
import warnings
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch

from charm_megatron.kernels import selfcheck
from charm_megatron.kernels.base import AttentionBackend
from charm_megatron.kernels.registry import automatic_candidates, make_backend

# The timed block per key: long enough that a fused kernel's launch cost is a small part of it.
TIMED_ROWS = {"cuda": 2048, "cpu": 256}
TIMED_REPEATS = 3


@dataclass(frozen=True)
class Choice:
    """What the selection decided for one key: the pick, every candidate's measured seconds
    (forward + backward of the timed block) and the candidates it refused, with why."""

    key: tuple
    picked: str
    seconds: tuple[tuple[str, float], ...]
    refused: tuple[tuple[str, str], ...]


_CHOICES: dict[tuple, Choice] = {}


def choices() -> tuple[Choice, ...]:
    """Every choice made in this process."""
    return tuple(_CHOICES.values())


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def time_backend(backend: AttentionBackend, device: torch.device, dtype: torch.dtype,
                 head_dim: int, causal: bool) -> float:
    """Seconds of one forward + backward of the timed block (best of a few, after a warm-up)."""
    rows = TIMED_ROWS.get(device.type, 256)
    gen = torch.Generator().manual_seed(7)
    q = torch.randn(rows, 1, 8, head_dim, generator=gen).to(device=device, dtype=dtype)
    k = torch.randn(rows, 1, 8, head_dim, generator=gen).to(device=device, dtype=dtype)
    dout = torch.randn_like(q)
    scale = head_dim ** -0.5
    best = float("inf")
    for i in range(1 + TIMED_REPEATS):
        _sync(device)
        start = time.perf_counter()
        out, lse = backend.forward(q, k, k, causal, scale)
        backend.backward(dout, q, k, k, out, lse, causal, scale)
        _sync(device)
        if i:
            best = min(best, time.perf_counter() - start)
    return best


def choose(device: torch.device, dtype: torch.dtype, head_dim: int, causal: bool,
           candidates: Sequence[str] | None = None,
           timer: Callable[..., float] = time_backend) -> Choice:
    """The choice for one key (made once per process; ``candidates``: backend names, default
    the registry's automatic candidates for ``device`` and ``dtype``). Raises ``RuntimeError``
    listing every refusal when no candidate passes its self-check."""
    names = tuple(candidates) if candidates is not None else automatic_candidates(device, dtype)
    key = (names, device, dtype, head_dim, causal)
    if key in _CHOICES:
        return _CHOICES[key]
    passed, refused = [], []
    for name in names:
        backend = make_backend(name)
        why = selfcheck.cached_check(backend, device, dtype, head_dim, causal)
        if why is None:
            passed.append(name)
            continue
        refused.append((name, why))
        warnings.warn(f"charm-megatron: kernel backend {name!r} failed its self-check for "
                      f"{dtype} head dim {head_dim} {'causal' if causal else 'full'} blocks on "
                      f"{device} ({why}); it is not used", RuntimeWarning, stacklevel=3)
    if not passed:
        listed = "; ".join(f"{n}: {w}" for n, w in refused) or "no candidate is usable"
        raise RuntimeError(f"charm-megatron: no attention kernel passed its self-check for "
                           f"{dtype} head dim {head_dim} on {device} ({listed}); force one "
                           "with CHARM_ATTN_BACKEND / CPOptions.backend only if you know it "
                           "is right")
    seconds = tuple((n, timer(make_backend(n), device, dtype, head_dim, causal))
                    for n in passed) if len(passed) > 1 else ((passed[0], float("nan")),)
    picked = min(seconds, key=lambda s: s[1])[0] if len(passed) > 1 else passed[0]
    choice = Choice(key, picked, seconds, tuple(refused))
    _CHOICES[key] = choice
    return choice


class AutoBackend:
    """A backend that sends each block to the backend chosen for its key (see module
    docstring). ``candidates``: backend names (``None``: the registry's automatic ones)."""

    name = "auto"

    def __init__(self, candidates: Sequence[str] | None = None,
                 timer: Callable[..., float] = time_backend) -> None:
        self.candidates = tuple(candidates) if candidates is not None else None
        self.timer = timer
        # One forced candidate reads as itself (printouts, the agreement's backend field).
        if self.candidates is not None and len(self.candidates) == 1:
            self.name = self.candidates[0]

    @classmethod
    def for_device(cls, device: torch.device) -> AutoBackend:  # noqa: ARG003 - one per process
        return _DEFAULT

    def pick(self, q: torch.Tensor, causal: bool) -> AttentionBackend:
        choice = choose(q.device, q.dtype, q.shape[-1], causal, self.candidates, self.timer)
        return make_backend(choice.picked)

    def forward(self, q, k, v, causal, scale):
        return self.pick(q, causal).forward(q, k, v, causal, scale)

    def backward(self, dout, q, k, v, out, lse, causal, scale):
        return self.pick(q, causal).backward(dout, q, k, v, out, lse, causal, scale)


_DEFAULT = AutoBackend()
