"""Probe the CP topology: gather per-rank hardware facts, group ranks by host or NUMA domain.

Two halves, so the grouping is testable without processes:

* :func:`local_facts` reads this process's facts (host name, NUMA node of its device or of its
  CPU affinity, launcher hints) and :func:`probe` all-gathers them over the CP group;
* :func:`group_facts` is the pure decision: facts in, :class:`ProbeResult` (topology, level,
  reason, warning) out. Every rank runs it on the same gathered list, so every rank reaches the
  same answer without further communication.
"""

from __future__ import annotations

import math
import os
import socket
import warnings
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any, Literal

from charm_megatron.topology.core import Topology, format_ranks

__all__ = [
    "LEVELS",
    "ProbeLevel",
    "ProbeResult",
    "RankFacts",
    "TopologyWarning",
    "clear_probe_cache",
    "cpu_numa_node",
    "group_facts",
    "local_facts",
    "probe",
]

ProbeLevel = Literal["auto", "node", "numa", "flat"]
LEVELS: tuple[str, ...] = ("auto", "node", "numa", "flat")
LAUNCHER_VARS: tuple[str, ...] = (
    "SLURM_NODEID", "SLURM_LOCALID", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "GROUP_RANK",
)
_OVERRIDE = (
    "to override, set CHARM_TOPOLOGY (e.g. CHARM_TOPOLOGY=flat or an explicit '0-3/4-7'), "
    "pass topology=... to cp_attention, or --charm-topology to the Megatron launcher"
)


class TopologyWarning(UserWarning):
    """The probe could not follow the hardware exactly and chose a safe fallback."""


@dataclass(frozen=True)
class RankFacts:
    """What one CP rank knows about where it runs.

    ``rank`` is the CP-local rank, ``global_rank`` the rank in the default group. ``numa`` is the
    NUMA node of the rank's device (CUDA) or CPU affinity (CPU ranks); -1 when unknown.
    ``launcher`` holds the launcher's hints that were set (SLURM_NODEID, LOCAL_RANK, ...).
    """

    rank: int
    host: str
    numa: int = -1
    device: str = "cpu"
    global_rank: int = -1
    launcher: tuple[tuple[str, str], ...] = ()

    @property
    def node_key(self) -> tuple[str, str | None]:
        """Identity of the rank's node: the host name plus the launcher's node id if any.

        The node id (SLURM_NODEID, else torchrun's GROUP_RANK) separates nodes whose containers
        all report the same host name; it is the same for all ranks of one node.
        """
        hints = dict(self.launcher)
        return (self.host, hints.get("SLURM_NODEID", hints.get("GROUP_RANK")))

    @property
    def node_label(self) -> str:
        host, node_id = self.node_key
        return host if node_id is None else f"{host}[node {node_id}]"


@dataclass(frozen=True)
class ProbeResult:
    """The probe's decision: ``topology`` at ``level`` (never ``auto``), ``reason`` in words,
    ``warning`` when it had to fall back (already emitted as a :class:`TopologyWarning`)."""

    topology: Topology
    level: str
    requested: str
    reason: str
    warning: str | None = None
    facts: tuple[RankFacts, ...] = field(default=(), compare=False)


