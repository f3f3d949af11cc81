"""The bench's ``auto`` contender: it runs ``cp_attention(algo="auto")``, reports its pick,
the pick is the selector's for the point on this run's links, and auto is compared with the
fastest of ring / rmplus / charm."""

from __future__ import annotations

import csv
import json
import os

import pytest

from charm_megatron.cli import main as cli_main
from charm_megatron.lab.bench.analysis import AUTO_SLACK, RunInfo, analyse
from charm_megatron.lab.bench.config import BenchConfig, HeadSpec, Point, check_algos
from charm_megatron.lab.calibration.testbed import UNSHAPED_GBPS, bench_cluster
from charm_megatron.model import PROFILES, choose_algo
from charm_megatron.plan import registry
from charm_megatron.plan.cost import Problem

#: The algorithms these auto tests were calibrated on (CHARM_AUTO_ALGOS / auto_algos).
ORIGINAL = ("ring", "rmplus", "charm", "allgather")

# --------------------------------------------------------------------------- pure


def test_bench_cluster_puts_the_runs_links_where_the_emulator_has_them():
    base = PROFILES["cpu-testbed"].cluster
    node = bench_cluster(base, nic="node", cross_Bps=62.5e6, intra_Bps=500e6,
                         cross_burst=512 * 1024, intra_burst=4 << 20, cores=3)
    assert (node.nic, node.cross_gbps, node.intra_bus_gbps, node.intra_gbps) == (
        "node", 0.0625, 0.5, UNSHAPED_GBPS)
    assert (node.cross_burst_kb, node.intra_burst_kb, node.cores) == (512, 4096, 3)
    rank = bench_cluster(base, nic="rank", cross_Bps=12.5e6, intra_Bps=100e6, cores=2)
    assert (rank.nic, rank.cross_gbps, rank.intra_gbps, rank.intra_bus_gbps) == (
        "rank", 0.0125, 0.1, None)
    # The fitted costs stay the profile's.
    assert (rank.tflops, rank.msg_cpu_us, rank.latency_us) == (base.tflops, base.msg_cpu_us,
                                                               base.latency_us)
    unshaped = bench_cluster(base, nic="rank", cross_Bps=12.5e6, intra_Bps=None,
                             intra_burst=4 << 20)
    assert unshaped.intra_gbps == UNSHAPED_GBPS and unshaped.intra_burst_kb == 0
    soft = bench_cluster(base, nic="node", cross_Bps=12.5e6, intra_Bps=100e6, emulated=False)
    assert (soft.nic, soft.intra_gbps, soft.intra_bus_gbps) == ("node", 0.1, None)


def test_auto_is_a_choice_but_not_a_default_contender():
    assert check_algos(["ring", "auto"]) == ["ring", "auto"]
    assert "auto" not in BenchConfig(batches=[1], seqs=[256], heads=[HeadSpec(2, 32)]).algos
    with pytest.raises(ValueError, match="auto"):
        check_algos(["autoo"])


def _rank(ring: list[float], charm: list[float], auto: list[float], pick: str) -> dict:
    def rec(ts):
        return {"fwd": list(ts), "bwd": list(ts), "fwd_cpu": [0.0] * len(ts),
                "bwd_cpu": [0.0] * len(ts)}
    times = {"ring/full": rec(ring), "charm/full": rec(charm), "auto/full": rec(auto),
             "charm/compute": rec([0.1] * len(ring))}
    return {"topology": "2x2", "topology_groups": [[0, 1], [2, 3]],
            "points": [{"times": times, "memory": {}, "skipped": {}, "notes": {},
                        "picks": {"auto": pick}}]}


