"""When one emulated rank's transfers move, and how long a device op takes under them.

The timed device (:mod:`.device`) slows a compute op ``1 + comm_slowdown * k`` times while
``k`` of its rank's streams (communicators) have bytes moving, as the model does
(:func:`charm_megatron.model.effects.compute_caps`). This module says *when* a posted batch
moves; :func:`charm_megatron.model.effects.slowed_over` prices an op over those spans.

The model counts a message as moving from the time both sides have posted (its batches are
active; plus the link latency) until its last byte arrives, queueing behind other messages on
a shared link included. The software links know both ends, but not at once: the match once
the peer has posted (:attr:`~.link_work.LinkWork.matched`), the arrival once the message is
booked (``deadline``; on start-order links only when it is served, which can be well after
the device has queued the ops that run under it). So a span is what the links know *now*:

* matched and booked: ``[match + latency, arrival]``, the model's span;
* matched, not booked yet: ``[match + latency, match + time alone]``, a lower bound;
* not matched: nothing yet (the peer's send may come much later: a home receive is often
  posted long before its partial is sent);
* a handle that knows no match (the links' plain handles, tests' stand-ins) or a batch
  without handles: from the post until its booked arrival, else its time alone (the device
  of before 2026-12-07).

Because the spans grow as the links learn more, the device prices its ops again before the
host commits to their end (:class:`DeviceChain`, :meth:`.device.TimedBackend._drain`).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field

Span = tuple[float, float]


@dataclass
class MovingBatch:
    """One posted batch of a rank: its post time, its longest message's time alone on its
    links (``alone``: seconds, on the device's clock), its stream, the link handles of its
    messages, the latency before a message moves, and when the host saw it complete
    (``waited_at``: nothing of it moves after that)."""

    posted: float
    alone: float
    stream: object
    works: tuple[object, ...] = ()
    latency: float = 0.0
    waited_at: float = math.inf
    _final: list[Span] | None = field(default=None, repr=False)

    def spans(self) -> list[Span]:
        """The intervals during which this batch's bytes move, as far as the links know now
        (module doc)."""
        spans = self._final
        if spans is None:
            spans, complete = self._known_spans()
            if complete:
                self._final = spans
        return [(lo, min(hi, self.waited_at)) for lo, hi in spans
                if min(hi, self.waited_at) > lo]

    def _known_spans(self) -> tuple[list[Span], bool]:
        """The spans as the links know them, and whether they are complete (can no longer
        change)."""
        out: list[Span] = []
        plain: list[float | None] = []
        complete = True
        for w in self.works:
            if not hasattr(w, "matched"):
                plain.append(_known(getattr(w, "deadline", None)))
                continue
            match = w.matched
            if match is None:
                complete = False
                continue
            arrival = _known(w.deadline)
            start = match + self.latency
            if arrival is None:
                complete = False
                out.append((start, match + self.alone))
            else:
                out.append((start, arrival))
        if plain or not self.works:
            known = [d for d in plain if d is not None]
            if plain and len(known) == len(plain):
                end = max(known)
            else:
                complete = False
                end = max([self.posted + self.alone, *known])
            out.append((self.posted, end))
        return out, complete

    def settled(self) -> bool:
        """True once its spans can no longer change (every message matched and booked)."""
        self.spans()
        return self._final is not None

    def end(self) -> float:
        """When its bytes stop moving as far as known now (-inf: none move)."""
        return max((hi for _, hi in self.spans()), default=-math.inf)


def _known(t: float | None) -> float | None:
    return None if t is None or math.isnan(t) else t


def spans_by_stream(batches: Iterable[MovingBatch]) -> dict[object, list[Span]]:
    """Every stream's moving spans."""
    out: dict[object, list[Span]] = {}
    for b in batches:
        spans = b.spans()
        if spans:
            out.setdefault(b.stream, []).extend(spans)
    return out


@dataclass
class QueuedOp:
    """A device op queued since the host last committed to the device's end: the host's time
    when it was queued (it starts no earlier), its device seconds at full speed, and whether
    transfers slow it (kernels and merges; not the copies)."""

    floor: float
    work_s: float
    slowed: bool


@dataclass
class DeviceChain:
    """The ops a timed device has queued since the host last waited for it, with the time the
    device was free before the first (``base``): :meth:`end` prices them again, one after the
    other, on what the links know by then."""

    base: float = -math.inf
    ops: list[QueuedOp] = field(default_factory=list)

    def add(self, base: float, op: QueuedOp) -> None:
        """Queue ``op``; ``base``: when the device was free before it (kept for the first)."""
        if not self.ops:
            self.base = base
        self.ops.append(op)

    def end(self, price: Callable[[QueuedOp, float], float]) -> float:
        """When the chain ends with each op priced by ``price(op, start)`` (wall seconds)."""
        t = self.base
        for op in self.ops:
            start = max(t, op.floor)
            t = start + price(op, start)
        return t

    def clear(self) -> None:
        """The host has waited for the device: these ops are final."""
        self.ops.clear()
        self.base = -math.inf
