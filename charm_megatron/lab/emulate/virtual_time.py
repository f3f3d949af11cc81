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


class VirtualTime:
    """One rank's virtual host time and device timeline (see module)."""

    def __init__(self) -> None:
        self.host_t = -math.inf
        self.busy_until = -math.inf
        self._idle = True  # between calls: re-anchor at the wall clock on the next use
        self._lock = threading.Lock()

    def begin(self, at: float | None = None) -> float:
        """A call starts at ``at`` (``time.monotonic`` s, already past; default now): the
        clock is re-anchored there (never moved back); returns the call's virtual start. The
        bench passes every rank the same ``at``, when the last rank reached the call."""
        with self._lock:
            self._idle = False
            self.host_t = max(self.host_t, self.busy_until,
                              time.monotonic() if at is None else at)
            return self.host_t

    def end_call(self) -> None:
        """The call has synchronised with its device: until the next :meth:`begin`, the next
        use re-anchors the clock at the wall clock (the host between calls is not modelled)."""
        with self._lock:
            self.host_t = max(self.host_t, self.busy_until)
            self._idle = True

    def _anchor(self) -> None:
        if self._idle:  # caller holds the lock
            self._idle = False
            self.host_t = max(self.host_t, self.busy_until, time.monotonic())

    def arrived(self, t: float | None) -> None:
        """The host waited on a message that arrived at ``t`` (None or NaN: no modelled
        arrival, e.g. a message on a link left free)."""
        if t is None or math.isnan(t):
            return
        with self._lock:
            self._anchor()
            self.host_t = max(self.host_t, t)

    def synced(self) -> None:
        """The host waited for the device: everything queued on it is done."""
        with self._lock:
            self._anchor()
            self.host_t = max(self.host_t, self.busy_until)

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

    def now(self) -> float:
        """The wall clock's now: the host's time is never modelled here."""
        return time.perf_counter()