# --------------------------------------------------------------------------- pure grouping
def group_facts(facts: Sequence[RankFacts], level: str = "auto") -> ProbeResult:
    """Group CP ranks by hardware domain; pure function of the gathered facts.

    ``level``: ``node`` groups by node, ``numa`` by (node, NUMA node), ``flat`` one group,
    ``auto`` = ``node`` if the ranks span several nodes, else ``numa`` if several NUMA nodes,
    else ``flat``. When the domains hold different numbers of ranks, the largest equal split
    that stays inside domains is used (group size = gcd of the domain sizes, if >= 2), else flat;
    the result carries a warning saying so.
    """
    if level not in LEVELS:
        raise ValueError(f"unknown topology probe level {level!r}; choose one of {', '.join(LEVELS)}")
    facts = sorted(facts, key=lambda f: f.rank)
    n = len(facts)
    if [f.rank for f in facts] != list(range(n)) or n == 0:
        raise ValueError(f"facts must cover CP-local ranks 0..n-1 once each, got {[f.rank for f in facts]}")
    nodes = _domains(facts, lambda f: f.node_key)
    numas = _domains(facts, lambda f: (f.node_key, f.numa))
    # A rank whose NUMA node is unknown (-1) cannot be placed in a NUMA domain: grouping it
    # apart from known ones would invent a boundary, so NUMA grouping needs every node known.
    unknown = [f.rank for f in facts if f.numa < 0]
    note: str | None = None
    chosen = level
    if level == "numa" and unknown:
        chosen = "node"
        note = (
            f"CP topology: NUMA node unknown for ranks {format_ranks(unknown)}; grouping by node "
            f"instead of NUMA domain; {_OVERRIDE}"
        )
    if level == "auto":
        if len(nodes) > 1:
            chosen, why = "node", f"auto: the CP group spans {len(nodes)} nodes ({_describe(nodes, facts)})"
        elif len(numas) > 1 and not unknown:
            chosen, why = "numa", (
                f"auto: one node, {len(numas)} NUMA domains ({_describe(numas, facts, numa=True)})"
            )
        else:
            chosen = "flat"
            where = "one node" if n > 1 else "one rank"
            why = f"auto: {where} ({facts[0].node_label}), " + (
                f"NUMA node unknown for ranks {format_ranks(unknown)}" if unknown
                else f"one NUMA node ({facts[0].numa})"
            )
    elif level == "flat":
        why = "level flat requested"
    else:
        doms = nodes if chosen == "node" else numas
        why = (
            f"level {level} requested: {len(doms)} {chosen} domain(s) "
            f"({_describe(doms, facts, numa=chosen == 'numa')})"
        )
    if chosen == "flat":
        return ProbeResult(Topology.flat(n), "flat", level, why, note, tuple(facts))
    doms = nodes if chosen == "node" else numas
    sizes = [len(d) for d in doms]
    if len(set(sizes)) == 1:
        return ProbeResult(Topology.from_groups(doms), chosen, level, why, note, tuple(facts))
    # Unequal domains: CHARM+ needs equal groups. Splitting every domain into chunks of
    # gcd(sizes) keeps each group inside one domain (so no slow link is mistaken for a fast one);
    # a group size of 1 would call every link slow, which is no better than flat.
    m = math.gcd(*sizes)
    desc = _describe(doms, facts, numa=chosen == "numa")
    if m >= 2:
        groups = [d[i:i + m] for d in doms for i in range(0, len(d), m)]
        topo = Topology.from_groups(groups)
        msg = (
            f"CP topology: {chosen} domains hold different numbers of ranks ({desc}); using "
            f"{len(groups)} groups of {m} ({topo}), each inside one domain; {_OVERRIDE}"
        )
        return ProbeResult(topo, chosen, level, why + f"; unequal domains split into groups of {m}",
                           _join(note, msg), tuple(facts))
    msg = (
        f"CP topology: {chosen} domains hold different numbers of ranks ({desc}) and no equal "
        f"split inside the domains exists; using flat (one group of {n}); {_OVERRIDE}"
    )
    return ProbeResult(Topology.flat(n), "flat", level, why + "; unequal domains -> flat",
                       _join(note, msg), tuple(facts))


def _join(a: str | None, b: str) -> str:
    return b if a is None else f"{a}\n{b}"


def _domains(facts: Sequence[RankFacts], key: Any) -> list[list[int]]:
    """Ranks per distinct key, domains ordered by their lowest rank, ranks sorted."""
    out: dict[Any, list[int]] = {}
    for f in facts:
        out.setdefault(key(f), []).append(f.rank)
    return sorted(out.values(), key=lambda d: d[0])


def _describe(doms: list[list[int]], facts: Sequence[RankFacts], numa: bool = False) -> str:
    parts = []
    for d in doms:
        f = facts[d[0]]
        label = f.node_label + (f" numa {f.numa}" if numa else "")
        parts.append(f"{label}: ranks {format_ranks(d)}")
    return "; ".join(parts)


# --------------------------------------------------------------------------- local facts
def _parse_cpulist(text: str) -> set[int]:
    cpus: set[int] = set()
    for part in text.strip().split(","):
        if not part:
            continue
        a, _, b = part.partition("-")
        cpus.update(range(int(a), int(b or a) + 1))
    return cpus


