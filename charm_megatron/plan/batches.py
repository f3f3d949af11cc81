"""How posted batches meet: NCCL's grouped point-to-point on serial communicator streams.

One implementation, shared by the validator (:mod:`charm_megatron.plan.validate`, which proves
a plan deadlock-free) and the performance model (:mod:`charm_megatron.model.sim`, which times
it):

* each (rank, stream) runs its batches one after another, in posted order (one communicator's
  grouped launches queue on its stream): :class:`StreamQueues`;
* a batch exchanges with a peer only while both batches are at the heads of their queues on
  the same stream, and the ``k``-th send to a peer meets the peer's ``k``-th receive from the
  sender: :func:`messages_between` (a count that differs can never complete);
* :func:`closed_matching` is the validator's completion rule: a set of head batches completes
  together only when each one's every peer is in the set with a matching head. This is the
  strict reading (a grouped launch may serve its peers in any order, so it must be able to
  meet all of them at once); a plan proved under it cannot deadlock whatever the order.
  The simulator times the messages of each pair of heads as soon as both are active (pair by
  pair, the fastest NCCL can be), with :func:`messages_between` deciding what flows.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Iterator, Mapping
from typing import Generic, TypeVar

from charm_megatron.plan.core import Comm, Stream, Xfer

B = TypeVar("B")
Key = tuple[int, Stream]  # (rank, stream)


class BatchMismatch(ValueError):
    """Two head batches disagree on how many messages go from one to the other."""

    def __init__(self, stream: Stream, src: int, dst: int, sends: int, recvs: int) -> None:
        super().__init__(f"stream {stream}: rank {src} sends {sends} messages to rank {dst}, "
                         f"which expects {recvs}")
        self.stream, self.src, self.dst, self.sends, self.recvs = stream, src, dst, sends, recvs


def messages_between(src: int, src_batch: Comm, dst: int,
                     dst_batch: Comm) -> list[tuple[Xfer, Xfer]]:
    """The messages from ``src``'s batch to ``dst``'s: (send, matching receive) pairs, in
    posted order. Raises :class:`BatchMismatch` if the counts differ."""
    sends, recvs = _facing(src, src_batch, dst, dst_batch)
    if len(sends) != len(recvs):
        raise BatchMismatch(src_batch.stream, src, dst, len(sends), len(recvs))
    return list(zip(sends, recvs))


def _facing(src: int, src_batch: Comm, dst: int,
            dst_batch: Comm) -> tuple[list[Xfer], list[Xfer]]:
    """``src``'s sends to ``dst`` and ``dst``'s receives from ``src``."""
    return ([x for x in src_batch.sends if x.peer == dst],
            [x for x in dst_batch.recvs if x.peer == src])


def _counts_match(src: int, src_batch: Comm, dst: int, dst_batch: Comm) -> bool:
    return src_batch.counts[0].get(dst, 0) == dst_batch.counts[1].get(src, 0)


class StreamQueues(Generic[B]):
    """Posted batches (any record holding a :class:`Comm`) per (rank, stream), oldest first."""

    def __init__(self) -> None:
        self._q: dict[Key, deque[B]] = {}

    def post(self, rank: int, stream: Stream, batch: B) -> bool:
        """Queue ``batch``; True if it is at the head (it can start at once)."""
        q = self._q.setdefault((rank, stream), deque())
        q.append(batch)
        return len(q) == 1

    def head(self, rank: int, stream: Stream) -> B | None:
        q = self._q.get((rank, stream))
        return q[0] if q else None

    def pop(self, rank: int, stream: Stream) -> B | None:
        """Remove the head batch; return the next one (now the head), if any."""
        q = self._q[(rank, stream)]
        q.popleft()
        return q[0] if q else None

    def heads(self) -> dict[Key, B]:
        return {k: q[0] for k, q in self._q.items() if q}

    def pending(self) -> dict[Key, int]:
        """Batches still queued, per (rank, stream) (those never completed)."""
        return {k: len(q) for k, q in self._q.items() if q}

    def __iter__(self) -> Iterator[tuple[Key, deque[B]]]:
        return iter(self._q.items())


def closed_matching(heads: Mapping[Key, Comm]) -> set[Key]:
    """The head batches that complete now under the strict rule: the largest set in which every
    batch's peers all have their heads on the same stream in the set, with matching counts.
    ``heads`` maps (rank, stream) to the batch at the head of that queue."""
    alive = set(heads)
    changed = True
    while changed:
        changed = False
        for key in list(alive):
            rank, stream = key
            batch = heads[key]
            for peer in batch.peers:
                other = (peer, stream)
                # Both ways: a batch that only receives from ``peer`` must not meet a head of
                # ``peer`` that sends it nothing (a later batch of ``peer`` is its partner).
                if other not in alive or not _counts_match(rank, batch, peer, heads[other]) \
                        or not _counts_match(peer, heads[other], rank, batch):
                    alive.discard(key)
                    changed = True
                    break
    return alive