@pytest.mark.parametrize("auto_s, check", [(1.04, "ok"), (1.10, "over")])
def test_analysis_auto_versus_fastest(auto_s, check):
    cfg = BenchConfig(batches=[1], seqs=[1024], heads=[HeadSpec(2, 32)], dtype="fp32",
                      algos=["ring", "charm", "auto"])
    point = Point(0, 1, 1024, 2, 2, 32)
    # charm is the fastest (median 1.0 s); auto ran charm at auto_s.
    per_rank = [_rank([2.0, 2.0, 2.0], [1.0, 0.9, 1.1], [auto_s] * 3, "charm")] * 4
    info = RunInfo("netns", 4, cores=2, nic="rank", hw_groups=[[0, 1], [2, 3]],
                   cross_rate=1e6, cross_rate_source="measured")
    rows, _ = analyse(cfg, [point], per_rank, info)
    auto = [r for r in rows if r["algo"] == "auto"]
    assert {r["pass"] for r in auto} == {"fwd", "bwd", "fwdbwd"}
    fwd = next(r for r in auto if r["pass"] == "fwd")
    assert (fwd["auto_pick"], fwd["fastest"], fwd["auto_check"]) == ("charm", "charm", check)
    assert fwd["vs_fastest"] == pytest.approx(auto_s / 1.0)
    assert (fwd["vs_fastest"] > AUTO_SLACK) == (check == "over")
    assert fwd["pick_vs_fastest"] == pytest.approx(1.0)  # the pick is the fastest here
    # auto's bound is its pick's: charm's compute-only run and charm's plan bytes.
    charm = next(r for r in rows if r["algo"] == "charm" and r["pass"] == "fwd")
    assert fwd["bound_ms"] == pytest.approx(charm["bound_ms"])
    assert fwd["cross_link_mb"] == pytest.approx(charm["cross_link_mb"])
    assert all(r.get("auto_pick") is None for r in rows if r["algo"] != "auto")
    from charm_megatron.lab.bench.report import format_table

    text = format_table(rows)
    assert "auto picked charm; auto / fastest: fwd" in text
    assert ("CHECK > 1.05" in text) == (check == "over")


# --------------------------------------------------------------------------- a real run


def test_bench_auto_contender_runs_and_reports_the_selectors_pick(tmp_path, capsys,
                                                                  monkeypatch):
    """4 real gloo ranks on the software link model (runs without root); the pick in the CSV is
    the selector's on this run's links, and differs from the generic cluster's (the bench
    really passed its links to auto)."""
    from charm_megatron.lab.bench.runners import _cores
    from charm_megatron.topology.core import Topology

    out = str(tmp_path / "auto")
    # auto among the algorithms this test was calibrated on (a head all-to-all would win
    # at these 4 heads on 4 ranks).
    monkeypatch.setenv("CHARM_AUTO_ALGOS", ",".join(ORIGINAL))
    # A point where the run's links (one shared NIC per node, 100 Mbit/s) make auto pick
    # charm, while the generic cluster would pick rmplus.
    args = ["bench", "--preset", "tiny", "--seq", "512", "--heads", "4x64", "--iters", "1",
            "--warmup", "1",
            "--quiet", "--no-plot", "--no-memory", "--algos", "ring,rmplus,charm,auto",
            "--emulate", "2x2", "--emulate-backend", "software", "--cross-rate", "100mbit",
            "--intra-rate", "800mbit", "--nic", "node", "--timeout-s", "240",
            "--comm-timeout-s", "120", "--out", out]
    assert cli_main(args) == 0
    text = capsys.readouterr().out
    with open(os.path.join(out, "results.csv")) as f:
        rows = list(csv.DictReader(f))
    auto = [r for r in rows if r["algo"] == "auto"]
    assert len(auto) == 3 and all(r["status"] == "ok" for r in auto)
    picks = {r["auto_pick"] for r in auto}
    assert len(picks) == 1
    pick = picks.pop()
    groups = Topology.parse("2x2").groups
    problem = Problem(1, 512, 4, 4, 64, 4)
    cluster = bench_cluster(PROFILES["cpu-testbed"].cluster, nic="node", cross_Bps=12.5e6,
                            intra_Bps=100e6, cores=_cores(4, 1), emulated=False)
    assert pick == choose_algo(groups, problem, cluster, causal=True, roles="bytes",
                               algos=ORIGINAL)
    assert pick != choose_algo(groups, problem, None, causal=True, roles="bytes",
                               algos=ORIGINAL)
    for r in auto:
        assert r["fastest"] in registry.names()
        assert float(r["vs_fastest"]) > 0 and r["auto_check"] in ("ok", "over")
        assert float(r["bound_ms"]) > 0
    assert f"auto picked {pick}; auto / fastest:" in text
    with open(os.path.join(out, "results.json")) as f:
        notes = json.load(f)["meta"]["notes"]
    assert any(n.startswith("auto (and charm's split_visiting) predicts with profile "
                            "cpu-testbed") for n in notes)


