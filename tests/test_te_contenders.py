"""TransformerEngine's CP types as shipped (``te-*``) and the kernel rate curves they run on:
the profiles' curves, TE's refusals, the model's predictions and table, the ``te`` report and
the bench's contenders (CPU testbed and emulated cluster)."""

from __future__ import annotations

import csv
import json
from dataclasses import replace
from pathlib import Path

import pytest

from charm_megatron.cli import main as cli_main
from charm_megatron.devices import dumps, get_profile
from charm_megatron.devices.schema import profile_from_dict
from charm_megatron.model import predict
from charm_megatron.model.kernel_rates import KERNEL_FIELDS, KernelRates, cluster_on, kernels_of
from charm_megatron.model.te_contenders import (
    TE_KERNEL,
    TE_NAMES,
    fastest_te,
    predict_te,
    predict_te_all,
    ring_collective_seconds,
    te_cluster,
    te_refusal,
)
from charm_megatron.plan.cost import Problem
from charm_megatron.plan.registry import CallTraits

G2x8 = [list(range(8)), list(range(8, 16))]
LLAMA = Problem(1, 32768, 32, 8, 128)


# ---------------------------------------------------------------------------- kernel curves
def test_gpu_profiles_carry_our_measured_kernel_and_assumed_hopper_kernels() -> None:
    h200 = get_profile("h200")
    known = kernels_of(h200)
    assert h200.kernel == "aten-flash"
    assert known["aten-flash"].status == "measured"
    assert known["cudnn"].status == known["fa3"].status == "assumed"
    assert "assumed" in known["cudnn"].source and "FA-3 paper" in known["cudnn"].source
    # Our curve is the cluster's; the assumed ones are faster (the published ratios are
    # 1.6x / 1.8x at head dim 128) and keep the measured fixed rows.
    assert known["aten-flash"].tflops == h200.cluster.tflops
    assert known["cudnn"].tflops == pytest.approx(1.609 * h200.cluster.tflops, rel=0.01)
    assert known["fa3"].tflops > known["cudnn"].tflops
    assert known["cudnn"].kernel_q_rows == h200.cluster.kernel_q_rows
    # h100 takes the same measured curve (the same GH100 die and clocks).
    h100 = kernels_of(get_profile("h100"))["aten-flash"]
    assert h100.status == "measured" and h100.tflops == known["aten-flash"].tflops


def test_cluster_on_a_kernel_changes_the_kernel_terms_only() -> None:
    h200 = get_profile("h200")
    on = cluster_on(h200, "cudnn")
    for f in KERNEL_FIELDS:
        assert getattr(on, f) == getattr(kernels_of(h200)["cudnn"], f)
    same = {f: getattr(on, f) for f in ("intra_gbps", "cross_gbps", "op_overhead_us",
                                        "merge_gbps", "comm_slowdown", "nic")}
    assert same == {f: getattr(h200.cluster, f) for f in same}
    with pytest.raises(ValueError, match="no rate curve for kernel 'fa4'.*aten-flash"):
        cluster_on(h200, "fa4")


def test_kernel_curves_survive_the_profile_file_and_bad_ones_are_named() -> None:
    h200 = get_profile("h200")
    back = profile_from_dict(json.loads(dumps(h200)))
    assert back.kernel == h200.kernel
    assert {k.name: k for k in back.kernels} == {k.name: k for k in h200.kernels}
    data = json.loads(dumps(h200))
    data["kernels"]["cudnn"]["tflop"] = 1.0
    with pytest.raises(ValueError, match="kernel 'cudnn': unknown fields"):
        profile_from_dict(data, "x.json")
    data["kernels"]["cudnn"].pop("tflop")
    data["kernels"]["cudnn"]["status"] = "guessed"
    with pytest.raises(ValueError, match="status must be one of"):
        profile_from_dict(data, "x.json")
    # A profile without curves has its own cluster's, marked assumed.
    plain = replace(h200, kernel="", kernels=())
    assert kernels_of(plain)["default"].status == "assumed"
    # No TE curve: TE priced on the profile's own, its SM contention on one communicator,
    # its all-to-alls' copies TE's.
    assert te_cluster(plain) == plain.cluster.with_(comm_slowdown_streams=1, head_copies="te")
    with pytest.raises(ValueError, match="must be > 0"):
        KernelRates("x", "assumed", "", 0.0, 1.0)


