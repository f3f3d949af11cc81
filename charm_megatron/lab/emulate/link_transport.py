"""The executor's transport over the software links (:mod:`.linkmodel`): every op of a batch
is booked on the rank's modelled links, at the rank's virtual time where it follows a virtual
clock (:mod:`.virtual_time`), and each real handle waits no earlier than its modelled arrival."""

from __future__ import annotations

import time
from typing import Any

from charm_megatron.lab.emulate.floors import FloorSlot
from charm_megatron.lab.emulate.link_order import BATCH_SEQ
from charm_megatron.lab.emulate.link_work import ThrottledWork
from charm_megatron.lab.emulate.linkmodel import KEEP_PAST_S, RankLinks

__all__ = ["LinkTransport"]

class LinkTransport:
    """A transport (ops/transport.py) that books every op on its modelled links: each op of a
    batch is posted to :class:`~.linkmodel.RankLinks` (its side of the message, its module doc), then the batch
    goes through ``inner`` (default: torch.distributed) and each real handle is attached, so
    its ``wait()`` returns no earlier than the message could have arrived. gloo only: it needs
    one handle per op (NCCL gives one per batch).

    ``clock``: the rank's virtual clock (:class:`~.virtual_time.VirtualTime`, the emulated GPU
    cluster's default; :meth:`follow` sets it later): a batch is booked at the clock's
    :meth:`~.virtual_time.VirtualTime.ready` time (its data is ready then) instead of the wall
    clock's now, and each handle's wait reports its message's arrival to the clock. A host
    early for that time sleeps until it, so wall and virtual time agree while the host is on
    time. One communicator (``op.group``) runs its batches one after another (NCCL; the model's
    streams): on the virtual clock a batch starts no earlier than the communicator's previous
    batch could have completed, its messages alone on their links from its start (latency +
    bytes at the per-message rate; a lower bound: the real completion, with queueing, is not
    known when the host posts). Before 2026-12-06 every batch started at its post, so the four
    quarters of a rank posted a few us before another's all went ahead of the other's first
    on a shared NIC (docs/emulator.md, *A communicator's batches in turn*)."""

    name = "software_links"

    def __init__(self, links: RankLinks, inner: Any = None, clock: Any = None) -> None:
        if inner is None:
            from charm_megatron.ops.transport import TorchTransport

            inner = TorchTransport()
        self.links, self.inner = links, inner
        self._call = self._batches = 0
        # communicator -> when its last batch can have completed at the earliest (its
        # messages alone on their links from its start): the next batch there starts no
        # earlier (one communicator runs its batches one after another, the model's streams)
        self._stream_free: dict[object, float] = {}
        self.follow(clock)

    def follow(self, clock: Any) -> None:
        """Book on ``clock`` (a :class:`~.virtual_time.VirtualTime`; ``None``: the wall). On
        start-order links the clock publishes this rank's floor (:mod:`.floors`)."""
        self.clock = clock
        spec = self.links.spec
        if clock is not None and spec.start_order:
            clock.publish_floor(FloorSlot(spec.floors(), self.links.rank))

    def _post_time(self) -> float | None:
        """The batch's virtual post time (``None``: now, on the wall clock), after sleeping
        until it if the host is early."""
        if self.clock is None:
            return None
        at = self.clock.ready()
        lag = time.monotonic() - at
        if lag < 0:
            time.sleep(-lag)
        elif lag > KEEP_PAST_S / 2:
            raise RuntimeError(
                f"software link model: rank {self.links.rank}'s virtual clock trails the wall "
                f"by {lag:.1f} s, more than the links keep ({KEEP_PAST_S:g} s / 2): this "
                "machine's cores cannot keep up with the emulated devices (raise --dilation)")
        return at

    def post(self, ops: list) -> list[ThrottledWork]:
        at = self._post_time()
        seqs: list[int | None] = [None] * len(ops)
        if self.clock is not None:  # numbered by batch in the call (start order's ties)
            if self.clock.calls != self._call:
                self._call, self._batches = self.clock.calls, 0
            self._batches += 1
            seqs = [self._batches * BATCH_SEQ + i for i in range(len(ops))]
        starts = [at] * len(ops)
        if at is not None:
            starts = [max(at, self._stream_free.get(self._stream(op), at)) for op in ops]
            for op, start in zip(ops, starts):
                key = self._stream(op)
                self._stream_free[key] = max(self._stream_free.get(key, start),
                                             start + self.links.alone_s(op.peer, op.nbytes,
                                                                        op.send))
        handles = [self.links.post(op.nbytes, op.peer, op.send, op.group, at=start,
                                   clock=self.clock, seq=seq)
                   for op, seq, start in zip(ops, seqs, starts)]
        if self.clock is not None:
            for h in handles:
                h.on_arrival = self.clock.arrived
        works = list(self.inner.post(ops))
        if len(works) != len(ops):
            raise RuntimeError("software link model: the backend coalesced a P2P batch; it "
                               "only works with gloo (one work handle per operation)")
        return [h.attach(w) for h, w in zip(handles, works)]

    @staticmethod
    def _stream(op: Any) -> object:
        return id(op.group) if op.group is not None else None

    def __repr__(self) -> str:
        return f"LinkTransport(rank {self.links.rank})"