# --------------------------------------------------------------------------- auto runs its pick
def _auto_runs_its_pick(rank: int, world: int, profile: str | None) -> tuple[str, dict]:
    """resolve_algo's answer, and whether cp_attention(algo="auto")'s output is bitwise the
    output of each algorithm run by name (different algorithms merge in different orders)."""
    import torch

    from charm_megatron.ops.attention import cp_attention, resolve_algo
    from charm_megatron.ops.options import CPOptions

    g = torch.Generator().manual_seed(100 + rank)
    q, k, v = (torch.randn(128, 1, 4, 64, generator=g) for _ in range(3))
    opts = CPOptions(model_profile=profile, auto_algos=ORIGINAL)
    pick = resolve_algo(q.to("meta"), k.to("meta"), algo="auto", topology="2x2", options=opts)
    out = cp_attention(q, k, v, algo="auto", topology="2x2", options=opts)
    same = {a: bool(torch.equal(out, cp_attention(q, k, v, algo=a, topology="2x2",
                                                  options=opts)))
            for a in registry.names()}
    return pick, same


def test_auto_runs_the_algorithm_resolve_algo_reports(tmp_path):
    from charm_megatron.devices import save_profile
    from charm_megatron.local_ranks import run_ranks
    from charm_megatron.model.cluster import Profile

    # One shared NIC per node at 100 Mbit/s: charm; the generic cluster (no profile), where
    # these 128-row blocks are latency-bound: allgather (one step; rmplus takes two).
    cl = bench_cluster(PROFILES["cpu-testbed"].cluster, nic="node", cross_Bps=12.5e6,
                       intra_Bps=100e6, cores=2)
    path = str(tmp_path / "node.json")
    save_profile(Profile("node-100", cl, "2x2", "test"), path)
    seen = set()
    for profile in (path, None):
        results = run_ranks(_auto_runs_its_pick, 4, profile, timeout_s=180)
        picks = {p for p, _ in results}
        assert len(picks) == 1, results  # every rank picks alike
        pick = picks.pop()
        seen.add(pick)
        for _, same in results:
            assert same[pick], (pick, same)
            # charm's output differs from the flat algorithms' (ring and rmplus may agree
            # bitwise on 4 ranks): what ran is told apart from what was reported.
            assert same["charm"] == (pick == "charm"), (pick, same)
    assert seen == {"charm", "allgather"}


def test_summary_labels_the_link_model(tmp_path):
    """Runs that differ only in their link model must not share a label in the summary."""
    import csv
    import json

    from charm_megatron.lab.reports.summary import load

    labels = []
    for model in ("tbf", "htb"):
        run = tmp_path / model
        run.mkdir()
        meta = {"hw_groups": [[0, 1], [2, 3]], "mode": "netns", "nic": "rank",
                "link_model": model, "rates_Bps": {"configured_cross": 12.5e6}}
        (run / "results.json").write_text(json.dumps({"meta": meta}))
        with open(run / "results.csv", "w", newline="") as f:
            w = csv.DictWriter(f, fieldnames=["point", "algo", "pass", "median_ms"])
            w.writeheader()
            w.writerow({"point": 0, "algo": "ring", "pass": "fwd", "median_ms": 1.0})
        labels.append(load(str(run / "results.csv"))[0])
    assert labels == ["2x2 netns nic=rank 100 Mbit/s", "2x2 netns nic=rank htb 100 Mbit/s"]


