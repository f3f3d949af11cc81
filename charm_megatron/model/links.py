"""One description of a cluster's links, read by the performance model and the emulator alike.

A :class:`LinkSpec` says, for one kind of link (inside a hardware group, or across groups),
what one message can reach (``message_Bps``), what one *port* (a rank's, or a group's, egress
or ingress) carries in all (``port_Bps``), the latency every message pays and how the port
serves the messages on it at once (``order``: ``"fifo"``, the first started takes what it can
use and later ones the rest; ``"fair"``, max-min fair shares). :class:`Links` holds both kinds
of one :class:`~charm_megatron.model.cluster.Cluster` (:meth:`Links.of`).

The model's engine (:mod:`charm_megatron.model.sim`) sizes its ports and caps its messages with
it; the emulated GPU cluster (``lab/bench/gpu_emulation.py``, ``DeviceSetup.links``) builds its
software links (``lab/emulate/linkmodel.py``) from the same object, scaled to the wire
(:meth:`Links.on_wire`), so the two cannot describe a link differently. ``Links`` also says
whether cross messages cross the ranks' intra ports too (``cross_via_intra``, the cluster's:
the model's engine and the software links both read it here and book a cross message on
them as well). What the emulator leaves out (an intra bus, burst buckets, the concurrency penalty)
is the cluster's, not the link description's: docs/emulator.md lists it.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

from charm_megatron.model.cluster import Cluster


@dataclass(frozen=True)
class LinkSpec:
    """One kind of link: rates in bytes/s, latency in seconds.

    ``message_Bps``: the most one message reaches on it; ``port_Bps``: what one port (one
    direction) carries in all, messages at once sharing it (a port wider than a message carries
    ``port / message`` of them at full speed); ``shared_by``: whose port it is (``"rank"``, or
    ``"node"``: one per hardware group, all its ranks' messages on it); ``latency_s``: paid by
    every message once; ``order``: how concurrent messages share a port
    (:data:`~charm_megatron.model.cluster.LINK_ORDERS`)."""

    message_Bps: float
    port_Bps: float
    latency_s: float = 0.0
    order: str = "fair"
    shared_by: str = "rank"

    def __post_init__(self) -> None:
        if not (self.message_Bps > 0 and self.port_Bps > 0):
            raise ValueError(f"link rates must be > 0, got message {self.message_Bps!r}, "
                             f"port {self.port_Bps!r}")
        if self.latency_s < 0:
            raise ValueError(f"latency must be >= 0, got {self.latency_s!r}")

    @property
    def one_message_Bps(self) -> float:
        """What a message alone on its ports reaches."""
        return min(self.message_Bps, self.port_Bps)

    def on_wire(self, bytes_scale: float, dilation: float) -> LinkSpec:
        """The emulated link: ``bytes_scale`` times fewer bytes on the wire and time ``dilation``
        times slower, so both rates are divided by their product and the latency (device time)
        is multiplied by ``dilation``."""
        slower = bytes_scale * dilation
        return replace(self, message_Bps=self.message_Bps / slower,
                       port_Bps=self.port_Bps / slower, latency_s=self.latency_s * dilation)


@dataclass(frozen=True)
class Links:
    """A cluster's two kinds of link: ``intra`` (between ranks of one hardware group) and
    ``cross`` (between groups). ``cross_via_intra``: a cross message from src to dst also
    takes src's intra egress port and dst's intra ingress port (its own rate still the cross
    one; the cluster's :attr:`~charm_megatron.model.cluster.Cluster.cross_via_intra`)."""

    intra: LinkSpec
    cross: LinkSpec
    cross_via_intra: bool = False

    @classmethod
    def of(cls, cluster: Cluster) -> Links:
        """The links of ``cluster``. Intra: a message reaches ``intra_gbps`` on a rank's port
        of ``intra_port_gbps`` (``None``: ``intra_gbps``, one message fills it). Cross: one
        message can fill a port of ``cross_gbps``, the rank's (``nic="rank"``) or the group's
        (``nic="node"``)."""
        latency = cluster.latency_us * 1e-6
        intra_port = cluster.intra_port_gbps or cluster.intra_gbps
        return cls(LinkSpec(cluster.intra_gbps * 1e9, intra_port * 1e9, latency,
                            cluster.link_order, "rank"),
                   LinkSpec(cluster.cross_gbps * 1e9, cluster.cross_gbps * 1e9, latency,
                            cluster.link_order, cluster.nic), cluster.cross_via_intra)

    def on_wire(self, bytes_scale: float, dilation: float) -> Links:
        """Both kinds scaled to the wire (:meth:`LinkSpec.on_wire`)."""
        return replace(self, intra=self.intra.on_wire(bytes_scale, dilation),
                       cross=self.cross.on_wire(bytes_scale, dilation))