def cpu_numa_node(affinity: set[int] | None = None, sysfs: str = "/sys/devices/system/node") -> int:
    """The NUMA node whose CPUs contain this process's whole CPU affinity, else -1.

    A process allowed on CPUs of several NUMA nodes (not pinned) has no single node: -1.
    """
    try:
        cpus = set(os.sched_getaffinity(0)) if affinity is None else set(affinity)
        entries = sorted(e for e in os.listdir(sysfs) if e.startswith("node") and e[4:].isdigit())
    except OSError:
        return -1
    for entry in entries:
        try:
            with open(os.path.join(sysfs, entry, "cpulist")) as fh:
                node_cpus = _parse_cpulist(fh.read())
        except (OSError, ValueError):
            continue
        if cpus and cpus <= node_cpus:
            return int(entry[4:])
    return -1


def _cuda_facts() -> tuple[str, int]:
    """(device description, NUMA node) of the current CUDA device."""
    import torch

    dev = torch.cuda.current_device()
    props = torch.cuda.get_device_properties(dev)
    bus = getattr(props, "pci_bus_id", None)
    if bus is None:
        return f"cuda:{dev}", -1
    pci = f"{getattr(props, 'pci_domain_id', 0):04x}:{bus:02x}:{getattr(props, 'pci_device_id', 0):02x}.0"
    numa = -1
    try:
        with open(f"/sys/bus/pci/devices/{pci}/numa_node") as fh:
            numa = int(fh.read().strip())
    except (OSError, ValueError):
        pass
    # The kernel reports -1 when the platform gives no affinity (single-socket machines, VMs).
    return f"cuda:{dev} ({pci})", max(numa, -1)


def local_facts(rank: int, global_rank: int = -1, use_cuda: bool = False) -> RankFacts:
    """This process's facts. ``use_cuda``: the rank's device is the current CUDA device."""
    if use_cuda:
        device, numa = _cuda_facts()
    else:
        device, numa = "cpu", cpu_numa_node()
    launcher = tuple((k, os.environ[k]) for k in LAUNCHER_VARS if os.environ.get(k))
    return RankFacts(rank=rank, host=socket.gethostname(), numa=numa, device=device,
                     global_rank=global_rank, launcher=launcher)


# --------------------------------------------------------------------------- collective
_CACHE: dict[tuple, ProbeResult] = {}


def clear_probe_cache() -> None:
    """Forget cached probe results (call it on every rank, or on none)."""
    _CACHE.clear()


def probe(group: Any = None, level: str = "auto", *, warn: bool = True) -> ProbeResult:
    """Probe the topology of the CP process group ``group`` (``None``: the default group).

    A collective: every rank of ``group`` must call it, with the same ``level``; every rank gets
    the same :class:`ProbeResult`. Results are cached per (group members, level), so later calls
    do not communicate. Without an initialised process group it describes this process alone.
    """
    if level not in LEVELS:
        raise ValueError(f"unknown topology probe level {level!r}; choose one of {', '.join(LEVELS)}")
    import torch.distributed as dist

    if not (dist.is_available() and dist.is_initialized()):
        if group is not None:
            raise ValueError("probe(group=...) needs an initialised torch.distributed")
        key: tuple = ("no-dist", level)
        if key not in _CACHE:
            _CACHE[key] = group_facts([local_facts(0, 0)], level)
        return _CACHE[key]
    members = tuple(dist.get_process_group_ranks(group if group is not None else dist.group.WORLD))
    key = (members, level)
    if key in _CACHE:
        return _CACHE[key]
    backend = str(dist.get_backend(group)).lower()
    use_cuda = "nccl" in backend
    mine = local_facts(dist.get_rank(group), dist.get_rank(), use_cuda=use_cuda)
    gathered: list[Any] = [None] * dist.get_world_size(group)
    dist.all_gather_object(gathered, mine, group=group)
    result = group_facts(gathered, level)
    if warn and result.warning:
        warnings.warn(result.warning, TopologyWarning, stacklevel=2)
    _CACHE[key] = result
    return result
