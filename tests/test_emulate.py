"""Cluster emulation: namespaces come and go, rates hold, ranks inside see two hosts; LinkModel."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import threading
import time
import warnings

import pytest

from charm_megatron.lab.emulate import (
    EmulatedCluster,
    LinkModel,
    SoftwareLinks,
    ThrottledWork,
    available,
    cleanup_stale,
    list_netns,
    parse_rate,
    parse_size,
    run_ranks_in_cluster,
)
from charm_megatron.local_ranks import run_ranks

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


@pytest.fixture
def netns_ok():
    ok, why = available()
    if not ok:
        # Shown in pytest's warnings summary even without -rs.
        warnings.warn(f"network-namespace emulation tests skipped: {why}", stacklevel=1)
        pytest.skip(f"network namespaces unavailable: {why}")


def ours(cluster: EmulatedCluster) -> list[str]:
    return [n for n in list_netns() if n.startswith(cluster.name + "-")]


# --------------------------------------------------------------------------- pure


def test_rate_units():
    assert parse_rate("1gbit") == 125e6 and parse_rate("8bit") == 1.0
    assert parse_rate("125mbps") == 125e6 and parse_rate("1.5GB/s") == 1.5e9
    assert parse_rate(1e6) == 1e6
    assert parse_size("512kb") == 512 * 1024 and parse_size("4mb") == 4 << 20
    for bad in ("fast", "-1gbit", "0"):
        with pytest.raises(ValueError):
            parse_rate(bad)


def test_cluster_arguments_validated():
    with pytest.raises(ValueError, match="nic"):
        EmulatedCluster(nic="switch")
    with pytest.raises(ValueError, match="hostnames"):
        EmulatedCluster(2, 2, hostnames=["a"])
    c = EmulatedCluster(2, 3, nic="rank", hostnames=["x", "y"])  # planned, not built
    assert [p.hostname for p in c.places] == ["x"] * 3 + ["y"] * 3
    assert len({p.address for p in c.places}) == 6 and len({p.netns for p in c.places}) == 6
    assert EmulatedCluster(2, 3).places[4].address == "10.213.0.2"
    assert ours(c) == []


# --------------------------------------------------------------------------- LinkModel


class _Done:
    def wait(self, *a):
        return True

    def is_completed(self):
        return True


def test_link_model_serialises_transfers():
    link = LinkModel("80mbit")  # 10 MB/s
    t0 = time.monotonic()
    d1, d2 = link.reserve(1_000_000), link.reserve(1_000_000)
    assert d1 == pytest.approx(t0 + 0.1, abs=0.02) and d2 == pytest.approx(t0 + 0.2, abs=0.02)
    assert link.bytes_posted == 2_000_000 and link.transfers_posted == 2
    w = link.wrap(_Done(), 200_000)
    assert not w.is_completed()
    w.wait()
    assert time.monotonic() >= t0 + 0.22
    assert w.is_completed()


def test_link_model_shared_between_processes(tmp_path):
    path = str(tmp_path / "node0.link")
    a = LinkModel(1e6, shared_path=path)
    b = LinkModel(1e6, shared_path=path)  # another process would open the same file
    t0 = time.monotonic()
    a.reserve(100_000)
    assert b.reserve(100_000) == pytest.approx(t0 + 0.2, abs=0.03)
    assert a.bytes_posted == 200_000


def test_link_model_threads_share():
    link = LinkModel(1e6)
    t0 = time.monotonic()
    works = []
    ts = [threading.Thread(target=lambda: works.append(link.wrap(_Done(), 20_000))) for _ in range(5)]
    for t in ts:
        t.start()
    for t in ts:
        t.join(timeout=5)
    t1 = time.monotonic()  # every wrap() was called between t0 and t1
    for w in works:
        w.wait()
    assert time.monotonic() - t0 >= 0.1 - 0.005
    # Shared: the five 20 ms messages queue behind each other, so the last one is due 100 ms
    # after the first was posted (a private link per thread would make it ~20 ms). Bounded by
    # when the posts happened rather than by wall-clock slack, so a loaded machine that starts
    # the threads late cannot fail it.
    last = max(w.deadline for w in works)
    assert t0 + 0.1 - 0.005 <= last <= t1 + 0.1 + 0.005


def test_software_links_choose_link():
    spec = SoftwareLinks(2, 2, "8mbit", intra_rate=None, nic="node")
    r1 = spec.for_rank(1)
    assert r1.link(0, True) is None and r1.link(2, True) is r1.cross_out
    assert r1.link(3, False) is r1.cross_in
    assert isinstance(r1.wrap(_Done(), 10, 0, True), ThrottledWork)
    r1 = SoftwareLinks(2, 2, "8mbit", intra_rate="80mbit", nic="rank").for_rank(1)
    assert r1.intra is not None and r1.link(0, True) is r1.intra[0]
    assert r1.link(0, False) is r1.intra[1] and r1.cross_out.name == "cross-out rank1"


def _software_exchange(rank, world, spec):
    import torch

    links = spec.for_rank(rank)
    x = torch.ones(250_000)  # 1 MB
    t0 = time.perf_counter()
    if rank == 0:
        works = [links.isend(x, 1), links.isend(x, 2)]
    elif rank == 1:
        works = [links.irecv(torch.empty_like(x), 0)]
    elif rank == 2:
        works = [links.irecv(torch.empty_like(x), 0)]
    else:
        works = []
    for w in works:
        w.wait()
    return time.perf_counter() - t0


def test_software_links_real_gloo(tmp_path):
    # 2 nodes x 2 ranks, cross 10 MB/s per node link, intra free.
    spec = SoftwareLinks(2, 2, "80mbit", nic="node", state_dir=str(tmp_path))
    t = run_ranks(_software_exchange, 4, spec, timeout_s=120)
    assert t[1] < 0.08  # intra: not throttled
    assert t[2] >= 0.095  # 1 MB on a 10 MB/s link
    assert t[0] >= 0.095


# --------------------------------------------------------------------------- namespaces


def test_create_and_remove(netns_ok):
    before = set(list_netns())
    with EmulatedCluster(2, 2, "1gbit", nic="node") as c:
        names = ours(c)
        assert sorted(names) == sorted([c.bridge_ns, c.node_ns(0), c.node_ns(1)])
        assert all(os.path.exists(p.netns_path) for p in c.places)
    after = set(list_netns())
    assert ours(c) == [] and not after & set(names)
    assert after - before == set() or all(not n.startswith(c.name) for n in after - before)
    with pytest.raises(RuntimeError, match="boom"):
        with EmulatedCluster(2, 2, nic="rank") as c2:
            assert len(ours(c2)) == 1 + 2 + 4
            raise RuntimeError("boom")
    assert ours(c2) == []


_KILL_SCRIPT = textwrap.dedent("""
    import sys, time
    sys.path.insert(0, {repo!r})
    from charm_megatron.lab.emulate import EmulatedCluster
    c = EmulatedCluster(2, 1)
    c.start()
    print(c.name, flush=True)
    time.sleep(60)
