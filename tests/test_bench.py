"""``charm-megatron bench``: grid and statistics (pure), output files of a real 4-rank run,
the emulated-cluster path (namespaces created and removed) and the software link model."""

from __future__ import annotations

import csv
import json
import os
import statistics
import time
import warnings

import pytest

from charm_megatron.cli import main as cli_main
from charm_megatron.lab.bench.analysis import COLUMNS, RunInfo, analyse, busiest_link_bytes
from charm_megatron.lab.bench.config import BenchConfig, HeadSpec, Point, parse_count
from charm_megatron.lab.bench.progress import Progress
from charm_megatron.plan import registry

# --------------------------------------------------------------------------- pure


def test_grid_parsing_and_points():
    assert parse_count("8k") == 8192 and parse_count("300") == 300
    assert HeadSpec.parse("12x128") == HeadSpec(12, 128)
    with pytest.raises(ValueError):
        HeadSpec.parse("12")
    cfg = BenchConfig(batches=[1, 2], seqs=[1020, 1024], heads=[HeadSpec(4, 64), HeadSpec(6, 64)],
                      kv_heads=2, max_tokens=1500)
    points, dropped = cfg.points(world=4)
    # S=1020 is not divisible by 2*4; B*S=2048 > 1500; 6 heads fit kv_heads=2 as well.
    assert [(p.batch, p.seq, p.heads) for p in points] == [(1, 1024, 4), (1, 1024, 6)]
    assert len(dropped) == 6 and any("divisible by 8" in d for d in dropped)
    assert ("ring", "comm") in cfg.variants() and ("charm", "compute") in cfg.variants()
    assert ("torch", "compute") not in cfg.variants()


def _fake_rank(rank: int, ring: list[float], charm: list[float]) -> dict:
    """One rank's raw result: ring, its ablations and charm (fwd = bwd for simplicity)."""
    def rec(ts, cpu=0.0):
        return {"fwd": list(ts), "bwd": list(ts), "fwd_cpu": [cpu] * len(ts),
                "bwd_cpu": [cpu] * len(ts)}
    times = {"ring/full": rec(ring), "charm/full": rec(charm),
             "ring/compute": rec([0.2] * len(ring), cpu=0.1),
             "ring/comm": rec([0.8] * len(ring)),
             "charm/compute": rec([0.2] * len(ring), cpu=0.1)}
    return {"topology": "2x2", "topology_groups": [[0, 1], [2, 3]],
            "points": [{"times": times, "memory": {"ring": {"fwd": 2**20, "fwdbwd": 3 * 2**20}},
                        "skipped": {}, "notes": {}}]}


def test_analysis_speedup_ccr_and_bound():
    cfg = BenchConfig(batches=[1], seqs=[1024], heads=[HeadSpec(2, 32)], dtype="fp32",
                      algos=["ring", "charm"])
    point = Point(0, 1, 1024, 2, 2, 32)
    # Rank 1 is the slowest in round 0, rank 0 in round 1: a call's time is the slowest rank's.
    per_rank = [_fake_rank(0, [1.0, 2.0], [0.5, 1.0]), _fake_rank(1, [1.5, 1.0], [0.5, 0.4]),
                _fake_rank(2, [1.0, 1.0], [0.5, 0.5]), _fake_rank(3, [1.0, 1.0], [0.5, 0.5])]
    info = RunInfo("netns", 4, cores=2, nic="node", hw_groups=[[0, 1], [2, 3]],
                   cross_rate=1e6, cross_rate_source="measured")
    rows, raw = analyse(cfg, [point], per_rank, info)
    assert {(r["algo"], r["pass"]) for r in rows} == {(a, p) for a in ("ring", "charm")
                                                      for p in ("fwd", "bwd", "fwdbwd")}
    charm = next(r for r in rows if r["algo"] == "charm" and r["pass"] == "fwd")
    assert raw["0"]["ring/full"]["fwd_ms"] == [1500.0, 2000.0]
    # Per-round ratios 1.5/0.5 = 3 and 2.0/1.0 = 2: the median of ratios, not a ratio of medians.
    assert charm["speedup_vs_ring"] == pytest.approx(statistics.median([3.0, 2.0]))
    assert charm["ring_ccr"] == pytest.approx(0.25)
    # CPU work = 4 ranks x 0.1 s on 2 cores = 0.2 s; the link term from the plan's bytes.
    link = busiest_link_bytes("charm", [[0, 1], [2, 3]], [[0, 1], [2, 3]], True, point, "fp32",
                              "node")["fwd"]
    assert charm["cross_link_mb"] == pytest.approx(link / 1e6)
    assert charm["bound_ms"] == pytest.approx(max(200.0, link / 1e6 * 1e3))
    assert charm["vs_bound"] == pytest.approx(charm["median_ms"] / charm["bound_ms"])
    ring = next(r for r in rows if r["algo"] == "ring" and r["pass"] == "fwdbwd")
    assert ring["peak_mem_mb"] == pytest.approx(3.0)


