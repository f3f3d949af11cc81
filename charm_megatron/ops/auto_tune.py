"""A measured ``auto``: time the model's shortlist once per shape, then run the fastest.

``algo="auto"`` normally runs the performance model's pick (ops/resolution.py). The model can
be wrong where the hardware does something it does not describe: on the CPU testbed it ranks
Ulysses 1.28x ahead of CHARM+ where CHARM+ is measured 1.17x ahead (docs/performance.md,
*Against every CP a user can pick*). With ``CPOptions(auto_tune=margin)``
(``CHARM_AUTO_TUNE``) the first ``auto`` call of each shape:

1. shortlists every algorithm the model predicts within ``margin`` of its fastest
   (:func:`shortlist`; one entry: nothing to measure, the model's pick runs);
2. runs each of them, forward and backward, on detached copies of the call's own inputs
   (:func:`measure`): one warm-up, then the best of ``REPEATS`` timed runs, each a full
   ``cp_attention`` call of that algorithm, so every one is agreed on and fails like any
   call; one that raises is left out on every rank alike;
3. shares every rank's times on the control channel (one exchange, ops/agreement.py
   :func:`~charm_megatron.ops.agreement.share`) and picks the algorithm whose *slowest* rank
   was fastest (:func:`pick`: a step waits for its slowest rank); every rank reads the same
   table, so every rank picks alike;
4. records the pick under the shape's key (:data:`_PICKS`); this and every later call of the
   shape run it, with no further measurement or communication.

The picks a rank holds are part of what the ranks agree on (a digest,
:func:`picks_digest`): a rank that lost them (a restarted process) meets a clear
``CPMismatchError`` instead of running another plan than its peers.
"""

from __future__ import annotations

import hashlib
import math
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch

#: Timed runs per candidate after its warm-up; the best counts (the first call of an
#: algorithm builds its plans and communicators, the warm-up pays for that).
REPEATS = 2
#: The code a rank shares for a candidate that raised (never the fastest).
FAILED = -1

_PICKS: dict[tuple, str] = {}
_DIGEST: list[str | None] = [None]
#: The last measurement on this rank (for reports and tests): key, shortlist, every rank's
#: times in seconds (``inf``: failed), the pick.
_LAST: list[Report] = []


@dataclass(frozen=True)
class Pending:
    """A call whose ``auto`` must be measured before it runs."""

    key: tuple
    shortlist: tuple[str, ...]


@dataclass(frozen=True)
class Report:
    """One measurement: the candidates, every rank's seconds per candidate, the pick."""

    key: tuple
    shortlist: tuple[str, ...]
    seconds: tuple[tuple[float, ...], ...]  # [rank][candidate]; inf: it raised there
    pick: str


def shortlist(ranked: Sequence[tuple[float, str]], margin: float) -> tuple[str, ...]:
    """The algorithms of ``ranked`` (predicted seconds, name; fastest first) predicted within
    ``margin`` times the fastest, in that order."""
    best = ranked[0][0]
    return tuple(a for t, a in ranked if t <= best * margin)


def pick(shortlist_: Sequence[str], seconds: Sequence[Sequence[float]]) -> str:
    """The candidate whose slowest rank was fastest (``seconds[rank][candidate]``; ``inf``
    where it raised); ties to the earlier (the model's order). ValueError if every candidate
    failed somewhere."""
    worst = [max(row[i] for row in seconds) for i in range(len(shortlist_))]
    best = min(range(len(shortlist_)), key=lambda i: (worst[i], i))
    if not math.isfinite(worst[best]):
        raise ValueError("every algorithm auto_tune measured failed on some rank")
    return shortlist_[best]


def lookup(key: tuple) -> str | None:
    """The pick measured for ``key`` on this rank (``None``: not measured yet)."""
    return _PICKS.get(key)


def picks_digest() -> str | None:
    """A digest of every pick this rank holds (``None``: none), for the agreement."""
    return _DIGEST[0]


def record(key: tuple, algo: str) -> None:
    _PICKS[key] = algo
    text = repr(sorted(_PICKS.items(), key=repr))
    _DIGEST[0] = hashlib.blake2b(text.encode(), digest_size=8).hexdigest()


def forget() -> None:
    """Drop every pick (a new measurement at the next ``auto`` call of each shape). Every
    rank of a CP group must call it alike."""
    _PICKS.clear()
    _DIGEST[0] = None
    _LAST.clear()


def last_report() -> Report | None:
    """This rank's most recent measurement (``None``: none yet)."""
    return _LAST[-1] if _LAST else None


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def measure(run: Callable[..., torch.Tensor], algo: str, q: torch.Tensor, k: torch.Tensor,
            v: torch.Tensor, offset: torch.Tensor | None) -> float:
    """Seconds of ``algo``'s forward + backward on copies of the inputs: the best of
    :data:`REPEATS` after one warm-up. ``run(algo, q, k, v, offset)`` is the call."""
    gen = torch.Generator(device=q.device).manual_seed(0)  # the caller's RNG stays untouched
    leaves = [t.detach().clone().requires_grad_(True) for t in (q, k, v)]
    off = None if offset is None else offset.detach().clone().requires_grad_(offset.requires_grad)
    dout = None
    best = math.inf
    with torch.enable_grad():
        for i in range(1 + REPEATS):
            _sync(q.device)
            start = time.perf_counter()
            out = run(algo, *leaves, off)
            if dout is None:
                dout = torch.randn(out.shape, generator=gen, device=out.device,
                                   dtype=out.dtype)
            torch.autograd.backward(out, dout)
            _sync(q.device)
            if i:
                best = min(best, time.perf_counter() - start)
            for t in (*leaves, off):
                if t is not None:
                    t.grad = None
    return best


def tune(pending: Pending, run: Callable[..., torch.Tensor], q: torch.Tensor,
         k: torch.Tensor, v: torch.Tensor, offset: torch.Tensor | None, sg,
         timeout_s: float) -> str:
    """Measure ``pending``'s shortlist on this rank, share the times with the CP group's
    ranks (``sg``), record and return the pick (the same on every rank)."""
    from charm_megatron.ops.agreement import share

    mine, errors = [], []
    for algo in pending.shortlist:
        try:
            mine.append(measure(run, algo, q, k, v, offset))
        except Exception as exc:  # noqa: BLE001 - a failed candidate is left out, everywhere
            mine.append(math.inf)
            errors.append(f"{algo}: {type(exc).__name__}: {exc}")
    codes = [FAILED if not math.isfinite(s) else max(0, round(s * 1e9)) for s in mine]
    table = share(sg, codes, timeout_s, "auto-tune")
    seconds = tuple(tuple(math.inf if c == FAILED else c / 1e9 for c in row) for row in table)
    try:
        chosen = pick(pending.shortlist, seconds)
    except ValueError:
        from charm_megatron.ops.agreement import CPAttentionError

        raise CPAttentionError(
            f"cp_attention(algo='auto', auto_tune): every algorithm of the shortlist "
            f"{', '.join(pending.shortlist)} failed on some rank while being measured (here: "
            f"{'; '.join(errors) or 'none failed'}); run them by name to see each rank's "
            "error, or set auto_tune off (CHARM_AUTO_TUNE=off)") from None
    record(pending.key, chosen)
    _LAST.append(Report(pending.key, pending.shortlist, seconds, chosen))
    del _LAST[:-1]
    return chosen
