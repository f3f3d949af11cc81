"""A software link model: the fallback when network namespaces are not available (no root).

The real bytes move at loopback speed (gloo); the model only makes each transfer's ``wait()``
return no earlier than modelled links could have delivered it. It is the emulated GPU
cluster's default link backend (docs/emulator.md) and mirrors the performance model
(``model/sim.py``), so that both give one message the same arrival time.

**A message.** ``src``'s k-th send to ``dst`` on one communicator and tag is ``dst``'s k-th
receive from ``src`` there (the order in which torch / gloo pair them). It needs two links:
the sender's *egress* and the receiver's *ingress* (below). It starts when both sides have
posted; from then on it moves at what the model's first-come-first-served sharing gives it
(``model/sim.py`` with ``link_order="fifo"``, ``model/fluid.py``'s ``allocate_in_order``),
and arrives ``latency_s`` after its last byte left::

    start    = max(send posted, receive posted)
    rate(t)  = min(message rate, egress port - booked on it at t, ingress port - booked at t)
    arrival  = (when rate(t) integrated from start reaches bytes) + latency_s

and its ``rate(t)`` is then booked on both links. With ``cross_via_intra`` (the ``l20-pcie``
profile's: a PCIe GPU's cross-NUMA traffic also crosses its own PCIe port) a cross message
takes two more, the sender's intra egress and the receiver's intra ingress, as the model's
``("iout", src)`` / ``("iin", dst)``: its rate(t) is bounded by what all four ports have
left (its own cap stays the cross one) and booked on all four. Each link is described as the model
describes it (:class:`~charm_megatron.model.links.LinkSpec`): the most one message reaches
(``rate``, the profiles' ``intra_gbps``) and what the port carries in all (``port_rate``, the
profiles' ``intra_port_gbps``): on an H100 profile a rank's intra egress carries one message at
365 GB/s and a second one at once at the 85 GB/s left, which speeds up to 365 when the first
has arrived. A port no wider than a message (every cross link: one message can fill a NIC)
queues messages whole, as these links did before (2026-12-06) for every link, except that a
message waiting for its receiver's ingress no longer holds the sender's egress idle (a later
message uses it meanwhile, as in the model). Messages booked earlier keep their rates (a later
one never slows them), as in the model's fifo order.

The booking is made by whichever side posts second, at its post (the first leaves its post
time in the pair's mailbox), so links serve messages in the order they start. A side's post
time is the wall clock's at its post, or, on a rank's virtual clock
(:mod:`charm_megatron.lab.emulate.virtual_time`, ``LinkTransport(clock=...)``), the virtual
time at which its data was ready, possibly a little in the past: the message then takes what
the bookings made before it left on its links from that time on. With
``SoftwareLinks(start_order=True)`` (every rank on a virtual clock: the bench's ``--device-clock
virtual``) the second side does not book it: it waits, queued, until no message that starts
earlier can still be posted (the ranks' floors), and is then booked in virtual start order
(:mod:`.link_order`), so the order of service does not depend on which host posted first on
the wall clock. Both sides'
``wait()`` return no earlier than the arrival: a send completes when its bytes have arrived
(as the model completes a batch when all its messages arrived, and as NCCL's point-to-point
does), so a waited send whose receiver has not posted yet blocks until it does (bounded by
the wait's ``timeout`` or ``SoftwareLinks.pair_timeout_s``, then :class:`TimeoutError`).

This is *cut-through*, not store-and-forward: the model's message is one flow over the
sender's out-link and the receiver's in-link at once, taking ``latency + bytes / rate`` (not
twice the bytes' time). The model waits the latency *before* moving the bytes, the links
here add it after; with first-come service and one latency for every message that is the same
arrival (every link's time line is shifted by the latency), so on an emulated GPU cluster the
model is told ``link_order="fifo"`` (lab/bench/cli.py).

**Links** (:class:`SoftwareLinks`): across nodes, ``nic="rank"`` gives each rank an egress
and an ingress of ``cross_rate``; ``nic="node"`` gives each node one of each, shared by all
its ranks (the model's ``("xout", group)`` / ``("xin", group)``). Inside a node every rank
has an intra egress and ingress (the model's ports) on which a message reaches ``intra_rate``
and all together ``intra_port_rate``; with ``intra_rate=None`` intra-node messages are free
(no latency either). :meth:`SoftwareLinks.from_links` takes all of it from the model's
:class:`~charm_megatron.model.links.Links` (the emulated GPU cluster's ``DeviceSetup``
does). A link's state is its reservations, ``(from, until, bytes/s)`` segments (those that
ended over :data:`KEEP_PAST_S` ago are dropped), with the bytes and transfers posted, in this
process (threads share it) or, with ``state_dir``, in an ``flock``-ed file every process of
the machine shares (``time.monotonic`` is machine-wide); the pairs' mailboxes live there too
(``pair-<src>-<dst>-<channel>.fifo``, 32 bytes per message). Ranks in separate processes need
``state_dir``.

Where it differs from the model (``model/sim.py``): the links always serve in start order
(the model's profiles share fairly unless told ``link_order="fifo"``, which the bench does);
without ``start_order`` the order is the order of bookings on the wall clock, whose start
times are post times taken before the locks, so two posts a few microseconds apart (or, on a
virtual clock, a late host's early post) may be served in the other order; the model activates a
stream's batches one after another when the previous one completed, here (``LinkTransport``) a
batch starts when the previous one could have completed alone; no intra bus, burst
buckets or concurrency penalty. The emulator's own limits
(docs/topology.md): no CPU contention in a network stack or TCP fair sharing, and a transfer
that only progresses inside ``wait()`` is not penalised.

:class:`LinkModel` alone (``reserve`` / ``wrap`` / ``isend`` / ``irecv``) is one link seen by
its poster: from now, at what its port has left up to its rate (a port no wider than a
message: ``max(now, busy until) + bytes/rate + latency``), no pairing.
"""