# ---------------------------------------------------------------------------- TE's refusals
@pytest.mark.parametrize(("name", "traits", "why"), [
    ("te-p2p", dict(windowed=True), "sliding window only with cp_comm_type a2a or all_gather"),
    ("te-p2p", dict(offset=True), "attention sinks"),
    ("te-a2a+p2p", dict(packed=True), "no packed"),
    ("te-a2a+p2p", dict(windowed=True), "sliding window"),
    ("te-allgather", dict(offset=True), "attention sinks"),
    ("te-a2a", dict(hkv=8), "divide"),  # 8 kv heads on 16 ranks: TE's a2a refuses GQA so
])
def test_te_refuses_what_transformer_engine_refuses(name: str, traits: dict, why: str) -> None:
    t = CallTraits(tuple(tuple(g) for g in G2x8), traits.pop("hq", 32), traits.pop("hkv", 32),
                   **traits)
    assert why in te_refusal(name, t)


def test_te_runs_what_transformer_engine_runs() -> None:
    t = CallTraits(tuple(tuple(g) for g in G2x8), 32, 32)
    for name in TE_NAMES:
        assert te_refusal(name, t) is None
    assert te_refusal("te-a2a", replace(t, windowed=True, offset=True, packed=True)) is None
    assert te_refusal("te-allgather", replace(t, windowed=True, packed=True)) is None
    assert te_refusal("te-p2p", replace(t, packed=True)) is None
    with pytest.raises(ValueError, match="unknown TransformerEngine contender 'te-ring'"):
        te_refusal("te-ring", t)


# ---------------------------------------------------------------------------- predictions
def test_te_is_our_plan_on_te_s_kernel() -> None:
    """TE's conventions match the plan that moves its blocks (input-dtype partials, the
    same messages), so te-X is our X priced on cuDNN's curve, and faster than our X on our
    measured FA-2 curve."""
    h200 = get_profile("h200")
    te_cl = te_cluster(h200)
    for name, algo in (("te-p2p", "ring"), ("te-a2a+p2p", "a2a+p2p")):
        te = predict_te(name, G2x8, LLAMA, te_cl, True)
        assert te.algo == name
        assert te.total_s == pytest.approx(predict(algo, G2x8, LLAMA, te_cl, True).total_s)
        assert te.total_s < predict(algo, G2x8, LLAMA, h200.cluster, True).total_s
    preds = predict_te_all(G2x8, LLAMA, te_cl, True)
    assert set(preds) == {"te-p2p", "te-a2a+p2p", "te-allgather"}  # te-a2a: 8 kv heads
    best = fastest_te(G2x8, LLAMA, te_cl, True)
    assert best.algo == min(preds, key=lambda n: preds[n].total_s) == "te-a2a+p2p"
    with pytest.raises(ValueError, match="sliding window"):
        predict_te("te-p2p", G2x8, replace(LLAMA, window=(4096, 0)), te_cl, True)


def test_te_allgather_is_its_tiles_after_synchronous_ring_collectives() -> None:
    """TE's all-gather: our allgather's tiles with free messages, plus NCCL ring collectives
    that nothing overlaps (forward: gather kv; backward: gather kv, reduce-scatter dkv), whose
    cross bytes share the node's NICs: one NIC per node is 8x slower than one per GPU."""
    te_cl = te_cluster(get_profile("h200"))
    kv = LLAMA.block_bytes("kv", 16) * 16
    share = 15 / 16 * kv
    rank = ring_collective_seconds(kv, G2x8, te_cl)
    node = ring_collective_seconds(kv, G2x8, te_cl.with_(nic="node"))
    assert rank == pytest.approx(share / (8 * 25.6e9) + 15 * 10e-6)
    assert node == pytest.approx(share / 25.6e9 + 15 * 10e-6)
    flat = ring_collective_seconds(kv, [list(range(16))], te_cl)
    assert flat == pytest.approx(share / 450e9 + 15 * 10e-6)  # NVLink ports only
    te = predict_te("te-allgather", G2x8, LLAMA, te_cl, True)
    tiles = predict("allgather", G2x8, LLAMA, te_cl, True, compute_only=True)
    assert te.forward.time_s == pytest.approx(tiles.forward.time_s + rank)
    assert te.backward.time_s == pytest.approx(tiles.backward.time_s + 2 * rank)
    assert fastest_te(G2x8, LLAMA, te_cl, True, sinks=True) is None  # te-a2a alone takes sinks