def test_summary_ceiling_is_ring_over_the_bound(tmp_path):
    """The summary's ceiling column: ring's median over each algorithm's lower bound (the
    most it could gain over ring in that run), '-' where no bound was measured."""
    import csv

    from charm_megatron.lab.reports.summary import load, table

    fields = ["point", "algo", "pass", "status", "seq", "heads", "kv_heads", "head_dim",
              "dtype", "median_ms", "speedup_vs_ring", "vs_bound", "ring_ccr", "bound_ms"]
    rows = [
        {"algo": "ring", "median_ms": 450.0, "bound_ms": 380.0, "vs_bound": 1.18},
        {"algo": "charm", "median_ms": 265.0, "bound_ms": 207.0, "vs_bound": 1.28},
        {"algo": "rmplus", "median_ms": 360.0, "bound_ms": "", "vs_bound": ""},
    ]
    run = tmp_path / "run"
    run.mkdir()
    with open(run / "results.csv", "w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=fields)
        w.writeheader()
        for r in rows:
            w.writerow({"point": 0, "pass": "fwd", "status": "ok", "seq": 3072, "heads": 8,
                        "kv_heads": 2, "head_dim": 64, "dtype": "fp32", "ring_ccr": 0.5,
                        "speedup_vs_ring": 1.0, **r})
    text = table([load(str(run / "results.csv"))], ["fwd"])
    head, _, line = text.splitlines()
    cells = dict(zip((c.strip() for c in head.strip("|").split("|")),
                     (c.strip() for c in line.strip("|").split("|"))))
    assert cells["charm ceiling"] == "2.17x"  # 450 / 207
    assert cells["rmplus ceiling"] == "-"


def test_bench_measured_auto_runs_what_it_measured(tmp_path, monkeypatch):
    """``--auto-tune all``: the auto contender's warm-up call measures every candidate on the
    run's real links (4 gloo ranks, software link model) and the CSV reports the pick it
    measured, its margin and its notes."""
    out = str(tmp_path / "tuned")
    monkeypatch.setenv("CHARM_AUTO_ALGOS", "ring,rmplus,charm")
    args = ["bench", "--preset", "tiny", "--seq", "512", "--heads", "4x64", "--iters", "1",
            "--warmup", "1", "--quiet", "--no-plot", "--no-memory",
            "--algos", "ring,charm,auto", "--emulate", "2x2", "--emulate-backend", "software",
            "--cross-rate", "100mbit", "--intra-rate", "800mbit", "--nic", "node",
            "--timeout-s", "240", "--comm-timeout-s", "120", "--auto-tune", "all",
            "--out", out]
    assert cli_main(args) == 0
    with open(os.path.join(out, "results.csv")) as f:
        auto = [r for r in csv.DictReader(f) if r["algo"] == "auto"]
    assert len(auto) == 3 and all(r["status"] == "ok" for r in auto)
    assert {r["auto_tune"] for r in auto} == {"all"}
    assert len({r["auto_pick"] for r in auto}) == 1
    assert auto[0]["auto_pick"] in ("ring", "rmplus", "charm")
    with open(os.path.join(out, "results.json")) as f:
        text = f.read()
    assert "auto (auto_tune all) ran " + auto[0]["auto_pick"] in text


def test_bad_auto_tune_flag_is_named(capsys):
    assert cli_main(["bench", "--preset", "tiny", "--auto-tune", "0.5", "--no-plot"]) == 2
    err = capsys.readouterr().err
    assert "--auto-tune '0.5'" in err and "CHARM_AUTO_TUNE" in err