def test_link_bytes_ring_vs_charm():
    """Ring crosses the node boundary every step; CHARM+ only at the start and the end."""
    point = Point(0, 1, 4096, 4, 4, 64)
    hw = [[0, 1, 2, 3], [4, 5, 6, 7]]
    kw = {"causal": True, "point": point, "dtype": "bf16"}
    kv_block = 4096 / 8 * 2 * 4 * 64 * 2  # one rank's k and v, bf16
    ring = busiest_link_bytes("ring", [list(range(8))], hw, nic="node", **kw)
    assert ring["fwd"] == pytest.approx(7 * kv_block)  # one ring edge per direction, 7 steps
    charm_node = busiest_link_bytes("charm", hw, hw, nic="node", **kw)
    charm_rank = busiest_link_bytes("charm", hw, hw, nic="rank", **kw)
    assert charm_node["fwd"] < ring["fwd"]
    assert charm_rank["fwd"] == pytest.approx(charm_node["fwd"] / 4)  # 4 NICs share the load


def test_link_bytes_count_the_head_all_to_alls():
    """Ulysses' bytes are its all-to-alls: on 2x4 with a NIC per rank, each rank sends 4 of
    its 8 head slices of q, k, v across the boundary and receives as many, and the outputs
    (with their fp32 lse) come home the same way."""
    point = Point(0, 2, 4096, 8, 8, 64)
    hw = [[0, 1, 2, 3], [4, 5, 6, 7]]
    rows = 4096 / 8
    q = rows * 2 * 8 * 64 * 2  # one rank's q, bf16 (k and v: the same each)
    out = q + rows * 2 * 8 * 4  # its output and lse
    a2a = busiest_link_bytes("a2a", [list(range(8))], hw, nic="rank", causal=True,
                             point=point, dtype="bf16")
    assert a2a["fwd"] == pytest.approx(4 / 8 * (3 * q + out))


def test_progress_bar_lines():
    import io

    out = io.StringIO()
    p = Progress(4, stream=out, every=0.5)
    for i in range(4):
        p.update(1, f"step {i}")
    p.close()
    lines = out.getvalue().splitlines()
    # Not a terminal: the first step, then one line per half of the total, and the last.
    assert len(lines) == 3 and lines[-1].startswith("[" + "#" * 24 + "] 4/4")


# --------------------------------------------------------------------------- real runs

TINY = ["--preset", "tiny", "--iters", "2", "--warmup", "1", "--quiet"]


def _check_outputs(out: str, algos: set[str], mode: str) -> list[dict]:
    with open(os.path.join(out, "results.csv")) as f:
        reader = csv.DictReader(f)
        assert reader.fieldnames == COLUMNS
        rows = list(reader)
    assert {r["algo"] for r in rows} == algos
    assert {r["pass"] for r in rows} == {"fwd", "bwd", "fwdbwd"}
    for r in rows:
        assert r["mode"] == mode
        if r["status"] != "ok":
            assert r["note"], "a skipped contender must say why"
            continue
        assert 0 < float(r["min_ms"]) <= float(r["median_ms"]) <= float(r["max_ms"])
        assert float(r["speedup_vs_ring"]) > 0 and float(r["ring_ccr"]) > 0
        if r["algo"] != "torch":
            assert float(r["bound_ms"]) > 0 and r["bound_by"] in ("cpu", "link")
        assert r["peak_mem_mb"] != ""
    with open(os.path.join(out, "results.json")) as f:
        doc = json.load(f)
    assert set(doc) == {"meta", "rows", "raw"}
    for key in ("config", "world", "mode", "cores", "topology", "memory_method", "points",
                "rates_Bps", "cross_rate_Bps", "notes"):
        assert key in doc["meta"], key
    assert len(doc["rows"]) == len(rows)
    assert set(doc["raw"]["0"]) >= {"ring/full", "ring/compute", "ring/comm"}
    png = os.path.join(out, "speedup_vs_ccr.png")
    assert os.path.getsize(png) > 1000
    with open(png, "rb") as f:
        assert f.read(8) == b"\x89PNG\r\n\x1a\n"
    return rows


