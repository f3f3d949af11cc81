"""The handles the software links return (:mod:`charm_megatron.lab.emulate.linkmodel`): a
transfer's ``wait()`` returns no earlier than its modelled arrival, and a paired message's
side waits (bounded) for its peer's post before it knows that arrival. A handle given
``on_arrival`` reports the arrival it waited for (a rank's virtual clock,
:mod:`charm_megatron.lab.emulate.virtual_time`, takes its host time from it)."""

from __future__ import annotations

import datetime
import math
import time
from collections.abc import Callable
from typing import Any


class ThrottledWork:
    """A communication handle whose ``wait()`` returns no earlier than ``deadline``."""

    def __init__(self, work: Any, deadline: float) -> None:
        self.work = work
        self.deadline = deadline
        # told the modelled arrival once wait() has returned (a rank's virtual clock)
        self.on_arrival: Callable[[float], None] | None = None

    def attach(self, work: Any) -> ThrottledWork:
        self.work = work
        return self

    def _wait_real(self, timeout: Any) -> None:
        if self.work is not None:
            if timeout is None:
                self.work.wait()
            else:
                self.work.wait(timeout)

    def wait(self, timeout: Any = None) -> bool:
        """Wait for the real transfer, then for the modelled link (``timeout`` goes to the real
        handle, e.g. a ``datetime.timedelta`` for torch ``Work``)."""
        self._wait_real(timeout)
        _sleep_until(self.deadline)
        self._arrived(self.deadline)
        return True

    def _arrived(self, arrival: float) -> None:
        if self.on_arrival is not None:
            self.on_arrival(arrival)

    def is_completed(self) -> bool:
        done = self.work is None or self.work.is_completed()
        return bool(done) and time.monotonic() >= self.deadline

    def __getattr__(self, name: str) -> Any:
        if name in ("work", "on_arrival"):  # not set yet (unpickling): no recursion
            raise AttributeError(name)
        return getattr(self.work, name)


class LinkWork(ThrottledWork):
    """One side of a paired message: ``wait()`` returns no earlier than the message's arrival,
    which exists once both sides posted (module doc). ``deadline`` is ``None`` until then."""

    def __init__(self, work: Any, box: Any, index: int, what: str,
                 timeout_s: float, order: Any = None) -> None:
        super().__init__(work, math.nan)
        self.box, self.index, self.what, self.timeout_s = box, index, what, timeout_s
        # start-order links (link_order.Await): the message is served once no earlier one
        # can come; the wait publishes this rank's lookahead and serves what is due meanwhile
        self.order = order
        self._arrival: float | None = None
        self._matched: float | None = None

    @property  # type: ignore[override]
    def deadline(self) -> float | None:
        if self._arrival is None:
            self._arrival = self.box.arrival(self.index)
        return self._arrival

    @deadline.setter
    def deadline(self, value: float) -> None:
        pass  # set by the booking, not by the base class

    @property
    def matched(self) -> float | None:
        """When both sides had posted (the later post's time), the earliest the message can
        start moving; ``None`` while the peer has not posted (a timed device's SM-contention
        span starts here, as the model's does: :mod:`.moving`)."""
        if self._matched is None:
            send_t, recv_t = self.box.slot(self.index)[:2]
            if not (math.isnan(send_t) or math.isnan(recv_t)):
                self._matched = max(send_t, recv_t)
        return self._matched

    def wait(self, timeout: Any = None) -> bool:
        """Wait for the real transfer, then (bounded by ``timeout``, a ``timedelta`` or
        seconds, else ``timeout_s``) for the other side's post, then for the arrival. On
        start-order links: first (bounded alike) until the message is served, then for the
        real transfer and the arrival."""
        bound = timeout.total_seconds() if isinstance(timeout, datetime.timedelta) else timeout
        seconds = float(bound if bound is not None else self.timeout_s)
        if self.order is not None:
            # The arrival first: a host blocked in the real op's wait would publish no
            # lookahead; once served, both sides have posted their real ops, which complete.
            arrival = self._arrival = self.order.arrival(time.monotonic() + seconds, self.what)
            self._wait_real(timeout)
            _sleep_until(arrival)
            self._arrived(arrival)
            return True
        self._wait_real(timeout)
        limit = time.monotonic() + seconds
        pause = 0.0005
        while (arrival := self.deadline) is None:
            if time.monotonic() > limit:
                raise TimeoutError(
                    f"software link model: {self.what} was not matched within "
                    f"{bound if bound is not None else self.timeout_s:g} s: the peer never "
                    "posted its side (a rank that died or is stuck, sends and receives that "
                    "do not pair, or ranks in separate processes whose SoftwareLinks has no "
                    "state_dir)")
            time.sleep(pause)
            pause = min(pause * 2, 0.005)
        _sleep_until(arrival)
        self._arrived(arrival)
        return True

    def is_completed(self) -> bool:
        done = self.work is None or self.work.is_completed()
        arrival = self.deadline
        return bool(done) and arrival is not None and time.monotonic() >= arrival


def _sleep_until(deadline: float) -> None:
    remaining = deadline - time.monotonic()
    if remaining > 0:
        time.sleep(remaining)
