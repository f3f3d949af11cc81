"""Cluster descriptions for the performance model: links, NICs, compute, overheads.

A :class:`Cluster` says how fast things are; *which* ranks share fast links is the topology
(groups of CP ranks), passed separately, so one description serves ``2x8`` and ``4x8`` alike.
A :class:`Profile` is a named cluster with a default topology and where each number comes
from (the named ones are :data:`charm_megatron.devices.PROFILES`);
:func:`default_cluster_for` is the generic guess used when the user describes nothing.

Units: GB/s means 1e9 bytes per second, per direction (links are full duplex); TFLOP/s is the
*sustained* attention rate of one rank (one GPU, or one CPU core), not the datasheet peak.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field, fields, replace

from charm_megatron.plan.head_stage import HEAD_COPIES

NICS = ("rank", "node")
#: How a link serves the messages on it at once: ``fair`` (max-min fair shares, as a NIC
#: arbitrates among flows of separate communicators) or ``fifo`` (in the order they started:
#: one NCCL communicator runs its operations in issue order, as TransformerEngine's ring sends
#: kv and dkv on one group; the emulator's software links book transfers so).
LINK_ORDERS = ("fair", "fifo")
#: Which messages slow a rank's compute (``Cluster.comm_slowdown``): ``all`` of them, or only
#: those on ``cross`` links (an implementation whose intra-node copies hold no SMs, or whose
#: cross transfers are the ones that hold them: the paper's, docs/model.md).
SLOWDOWN_LINKS = ("all", "cross")


@dataclass(frozen=True)
class Cluster:
    """How fast one CP group's hardware is. Immutable and hashable (usable as a cache key).

    Links (per direction, GB/s):

    * every rank has an intra *port* of ``intra_gbps`` out and one in; a message between two
      ranks of the same hardware group uses the sender's out-port and the receiver's in-port,
      so concurrent messages of one rank share its port (the PCIe contention of the paper's
      Fig. 1a; on NVLink the port is just fast). ``intra_port_gbps`` makes the port's
      aggregate larger than what one message reaches (NVLink: one NCCL point-to-point stream
      does not fill all links; ``None``: one message can fill the port);
    * cross-group messages use the cross links: ``nic="rank"`` gives every rank its own cross
      link of ``cross_gbps`` (one NIC per GPU); ``nic="node"`` gives each *group* one cross link
      shared by all its ranks (one NIC per node, or the inter-socket path of a dual-NUMA node);
    * ``cross_via_intra``: cross messages also use the ranks' intra ports (a PCIe GPU has one
      x16 link that carries both its intra-NUMA and its cross-NUMA traffic);
    * ``intra_bus_gbps``: optional capacity shared by *all* intra messages of a group (a PCIe
      root complex or switch uplink); ``None`` is a non-blocking fabric (NVSwitch).

    Concurrent messages on a link share it max-min fairly (recomputed whenever one starts or
    ends); with ``link_order="fifo"`` the one that started first takes what it can use and the
    later ones the rest, in start order (:data:`LINK_ORDERS`; GPU profiles only: a shared core
    pool stays fair). Each message first waits ``latency_us`` without using bandwidth.
    ``head_copies``: whose head all-to-all's local copies to price (:data:`HEAD_COPIES`,
    ``plan.head_stage.copy_passes``): ours, or TransformerEngine's for its ``te-*``
    contenders.

    Compute: a tile of ``F`` FLOPs takes ``F / (tflops * 1e12)`` seconds (backward tiles have
    ``bwd_factor`` times the forward FLOPs). ``cores`` switches on a *shared* compute pool: all
    ranks' compute then shares ``cores`` workers (each op using at most one), as on a CPU
    testbed where ``n`` rank processes run on a few cores; ``None`` gives each rank its own
    device. Overheads: ``op_overhead_us`` per compute op (kernel launch, Python dispatch),
    ``merge_gbps`` for accumulating partials (bytes of partial per second; ``None``: free),
    ``msg_cpu_us`` of compute per message posted (the poster's time, e.g. Python and gloo
    set-up), and ``cpu_ns_per_byte`` of pool time per byte moved (a CPU testbed's network stack
    and copies; needs ``cores``; a transfer is then one thread, so it runs at most at
    ``1 / cpu_ns_per_byte`` GB/s).

    Second-order effects (:mod:`charm_megatron.model.effects`; all off by default, docs/model.md
    gives each one's source):

    * kernel rate against tile size: a tile of ``sq`` q rows and ``sk`` kv rows runs at
      ``tflops / (1 + kernel_q_rows / sq + kernel_k_rows / sk)`` (a fixed cost per q row block
      and per kv row block; ``tflops`` is then the long-tile rate);
    * kernel rate against head dim: ``head_dim_factors`` pairs ``(d, factor)``, interpolated
      linearly in ``d`` (clamped at the ends); empty: no effect;
    * ``comm_slowdown``: while messages of a rank move, that rank's compute runs
      ``1 + comm_slowdown * k`` times slower, ``k`` the number of its streams (communicators)
      with a message moving (each communicator's kernel holds SMs and memory bandwidth);
      ``comm_slowdown_streams`` caps ``k`` (``None``: no cap; ``1``: the flat slowdown of one
      communicator whatever is in flight, the model before issue 41);
      ``comm_slowdown_links="cross"`` counts only streams with a cross-group message moving
      (:data:`SLOWDOWN_LINKS`);
    * ``concurrency_penalty``: a link carrying ``k > 1`` messages at once delivers
      ``1 / (1 + concurrency_penalty * (k - 1))`` of its capacity in total;
    * ``cross_burst_kb`` / ``intra_burst_kb``: a token bucket per link (``tc tbf`` on the
      emulated testbed): the first that many KiB a link carries in a call pass without
      waiting for its rate (they still cost CPU, ``cpu_ns_per_byte``). Intra buckets sit on
      the ports, or on the bus when ``intra_bus_gbps`` is set.
    """

    intra_gbps: float
    cross_gbps: float
    tflops: float
    nic: str = "rank"
    latency_us: float = 0.0
    bwd_factor: float = 2.5
    merge_gbps: float | None = None
    op_overhead_us: float = 0.0
    cores: int | None = None
    msg_cpu_us: float = 0.0
    cpu_ns_per_byte: float = 0.0
    cross_via_intra: bool = False
    intra_bus_gbps: float | None = None
    intra_port_gbps: float | None = None
    kernel_q_rows: float = 0.0
    kernel_k_rows: float = 0.0
    head_dim_factors: tuple[tuple[float, float], ...] = ()
    comm_slowdown: float = 0.0
    comm_slowdown_streams: int | None = None
    comm_slowdown_links: str = "all"
    concurrency_penalty: float = 0.0
    cross_burst_kb: float = 0.0
    intra_burst_kb: float = 0.0
    link_order: str = "fair"
    head_copies: str = "charm"

    def __post_init__(self) -> None:
        if self.nic not in NICS:
            raise ValueError(f"nic must be one of {NICS}, got {self.nic!r}")
        if self.comm_slowdown_links not in SLOWDOWN_LINKS:
            raise ValueError(f"comm_slowdown_links must be one of {SLOWDOWN_LINKS}, "
                             f"got {self.comm_slowdown_links!r}")
        if self.head_copies not in HEAD_COPIES:
            raise ValueError(f"head_copies must be one of {HEAD_COPIES}, got {self.head_copies!r}")
        if self.link_order not in LINK_ORDERS:
            raise ValueError(f"link_order must be one of {LINK_ORDERS}, got {self.link_order!r}")
        if self.link_order == "fifo" and self.cores is not None:
            raise ValueError("link_order='fifo' describes GPU links; a shared core pool "
                             "(cores) is shared fairly: use link_order='fair'")
        for name in ("intra_gbps", "cross_gbps", "tflops", "bwd_factor"):
            if not getattr(self, name) > 0:
                raise ValueError(f"{name} must be > 0, got {getattr(self, name)!r}")
        for name in ("latency_us", "op_overhead_us", "msg_cpu_us", "cpu_ns_per_byte",
                     "kernel_q_rows", "kernel_k_rows", "comm_slowdown", "concurrency_penalty",
                     "cross_burst_kb", "intra_burst_kb"):
            if getattr(self, name) < 0:
                raise ValueError(f"{name} must be >= 0, got {getattr(self, name)!r}")
        for name in ("merge_gbps", "intra_bus_gbps", "intra_port_gbps"):
            v = getattr(self, name)
            if v is not None and not v > 0:
                raise ValueError(f"{name} must be > 0 or None, got {v!r}")
        k = self.comm_slowdown_streams
        if k is not None and (isinstance(k, bool) or not isinstance(k, int) or k < 1):
            raise ValueError(f"comm_slowdown_streams must be a whole number >= 1 or None, "
                             f"got {k!r}")
        if self.cores is not None and self.cores < 1:
            raise ValueError(f"cores must be >= 1 or None, got {self.cores!r}")
        if self.cpu_ns_per_byte and self.cores is None:
            raise ValueError("cpu_ns_per_byte needs a shared compute pool: set cores")
        factors = tuple((float(d), float(f)) for d, f in self.head_dim_factors)
        if any(f <= 0 or d <= 0 for d, f in factors) or list(factors) != sorted(factors):
            raise ValueError("head_dim_factors must be (head_dim, factor > 0) pairs sorted by "
                             f"head_dim, got {self.head_dim_factors!r}")
        object.__setattr__(self, "head_dim_factors", factors)  # lists from JSON -> tuples

    def with_(self, **changes: object) -> Cluster:
        """A copy with some fields changed (``None`` values are ignored, for CLI overrides)."""
        return replace(self, **{k: v for k, v in changes.items() if v is not None})

    def describe(self) -> str:
        """One line for printouts."""
        per = "per rank" if self.nic == "rank" else "per group"
        parts = [f"intra {self.intra_gbps:g} GB/s", f"cross {self.cross_gbps:g} GB/s {per}",
                 f"attention {self.tflops:g} TFLOP/s" + (" per core" if self.cores else "/rank")]
        if self.latency_us:
            parts.append(f"latency {self.latency_us:g} us")
        if self.cores:
            parts.append(f"{self.cores} shared cores")
        if self.cross_via_intra:
            parts.append("cross via intra port")
        if self.intra_port_gbps:
            parts.append(f"intra port {self.intra_port_gbps:g} GB/s")
        if self.intra_bus_gbps:
            parts.append(f"intra bus {self.intra_bus_gbps:g} GB/s")
        if self.merge_gbps:
            parts.append(f"merge {self.merge_gbps:g} GB/s")
        for name, unit in (("op_overhead_us", "us/op"), ("msg_cpu_us", "us/msg CPU"),
                           ("cpu_ns_per_byte", "ns/B CPU")):
            if getattr(self, name):
                parts.append(f"{getattr(self, name):g} {unit}")
        if self.bwd_factor != 2.5:
            parts.append(f"bwd x{self.bwd_factor:g}")
        if self.kernel_q_rows or self.kernel_k_rows:
            parts.append(f"tile rows q {self.kernel_q_rows:g} kv {self.kernel_k_rows:g}")
        if self.head_dim_factors:
            parts.append("head dim " + "/".join(f"{d:g}:{f:g}" for d, f in self.head_dim_factors))
        if self.comm_slowdown:
            k = self.comm_slowdown_streams
            per = ("" if k == 1 else " per stream" if k is None
                   else f" per stream (at most {k})")
            under = "cross comm" if self.comm_slowdown_links == "cross" else "comm"
            parts.append(f"compute +{self.comm_slowdown:.0%}{per} under {under}")
        if self.concurrency_penalty:
            parts.append(f"concurrency penalty {self.concurrency_penalty:g}")
        if self.cross_burst_kb or self.intra_burst_kb:
            parts.append(f"burst cross {self.cross_burst_kb:g} / intra {self.intra_burst_kb:g} KiB")
        if self.link_order != "fair":
            parts.append("links in start order (fifo)")
        if self.head_copies != "charm":
            parts.append(f"{self.head_copies} all-to-all copies")
        return ", ".join(parts)


CLUSTER_FIELDS = tuple(f.name for f in fields(Cluster))


@dataclass(frozen=True)
class Profile:
    """A named cluster with its default topology and where the numbers come from.

    ``fit`` is what a calibration recorded (data it was fitted on, residuals; JSON-able);
    ``origin`` the file it was read from (``None``: built in). ``kernel`` names the attention
    kernel whose curve ``cluster`` prices tiles with (``""``: unnamed), ``kernels`` the other
    kernels' curves on this device
    (:class:`~charm_megatron.model.kernel_rates.KernelRates`; what TransformerEngine's
    contenders run, for one).
    """

    name: str
    cluster: Cluster
    topology: str
    source: str
    fit: dict = field(default_factory=dict, compare=False, hash=False)
    origin: str | None = field(default=None, compare=False, hash=False)
    kernel: str = ""
    kernels: tuple = field(default=(), compare=False, hash=False)


# The generic guess: a modern GPU node (NVLink-class intra links, one ~200 Gb/s NIC per GPU).
# Only the *ratios* compute : intra : cross matter for choosing an algorithm; 8x between intra
# and cross is the paper's observation that cross-hardware links are several times slower.
_GENERIC_INTRA_GBPS = 200.0
_GENERIC_TFLOPS = 300.0
_GENERIC_CROSS_RATIO = 8.0


def default_cluster_for(groups: Sequence[Sequence[int]]) -> Cluster:
    """A generic cluster for a topology when the user describes none (used by ``auto``).

    Assumption (docs/model.md): each rank computes attention at 300 TFLOP/s and has a 200 GB/s
    intra-group port; with more than one group the cross-group links are 8x slower (25 GB/s,
    one NIC per rank); a single group (flat) has all links equal. 10 us per message.
    """
    num_groups = len(groups)
    cross = _GENERIC_INTRA_GBPS / _GENERIC_CROSS_RATIO if num_groups > 1 else _GENERIC_INTRA_GBPS
    return Cluster(intra_gbps=_GENERIC_INTRA_GBPS, cross_gbps=cross, tflops=_GENERIC_TFLOPS,
                   nic="rank", latency_us=10.0)
