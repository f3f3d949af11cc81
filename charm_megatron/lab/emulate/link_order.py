"""Software links that serve messages in *virtual start order* (docs/emulator.md, *The links'
order*), whatever order the crowded host's processes post them in on the wall clock.

On the virtual clock (:mod:`.virtual_time`) a post carries the virtual time at which its data
is ready, and a message starts at the later of its two sides'. Booked at once by whichever side
posts second (:mod:`.linkmodel`), a message would take what the bookings made before it *on
the wall clock* left on its links: a host that runs late on this machine posts a message with an
early start after another rank's with a later one, and queues behind it. Here a message whose
both sides have posted waits in a queue (:class:`StartOrder`, ``order.queue`` in the links'
``state_dir``) until no message that starts earlier can still be posted; the queue then books
its due messages in key order (the start, then as the model orders messages of one start:
:class:`Matched`), with the links' own
:func:`~.linkmodel.book_message`, and writes each arrival into its pair's mailbox.

**What can still come** is bounded by the ranks' *floors* (:mod:`.floors`): each rank's
virtual clock publishes a time before which it posts nothing more. A message not yet matched
starts no earlier than the floor of the side still to post, so every message whose start is
below the lowest floor can be served: nothing will come before it. Served messages are
removed in start order, and every later message starts at or above the floor they were served
under, so the order of service is the order of starts (and of keys among equal starts).

**Why it cannot deadlock** (positive lookahead). A side waiting for its message (:class:`Await`)
publishes, besides its clock's ``ready()``, the earliest its host can post again: after the wait
returns its clock's host time is at least the message's arrival, which is at least the
message's start (at least its own post, and the peer's post or, until that comes, the peer's
floor) plus the latency plus its bytes at the per-message rate. Take the pending message with
the lowest start ``s``: an idle rank's floor reads as the wall clock's now, above every start
already posted; a rank that runs (its host not blocked) reaches a wait or the end of its posts
in finite time; a rank waiting for a message that is matched has a floor above that message's
start, which is at least ``s``, by its bytes' time (messages of no bytes are booked at once,
they reserve nothing); a rank waiting for its peer's side has a floor above its peer's, and
following peers ends, in a program that runs at all, at a rank of the kinds before. So the
lowest floor passes ``s`` and the message is served. A rank that died or never posts stops all
of this: every wait is bounded (its ``timeout``, else ``SoftwareLinks.pair_timeout_s``) and
then raises :class:`TimeoutError` naming the rank whose floor holds the queue.

What it rests on: a rank's posts and waits run one at a time (the executor interprets a plan
in order on the calling thread, and autograd runs a CPU backward on it too), the lookahead of
a wait holds only then; every rank on the links follows a virtual clock that publishes its
floor (``SoftwareLinks.start_order`` is for runs where they all do); and a rank posts nothing
after it declared its call's posts done (:meth:`~.virtual_time.VirtualTime.posts_done`, called
before the executor's status exchange, a collective that waits for every rank and after which
the call posts nothing on the links). A message that
comes with a start below one already served (a floor was wrong) is still booked, taking what is
left, and counted (:attr:`StartOrder.late`).
"""

from __future__ import annotations

import math
import os
import struct
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from charm_megatron.lab.emulate.floors import FloorBoard
from charm_megatron.lab.emulate.locked import Locked

_QUEUE_HEAD = struct.Struct("=QQd")  # messages waiting, late ones so far, latest start served
_ENTRY = struct.Struct("=dQIQIIQ16sQ")  # start, batch, completer, post, src, dst, k, channel, bytes
#: A post's number (``Matched.post``): its batch's number in the call times this, plus the
#: op's place in the batch.
BATCH_SEQ = 1 << 20


@dataclass(frozen=True, order=True)
class Matched:
    """A message both of whose sides have posted: served in the order of these fields. Among
    messages of one start, close to the order in which the model (``model/sim.py``) starts
    them: the model starts a rank's batches on a communicator one after another (here each is
    booked when posted), and its ranks' posts at one time in rank order, so at one start the
    ranks' first batches of the call go first, then their second ones, and so on: by the
    number in its call of the batch (``batch``; ``post``: that times :data:`BATCH_SEQ` plus the
    op's place in it) of the rank whose post completed the message (``completer``: the later
    side, the higher rank when both posted at once), then by that rank, then op by op. (By
    rank first instead, CHARM+'s forward on 2x4 with a NIC per node, whose cross messages
    all start at once, came out 1.13x the model; 1.00x so.)"""

    start: float
    batch: int
    completer: int
    post: int
    src: int
    dst: int
    k: int
    channel: str
    nbytes: int = field(compare=False)

    @classmethod
    def of(cls, src: int, dst: int, channel: str, k: int, nbytes: int,
           send: tuple[float, int], recv: tuple[float, int]) -> Matched:
        """Message ``k`` of ``src`` -> ``dst`` on ``channel``, from its sides' (virtual post
        time, post number on its rank)."""
        later_is_send = send[0] > recv[0] or (send[0] == recv[0] and src > dst)
        completer, post = (src, send[1]) if later_is_send else (dst, recv[1])
        return cls(max(send[0], recv[0]), post // BATCH_SEQ, completer, post, src, dst, k,
                   channel, nbytes)


