"""The emulated CPU testbed's link layout, so one profile predicts both of its NIC models.

``charm_megatron.lab.emulate.cluster`` shapes links with ``tc tbf`` differently per NIC model:

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


def bench_cluster(base: Cluster, *, nic: str, cross_Bps: float, intra_Bps: float | None,
                  cross_burst: int = 0, intra_burst: int = 0, cores: int | None = None,
                  emulated: bool = True) -> Cluster:
    """``base``'s fitted costs (kernel rate, per-message and per-byte CPU, latency) on the
    links of one ``charm-megatron bench`` run: its NIC model, its link rates (bytes/s, as the
    bench measured them, else as configured; ``intra_Bps=None``: unshaped), its ``tbf``
    buckets (bytes) and the cores its ranks share. ``emulated``: the netns testbed's layout
    (:func:`emulated_cluster`); otherwise (the software link model) plain per-rank ports.

    This is what the bench's ``auto`` contender predicts with (lab/bench/autoprofile.py): a
    profile alone describes the links it was calibrated on, not the rates and NIC model a
    bench run sets.
    """
    intra = intra_Bps / 1e9 if intra_Bps else UNSHAPED_GBPS
    cl = replace(base, cross_gbps=cross_Bps / 1e9, intra_gbps=intra, intra_bus_gbps=None,
                 intra_port_gbps=None, cross_burst_kb=cross_burst / 1024,
                 intra_burst_kb=intra_burst / 1024 if intra_Bps else 0.0,
                 cores=cores if cores else base.cores)
    return emulated_cluster(cl, nic) if emulated else replace(cl, nic=nic)
