"""A software link model: the fallback when network namespaces are not available (no root).

The real transfer happens at loopback speed; :class:`LinkModel` only makes ``wait()`` return no
earlier than the link could have delivered the bytes: ``max(now, link busy until) + bytes/rate``
at posting time, with the "busy until" counter shared by everything posted on the link (threads,
streams, and with ``shared_path`` also the processes of one node). Limits (see
docs/topology.md): it does not model CPU contention or TCP fair sharing, and it can hide
transfers that only progress inside ``wait()`` (the real bytes moved earlier, for free).
"""

from __future__ import annotations

import fcntl
import os
import struct
import threading
import time
from dataclasses import dataclass
from typing import Any

from charm_megatron.lab.emulate.cluster import NIC_MODELS
from charm_megatron.lab.emulate.rates import parse_rate

__all__ = ["LinkModel", "LinkTransport", "RankLinks", "SoftwareLinks", "ThrottledWork"]

_STATE = struct.Struct("=dQQ")  # busy_until (monotonic s), bytes posted, transfers posted


class LinkModel:
    """One modelled link of ``rate`` (tc units or bytes/s) plus a fixed ``latency_s``.

    ``shared_path``: a file holding the link's counter so that several processes share one link
    (e.g. the ranks of a node on one NIC); ``time.monotonic`` is machine-wide, so deadlines agree
    across processes. Without it the counter lives in this process (threads share it).
    """

    def __init__(self, rate: str | float, *, latency_s: float = 0.0,
                 shared_path: str | None = None, name: str = "") -> None:
        self.rate = parse_rate(rate)
        self.latency_s = float(latency_s)
        self.shared_path = shared_path
        self.name = name
        self._lock = threading.Lock()
        self._local = [0.0, 0, 0]
        self._fd: int | None = None

    def __getstate__(self) -> dict:
        state = dict(self.__dict__)
        state["_lock"] = None
        state["_fd"] = None
        return state

    def __setstate__(self, state: dict) -> None:
        self.__dict__.update(state)
        self._lock = threading.Lock()

    def _update(self, nbytes: int | None) -> tuple[float, int, int]:
        """Book ``nbytes`` (None: only read) and return the new (busy_until, bytes, count)."""
        now = time.monotonic()
        with self._lock:
            if self.shared_path is None:
                busy, total, count = self._local
                if nbytes is not None:
                    self._local = [max(now, busy) + nbytes / self.rate, total + nbytes, count + 1]
                return tuple(self._local)  # type: ignore[return-value]
            if self._fd is None:
                self._fd = os.open(self.shared_path, os.O_RDWR | os.O_CREAT, 0o600)
            fcntl.flock(self._fd, fcntl.LOCK_EX)
            try:
                raw = os.pread(self._fd, _STATE.size, 0)
                busy, total, count = _STATE.unpack(raw) if len(raw) == _STATE.size else (0.0, 0, 0)
                if nbytes is None:
                    return busy, total, count
                state = (max(now, busy) + nbytes / self.rate, total + nbytes, count + 1)
                os.pwrite(self._fd, _STATE.pack(*state), 0)
                return state
            finally:
                fcntl.flock(self._fd, fcntl.LOCK_UN)

    def reserve(self, nbytes: int) -> float:
        """Book ``nbytes`` on the link now; the ``time.monotonic()`` when they have arrived."""
        busy, _, _ = self._update(int(nbytes))
        return busy + self.latency_s

    @property
    def bytes_posted(self) -> int:
        """Bytes booked on this link so far (by every sharer)."""
        return self._update(None)[1]

    @property
    def transfers_posted(self) -> int:
        return self._update(None)[2]

    def wrap(self, work: Any, nbytes: int) -> ThrottledWork:
        """Book ``nbytes`` and wrap ``work`` (anything with ``wait()``) to honour the link."""
        return ThrottledWork(work, self.reserve(nbytes))

    def isend(self, tensor: Any, dst: int, group: Any = None, tag: int = 0) -> ThrottledWork:
        """``dist.isend`` on this link (``dst``: global rank)."""
        import torch.distributed as dist

        return self.wrap(dist.isend(tensor, dst, group=group, tag=tag), _nbytes(tensor))

    def irecv(self, tensor: Any, src: int, group: Any = None, tag: int = 0) -> ThrottledWork:
        """``dist.irecv`` on this link (``src``: global rank); the receiver's view of the link."""
        import torch.distributed as dist

        return self.wrap(dist.irecv(tensor, src, group=group, tag=tag), _nbytes(tensor))

    def __repr__(self) -> str:
        return f"LinkModel({self.name or 'link'}, {self.rate:.3g} B/s)"


class ThrottledWork:
    """A communication handle whose ``wait()`` returns no earlier than ``deadline``."""

    def __init__(self, work: Any, deadline: float) -> None:
        self.work = work
        self.deadline = deadline

    def wait(self, timeout: Any = None) -> bool:
        """Wait for the real transfer, then for the modelled link (``timeout`` goes to the real
        handle, e.g. a ``datetime.timedelta`` for torch ``Work``)."""
        if self.work is not None:
            if timeout is None:
                self.work.wait()
            else:
                self.work.wait(timeout)
        remaining = self.deadline - time.monotonic()
        if remaining > 0:
            time.sleep(remaining)
        return True

    def is_completed(self) -> bool:
        done = self.work is None or self.work.is_completed()
        return bool(done) and time.monotonic() >= self.deadline

    def __getattr__(self, name: str) -> Any:
        return getattr(self.work, name)