# ---------------------------------------------------------------------------- the commands
def _out(capsys, *args: str) -> str:
    assert cli_main(list(args)) == 0
    return capsys.readouterr().out


def test_model_prints_te_rows_and_prices_our_tiles_on_a_named_kernel(capsys) -> None:
    base = ("model", "--profile", "h200", "--topology", "2x8", "--seq", "32768", "--heads",
            "32", "--kv-heads", "8", "--causal", "--tune")
    out = _out(capsys, *base)
    rows = {line.split()[0]: line.split() for line in out.splitlines() if line[:3] == "te-"}
    assert set(rows) == {"te-p2p", "te-a2a+p2p", "te-allgather"}
    assert f"on its kernel ({TE_KERNEL}, assumed" in out
    assert "# fastest TransformerEngine: te-a2a+p2p" in out
    on_cudnn = _out(capsys, *base, "--kernel", "cudnn")
    assert "our tiles on kernel cudnn" in on_cudnn and "attention 572.1 TFLOP/s" in on_cudnn
    assert "te-p2p" not in _out(capsys, *base, "--no-te")
    assert "te-p2p" not in _out(capsys, "model", "--profile", "cpu-testbed", "--topology", "2x2",
                                "--seq", "4096")
    with pytest.raises(SystemExit, match="--kernel names a rate curve of a profile"):
        cli_main(["model", "--topology", "2x2", "--kernel", "cudnn"])


def test_report_te_puts_the_fastest_te_beside_our_auto(capsys) -> None:
    out = _out(capsys, "report", "te", "--topologies", "2x8", "--nics", "rank", "--only",
               "32k")
    lines = [line for line in out.splitlines() if line.startswith("| 2x8")]
    assert "fastest TE (cudnn, assumed)" in out and "ours, auto (FA-2, measured)" in out
    qwen = next(line for line in lines if "Qwen" in line)
    assert "te-p2p" in qwen  # 4 kv heads: TE's head all-to-alls refuse
    llama = next(line for line in lines if "8B 32/8 32k" in line)
    cells = [c.strip() for c in llama.split("|")]
    te_ms, ours_ms = float(cells[4].split()[1]), float(cells[5].split()[1])
    assert cells[6] == f"{te_ms / ours_ms:.2f}x"


# ---------------------------------------------------------------------------- the bench
def test_bench_runs_te_contenders_on_cpu_ranks_and_skips_what_te_refuses(tmp_path) -> None:
    out = tmp_path / "run"
    assert cli_main(["bench", "--preset", "tiny", "--ranks", "2", "--algos",
                     "ring,te-p2p,te-allgather", "--window", "40", "--no-plot", "--quiet",
                     "--no-memory", "--out", str(out)]) == 0
    rows = list(csv.DictReader(open(out / "results.csv")))
    status = {r["algo"]: (r["status"], r["note"]) for r in rows}
    assert status["te-p2p"][0] == "skipped" and "sliding window" in status["te-p2p"][1]
    assert status["te-allgather"][0] == "ok"
    assert "TransformerEngine cp_comm_type all_gather" in status["te-allgather"][1]
    assert all(float(r["median_ms"]) > 0 for r in rows if r["status"] == "ok")


