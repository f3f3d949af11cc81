"""Which topology a CP attention call uses: argument, then ``CHARM_TOPOLOGY``, then the probe."""

from __future__ import annotations

import os
from typing import Any

from charm_megatron.plan.registry import uses_topology
from charm_megatron.topology.core import Topology
from charm_megatron.topology.probing import LEVELS, probe

__all__ = ["ENV_VAR", "resolve_topology"]

ENV_VAR = "CHARM_TOPOLOGY"


def resolve_topology(
    topology: Topology | str | None, group: Any, algo: str, cp_size: int
) -> Topology:
    """The topology for one CP attention call on the CP process group ``group``.

    Precedence: an explicit ``topology`` (a :class:`Topology` or a string: ``GxM``, ``flat``,
    explicit groups, or a probe level ``auto|node|numa``) beats ``CHARM_TOPOLOGY`` (same syntax),
    which beats the probe at level ``auto``. With ``topology=None``, an ``algo`` registered as not
    using the topology (ring, rmplus) gets flat (the env var is for CHARM+); any other algo uses
    the env var or the probe.

    The only communication is the probe's one cached all-gather, so every rank reaches the same
    result provided all ranks pass the same ``topology`` and see the same ``CHARM_TOPOLOGY``.
    Raises :class:`ValueError` when the result does not have ``cp_size`` ranks.
    """
    if isinstance(cp_size, bool) or not isinstance(cp_size, int) or cp_size < 1:
        raise ValueError(f"cp_size must be a positive integer, got {cp_size!r}")
    if topology is None:
        if not uses_topology(algo):
            return Topology.flat(cp_size)
        env = os.environ.get(ENV_VAR, "").strip()
        source = f"{ENV_VAR}={env!r}"
        spec: Topology | str = env or "auto"
        if not env:
            source = "the probe (CHARM_TOPOLOGY unset)"
    else:
        spec, source = topology, f"topology={str(topology)!r}"
    if isinstance(spec, Topology):
        topo = spec
    elif not isinstance(spec, str):
        raise ValueError(f"topology must be a Topology, a string or None, got {type(spec).__name__}")
    elif spec.strip().lower() in LEVELS and spec.strip().lower() != "flat":
        topo = _probe(group, spec.strip().lower(), cp_size)
    else:
        try:
            topo = Topology.parse(spec, cp_size=cp_size)
        except ValueError as exc:
            raise ValueError(f"{source}: {exc}") from None
    try:
        topo.check_size(cp_size)
    except ValueError as exc:
        raise ValueError(f"{source}: {exc}") from None
    return topo


def _probe(group: Any, level: str, cp_size: int) -> Topology:
    import torch.distributed as dist

    if not (dist.is_available() and dist.is_initialized()):
        if cp_size == 1 and group is None:
            return Topology.flat(1)
        raise ValueError(
            f"probing the topology of a CP group of {cp_size} ranks needs an initialised "
            f"torch.distributed; initialise it first or give the topology ({ENV_VAR}=2x4, ...)"
        )
    size = dist.get_world_size(group)
    if size != cp_size:
        raise ValueError(
            f"cp_size is {cp_size} but the CP process group has {size} ranks; pass the CP group "
            "(e.g. parallel_state.get_context_parallel_group()) and its size"
        )
    return probe(group, level).topology
