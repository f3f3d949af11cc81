"""Topology layer: which CP ranks share fast links (docs/topology.md).

* :class:`Topology` - ``G`` groups of ``M`` CP-local ranks; parse / print ``2x4``, ``0-3,4-7``,
  ``0,2,4,6/1,3,5,7``, ``flat``.
* :func:`probe` (``probe(group, level).topology``) - a collective that gathers host and NUMA facts per rank and
  groups them (:func:`group_facts` is the pure decision).
* :func:`resolve_topology` - argument, then ``CHARM_TOPOLOGY``, then the probe.

Importing this package does not import torch; only the probe does.
"""

from charm_megatron.topology.core import Topology, format_ranks
from charm_megatron.topology.probing import (
    LEVELS,
    ProbeResult,
    RankFacts,
    TopologyWarning,
    clear_probe_cache,
    group_facts,
    local_facts,
    probe,
)
from charm_megatron.topology.resolve import ENV_VAR, resolve_topology

__all__ = [
    "ENV_VAR",
    "LEVELS",
    "ProbeResult",
    "RankFacts",
    "Topology",
    "TopologyWarning",
    "clear_probe_cache",
    "format_ranks",
    "group_facts",
    "local_facts",
    "probe",
    "resolve_topology",
]
