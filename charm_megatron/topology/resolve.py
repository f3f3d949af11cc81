"""Which topology a CP attention call uses, from a value: a :class:`Topology`, a topology
string, or a probe level. Where the value comes from (the call's argument, ``CHARM_TOPOLOGY``
through the options, the probe by default) is decided at the API edge
(:meth:`charm_megatron.CPOptions.topology_for`); this module reads no environment variable
and knows no algorithm."""

from __future__ import annotations

from typing import Any

from charm_megatron.topology.core import Topology
from charm_megatron.topology.probing import LEVELS, probe

__all__ = ["ENV_VAR", "resolve_topology"]

#: The variable the API edges read a default topology from (CPOptions.from_env, the topo CLI).
ENV_VAR = "CHARM_TOPOLOGY"


def resolve_topology(spec: Topology | str, group: Any, cp_size: int, *,
                     source: str | None = None) -> Topology:
    """The topology ``spec`` names for the CP process group ``group`` of ``cp_size`` ranks.

    ``spec``: a :class:`Topology`, a string (``GxM``, ``flat``, explicit groups) or a probe level
    (``auto``, ``node``, ``numa``: the probe's one cached all-gather over ``group``, the only
    communication here). ``source`` names where ``spec`` came from in errors (default
    ``topology=...``). Raises :class:`ValueError` when the result does not have ``cp_size``
    ranks, or ``spec`` cannot be read.
    """
    if isinstance(cp_size, bool) or not isinstance(cp_size, int) or cp_size < 1:
        raise ValueError(f"cp_size must be a positive integer, got {cp_size!r}")
    source = source or f"topology={str(spec)!r}"
    if isinstance(spec, Topology):
        topo = spec
    elif not isinstance(spec, str):
        raise ValueError(f"topology must be a Topology or a string, got {type(spec).__name__}")
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