from __future__ import annotations

import hashlib
import math
import os
import struct
import threading
import time
import uuid
from collections.abc import Callable, Sequence
from contextlib import ExitStack
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from charm_megatron.lab.emulate.cluster import NIC_MODELS
from charm_megatron.lab.emulate.floors import FloorBoard
from charm_megatron.lab.emulate.link_fill import fill, used_at
from charm_megatron.lab.emulate.link_order import Await, Matched, StartOrder
from charm_megatron.lab.emulate.link_work import LinkWork, ThrottledWork
from charm_megatron.lab.emulate.locked import Locked
from charm_megatron.lab.emulate.rates import parse_rate

if TYPE_CHECKING:
    from charm_megatron.model.links import Links

__all__ = ["LinkModel", "LinkWork", "RankLinks", "SoftwareLinks",
           "ThrottledWork", "book_message", "fill", "message_rate"]

_HEADER = struct.Struct("=QQQ")  # a link's bytes posted, transfers posted, segments stored
_SEGMENT = struct.Struct("=ddd")  # one reservation: from, until (monotonic s), bytes/s
_HEAD = struct.Struct("=QQ")  # a pair's sends posted, receives posted
# send posted, receive posted, arrival (NaN: not yet), bytes, and each side's post number on
# its rank (-1: not posted; the start-order links break ties of start by it)
_SLOT = struct.Struct("=dddQqq")
_EMPTY_SLOT = (math.nan, math.nan, math.nan, 0, -1, -1)
#: Reservations that ended this long before now are dropped from a link's state: a booking's
#: start (a post time) lags the clock by the locks it waited for and, on a rank's virtual clock,
#: by how late its host runs (``LinkTransport`` refuses a lag of over half of this).
KEEP_PAST_S = 60.0