def test_bench_four_cpu_ranks(tmp_path, capsys):
    out = str(tmp_path / "run")
    t0 = time.monotonic()
    assert cli_main(["bench", *TINY, "--ranks", "4", "--out", out]) == 0
    text = capsys.readouterr().out
    rows = _check_outputs(out, {*registry.names(), "torch"}, "local")
    assert "lower bound = max(" in text and "B=1 S=256 H=2x32" in text
    torch_rows = [r for r in rows if r["algo"] == "torch"]
    # PyTorch's CP either ran (with a note on how) or was skipped with its reason.
    assert all(r["note"] for r in torch_rows)
    assert cli_main(["report", "summary", os.path.join(out, "results.csv")]) == 0
    table = capsys.readouterr().out.splitlines()
    assert table[0].startswith("| run | S |") and len(table) == 2 + 2  # header, rule, fwd, fwdbwd
    print(f"4-rank bench: {time.monotonic() - t0:.1f} s")


def test_bench_usage_errors(capsys):
    assert cli_main(["bench", "--emulate", "2x2", "--quiet"]) == 2  # no --cross-rate
    assert "--cross-rate" in capsys.readouterr().err
    assert cli_main(["bench", "--preset", "tiny", "--seq", "250", "--ranks", "4"]) == 2


@pytest.fixture
def netns_ok():
    from charm_megatron.lab.emulate import available

    ok, why = available()
    if not ok:
        warnings.warn(f"bench emulation test skipped: {why}", stacklevel=1)
        print(f"SKIPPED: network namespaces unavailable here: {why}")
        pytest.skip(f"network namespaces unavailable: {why}")


def _ip_netns() -> set[str]:
    import subprocess

    res = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True, timeout=30,
                         check=True)
    return {line.split()[0] for line in res.stdout.splitlines() if line.strip()}


def test_bench_emulated_2x2(tmp_path, capsys, netns_ok):
    before = _ip_netns()
    out = str(tmp_path / "emu")
    args = ["bench", *TINY, "--algos", "ring,charm", "--emulate", "2x2", "--cross-rate",
            "200mbit", "--intra-rate", "1600mbit", "--nic", "rank", "--out", out]
    assert cli_main(args) == 0
    text = capsys.readouterr().out
    after = _ip_netns()
    # Namespaces of other processes may come and go meanwhile; ours are named after our pid.
    mine = f"cmemu-{os.getpid()}-"
    assert not {n for n in after if n.startswith(mine)}, "bench left namespaces behind"
    assert not {n for n in after - before if n.startswith(mine)}
    created = [line for line in text.splitlines() if line.startswith("emulated cluster cmemu-")]
    assert created and "removed" in text and "LEFT BEHIND" not in text
    assert "cross-node, one pair:" in text  # the measured rates are reported
    rows = _check_outputs(out, {"ring", "charm"}, "netns")
    assert all(r["nic"] == "rank" for r in rows)
    assert any(r["cross_link_mb"] and float(r["cross_link_mb"]) > 0 for r in rows)
    with open(os.path.join(out, "results.json")) as f:
        meta = json.load(f)["meta"]
    assert meta["cross_rate_source"] == "measured" and meta["cross_rate_Bps"] > 0
    assert meta["hw_groups"] == [[0, 1], [2, 3]]