""")


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGKILL])
def test_signal_cleanup(netns_ok, sig):
    proc = subprocess.Popen([sys.executable, "-c", _KILL_SCRIPT.format(repo=REPO)],
                            stdout=subprocess.PIPE, text=True)
    try:
        name = proc.stdout.readline().strip()
        assert name and any(n.startswith(name + "-") for n in list_netns())
        proc.send_signal(sig)
        assert proc.wait(timeout=20) == -sig
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(timeout=10)
    if sig == signal.SIGKILL:
        # Nothing runs after SIGKILL: the next cluster (or cleanup_stale) removes the leftovers.
        left = [n for n in list_netns() if n.startswith(name + "-")]
        assert left and set(left) <= set(cleanup_stale())
    assert not any(n.startswith(name + "-") for n in list_netns())


def test_measured_rates_match_configuration(netns_ok):
    rate = parse_rate("400mbit")  # 50 MB/s
    with EmulatedCluster(2, 2, "400mbit", nic="node") as c:
        rep = c.measure_rates(0.3, concurrent=True)
    print(rep)
    assert 0.6 * rate < rep.cross < 1.15 * rate
    assert rep.intra > 3 * rate
    assert rep.cross_concurrent < 1.3 * rate  # the node's ranks share one link
    with EmulatedCluster(2, 2, "400mbit", intra_rate="1.6gbit", nic="rank") as c:
        rep = c.measure_rates(0.3, concurrent=True)
    print(rep)
    assert 0.6 * rate < rep.cross < 1.15 * rate
    assert rep.cross_concurrent > 1.4 * rate  # one link per rank
    assert 0.4 * 200e6 < rep.intra < 1.3 * 200e6


def timed_exchanges(rank: int) -> dict[str, float]:
    """Seconds to swap 2 MB with the neighbour on the node (intra) and with the counterpart on
    the other node (cross), on a 2x2 emulated cluster; also the htb tests' worker body."""
    import torch
    import torch.distributed as dist

    x = torch.ones(500_000)
    times = {}
    for name, peer in (("intra", rank ^ 1), ("cross", (rank + 2) % 4)):
        dist.barrier()
        t0 = time.perf_counter()
        if rank < peer:
            dist.send(x, peer)
            dist.recv(x, peer)
        else:
            dist.recv(x, peer)
            dist.send(x, peer)
        times[name] = time.perf_counter() - t0
    return times