class LinkModel(Locked):
    """One modelled link direction (a port): each message on it reaches at most ``rate`` (tc
    units or bytes/s), all messages at once at most ``port_rate`` (``None``: ``rate``, one
    message fills the port), plus a fixed ``latency_s``.

    Its state is the reservations booked on it (``(from, until, bytes/s)`` segments, module
    doc), with the bytes and transfers posted. ``shared_path``: a file holding that state so
    that several processes share one link (e.g. the ranks of a node on one NIC);
    ``time.monotonic`` is machine-wide, so times agree across processes. Without it the state
    lives in this process (threads share it).
    """

    def __init__(self, rate: str | float, *, latency_s: float = 0.0,
                 shared_path: str | None = None, name: str = "",
                 port_rate: str | float | None = None) -> None:
        super().__init__(shared_path)
        self.rate = parse_rate(rate)
        self.port_rate = self.rate if port_rate is None else parse_rate(port_rate)
        if not (self.rate > 0 and self.port_rate > 0):
            raise ValueError(f"link rates must be > 0, got {rate!r} per message, "
                             f"{port_rate!r} per port")
        self.latency_s = float(latency_s)
        self.shared_path = shared_path
        self.name = name
        self._local: tuple[int, int, list[tuple[float, float, float]]] = (0, 0, [])

    def _read(self, fd: int | None) -> tuple[int, int, list[tuple[float, float, float]]]:
        """(bytes posted, transfers posted, reservation segments)."""
        if fd is None:
            total, count, segs = self._local
            return total, count, list(segs)
        raw = os.pread(fd, _HEADER.size, 0)
        if len(raw) != _HEADER.size:
            return 0, 0, []
        total, count, n = _HEADER.unpack(raw)
        body = os.pread(fd, n * _SEGMENT.size, _HEADER.size)
        return total, count, [_SEGMENT.unpack_from(body, k * _SEGMENT.size) for k in range(n)]

    def _write(self, fd: int | None, total: int, count: int,
               segs: list[tuple[float, float, float]]) -> None:
        cutoff = time.monotonic() - KEEP_PAST_S
        segs = [s for s in segs if s[1] > cutoff]
        if fd is None:
            self._local = (total, count, segs)
            return
        data = _HEADER.pack(total, count, len(segs)) + b"".join(_SEGMENT.pack(*s) for s in segs)
        os.pwrite(fd, data, 0)
        os.ftruncate(fd, len(data))

    def _state(self) -> tuple[int, int, list[tuple[float, float, float]]]:
        with self._held() as fd:
            return self._read(fd)

    def reserve(self, nbytes: int) -> float:
        """Book ``nbytes`` on this link alone from now (what the port has left, up to
        ``rate``); the ``time.monotonic()`` when they have arrived."""
        with self._held() as fd:
            total, count, segs = self._read(fd)
            end, pieces = fill(time.monotonic(), nbytes, self.rate, [(self.port_rate, segs)])
            self._write(fd, total + int(nbytes), count + 1, segs + pieces)
        return end + self.latency_s

    @property
    def busy_until(self) -> float:
        """When the last byte booked on this link leaves (0: none booked lately)."""
        return max((s[1] for s in self._state()[2]), default=0.0)

    def reserved(self, t: float) -> float:
        """The rate (bytes/s) booked on this link at ``time.monotonic()`` time ``t``."""
        return used_at(self._state()[2], t)

    @property
    def bytes_posted(self) -> int:
        """Bytes booked on this link so far (by every sharer)."""
        return self._state()[0]

    @property
    def transfers_posted(self) -> int:
        return self._state()[1]

    def wrap(self, work: Any, nbytes: int) -> ThrottledWork:
        """Book ``nbytes`` and wrap ``work`` (anything with ``wait()``) to honour the link."""
        return ThrottledWork(work, self.reserve(nbytes))

    def isend(self, tensor: Any, dst: int, group: Any = None, tag: int = 0) -> ThrottledWork:
        """``dist.isend`` on this link (``dst``: global rank), unpaired (see module doc)."""
        import torch.distributed as dist

        return self.wrap(dist.isend(tensor, dst, group=group, tag=tag), _nbytes(tensor))

    def irecv(self, tensor: Any, src: int, group: Any = None, tag: int = 0) -> ThrottledWork:
        """``dist.irecv`` on this link (``src``: global rank); the receiver's view of the link
        alone (:class:`RankLinks` pairs it with the sender's)."""
        import torch.distributed as dist

        return self.wrap(dist.irecv(tensor, src, group=group, tag=tag), _nbytes(tensor))

    def __repr__(self) -> str:
        port = "" if self.port_rate == self.rate else f", port {self.port_rate:.3g} B/s"
        return f"LinkModel({self.name or 'link'}, {self.rate:.3g} B/s{port})"


def message_rate(links: Sequence[LinkModel]) -> float:
    """The most one message on ``links`` reaches: its own egress's and ingress's (the first
    two; further ones, ``cross_via_intra``'s intra ports, only lend what their port has left)."""
    return min(links[0].rate, links[1].rate)


