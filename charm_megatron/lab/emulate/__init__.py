"""Emulate a multi-node cluster on one machine for gloo ranks (docs/topology.md, "Emulation").

* :class:`EmulatedCluster` - network namespaces ("nodes") joined through a bridge by rate-limited
  veth links (``tbf`` per link, or ``htb`` classes on one veth per rank); per-node or per-rank
  NICs; a host name per node. Needs root and
  iproute2: :func:`available` says whether it works here.
* :func:`run_ranks_in_cluster` - run a function on every rank inside the cluster (gloo).
* :class:`LinkModel` / :class:`SoftwareLinks` - the fallback without namespaces: a send and
  its receive complete no earlier than the message could arrive over the sender's egress and
  the receiver's ingress, from the later of the two posts (the performance model's rule); a
  rank's links are the executor's transport :class:`LinkTransport` (ops/transport.py). On
  the ranks' virtual clocks they serve messages in virtual start order (``link_order``: a
  message waits until every rank's floor, ``floors``, has passed its start).

Importing this package does not import torch.
"""

from charm_megatron.lab.emulate.cluster import (
    LINK_MODELS,
    NIC_MODELS,
    EmulatedCluster,
    RankPlace,
    RateReport,
    enter,
)
from charm_megatron.lab.emulate.cluster_ranks import run_ranks_in_cluster
from charm_megatron.lab.emulate.link_transport import LinkTransport
from charm_megatron.lab.emulate.linkmodel import (
    LinkModel,
    RankLinks,
    SoftwareLinks,
    ThrottledWork,
)
from charm_megatron.lab.emulate.netns import available, cleanup_stale, list_netns
from charm_megatron.lab.emulate.rates import format_rate, parse_rate, parse_size

__all__ = [
    "LINK_MODELS",
    "NIC_MODELS",
    "EmulatedCluster",
    "LinkModel",
    "LinkTransport",
    "RankLinks",
    "RankPlace",
    "RateReport",
    "SoftwareLinks",
    "ThrottledWork",
    "available",
    "cleanup_stale",
    "enter",
    "format_rate",
    "list_netns",
    "parse_rate",
    "parse_size",
    "run_ranks_in_cluster",
]