def _two_node_rank(rank, world):
    import socket

    from charm_megatron.topology import probe

    r = probe()
    times = timed_exchanges(rank)
    return (socket.gethostname(), os.environ["GLOO_SOCKET_IFNAME"], r.topology.groups, r.level,
            times)


@pytest.mark.parametrize("nic", ["node", "rank"])
def test_two_node_probe(netns_ok, nic):
    with EmulatedCluster(2, 2, "400mbit", nic=nic) as c:
        out = run_ranks_in_cluster(c, _two_node_rank, timeout_s=120)
    assert [o[0] for o in out] == ["node0", "node0", "node1", "node1"]
    for _host, ifname, groups, level, times in out:
        assert ifname == "eth0" and level == "node"
        assert groups == ((0, 1), (2, 3))
        # The cross link is throttled: 2 MB each way over 50 MB/s takes ~80 ms, less the
        # shaper's burst (measured 60-70 ms). A lower bound set by the shaper, so a loaded
        # machine cannot fail it; an unshaped veth moves the 4 MB in a few ms.
        assert times["cross"] >= 0.03, times
    assert ours(c) == []


def test_topo_cli_subprocesses_under_slurm_vars(netns_ok):
    """``charm-megatron topo`` as srun would start it: SLURM vars only, one rank per node."""
    with EmulatedCluster(2, 1, "1gbit") as c:
        procs = []
        for rank in range(2):
            env = dict(os.environ, SLURM_PROCID=str(rank), SLURM_NTASKS="2",
                       SLURM_NODEID=str(rank), SLURM_LOCALID="0", MASTER_ADDR=c.master_addr,
                       MASTER_PORT="29511", PYTHONPATH=REPO, OMP_NUM_THREADS="1")
            for k in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "CHARM_TOPOLOGY"):
                env.pop(k, None)
            argv = [sys.executable, "-m", "charm_megatron.cli", "topo", "--backend", "gloo",
                    "--timeout-s", "60"]
            procs.append(subprocess.Popen(c.command(rank, argv), env=env, stdout=subprocess.PIPE,
                                          stderr=subprocess.STDOUT, text=True))
        try:
            outs = [p.communicate(timeout=120)[0] for p in procs]
        finally:
            for p in procs:
                if p.poll() is None:
                    p.kill()
                    p.wait(timeout=10)
    assert [p.returncode for p in procs] == [0, 0], outs
    text = outs[0]
    assert "world 2, backend gloo" in text and "CP group 0 (global ranks 0-1): 2x1" in text
    assert "node0" in text and "node1" in text and "node=1" in text
    assert "auto: the CP group spans 2 nodes" in text
    # Only global rank 0 prints (c10d may log a harmless reverse-DNS warning on stderr).
    assert "charm-megatron topo" not in outs[1]