def test_emulated_te_p2p_runs_on_te_s_kernel_within_the_model(tmp_path) -> None:
    """Two emulated H200s (one cross link): te-p2p is ring's plan on cuDNN's curve, so its
    device time is shorter than ring's and within 10 % of the model on that curve. S=32k at
    dilation 80 (auto would stretch its 4 ms steps for 16-32 processes, not 2): ~19 s."""
    out = tmp_path / "run"
    assert cli_main(["bench", "--emulate", "2x1", "--device-model", "h200", "--batch", "1",
                     "--seq", "32768", "--heads", "16x128", "--algos", "ring,te-p2p,te-allgather",
                     "--dtype", "bf16", "--dilation", "80", "--warmup", "1", "--iters", "2",
                     "--out", str(out), "--no-plot", "--quiet"]) == 0
    rows = {(r["algo"], r["pass"]): r for r in csv.DictReader(open(out / "results.csv"))}
    ag = rows["te-allgather", "fwdbwd"]
    assert ag["status"] == "skipped" and "NCCL ring collectives" in ag["note"]
    ring, te = rows["ring", "fwdbwd"], rows["te-p2p", "fwdbwd"]
    assert float(te["median_ms"]) < float(ring["median_ms"])
    assert abs(float(te["vs_model"]) - 1) < 0.10, te["vs_model"]
    problem = Problem(1, 32768, 16, 16, 128)
    model = predict("ring", [[0], [1]], problem, te_cluster(get_profile("h200")), True)
    assert float(te["model_ms"]) == pytest.approx(model.total_s * 1e3, rel=0.02)
    assert te["analytic_ring_ms"] == "" and ring["analytic_ring_ms"] != ""


def test_report_te_emulated_reads_the_docs_runs(capsys) -> None:
    """The emulated table of docs/performance.md from its CSVs: TE's fastest timed contender
    beside our auto, and where TE's fastest is its all-gather (not timed by the emulator),
    the model's price of it, marked."""
    from pathlib import Path

    csvs = sorted(str(p) for p in (Path(__file__).resolve().parents[1] / "docs" /
                                   "performance" / "te-grid").glob("llama8b-2x8-s[36]*.csv"))
    assert csvs
    out = _out(capsys, "report", "te", "--emulated", *csvs)
    rows = {line.split("|")[1].split()[0]: [c.strip() for c in line.split("|")]
            for line in out.splitlines() if line.startswith("| ") and "(h200)" in line}
    assert set(rows) == {Path(p).stem for p in csvs}
    for cells in rows.values():
        te_ms = float(cells[3].split()[1])
        ours_ms = float(cells[4].split()[1].rstrip("†"))
        assert float(cells[5].rstrip("x")) == pytest.approx(te_ms / ours_ms, abs=0.011)
    assert "(model only)" in rows["llama8b-2x8-s65536-w4096"][3]
    assert rows["llama8b-2x8-s32768"][3].startswith("te-a2a+p2p")


def test_emulated_tables_price_te_beside_ours_by_the_model():
    """Every emulated table's TE column: TE's fastest type at the row's point on its device
    (12 heads: only its all-gather and ring run; Llama-like GQA: its a2a+p2p), over our
    fastest by the model; a CPU-testbed row has none."""
    from charm_megatron.lab.reports import peers
    from charm_megatron.lab.reports.te_shipped import te_beside

    root = Path(__file__).resolve().parents[1] / "docs" / "performance" / "peers"
    t5 = peers.load(root / "t5-2x8-b16-s26880.csv")
    ours = predict("charm", G2x8, Problem(16, 26880, 12, 12, 192), get_profile("h100").cluster,
                   False, tune=True).total_s * 1e3
    name, ms, ratio = te_beside(t5.any, ["charm"]).split(" ")
    assert name == "te-allgather" and ratio == f"({float(ms) / ours:.2f}x)"
    # Our fastest of the run's contenders, whatever else is listed (refused or TE's own).
    assert te_beside(t5.any, ["charm", "a2a", "te-p2p", "auto"]) == f"{name} {ms} {ratio}"
    llama = peers.load(root / "llama8b-2x8-s32768.csv")
    assert te_beside(llama.any, ["ring"], "fwd").startswith("te-a2a+p2p ")
    cpu = peers.load(root / "cpu-2x4-node-100mbit-kv8.csv")
    assert te_beside(cpu.any, ["ring"]) == "-"