def _links_rank(rank: int, world: int, nbytes: int) -> float:
    """One transfer through the transport the process's options select (the setup hook
    selects the software links)."""
    import torch
    import torch.distributed as dist

    from charm_megatron.ops.options import CPOptions
    from charm_megatron.ops.transport import P2P, get_transport

    transport = get_transport(CPOptions.from_env().transport)
    assert transport.name == "software_links", transport
    t = torch.zeros(nbytes // 4)
    dist.barrier()
    t0 = time.monotonic()
    for w in transport.post([P2P(rank == 0, t, 1 - rank)]):
        w.wait()
    return time.monotonic() - t0


def test_software_links_throttle_gloo_p2p():
    """The fallback really slows this package's P2P down to the modelled cross rate."""
    import tempfile

    from charm_megatron.lab.bench.links import SoftwareLinkSetup
    from charm_megatron.lab.emulate import SoftwareLinks
    from charm_megatron.local_ranks import run_ranks

    nbytes = 1 << 20
    with tempfile.TemporaryDirectory() as state:
        spec = SoftwareLinks(2, 1, cross_rate=8e6, nic="rank", state_dir=state)  # 8 MB/s
        took = run_ranks(_links_rank, 2, nbytes, setup=SoftwareLinkSetup(spec), timeout_s=60)
    assert min(took) >= nbytes / 8e6 * 0.95, took


# --------------------------------------------------------------------------- ablated variants
def _ablated_variants(rank: int, world: int) -> dict:
    """Each bench variant of a plan contender runs with its own ``CPOptions.ablation`` (sbhd
    and packed THD), and switching communication off really changes the result."""
    import torch

    from charm_megatron.lab.bench.contenders import PlanContender

    torch.manual_seed(rank)
    q, k, v = (torch.randn(8, 1, 2, 8) for _ in range(3))
    packed = {"cu_seqlens": torch.tensor([0, 6, 14], dtype=torch.int32),
              "cu_seqlens_padded": torch.tensor([0, 8, 16], dtype=torch.int32)}
    out: dict = {}
    for name, c, args in (("sbhd", PlanContender("ring", None, True), (q, k, v)),
                          ("thd", PlanContender("ring", None, True, packed),
                           (q[:, 0], k[:, 0], v[:, 0]))):
        full = c(*args)
        for ablation in ("compute_only", "comm_only"):
            variant = c.ablated(ablation)
            res = variant(*args)
            out[name, ablation] = (variant.options.ablation, c.options.ablation,
                                   bool((res - full).abs().max() > 1e-3))
    return out


# With computation off nothing is computed, and with communication off the peers' blocks are
# zeros instead of their data (next test): either way the output differs from the full run's.
MUST_DIFFER = {"compute_only": True, "comm_only": True}


def test_plan_contender_ablations_reach_cp_attention():
    from charm_megatron.local_ranks import run_ranks

    for res in run_ranks(_ablated_variants, 2, timeout_s=120):
        for (_, ablation), (got, base, differs) in res.items():
            assert (got, base) == (ablation, "none")
            if MUST_DIFFER[ablation]:
                assert differs, ablation


def _compute_only_sees_zero_blocks(rank: int, world: int) -> float:
    """A comm-off (compute-only) ring call: the peer's kv block it 'receives' must be zeros,
    not whatever stale bytes its buffer was given (NaNs or denormals, which the CPU kernels
    time several times slower). Returns the largest error against that expectation (NaN
    where stale NaNs got through)."""
    import torch

    from charm_megatron.lab.bench.contenders import PlanContender

    torch.manual_seed(10 + rank)
    q, k, v = (torch.randn(16, 1, 2, 8) for _ in range(3))
    contender = PlanContender("ring", None, False)
    contender(q, k, v)
    # Leave freed NaN-filled blocks of a kv block's size for the allocator to hand out again.
    junk = [torch.full((16, 1, 2, 8), float("nan")) for _ in range(32)]
    del junk
    got = contender.ablated("compute_only")(q, k, v).double()
    # Full attention over [own keys, 16 zero keys]: a zero key scores 0 and carries value 0.
    scores = torch.einsum("sbhd,tbhd->bhst", q.double(), k.double()) / 8 ** 0.5
    scores = torch.cat([scores, torch.zeros_like(scores)], dim=-1)
    values = torch.cat([v.double(), torch.zeros_like(v.double())], dim=0)
    want = torch.einsum("bhst,tbhd->sbhd", scores.softmax(-1), values)
    return float((got - want).abs().max())


def test_compute_only_runs_receive_zeros():
    from charm_megatron.local_ranks import run_ranks

    for err in run_ranks(_compute_only_sees_zero_blocks, 2, timeout_s=120):
        assert err < 1e-5, err  # also fails on NaN


def test_gc_is_off_inside_timed_calls_and_restored():
    """The timed region runs with the cyclic collector off (a full collection inside a call
    would stall that rank and all waiting on it); it is back on afterwards, also after an
    error, and a caller that had it off keeps it off."""
    import gc

    from charm_megatron.lab.bench.measure import _gc_between_calls

    assert gc.isenabled()
    with _gc_between_calls():
        assert not gc.isenabled()
    assert gc.isenabled()
    with pytest.raises(RuntimeError), _gc_between_calls():
        raise RuntimeError("a failing call")
    assert gc.isenabled()
    gc.disable()
    try:
        with _gc_between_calls():
            pass
        assert not gc.isenabled()
    finally:
        gc.enable()


def test_bench_window_on_cpu_ranks_leaves_torch_out(tmp_path, capsys):
    # A window on every call; PyTorch's CP takes none, so it is left out with its reason.
    out = str(tmp_path / "run")
    assert cli_main(["bench", *TINY, "--ranks", "2", "--algos", "ring,charm,torch",
                     "--window", "40", "--out", out]) == 0
    assert "window 40,0" in capsys.readouterr().out
    rows = _check_outputs(out, {"ring", "charm", "torch"}, "local")
    assert {r["window"] for r in rows} == {"40,0"}
    torch_rows = [r for r in rows if r["algo"] == "torch"]
    assert all(r["status"] != "ok" and "window" in r["note"] for r in torch_rows)
