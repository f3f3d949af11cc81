"""Where the benchmark's ranks run.

* ``torchrun``: this process is one rank (env:// rendezvous, NCCL on GPUs with
  ``device = LOCAL_RANK``, gloo on CPU); rank 0 gathers everyone's measurements.
* ``local``: ``--ranks N`` gloo processes on this machine (``charm_megatron.local_ranks.run_ranks``);
  all links are loopback.
* ``netns``: an :class:`~charm_megatron.lab.emulate.EmulatedCluster` (network namespaces joined by
  ``tc tbf`` links); always torn down, on every exit path (the cluster's context manager plus
  its atexit and SIGTERM/SIGHUP handlers).
* ``software``: the same cluster shape through the software link model
  (:mod:`charm_megatron.lab.bench.links`), when namespaces are unavailable.
"""

from __future__ import annotations

import datetime
import os
import sys
import tempfile
from typing import Any

from charm_megatron.lab.bench.analysis import RunInfo
from charm_megatron.lab.bench.autoprofile import run_profile
from charm_megatron.lab.bench.links import SoftwareLinkSetup
from charm_megatron.lab.bench.measure import Job, rank_main
from charm_megatron.lab.emulate import (
    EmulatedCluster,
    SoftwareLinks,
    list_netns,
    parse_rate,
    run_ranks_in_cluster,
)
from charm_megatron.local_ranks import run_ranks
from charm_megatron.model.links import Links


def _cores(world: int, threads: int) -> int:
    try:
        cores = len(os.sched_getaffinity(0))
    except AttributeError:
        cores = os.cpu_count() or 1
    return max(1, min(cores, world * threads))


def run_local(job: Job, world: int, *, timeout_s: float, pg_timeout_s: float) -> tuple[list, RunInfo]:
    """``world`` gloo ranks on this machine, plain loopback."""
    results = run_ranks(rank_main, world, job, timeout_s=timeout_s, pg_timeout_s=pg_timeout_s,
                        threads=job.cfg.threads, env=job.env)
    info = RunInfo("local", world, "cpu", _cores(world, job.cfg.threads))
    info.notes.append("all ranks on one machine over loopback: no slow link, so this shows "
                      "overheads, not the cross-node effect (use --emulate GxM)")
    return results, info


def run_netns(job: Job, groups: int, per_group: int, cross: str, intra: str | None, nic: str,
              *, timeout_s: float, pg_timeout_s: float, log=print,
              **cluster_kw) -> tuple[list, RunInfo]:
    """Ranks inside an emulated cluster: real TCP through namespaces and tc shapers
    (``cluster_kw``: link_model, ingress, cross_burst, intra_burst, mtu of
    :class:`EmulatedCluster`)."""
    world = groups * per_group
    with EmulatedCluster(groups, per_group, cross_rate=cross, intra_rate=intra, nic=nic,
                         **cluster_kw) as cl:
        log(cl.describe())
        rep = cl.measure_rates(seconds=0.3, concurrent=True)
        tcp_before = [cl.tcp_counters(r) for r in range(world)]
        log("measured link rates (plain TCP, before the benchmark):")
        log("  " + str(rep).replace("\n", "\n  "))
        with run_profile(job, nic=nic, cross_Bps=rep.cross or rep.configured_cross,
                         intra_Bps=(rep.intra or rep.configured_intra) if rep.configured_intra
                         else None, cross_burst=cl.cross_burst, intra_burst=cl.intra_burst,
                         cores=_cores(world, job.cfg.threads), emulated=True) as auto_note:
            results = run_ranks_in_cluster(cl, rank_main, job, timeout_s=timeout_s,
                                           pg_timeout_s=pg_timeout_s, threads=job.cfg.threads,
                                           env=job.env)
        name = cl.name
        burst = cl.cross_burst
        tcp = _tcp_summary(tcp_before, [cl.tcp_counters(r) for r in range(world)])
        log(f"TCP during the benchmark (all ranks): {tcp['OutSegs']} segments sent, "
            f"{tcp['RetransSegs']} retransmitted, {tcp['TCPTimeouts']} retransmission timeouts, "
            f"{tcp['TCPLossProbes']} loss probes")
    left = [n for n in list_netns() if n.startswith(name + "-")]
    log(f"emulated cluster {name} removed" + (f" (LEFT BEHIND: {left})" if left else ""))
    info = RunInfo("netns", world, "cpu", _cores(world, job.cfg.threads), nic=nic,
                   hw_groups=[list(range(g * per_group, (g + 1) * per_group))
                              for g in range(groups)])
    info.rates = {"cross_one_pair": rep.cross, "intra_one_pair": rep.intra,
                  "cross_concurrent_total": rep.cross_concurrent,
                  "configured_cross": rep.configured_cross, "configured_intra": rep.configured_intra}
    info.cross_burst = burst
    if auto_note:
        info.notes.append(auto_note)
    if rep.cross:
        info.cross_rate, info.cross_rate_source = rep.cross, "measured"
    else:
        info.cross_rate, info.cross_rate_source = rep.configured_cross, "configured"
    info.rates["tcp"] = tcp
    if tcp["TCPTimeouts"]:
        info.notes.append(f"{tcp['TCPTimeouts']} TCP retransmission timeout(s) during the run "
                          "(each stalls a connection for >= 200 ms): see docs/bench.md")
    return results, info


