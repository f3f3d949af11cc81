"""One emulated rank's virtual clock (issue 41): the device's and the links' times stop
depending on how late this machine's crowded host runs, as long as causality holds.

With 16-32 ranks as processes on 2 cores, a host learns that a message arrived only when its
``wait()`` returns, which on a busy machine is late; whatever it queues or posts next would then
start late, and each lateness shifts the device's and the links' timelines (docs/emulator.md).
A GPU's host runs ahead of its stream, so its own CPU work costs nothing where the device has
work queued. The virtual clock keeps that time apart from the wall clock:

* ``host_t``: the time by which everything the host has waited for is done. A wait on a
  message raises it to the message's modelled arrival (the link handle's ``deadline``), a
  synchronisation with the device to the device's ``busy_until``; the host's own CPU work never
  raises it (it is free, as on a GPU whose host runs ahead).
* ``busy_until``: when the work queued on the device ends; an op starts at
  ``max(busy_until, host_t)`` (:meth:`start`), not at the wall clock's now.
* A post is booked on the software links at :meth:`ready`, ``max(host_t, busy_until)``: the
  data it sends is ready then.

Times are ``time.monotonic`` seconds, those of the software links (machine-wide). Every time
the clock gives is one the host has already lived through on the wall (waits return no earlier
than the arrival they report, synchronisations sleep to ``busy_until``), so the virtual clock
never runs ahead of the wall: a late host makes the two differ, an on-time one keeps them equal.

Between calls the host is not modelled (barriers, other contenders, Python): the clock is
*re-anchored* at the wall clock when a call starts (:meth:`begin`, the bench's timed calls), or
lazily at the first op or post after a call ended (:meth:`end_call`: untimed calls such as the
memory probe or a tuning warm-up then do not book their messages seconds in the past).

On start-order links (:mod:`.link_order`) the clock also publishes the rank's *floor*
(:mod:`.floors`), a time before which it posts nothing more: ``ready()`` while the host runs (a
post is booked at ``ready()``, which only grows within a call), the lookahead of the message
it waits for while it waits (:meth:`waiting`), and *idle* between calls and once the call's
posts are done (:meth:`posts_done`): its next post is then in a later call, whose re-anchoring
at the wall clock takes its time from the floor board (``FloorBoard.wake``), after every rank
that read it idle.

The object is one per rank and shared by everything that rank's device and links do (the
bench's ranks hold two timed devices, ours and TransformerEngine's kernel curve: one GPU, one
timeline). Thread-safe: the executor's waits may run on other threads.

:class:`WallTime` is the same device timeline with the host's time always the wall clock's now:
the asynchronous device of ``--device-clock async`` (a late host starts what it queues late).
"""

from __future__ import annotations

import math
import threading
import time
from typing import Any


