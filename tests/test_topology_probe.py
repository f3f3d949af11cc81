"""The probe, resolve_topology and ``charm-megatron topo`` on real gloo ranks (processes)."""

from __future__ import annotations

import argparse
import contextlib
import io
import warnings

from charm_megatron.local_ranks import run_ranks

HOSTS_2X2 = ["hostA", "hostA", "hostB", "hostB"]


def _fake_facts(hosts, numas=None):
    """Replace this child's fact reader: rank -> host name (and NUMA node) from the lists."""
    import charm_megatron.topology.probing as P

    real = P.local_facts

    def fake(rank, global_rank=-1, use_cuda=False):
        f = real(rank, global_rank, use_cuda)
        return P.RankFacts(rank=rank, host=hosts[global_rank],
                           numa=numas[global_rank] if numas else 0, device=f.device,
                           global_rank=global_rank, launcher=f.launcher)

    P.local_facts = fake


def _count_gathers():
    import torch.distributed as dist

    calls = {"n": 0}
    real = dist.all_gather_object

    def counting(*a, **k):
        calls["n"] += 1
        return real(*a, **k)

    dist.all_gather_object = counting
    return calls


def _probe_default(rank, world):
    from charm_megatron.topology import probe

    r = probe()
    return str(r.topology), r.level, [f.host for f in r.facts], probe().topology == r.topology


def test_probe_real_ranks_agree():
    out = run_ranks(_probe_default, 4, timeout_s=120)
    assert len({o[0] for o in out}) == 1 and len({o[1] for o in out}) == 1
    topo, level, hosts, same = out[0]
    assert same and len(hosts) == 4
    # One machine: one node; flat unless it has several NUMA nodes the ranks are pinned to.
    if level == "flat":
        assert topo == "1x4"


def _probe_fake(rank, world, hosts, numas):
    import torch.distributed as dist

    from charm_megatron.topology import TopologyWarning, probe, resolve_topology

    _fake_facts(hosts, numas)
    calls = _count_gathers()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        r = probe()
    again = probe()  # cached: no communication
    # Strided CP groups {0,2} and {1,3}: CP-local ranks, global facts.
    g02, g13 = dist.new_group([0, 2]), dist.new_group([1, 3])
    mine = g02 if rank % 2 == 0 else g13
    strided = probe(mine)
    resolved = resolve_topology("auto", mine, 2)
    return {
        "topo": str(r.topology), "level": r.level, "cached": again is r, "gathers": calls["n"],
        "warned": [str(w.message) for w in caught if issubclass(w.category, TopologyWarning)],
        "strided": str(strided.topology), "strided_globals": [f.global_rank for f in strided.facts],
        "resolved": str(resolved),
    }


def test_probe_two_fake_hosts_and_strided_groups():
    out = run_ranks(_probe_fake, 4, HOSTS_2X2, None, timeout_s=120)
    for rank, o in enumerate(out):
        assert o["topo"] == "2x2" and o["level"] == "node" and o["cached"]
        assert o["warned"] == []
        # 1 world probe + 1 strided probe; resolve_topology reused the cached strided result.
        assert o["gathers"] == 2
        # {0,2} spans hostA/hostB -> two groups of one; likewise {1,3}.
        assert o["strided"] == "2x1" and o["resolved"] == "2x1"
        assert o["strided_globals"] == ([0, 2] if rank % 2 == 0 else [1, 3])


def test_probe_strided_hosts_and_unequal_warning():
    out = run_ranks(_probe_fake, 4, ["a", "b", "a", "b"], None, timeout_s=120)
    assert out[0]["topo"] == "0,2/1,3" and out[0]["strided"] == "1x2"
    out = run_ranks(_probe_fake, 4, ["a", "a", "a", "b"], None, timeout_s=120)
    for o in out:
        assert o["topo"] == "1x4" and o["level"] == "flat"
        assert len(o["warned"]) == 1 and "different numbers of ranks" in o["warned"][0]


def _resolve_env(rank, world):
    from charm_megatron.topology import resolve_topology

    _fake_facts(HOSTS_2X2, [0, 1, 0, 1])
    from charm_megatron.ops.options import CPOptions

    opts = CPOptions.from_env()  # CHARM_TOPOLOGY from the job's environment
    spec, source = opts.topology_for("charm", None)
    return [str(resolve_topology(spec, None, 4, source=source)),
            str(resolve_topology("numa", None, 4)),
            "1x4" if opts.topology_for("ring", None) is None else "not flat"]


def test_resolve_env_levels():
    out = run_ranks(_resolve_env, 4, env={"CHARM_TOPOLOGY": "flat"}, timeout_s=120)
    assert out[0] == ["1x4", "4x1", "1x4"]
    out = run_ranks(_resolve_env, 4, env={"CHARM_TOPOLOGY": "auto"}, timeout_s=120)
    assert all(o == ["2x2", "4x1", "1x4"] for o in out)


def _run_cli(rank, world, argv, hosts=None):
    from charm_megatron.topology import cli

    if hosts:
        _fake_facts(hosts)
    parser = argparse.ArgumentParser()
    cli.register(parser)
    buf = io.StringIO()
    with contextlib.redirect_stdout(buf):
        rc = cli.run(parser.parse_args(argv))
    return rc, buf.getvalue()


def test_topo_cli_on_ranks():
    out = run_ranks(_run_cli, 4, ["--cp-size", "2", "--measure", "--size-mb", "0.5", "--reps", "1"],
                    ["a", "b", "a", "b"], timeout_s=120)
    rc, text = out[0]
    assert rc == 0 and all(o == (0, "") for o in out[1:])  # only global rank 0 prints
    assert "world 4, backend gloo, CP size 2 -> 2 CP group(s)" in text
    assert "CP group 0 (global ranks 0-1): 2x1" in text and "CP group 1 (global ranks 2-3): 2x1" in text
    assert "auto: the CP group spans 2 nodes" in text
    assert "point-to-point bandwidth in CP group 0" in text and "cross-group median" in text
    assert "CHARM_TOPOLOGY=2x1" in text


def test_topo_cli_explicit_topology_errors():
    out = run_ranks(_run_cli, 2, ["--topology", "2x2"], timeout_s=120)
    rc, text = out[0]
    assert rc == 2 and "has 4 ranks but the CP group has 2" in text
    out = run_ranks(_run_cli, 2, ["--cp-size", "3"], timeout_s=120)
    assert out[0][0] == 2 and "does not divide" in out[0][1]
