"""Cluster descriptions for the performance model: links, NICs, compute, overheads.

A :class:`Cluster` says how fast things are; *which* ranks share fast links is the topology
(groups of CP ranks), passed separately, so one description serves ``2x8`` and ``4x8`` alike.
Named :data:`PROFILES` carry the bandwidths of the CHARM+ paper's Table 2 and a default
topology; :func:`default_cluster_for` is the generic guess used when the user describes nothing.

Units: GB/s means 1e9 bytes per second, per direction (links are full duplex); TFLOP/s is the
*sustained* attention rate of one rank (one GPU, or one CPU core), not the datasheet peak.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, fields, replace

NICS = ("rank", "node")


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
    ends). Each message first waits ``latency_us`` without using bandwidth.

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

    def __post_init__(self) -> None:
        if self.nic not in NICS:
            raise ValueError(f"nic must be one of {NICS}, got {self.nic!r}")
        for name in ("intra_gbps", "cross_gbps", "tflops", "bwd_factor"):
            if not getattr(self, name) > 0:
                raise ValueError(f"{name} must be > 0, got {getattr(self, name)!r}")
        for name in ("latency_us", "op_overhead_us", "msg_cpu_us", "cpu_ns_per_byte"):
            if getattr(self, name) < 0:
                raise ValueError(f"{name} must be >= 0, got {getattr(self, name)!r}")
        for name in ("merge_gbps", "intra_bus_gbps", "intra_port_gbps"):
            v = getattr(self, name)
            if v is not None and not v > 0:
                raise ValueError(f"{name} must be > 0 or None, got {v!r}")
        if self.cores is not None and self.cores < 1:
            raise ValueError(f"cores must be >= 1 or None, got {self.cores!r}")
        if self.cpu_ns_per_byte and self.cores is None:
            raise ValueError("cpu_ns_per_byte needs a shared compute pool: set cores")

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
        return ", ".join(parts)


CLUSTER_FIELDS = tuple(f.name for f in fields(Cluster))


@dataclass(frozen=True)
class Profile:
    """A named cluster with its default topology and where the numbers come from."""

    name: str
    cluster: Cluster
    topology: str
    source: str


# Bandwidths: the CHARM+ paper's Table 2 (NCCL / RDMA unidirectional P2P tests). Attention
# rates are assumptions (docs/model.md): a fraction of the bf16 dense peak that FlashAttention-2
# class kernels sustain on long blocks; override with --tflops. Merge rates: ~1/4 of HBM
# bandwidth (a merge reads the fp32 accumulator and the partial and writes the accumulator).
PROFILES: dict[str, Profile] = {
    "l20-pcie": Profile(
        "l20-pcie",
        Cluster(intra_gbps=24.0, cross_gbps=14.7, tflops=60.0, nic="node", latency_us=10.0,
                cross_via_intra=True, merge_gbps=200.0, op_overhead_us=10.0),
        "2x4",
        "8x L20 in one dual-NUMA PCIe node (paper Table 2: 24.0 GB/s intra-NUMA, 14.7 GB/s "
        "cross-NUMA); cross traffic shares the inter-socket path (nic=node) and each GPU's x16 "
        "link; L20 119.5 TFLOP/s bf16 peak, assumed 50% sustained in attention",
    ),
    "h20": Profile(
        "h20",
        Cluster(intra_gbps=297.2, cross_gbps=42.6, tflops=90.0, nic="rank", latency_us=10.0,
                merge_gbps=1000.0, op_overhead_us=10.0, intra_port_gbps=450.0),
        "2x8",
        "2 nodes x 8 H20, NVLink intra (297.2 GB/s per message, Table 2; 450 GB/s per port, "
        "NVLink4's 900 GB/s bidirectional), one RDMA NIC per GPU (42.6 GB/s), paper Table 2; H20 148 TFLOP/s bf16 peak, assumed 60% sustained in attention (H20 is "
        "compute-poor and memory-rich, so attention runs close to its peak)",
    ),
    "h100": Profile(
        "h100",
        Cluster(intra_gbps=365.1, cross_gbps=42.5, tflops=350.0, nic="rank", latency_us=10.0,
                merge_gbps=800.0, op_overhead_us=10.0, intra_port_gbps=450.0),
        "2x8",
        "H100 SXM nodes of 8, NVLink intra (365.1 GB/s per message, 450 GB/s per port), one "
        "RDMA NIC per GPU (42.5 GB/s), paper Table 2 (2x8 and 4x8 runs: pass --topology 4x8); 989 TFLOP/s bf16 peak, "
        "assumed 350 sustained (FlashAttention-2 level; FlashAttention-3 reaches ~600+)",
    ),
    "cpu-testbed": Profile(
        "cpu-testbed",
        Cluster(intra_gbps=10.0, cross_gbps=0.12, tflops=0.07, nic="node", latency_us=50.0,
                cores=2, cpu_ns_per_byte=0.6, msg_cpu_us=100.0, merge_gbps=2.0,
                op_overhead_us=200.0, bwd_factor=2.5),
        "2x4",
        "UNCALIBRATED sketch of the 2-vCPU emulated cluster of CPU-TESTBED.md: ranks share 2 "
        "cores; 1 Gbit tbf per node namespace (0.12 GB/s, nic=node); loopback copies cost "
        "~0.6 ns/B of CPU (aggregate ~3.2 GB/s on 2 cores); fp32 CPU flash attention "
        "~70 GFLOP/s per core",
    ),
}


def get_profile(name: str) -> Profile:
    """The profile called ``name``; :class:`ValueError` lists the known ones."""
    try:
        return PROFILES[name]
    except KeyError:
        raise ValueError(f"unknown profile {name!r}; choose one of {', '.join(PROFILES)}") from None


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
