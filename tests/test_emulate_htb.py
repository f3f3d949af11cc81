"""The htb link model: one veth per rank, classes by peer node (issue 12, item 7)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
import warnings

import pytest
from test_emulate import timed_exchanges

from charm_megatron.lab.bench.cli import main as bench_main
from charm_megatron.lab.emulate import EmulatedCluster, available, list_netns, run_ranks_in_cluster
from charm_megatron.lab.emulate.cluster import parse_proc_counters
from charm_megatron.lab.emulate.htb import CROSS_CLASS, INTRA_CLASS, htb_commands, parse_class_bytes

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


@pytest.fixture
def netns_ok():
    ok, why = available()
    if not ok:
        warnings.warn(f"network-namespace emulation tests skipped: {why}", stacklevel=1)
        pytest.skip(f"network namespaces unavailable: {why}")


# --------------------------------------------------------------------------- pure


def test_htb_needs_one_nic_per_rank():
    with pytest.raises(ValueError, match="link_model='htb'.*nic='rank'"):
        EmulatedCluster(2, 2, link_model="htb", nic="node")
    with pytest.raises(ValueError, match="link_model must be one of tbf, htb"):
        EmulatedCluster(2, 2, link_model="hfsc", nic="rank")
    with pytest.raises(ValueError, match="mtu"):
        EmulatedCluster(2, 2, link_model="htb", nic="rank", mtu=100)
    with pytest.raises(ValueError, match="intra_burst 2048 B is below"):
        EmulatedCluster(2, 2, "500mbit", "4gbit", nic="rank", intra_burst="2kb")  # tbf
    with pytest.raises(ValueError, match="cross_burst 1000 B is below"):
        EmulatedCluster(2, 2, "500mbit", nic="node", cross_burst=1000)
    EmulatedCluster(2, 2, "500mbit", "4gbit", nic="rank", link_model="htb", cross_burst="2kb",
                    intra_burst="2kb")  # htb sends a packet larger than its bucket
    c = EmulatedCluster(2, 2, "500mbit", "4gbit", nic="rank", link_model="htb")  # planned only
    assert not c.ingress and c.cross_burst == 512 * 1024 and c.intra_burst == 4 << 20
    assert EmulatedCluster(2, 2, nic="rank").ingress  # tbf keeps shaping both ways
    assert "htb (egress only)" in c.describe()
    assert [p.ifname for p in c.places] == ["eth0"] * 4


def test_htb_commands():
    lines = htb_commands("eth0", ["10.213.0.2"], match="dst", cross_rate=62.5e6,
                         cross_burst=512 * 1024, intra_rate=500e6, intra_burst=4 << 20)
    assert lines[0] == "qdisc add dev eth0 root handle 1: htb default 20"
    assert f"classid {CROSS_CLASS} htb rate 500000000bit ceil 500000000bit burst 524288 " \
           "cburst 524288" in lines[1]
    assert f"classid {INTRA_CLASS} htb rate 4000000000bit ceil 4000000000bit burst 4194304 " \
           "cburst 4194304" in lines[2]
    assert lines[3].endswith(f"u32 match ip dst 10.213.0.2/32 flowid {INTRA_CLASS}")
    free = htb_commands("p1", ["10.213.0.2", "10.213.0.3"], match="src", cross_rate=1e6,
                        cross_burst=1000, intra_rate=None, intra_burst=0)
    assert len(free) == 4 and all("match ip src" in f and f.endswith("flowid 1:0")
                                  for f in free[2:])
    with pytest.raises(ValueError, match="match"):
        htb_commands("eth0", [], match="both", cross_rate=1e6, cross_burst=1, intra_rate=None,
                     intra_burst=0)


def test_parsers():
    text = ("class htb 1:10 root prio 0 rate 4Gbit ceil 4Gbit burst 4Mb cburst 4Mb\n"
            " Sent 1234 bytes 5 pkt (dropped 0, overlimits 0 requeues 0)\n"
            "class htb 1:20 root prio 0 rate 500Mbit\n Sent 77 bytes 1 pkt\n")
    assert parse_class_bytes(text) == {"1:10": 1234, "1:20": 77}
    snmp = ("Tcp: RtoAlgorithm OutSegs RetransSegs\nTcp: 1 100 7\n"
            "TcpExt: TCPTimeouts TCPLossProbes\nTcpExt: 2 3\nUdp: InDatagrams\nUdp: 9\n")
    assert parse_proc_counters(snmp, ("Tcp:", "TcpExt:")) == {
        "RtoAlgorithm": 1, "OutSegs": 100, "RetransSegs": 7, "TCPTimeouts": 2, "TCPLossProbes": 3}


@pytest.mark.parametrize("argv, message", [
    (["--emulate", "2x4", "--cross-rate", "1gbit", "--link-model", "htb"], "add --nic rank"),
    (["--ranks", "2", "--link-model", "htb", "--nic", "rank"], "use them with --emulate"),
    (["--ranks", "2", "--cross-burst", "64kb"], "--cross-burst"),
    (["--emulate", "2x2", "--cross-rate", "1gbit", "--nic", "rank", "--link-model", "htb",
      "--emulate-backend", "software"], "need --emulate-backend netns"),
    (["--emulate", "2x2", "--cross-rate", "1gbit", "--intra-burst", "lots"], "cannot read size"),
])
def test_bench_rejects_bad_link_options(capsys, argv, message):
    before = set(list_netns())
    assert bench_main(["--preset", "tiny", "--quiet", *argv]) == 2
    assert message in capsys.readouterr().err
    assert set(list_netns()) <= before  # rejected before anything was built


# --------------------------------------------------------------------------- namespaces

# Runs in a child process so that a stuck transfer cannot outlive the test's timeout.
_RATES_SCRIPT = textwrap.dedent("""
    import json, sys
    sys.path.insert(0, {repo!r})
    from charm_megatron.lab.emulate import EmulatedCluster
    from charm_megatron.lab.emulate.link_probe import transfer
    out = {{}}
    with EmulatedCluster(2, 2, "400mbit", intra_rate="1.6gbit", nic="rank", link_model="htb",
                         ingress={ingress!r}) as c:
        rep = c.measure_rates(0.3, concurrent=True)
        out["rates"] = [rep.cross, rep.intra, rep.cross_concurrent]
        out["nns"] = len([n for n in __import__("charm_megatron.lab.emulate").lab.emulate.list_netns()
                          if n.startswith(c.name + "-")])
        # Routing: an intra-only stream lands in rank 0's intra class, a cross-only one in its
        # cross class (deltas of the class byte counters).
        for name, pair in (("intra", (0, 1)), ("cross", (0, 2))):
            b = c.link_bytes(0)
            transfer(c.places, [pair], 0.2)
            a = c.link_bytes(0)
            out[name] = {{k: a[k] - b[k] for k in a}}
        out["tcp"] = c.tcp_counters(0).get("OutSegs", 0)
    print(json.dumps(out))