class VirtualTime:
    """One rank's virtual host time and device timeline (see module)."""

    def __init__(self) -> None:
        self.host_t = -math.inf
        self.busy_until = -math.inf
        self._idle = True  # between calls: re-anchor at the wall clock on the next use
        self._lock = threading.Lock()
        # Start-order links: this rank's slot on the floor board (floors.FloorSlot), the floor
        # last published, and whether the call's posts are done (its floor idle until the
        # next call).
        self.floor: Any = None
        self._published = math.nan
        self._done = False
        self.calls = 0  # calls begun (the clock left its idle state), for the links' tie order

    def publish_floor(self, slot: Any) -> None:
        """Publish this rank's floor to ``slot`` (a :class:`~.floors.FloorSlot`) from now on."""
        with self._lock:
            self.floor = slot
            self._published = math.nan
            if self._idle or self._done:
                slot.idle()
            else:
                self._publish()

    def _publish(self, floor: float = -math.inf) -> None:
        """The floor is ``ready()`` or ``floor`` if later (caller holds the lock; nothing
        while the rank's posts are done, its floor idle)."""
        if self.floor is None or self._idle or self._done:
            return
        value = max(self.host_t, self.busy_until, floor)
        if value != self._published:
            self._published = value
            self.floor.publish(value)

    def _wake(self) -> None:
        """Leave the idle floor before the clock is re-anchored (caller holds the lock): the
        board's time for it is at or before the wall time the anchor reads next."""
        if self.floor is not None and (self._idle or self._done):
            self._published = self.floor.wake()
        self._done = False

    def begin(self, at: float | None = None) -> float:
        """A call starts at ``at`` (``time.monotonic`` s, already past; default now): the
        clock is re-anchored there (never moved back); returns the call's virtual start. The
        bench passes every rank the same ``at``, when the last rank reached the call. On
        start-order links ``at`` must be no earlier than when this clock left its idle floor:
        the bench calls ``begin()`` once before it reads the time it shares (its floor is
        then the wall clock's, and every rank's ``at`` is later)."""
        with self._lock:
            self._wake()
            if self._idle:
                self.calls += 1
            self._idle = False
            self.host_t = max(self.host_t, self.busy_until,
                              time.monotonic() if at is None else at)
            self._publish()
            return self.host_t

    def end_call(self) -> None:
        """The call has synchronised with its device: until the next :meth:`begin`, the next
        use re-anchors the clock at the wall clock (the host between calls is not modelled)."""
        with self._lock:
            self.host_t = max(self.host_t, self.busy_until)
            self._idle = True
            if self.floor is not None:
                self.floor.idle()

    def posts_done(self) -> None:
        """The call has posted everything it posts (the executor, before its status exchange,
        a collective that must not wait on this rank's floor): until the next call the floor
        is idle."""
        with self._lock:
            if self.floor is not None and not self._done:
                self._done = True
                self.floor.idle()

    def waiting(self, lookahead: float) -> None:
        """The host waits for a message and posts nothing before ``lookahead`` (its earliest
        arrival, :mod:`.link_order`) until the wait returns: the floor says so."""
        with self._lock:
            self._publish(lookahead)

    def _anchor(self) -> None:
        if self._idle:  # caller holds the lock
            self._wake()
            self.calls += 1
            self._idle = False
            self.host_t = max(self.host_t, self.busy_until, time.monotonic())
            self._publish()
        elif self._done:  # a post after the call's posts were done: served late if need be
            self._wake()

    def arrived(self, t: float | None) -> None:
        """The host waited on a message that arrived at ``t`` (None or NaN: no modelled
        arrival, e.g. a message on a link left free)."""
        if t is None or math.isnan(t):
            return
        with self._lock:
            self._anchor()
            self.host_t = max(self.host_t, t)
            self._publish()

    def synced(self) -> None:
        """The host waited for the device: everything queued on it is done."""
        with self._lock:
            self._anchor()
            self.host_t = max(self.host_t, self.busy_until)
            self._publish()

    def start(self) -> float:
        """When an op queued now starts on the device: when it is free and the host has what
        the op needs: the same time as :meth:`ready`."""
        return self.ready()

    def queue(self, seconds: float) -> float:
        """Queue an op of ``seconds`` (wall seconds, the dilation applied) on the device;
        returns its start."""
        with self._lock:
            self._anchor()
            start = max(self.busy_until, self.host_t)
            self.busy_until = start + seconds
            return start

    def host(self) -> float:
        """The host's time now (``host_t``): an op queued now starts no earlier."""
        with self._lock:
            self._anchor()
            return self.host_t

    def extend(self, until: float) -> None:
        """The ops queued on the device end at ``until`` after all (priced again once their
        transfers were booked, :mod:`.moving`); never earlier than before, so every floor
        published stays a lower bound."""
        with self._lock:
            if until > self.busy_until:
                self.busy_until = until
                self._publish()

    def ready(self) -> float:
        """When what the host has queued and waited for is all done: a post's virtual time
        (its sends hold what the device made) and a call's virtual end."""
        with self._lock:
            self._anchor()
            return max(self.host_t, self.busy_until)

    def now(self) -> float:
        """``max(host_t, busy_until)`` as it stands, never re-anchored: a call's virtual end,
        read after the call synchronised (:meth:`end_call`)."""
        with self._lock:
            return max(self.host_t, self.busy_until)

    def lag(self) -> float:
        """How far the virtual clock trails the wall clock now (seconds, >= 0 when causal)."""
        return time.monotonic() - self.ready()


class WallTime(VirtualTime):
    """The asynchronous device's timeline (``--device-clock async``, and the timed device's
    without a virtual clock): ops queue as on :class:`VirtualTime`, but the host's time is
    always the wall clock's now (``time.perf_counter``, the same clock as ``time.monotonic``
    on Linux), so a host that runs late starts what it queues late; arrivals and
    synchronisations it reports are already behind that now."""

    def _anchor(self) -> None:
        self._idle = False  # caller holds the lock
        self.host_t = max(self.host_t, time.perf_counter())

    def publish_floor(self, slot: Any) -> None:
        raise ValueError("the wall-clock device has no floor: start-order software links "
                         "need every rank on a virtual clock")

    def now(self) -> float:
        """The wall clock's now: the host's time is never modelled here."""
        return time.perf_counter()