def _nbytes(tensor: Any) -> int:
    return int(tensor.numel() * tensor.element_size())


@dataclass(frozen=True)
class SoftwareLinks:
    """The software twin of :class:`EmulatedCluster`: ``groups`` x ``ranks_per_group`` ranks.

    ``nic="node"``: a node's ranks share one egress and one ingress link of ``cross_rate``;
    ``nic="rank"``: each rank has its own. Intra-node transfers use a per-rank link of
    ``intra_rate``, or are not throttled when it is ``None``. ``state_dir`` (a directory every
    rank can write, e.g. a ``tempfile.mkdtemp()`` made by the launcher) holds the shared
    counters; it is required for ``nic="node"`` with ranks in separate processes.
    """

    groups: int
    ranks_per_group: int
    cross_rate: str | float
    intra_rate: str | float | None = None
    nic: str = "node"
    state_dir: str | None = None
    latency_s: float = 0.0

    def for_rank(self, rank: int) -> RankLinks:
        """The links ``rank`` uses; call it once per process."""
        if self.nic not in NIC_MODELS:
            raise ValueError(f"nic must be 'node' or 'rank', got {self.nic!r}")
        g = rank // self.ranks_per_group
        owner = f"node{g}" if self.nic == "node" else f"rank{rank}"

        def link(rate: str | float, kind: str, who: str) -> LinkModel:
            path = os.path.join(self.state_dir, f"{kind}-{who}.link") if self.state_dir else None
            return LinkModel(rate, latency_s=self.latency_s, shared_path=path, name=f"{kind} {who}")

        intra = None
        if self.intra_rate is not None:
            intra = (link(self.intra_rate, "intra-out", f"rank{rank}"),
                     link(self.intra_rate, "intra-in", f"rank{rank}"))
        return RankLinks(self, rank, link(self.cross_rate, "cross-out", owner),
                         link(self.cross_rate, "cross-in", owner), intra)


class RankLinks:
    """One rank's view of :class:`SoftwareLinks`: throttled ``isend`` / ``irecv``."""

    def __init__(self, spec: SoftwareLinks, rank: int, cross_out: LinkModel, cross_in: LinkModel,
                 intra: tuple[LinkModel, LinkModel] | None) -> None:
        self.spec, self.rank = spec, rank
        self.cross_out, self.cross_in, self.intra = cross_out, cross_in, intra

    def same_node(self, peer: int) -> bool:
        m = self.spec.ranks_per_group
        return peer // m == self.rank // m

    def link(self, peer: int, outgoing: bool) -> LinkModel | None:
        """The link a transfer to (``outgoing``) or from ``peer`` is booked on; None = free."""
        if self.same_node(peer):
            return None if self.intra is None else self.intra[0 if outgoing else 1]
        return self.cross_out if outgoing else self.cross_in

    def wrap(self, work: Any, nbytes: int, peer: int, outgoing: bool) -> ThrottledWork:
        link = self.link(peer, outgoing)
        return ThrottledWork(work, 0.0) if link is None else link.wrap(work, nbytes)

    def isend(self, tensor: Any, dst: int, group: Any = None, tag: int = 0) -> ThrottledWork:
        import torch.distributed as dist

        return self.wrap(dist.isend(tensor, dst, group=group, tag=tag), _nbytes(tensor), dst, True)

    def irecv(self, tensor: Any, src: int, group: Any = None, tag: int = 0) -> ThrottledWork:
        import torch.distributed as dist

        return self.wrap(dist.irecv(tensor, src, group=group, tag=tag), _nbytes(tensor), src, False)

    def transport(self, inner: Any = None) -> LinkTransport:
        """The executor's transport over these links (:class:`LinkTransport`)."""
        return LinkTransport(self, inner)


class LinkTransport:
    """A transport (ops/transport.py) that books every op on its modelled link: the executor's
    batches go through ``inner`` (default: torch.distributed), and each op's handle is wrapped
    by :meth:`RankLinks.wrap` (send: this rank's egress to the peer; receive: its ingress), so
    its ``wait()`` returns no earlier than the link could have delivered it. gloo only: it
    needs one handle per op (NCCL gives one per batch)."""

    name = "software_links"

    def __init__(self, links: RankLinks, inner: Any = None) -> None:
        if inner is None:
            from charm_megatron.ops.transport import TorchTransport

            inner = TorchTransport()
        self.links, self.inner = links, inner

    def post(self, ops: list) -> list[ThrottledWork]:
        works = list(self.inner.post(ops))
        if len(works) != len(ops):
            raise RuntimeError("software link model: the backend coalesced a P2P batch; it "
                               "only works with gloo (one work handle per operation)")
        return [self.links.wrap(work, op.nbytes, op.peer, op.send)
                for work, op in zip(works, ops)]

    def __repr__(self) -> str:
        return f"LinkTransport(rank {self.links.rank})"