class StartOrder(Locked):
    """The matched messages not served yet (module doc). ``book(message)`` books one on its
    links and returns its arrival; ``deliver(message, arrival)`` writes it to the pair's
    mailbox (outside this queue's lock: posts hold a mailbox's lock, then take this one)."""

    def __init__(self, path: str | None, board: FloorBoard,
                 book: Callable[[Matched], float],
                 deliver: Callable[[Matched, float], None]) -> None:
        super().__init__(path)
        self.board = board
        self._book, self._deliver = book, deliver
        self._local: tuple[list[Matched], int, float] = ([], 0, -math.inf)

    def _read(self, fd: int | None) -> tuple[list[Matched], int, float]:
        if fd is None:
            waiting, late, served = self._local
            return list(waiting), late, served
        raw = os.pread(fd, _QUEUE_HEAD.size, 0)
        if len(raw) != _QUEUE_HEAD.size:
            return [], 0, -math.inf
        n, late, served = _QUEUE_HEAD.unpack(raw)
        body = os.pread(fd, n * _ENTRY.size, _QUEUE_HEAD.size)
        waiting = []
        for start, batch, completer, post, src, dst, k, channel, nbytes in \
                _ENTRY.iter_unpack(body):
            waiting.append(Matched(start, batch, completer, post, src, dst, k,
                                   channel.decode(), nbytes))
        return waiting, late, served

    def _write(self, fd: int | None, waiting: list[Matched], late: int, served: float) -> None:
        if fd is None:
            self._local = (waiting, late, served)
            return
        data = _QUEUE_HEAD.pack(len(waiting), late, served) + b"".join(
            _ENTRY.pack(m.start, m.batch, m.completer, m.post, m.src, m.dst, m.k,
                        m.channel.encode(), m.nbytes)
            for m in waiting)
        os.pwrite(fd, data, 0)
        os.ftruncate(fd, len(data))

    def add(self, message: Matched) -> None:
        """Queue a message whose second side has just posted."""
        with self._held() as fd:
            waiting, late, served = self._read(fd)
            if message.start < served:
                late += 1
            self._write(fd, [*waiting, message], late, served)

    def settle(self) -> int:
        """Serve every waiting message that starts below the lowest floor, in key order;
        returns how many."""
        with self._held() as fd:
            waiting, late, served = self._read(fd)
            if not waiting:
                return 0
            lowest = min(self.board.floors())
            due = sorted(m for m in waiting if m.start < lowest)
            if not due:
                return 0
            booked = [(m, self._book(m)) for m in due]  # in order: each takes what is left
            self._write(fd, [m for m in waiting if not m.start < lowest], late,
                        max(served, due[-1].start))
        for m, arrival in booked:
            self._deliver(m, arrival)
        return len(booked)

    @property
    def late(self) -> int:
        """Messages that came with a start below one already served (module doc: 0 while
        every floor holds)."""
        with self._held() as fd:
            return self._read(fd)[1]

    def stalled(self) -> str:
        """Why nothing is served: the lowest floor's rank against the earliest waiting
        message (for the error a timed-out wait raises)."""
        with self._held() as fd:
            waiting = self._read(fd)[0]
        floors = self.board.floors()
        rank = min(range(len(floors)), key=floors.__getitem__)
        first = min(waiting, default=None)
        if first is None:
            return f"no message waits to be served; rank {rank} has the lowest floor"
        behind = first.start - floors[rank]
        held = ("has never published one" if floors[rank] == 0.0
                else f"is {behind * 1e3:.3f} ms below it")
        return (f"the earliest waiting message (rank {first.src} -> {first.dst}, #{first.k}) "
                f"starts at {first.start:.6f}; rank {rank}'s floor {held}")


class Await:
    """How one side of a message waits on start-order links (:meth:`arrival`): it publishes
    its rank's lookahead and serves what is due until its message has an arrival."""

    def __init__(self, order: StartOrder, clock: Any, box: Any, k: int, sending: bool,
                 peer: int, posted_at: float, nbytes: int, rate: float,
                 latency_s: float) -> None:
        self.order, self.clock, self.box, self.k = order, clock, box, k
        self.sending, self.peer, self.posted_at = sending, peer, posted_at
        self.nbytes, self.rate, self.latency_s = nbytes, rate, latency_s

    def lookahead(self) -> float:
        """The earliest this rank can post after the wait: the message's earliest start
        (this side's post; the peer's, or until it comes the peer's floor) plus the latency
        plus its bytes at the per-message rate (a receiver knows them once the send posted)."""
        send_t, recv_t, _, nbytes = self.box.slot(self.k)
        other = recv_t if self.sending else send_t
        if math.isnan(other):
            other = self.order.board.floors()[self.peer]
        size = self.nbytes if self.sending else (nbytes if not math.isnan(send_t) else 0)
        return max(self.posted_at, other) + self.latency_s + size / self.rate

    def arrival(self, limit: float, what: str) -> float:
        """The message's arrival, once served; :class:`TimeoutError` after ``limit``
        (``time.monotonic``)."""
        pause = 0.0005
        while True:
            arrival = self.box.arrival(self.k)
            if arrival is not None:
                return arrival
            self.clock.waiting(self.lookahead())  # first: this rank's floor may be the lowest
            if self.order.settle() and (arrival := self.box.arrival(self.k)) is not None:
                return arrival
            if time.monotonic() > limit:
                raise TimeoutError(
                    f"software link model (start order): {what} was not served in time: "
                    f"{self.order.stalled()} (a rank that died or is stuck, one that does not "
                    "follow a virtual clock on these links, or sends and receives that do not "
                    "pair)")
            time.sleep(pause)
            pause = min(pause * 2, 0.005)