def book_message(links: Sequence[LinkModel], earliest: float, nbytes: int,
                 latency_s: float) -> float:
    """Book one message on all its links at once (module doc): its egress and ingress, then
    any others it crosses (``cross_via_intra``: the sender's intra egress, the receiver's intra
    ingress). From ``earliest`` it moves at what every port has left, up to its per-message
    rate (:func:`message_rate`), and its rate over time is booked on each; returns its arrival
    (``time.monotonic`` s). The links are locked in the order given: callers give them in one
    global order (:meth:`SoftwareLinks.links`: cross-out, cross-in, intra-out, intra-in), so
    no two messages wait on each other's locks."""
    if len(links) < 2 or len({id(link) for link in links}) != len(links):
        raise ValueError("a message needs distinct links (at least the sender's egress and "
                         "the receiver's ingress)")
    with ExitStack() as stack:
        fds = [stack.enter_context(link._held()) for link in links]
        states = [link._read(fd) for link, fd in zip(links, fds)]
        end, pieces = fill(earliest, nbytes, message_rate(links),
                           [(link.port_rate, st[2]) for link, st in zip(links, states)])
        for link, fd, (total, count, segs) in zip(links, fds, states):
            link._write(fd, total + nbytes, count + 1, segs + pieces)
    return end + latency_s


class _PairBox(Locked):
    """The mailbox of one (src, dst, channel): slot k holds the k-th send's and the k-th
    receive's post times, the sender's byte count, and the message's arrival once booked.
    Its file is opened per use: a long run makes new communicators, so new mailboxes."""

    keep_open = False

    def __init__(self, path: str | None) -> None:
        super().__init__(path)
        self._head = [0, 0]
        self._slots: dict[int, list] = {}

    def _get(self, fd: int | None, k: int) -> list:
        if fd is None:
            return list(self._slots.get(k, _EMPTY_SLOT))
        raw = os.pread(fd, _SLOT.size, _HEAD.size + k * _SLOT.size)
        return list(_SLOT.unpack(raw)) if len(raw) == _SLOT.size else list(_EMPTY_SLOT)

    def _put(self, fd: int | None, k: int, slot: list) -> None:
        if fd is None:
            self._slots[k] = slot
        else:
            os.pwrite(fd, _SLOT.pack(*slot), _HEAD.size + k * _SLOT.size)

    def _counts(self, fd: int | None) -> list[int]:
        if fd is None:
            return self._head
        raw = os.pread(fd, _HEAD.size, 0)
        return list(_HEAD.unpack(raw)) if len(raw) == _HEAD.size else [0, 0]

    def post(self, send: bool, now: float, nbytes: int,
             book: Callable[[float, int], float] | None, seq: int = -1) -> tuple[int, list]:
        """One side posts its next op on the pair: it takes the next slot of its side; if the
        other side is there already, ``book(start, bytes)`` books the message (``None``: left
        unbooked, the start-order links serve it later, :mod:`.link_order`). ``seq``: the
        post's number on its rank. Returns k and the slot as this post left it (send posted,
        receive posted, arrival, bytes, send's number, receive's number)."""
        with self._held() as fd:
            counts = self._counts(fd)
            side = 0 if send else 1
            k = counts[side]
            counts[side] += 1
            if fd is None:
                self._head = counts
            else:
                os.pwrite(fd, _HEAD.pack(*counts), 0)
            slot = self._get(fd, k)
            slot[side] = now
            slot[4 + side] = seq
            if send:
                slot[3] = int(nbytes)
            other = slot[1 - side]
            if not math.isnan(other) and book is not None:
                slot[2] = book(max(now, other), int(slot[3]))
            self._put(fd, k, slot)
            return k, slot

    def arrival(self, k: int) -> float | None:
        with self._held() as fd:
            t = self._get(fd, k)[2]
        return None if math.isnan(t) else t

    def slot(self, k: int) -> tuple[float, float, float, int]:
        """Slot k as it stands: send posted, receive posted, arrival (NaN: not yet), bytes."""
        with self._held() as fd:
            send_t, recv_t, arrival, nbytes = self._get(fd, k)[:4]
        return send_t, recv_t, arrival, int(nbytes)

    def deliver(self, k: int, arrival: float) -> None:
        """Message k was served (start-order links): its arrival, for both sides' waits."""
        with self._held() as fd:
            slot = self._get(fd, k)
            slot[2] = arrival
            self._put(fd, k, slot)


def _nbytes(tensor: Any) -> int:
    return int(tensor.numel() * tensor.element_size())