""")


@pytest.mark.parametrize("ingress", [False, True])
def test_htb_rates_and_routing(netns_ok, ingress):
    proc = subprocess.run([sys.executable, "-c", _RATES_SCRIPT.format(repo=REPO, ingress=ingress)],
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    out = json.loads(proc.stdout.strip().splitlines()[-1])
    print(out)
    cross, intra, conc = out["rates"]
    rate = 50e6  # 400 Mbit/s
    assert out["nns"] == 1 + 4  # a bridge and one namespace per rank, no node switches
    assert 0.6 * rate < cross < 1.15 * rate
    assert conc > 1.4 * rate  # one link per rank
    assert 0.4 * 200e6 < intra < 1.3 * 200e6
    # Same-node bytes went through the intra class, other-node bytes through the cross class
    # (a few hundred bytes of ACKs and ARP may fall into the other one).
    assert out["intra"]["intra"] > 5e6 and out["intra"]["cross"] < 1e5, out
    assert out["cross"]["cross"] > 2e6 and out["cross"]["intra"] < 1e5, out
    assert out["tcp"] > 0


def _exchange(rank, world):
    return timed_exchanges(rank)


def test_htb_gloo_ranks(netns_ok):
    with EmulatedCluster(2, 2, "400mbit", intra_rate="4gbit", nic="rank", link_model="htb") as c:
        times = run_ranks_in_cluster(c, _exchange, timeout_s=120)
        sent = [c.link_bytes(r) for r in range(4)]
    for t in times:
        # 2 MB each way over 50 MB/s, less the 512 KiB bucket: >= 60 ms on the cross link; a
        # lower bound set by the shaper, so a loaded machine cannot fail it.
        assert t["cross"] >= 0.03, times
    for s in sent:  # gloo's 4 MB per pair went through the class of the peer's node
        assert s["intra"] > 2e6 and s["cross"] > 2e6, sent


def test_bench_runs_under_htb(tmp_path, capsys, netns_ok):
    out = str(tmp_path / "htb")
    argv = ["--preset", "tiny", "--iters", "2", "--warmup", "1", "--quiet", "--no-plot",
            "--algos", "ring,charm", "--emulate", "2x2", "--cross-rate", "200mbit",
            "--intra-rate", "1600mbit", "--nic", "rank", "--link-model", "htb",
            "--cross-burst", "256kb", "--timeout-s", "300", "--comm-timeout-s", "60",
            "--out", out]
    assert bench_main(argv) == 0
    text = capsys.readouterr().out
    assert "htb (egress only)" in text and "burst 256 KiB" in text
    assert "TCP during the benchmark (all ranks):" in text and "LEFT BEHIND" not in text
    with open(os.path.join(out, "results.json")) as f:
        meta = json.load(f)["meta"]
    assert meta["link_model"] == "htb" and meta["cross_burst_bytes"] == 256 * 1024
    assert meta["rates_Bps"]["tcp"]["OutSegs"] > 0
    assert not [n for n in list_netns() if n.startswith(f"cmemu-{os.getpid()}-")]
