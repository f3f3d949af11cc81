"""Every rank's *floor*: a virtual time before which that rank will post nothing more on the
software links (conservative synchronisation, as in Chandy-Misra-Bryant discrete-event
simulation). The links serve a message only once every floor has passed its start
(:mod:`.link_order`), so no message that starts earlier can still come.

One slot per rank, written by the rank's virtual clock (:class:`~.virtual_time.VirtualTime`,
through :class:`FloorSlot`) and read by every rank that waits for a message:

* a finite time: the rank is in a call and posts nothing earlier (its clock's ``ready()``
  while its host runs; more while it waits for a message, :mod:`.link_order`);
* *idle* (stored as NaN): the rank is between calls, or has posted everything of its call;
  its next post is in a later call, whose clock is re-anchored at the wall clock at a time
  taken under this board's lock (:meth:`FloorBoard.wake`), so a reader takes its own wall
  time, read under the same lock, as the idle rank's floor;
* 0 (what an unwritten slot of the file reads): not published yet, nothing can be served.

Times are ``time.monotonic`` seconds (machine-wide). In a file of ``state_dir`` shared by the
ranks' processes (``floors``, 8 bytes per rank), or in this process without one.
"""

from __future__ import annotations

import math
import os
import struct
import time

from charm_megatron.lab.emulate.locked import Locked

_FLOOR = struct.Struct("=d")
IDLE = math.nan


class FloorBoard(Locked):
    """The floors of ``ranks`` ranks (module doc)."""

    def __init__(self, path: str | None, ranks: int) -> None:
        super().__init__(path)
        self.ranks = ranks
        self._local = [0.0] * ranks

    def _write(self, fd: int | None, rank: int, value: float) -> None:
        if fd is None:
            self._local[rank] = value
        else:
            os.pwrite(fd, _FLOOR.pack(value), rank * _FLOOR.size)

    def _read(self, fd: int | None) -> list[float]:
        if fd is None:
            return list(self._local)
        raw = os.pread(fd, self.ranks * _FLOOR.size, 0)
        raw += bytes(self.ranks * _FLOOR.size - len(raw))  # unwritten: 0, not published
        return [v for (v,) in _FLOOR.iter_unpack(raw)]

    def publish(self, rank: int, floor: float) -> None:
        """``rank`` posts nothing before ``floor`` from now on."""
        with self._held() as fd:
            self._write(fd, rank, floor)

    def idle(self, rank: int) -> None:
        """``rank`` posts nothing more until its clock wakes (:meth:`wake`)."""
        self.publish(rank, IDLE)

    def wake(self, rank: int) -> float:
        """``rank`` leaves the idle state: its floor is the wall clock's now, read under the
        lock after every reader that saw it idle (so at or after the time each of them took
        for it); returns that time, at or before which its clock must not start."""
        with self._held() as fd:
            now = time.monotonic()
            self._write(fd, rank, now)
            return now

    def floors(self) -> list[float]:
        """Every rank's floor, an idle rank's read as the wall clock's now."""
        with self._held() as fd:
            values = self._read(fd)
            now = time.monotonic()  # after the read, under the lock: before any wake
        return [now if math.isnan(v) else v for v in values]


class FloorSlot:
    """One rank's slot on a :class:`FloorBoard`: what its virtual clock writes."""

    def __init__(self, board: FloorBoard, rank: int) -> None:
        self.board, self.rank = board, rank

    def publish(self, floor: float) -> None:
        self.board.publish(self.rank, floor)

    def idle(self) -> None:
        self.board.idle(self.rank)

    def wake(self) -> float:
        return self.board.wake(self.rank)

    def __repr__(self) -> str:
        return f"FloorSlot(rank {self.rank})"