def _channel(group: Any, tag: int) -> str:
    """A name for a communicator and tag that every rank computes alike (for file names)."""
    name = "world"
    if group is not None:
        import torch.distributed as dist

        if not (dist.is_initialized() and group is dist.group.WORLD):
            name = getattr(group, "group_name", None) or type(group).__name__
    return hashlib.sha1(f"{name}/{int(tag)}".encode()).hexdigest()[:16]


# Links and mailboxes of this process, by (scope, name): every RankLinks of one SoftwareLinks
# (threads) uses the same objects; with a state_dir those hold files the processes share.
_SHARED: dict[tuple[str, str], Any] = {}
_SHARED_LOCK = threading.Lock()


@dataclass(frozen=True)
class SoftwareLinks:
    """The software twin of :class:`EmulatedCluster`: ``groups`` x ``ranks_per_group`` ranks.

    ``nic="node"``: a node's ranks share one egress and one ingress link of ``cross_rate``;
    ``nic="rank"``: each rank has its own. Intra-node transfers use a per-rank link of
    ``intra_rate``, or are not throttled when it is ``None``. ``intra_port_rate`` /
    ``cross_port_rate``: what such a link carries in all when a message reaches only
    ``intra_rate`` / ``cross_rate`` (``None``: the same, one message fills it).
    ``latency_s``: added to every throttled message's arrival (the bench's emulated GPU
    cluster passes its profile's ``latency_us`` x the dilation). :meth:`from_links` builds it
    from the model's link description. ``state_dir`` (a directory every rank can write, e.g. a
    ``tempfile.mkdtemp()`` made by the launcher) holds the links' reservations and the pairs'
    mailboxes: required when ranks run in separate processes. ``pair_timeout_s`` bounds a
    ``wait()`` on the other side's post when the caller gives no timeout. Module doc: the rule.
    ``start_order``: serve messages in virtual start order, not in the order they are booked
    on the wall clock (:mod:`.link_order`); every rank must then post through a
    :class:`LinkTransport` that follows its virtual clock (the bench's ``--device-clock
    virtual``), whose floors it waits for. ``cross_via_intra``: a cross message also takes
    its sender's intra egress and its receiver's intra ingress (module doc; needs
    ``intra_rate``).
    """

    groups: int
    ranks_per_group: int
    cross_rate: str | float
    intra_rate: str | float | None = None
    nic: str = "node"
    state_dir: str | None = None
    latency_s: float = 0.0
    pair_timeout_s: float = 300.0
    intra_port_rate: str | float | None = None
    cross_port_rate: str | float | None = None
    start_order: bool = False
    cross_via_intra: bool = False
    # Tells this spec's in-process links apart from another's when there is no state_dir.
    token: str = field(default_factory=lambda: uuid.uuid4().hex, compare=False, repr=False)

    def _shared(self, name: str, make: Callable[[str | None], Any]) -> Any:
        scope = f"mem:{self.token}"
        if self.state_dir:  # a directory made again under the same name is another scope
            st = os.stat(self.state_dir)
            scope = f"{self.state_dir}:{st.st_dev}:{st.st_ino}"
        with _SHARED_LOCK:
            obj = _SHARED.get((scope, name))
            if obj is None:
                path = os.path.join(self.state_dir, name) if self.state_dir else None
                obj = _SHARED[(scope, name)] = make(path)
            return obj

    @classmethod
    def from_links(cls, groups: int, ranks_per_group: int, links: Links,
                   **kw: Any) -> SoftwareLinks:
        """The software links of the model's description ``links``
        (:class:`~charm_megatron.model.links.Links`, already on the wire: rates in wire
        bytes/s, latency in wall seconds): per-message rates and port aggregates of both kinds,
        the cross ports' sharing, ``cross_via_intra`` and the latency. ``kw``: ``state_dir``,
        ``pair_timeout_s``.
        The links always serve in start order (their ``order``: the bench tells the model
        ``fifo``)."""
        if links.intra.latency_s != links.cross.latency_s:
            raise ValueError("the software links add one latency to every message; these "
                             f"links have {links.intra.latency_s!r} s inside a node and "
                             f"{links.cross.latency_s!r} s across")
        if links.intra.shared_by != "rank":
            raise ValueError("the software links give each rank its own intra port")
        return cls(groups, ranks_per_group, links.cross.message_Bps, links.intra.message_Bps,
                   links.cross.shared_by, latency_s=links.intra.latency_s,
                   intra_port_rate=links.intra.port_Bps, cross_port_rate=links.cross.port_Bps,
                   cross_via_intra=links.cross_via_intra, **kw)

    def _link(self, rate: str | float, kind: str, who: str,
              port: str | float | None = None) -> LinkModel:
        return self._shared(f"{kind}-{who}.link", lambda path: LinkModel(
            rate, latency_s=self.latency_s, shared_path=path, name=f"{kind} {who}",
            port_rate=port))

    def _intra(self, kind: str, rank: int) -> LinkModel:
        assert self.intra_rate is not None
        return self._link(self.intra_rate, kind, f"rank{rank}", self.intra_port_rate)

    def _cross(self, kind: str, who: str) -> LinkModel:
        return self._link(self.cross_rate, kind, who, self.cross_port_rate)

    def node(self, rank: int) -> int:
        return rank // self.ranks_per_group

    def links(self, src: int, dst: int) -> tuple[LinkModel, ...] | None:
        """The links a message from ``src`` to ``dst`` takes, in the one order every booking
        locks them in (:func:`book_message`): its egress and ingress, then, for a cross message
        with ``cross_via_intra``, ``src``'s intra egress and ``dst``'s intra ingress (cross-out,
        cross-in, intra-out, intra-in); None: not throttled."""
        intra = None if self.intra_rate is None else (self._intra("intra-out", src),
                                                      self._intra("intra-in", dst))
        if self.node(src) == self.node(dst):
            return intra
        out, into = (f"node{self.node(src)}", f"node{self.node(dst)}") if self.nic == "node" \
            else (f"rank{src}", f"rank{dst}")
        cross = (self._cross("cross-out", out), self._cross("cross-in", into))
        if self.cross_via_intra:
            if intra is None:
                raise ValueError("cross_via_intra needs intra links (an intra_rate)")
            return cross + intra
        return cross

    def pair(self, src: int, dst: int, channel: str) -> _PairBox:
        return self._shared(f"pair-{src}-{dst}-{channel}.fifo", _PairBox)

    def floors(self) -> FloorBoard:
        """Every rank's floor (:mod:`.floors`), for the start-order links."""
        return self._shared("floors", lambda path: FloorBoard(
            path, self.groups * self.ranks_per_group))

    def start_queue(self) -> StartOrder:
        """The matched messages waiting to be served in start order (:mod:`.link_order`)."""
        board = self.floors()  # made first: _shared's lock is not re-entrant
        return self._shared("order.queue", lambda path: StartOrder(
            path, board, self._book_matched, self._deliver))

    def _book_matched(self, m: Matched) -> float:
        links = self.links(m.src, m.dst)
        assert links is not None  # free links are never queued
        return book_message(links, m.start, m.nbytes, self.latency_s)

    def _deliver(self, m: Matched, arrival: float) -> None:
        self.pair(m.src, m.dst, m.channel).deliver(m.k, arrival)

    def for_rank(self, rank: int) -> RankLinks:
        """The links ``rank`` uses."""
        if self.nic not in NIC_MODELS:
            raise ValueError(f"nic must be 'node' or 'rank', got {self.nic!r}")
        owner = f"node{self.node(rank)}" if self.nic == "node" else f"rank{rank}"
        intra = None
        if self.intra_rate is not None:
            intra = (self._intra("intra-out", rank), self._intra("intra-in", rank))
        return RankLinks(self, rank, self._cross("cross-out", owner),
                         self._cross("cross-in", owner), intra)