def _tcp_summary(before: list[dict], after: list[dict]) -> dict[str, int]:
    """Sum over ranks of how much each TCP counter grew."""
    keys = ("OutSegs", "RetransSegs", "TCPTimeouts", "TCPLossProbes", "TCPSpuriousRTOs")
    return {k: sum(a.get(k, 0) - b.get(k, 0) for a, b in zip(after, before)) for k in keys}


def run_software(job: Job, groups: int, per_group: int, cross: str, intra: str | None, nic: str,
                 *, timeout_s: float, pg_timeout_s: float, log=print,
                 latency_s: float = 0.0, links: Links | None = None) -> tuple[list, RunInfo]:
    """Ranks over loopback with the software link model throttling this package's P2P
    (``latency_s``: wall seconds added to every message's arrival; a CPU run's real loopback
    has its own). ``links``: the emulated GPU cluster's links on the wire, the model's
    description (``DeviceSetup.wire_links``), which then sets the links' rates, ports and
    latency (``cross`` / ``intra`` / ``nic`` are its per-message rates and sharing, for the
    run's record)."""
    world = groups * per_group
    with tempfile.TemporaryDirectory(prefix="charm-bench-links-") as state:
        # On every rank's virtual clock the links serve in virtual start order (ranks
        # publish their floors, lab/emulate/link_order.py), so the device times do not hang
        # on how this machine scheduled the ranks' processes.
        order = job.cfg.device is not None and job.cfg.device.links_in_start_order
        if links is not None:
            spec = SoftwareLinks.from_links(groups, per_group, links, state_dir=state,
                                            start_order=order)
        else:
            spec = SoftwareLinks(groups, per_group, cross, intra, nic, state_dir=state,
                                 latency_s=latency_s)
        with run_profile(job, nic=nic, cross_Bps=parse_rate(cross),
                         intra_Bps=parse_rate(intra) if intra else None, cross_burst=0,
                         intra_burst=0, cores=_cores(world, job.cfg.threads),
                         emulated=False) as auto_note:
            results = run_ranks(rank_main, world, job, timeout_s=timeout_s,
                                pg_timeout_s=pg_timeout_s, threads=job.cfg.threads, env=job.env,
                                setup=SoftwareLinkSetup(spec))
    info = RunInfo("software", world, "cpu", _cores(world, job.cfg.threads), nic=nic,
                   hw_groups=[list(range(g * per_group, (g + 1) * per_group))
                              for g in range(groups)])
    info.cross_rate, info.cross_rate_source = parse_rate(cross), "configured"
    if auto_note:
        info.notes.append(auto_note)
    info.rates = {"configured_cross": parse_rate(cross),
                  "configured_intra": parse_rate(intra) if intra else None}
    if links is not None:  # the ports a message shares (wire bytes/s; meta.json only)
        info.rates["configured_intra_port"] = links.intra.port_Bps
        info.rates["configured_cross_port"] = links.cross.port_Bps
    booked = [r.get("links_booked_cross_bytes") for r in results]
    if not any(booked):
        msg = ("WARNING: the software link model booked no cross-node bytes: the executor's "
               "traffic bypassed it, so this run was PLAIN LOOPBACK with no slow link")
        info.notes.append(msg)
        log(msg)
    late = max((r.get("links_late_bookings") or 0 for r in results), default=0)
    if late:
        msg = (f"WARNING: the start-order software links served {late} message(s) after one "
               "that started later in virtual time (a rank's floor was wrong; "
               "docs/emulator.md, The links' order)")
        info.notes.append(msg)
        log(msg)
    info.notes.append("software link model: rates as configured by construction; CPU cost of a "
                      "network stack and TCP sharing are not modelled (docs/topology.md)")
    return results, info


def in_torchrun() -> bool:
    return "RANK" in os.environ and "WORLD_SIZE" in os.environ and "MASTER_ADDR" in os.environ


def run_torchrun(job: Job, *, pg_timeout_s: float, nic: str | None, cross_rate: float | None,
                 hw_groups_from_topology: bool = True) -> tuple[list | None, RunInfo | None]:
    """This process is one rank of a torchrun / srun job. Returns (results, info) on rank 0 and
    (None, None) elsewhere."""
    import torch
    import torch.distributed as dist

    cuda = torch.cuda.is_available() and job.device != "cpu"
    job.device = "cuda" if cuda else "cpu"
    if cuda:
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
    else:
        torch.set_num_threads(job.cfg.threads)
    dist.init_process_group("nccl" if cuda else "gloo", init_method="env://",
                            timeout=datetime.timedelta(seconds=pg_timeout_s))
    try:
        rank, world = dist.get_rank(), dist.get_world_size()
        res = rank_main(rank, world, job)
        gathered: list[Any] | None = [None] * world if rank == 0 else None
        dist.gather_object(res, gathered, dst=0)
    finally:
        dist.destroy_process_group()
    if rank != 0:
        return None, None
    assert gathered is not None
    # Cores per machine, counted once per host: a host's ranks share its cores.
    per_host: dict[str, tuple[int, int]] = {}
    for r in gathered:
        cores, n = per_host.get(r["host"], (r["cores"], 0))
        per_host[r["host"]] = (cores, n + 1)
    cores = sum(min(c, n * job.cfg.threads) for c, n in per_host.values())
    info = RunInfo("torchrun", world, job.device, cores, nic=nic)
    groups = gathered[0]["topology_groups"]
    if hw_groups_from_topology and len(groups) > 1:
        info.hw_groups = groups
    if cross_rate:
        info.cross_rate, info.cross_rate_source = cross_rate, "configured"
    elif info.hw_groups:
        info.notes.append("no --cross-rate given: the bound has no link term")
    return gathered, info


def log_stderr(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)
