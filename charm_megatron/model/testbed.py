"""The emulated CPU testbed's link layout, so one profile predicts both of its NIC models.

``charm_megatron.emulate.cluster`` shapes links with ``tc tbf`` differently per NIC model:

* ``nic="node"``: one cross link per node namespace (``eth0`` out, the bridge port in), and
  *all* intra-node traffic of a node on its ``lo`` - one shared intra capacity per node (the
  model's ``intra_bus_gbps``), the per-rank paths unshaped;
* ``nic="rank"``: a cross link per rank namespace, and an intra veth per rank whose two ends
  are shaped (the model's intra ports at ``intra_gbps``).

A profile stores the shaped intra rate once (in ``intra_bus_gbps`` for a node-layout
profile, else ``intra_gbps``); :func:`emulated_cluster` moves it to where the other layout
puts it.
"""

from __future__ import annotations

from dataclasses import replace

from charm_megatron.model.cluster import Cluster

# Loopback inside a namespace is not shaped: a message is limited by its CPU cost only.
UNSHAPED_GBPS = 100.0


def shaped_intra_gbps(cl: Cluster) -> float:
    """The emulator's intra rate a profile describes."""
    return cl.intra_bus_gbps if cl.intra_bus_gbps is not None else cl.intra_gbps


def emulated_cluster(cl: Cluster, nic: str) -> Cluster:
    """``cl`` with the emulator's layout for ``nic`` (``node`` or ``rank``)."""
    rate = shaped_intra_gbps(cl)
    if nic == "node":
        return replace(cl, nic="node", intra_gbps=UNSHAPED_GBPS, intra_bus_gbps=rate,
                       intra_port_gbps=None)
    return replace(cl, nic="rank", intra_gbps=rate, intra_bus_gbps=None, intra_port_gbps=None)