class RankLinks:
    """One rank's view of :class:`SoftwareLinks`: throttled ``isend`` / ``irecv``."""

    def __init__(self, spec: SoftwareLinks, rank: int, cross_out: LinkModel, cross_in: LinkModel,
                 intra: tuple[LinkModel, LinkModel] | None) -> None:
        self.spec, self.rank = spec, rank
        self.cross_out, self.cross_in, self.intra = cross_out, cross_in, intra
        self._posts = 0  # this rank's posts so far, a post's number when not given one

    def same_node(self, peer: int) -> bool:
        return self.spec.node(peer) == self.spec.node(self.rank)

    def link(self, peer: int, outgoing: bool) -> LinkModel | None:
        """This rank's link a transfer to (``outgoing``) or from ``peer`` uses; None = free."""
        if self.same_node(peer):
            return None if self.intra is None else self.intra[0 if outgoing else 1]
        return self.cross_out if outgoing else self.cross_in

    def alone_s(self, peer: int, nbytes: int, outgoing: bool) -> float:
        """Seconds a message of ``nbytes`` to (``outgoing``) or from ``peer`` takes alone on
        its links: the latency plus its bytes at its per-message rate or the narrowest of its
        links' ports, whichever is lower (0 on free links)."""
        src, dst = (self.rank, peer) if outgoing else (peer, self.rank)
        links = self.spec.links(src, dst)
        if links is None:
            return 0.0
        rate = min(message_rate(links), *(link.port_rate for link in links))
        return self.spec.latency_s + nbytes / rate

    def post(self, nbytes: int, peer: int, outgoing: bool, group: Any = None,
             tag: int = 0, at: float | None = None, clock: Any = None,
             seq: int | None = None) -> ThrottledWork:
        """Post one side of a message *before* the real op is posted (so the peer can never
        see the bytes before the mailbox entry); ``attach`` the real handle after. ``at``:
        the post's time (``time.monotonic`` s; default now), e.g. a rank's virtual time at
        which the data is ready (:mod:`.virtual_time`): the booking starts no earlier.
        ``clock``: that virtual clock, required on start-order links (the wait publishes its
        lookahead on it, :mod:`.link_order`); ``seq``: the post's number on its rank, which
        orders messages of one start there (``link_order.Matched``; default: its count)."""
        src, dst = (self.rank, peer) if outgoing else (peer, self.rank)
        links = self.spec.links(src, dst)
        if links is None:
            return ThrottledWork(None, 0.0)
        channel = _channel(group, tag)
        box = self.spec.pair(src, dst, channel)
        latency = self.spec.latency_s

        def book(start: float, size: int) -> float:
            return book_message(links, start, size, latency)

        ordered = self.spec.start_order
        if ordered and (at is None or clock is None):
            raise ValueError("start-order software links serve messages by virtual start: "
                             "every post needs its rank's virtual clock and its time on it "
                             "(LinkTransport with a VirtualTime)")
        now = time.monotonic() if at is None else at
        self._posts += 1
        k, slot = box.post(outgoing, now, int(nbytes), None if ordered else book,
                           self._posts if seq is None else seq)
        what = (f"rank {self.rank}'s " + (f"send #{k} to rank {dst}" if outgoing
                                          else f"receive #{k} from rank {src}")
                + f" (channel {channel})")
        if not ordered:
            return LinkWork(None, box, k, what, self.spec.pair_timeout_s)
        queue = self.spec.start_queue()
        send_t, recv_t, _, size, send_seq, recv_seq = slot
        if not (math.isnan(send_t) or math.isnan(recv_t)):  # this post matched the message
            message = Matched.of(src, dst, channel, k, size, (send_t, send_seq),
                                 (recv_t, recv_seq))
            if size > 0:
                queue.add(message)
            else:  # reserves nothing: the order cannot matter
                box.deliver(k, book(message.start, 0))
        wait = Await(queue, clock, box, k, outgoing, peer, now, int(nbytes),
                     message_rate(links), latency)
        return LinkWork(None, box, k, what, self.spec.pair_timeout_s, order=wait)

    def wrap(self, work: Any, nbytes: int, peer: int, outgoing: bool, group: Any = None,
             tag: int = 0) -> ThrottledWork:
        """Post and attach in one step (the real op is already posted: the peer may wait a
        moment in its ``wait()`` for this side's entry)."""
        return self.post(nbytes, peer, outgoing, group, tag).attach(work)

    def isend(self, tensor: Any, dst: int, group: Any = None, tag: int = 0) -> ThrottledWork:
        import torch.distributed as dist

        handle = self.post(_nbytes(tensor), dst, True, group, tag)
        return handle.attach(dist.isend(tensor, dst, group=group, tag=tag))

    def irecv(self, tensor: Any, src: int, group: Any = None, tag: int = 0) -> ThrottledWork:
        import torch.distributed as dist

        handle = self.post(_nbytes(tensor), src, False, group, tag)
        return handle.attach(dist.irecv(tensor, src, group=group, tag=tag))

    def transport(self, inner: Any = None, clock: Any = None) -> Any:
        """The executor's transport over these links (:class:`LinkTransport`; ``clock``: the
        rank's virtual clock)."""
        from charm_megatron.lab.emulate.link_transport import LinkTransport

        return LinkTransport(self, inner, clock)
