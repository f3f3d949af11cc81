"""Regenerate the shipped profiles (``profile_data/*.json``) from their sources.

``python -m charm_megatron.lab.calibration.refit [--check]`` (from the repository root):

* ``h100``: Table 2's links; FlashAttention-2's H100 kernel curve (:mod:`.paper`) for the
  kernel rate against tile size and head dim; the overlap slowdown of Lee et al.; the cross
  rate *fitted on the ring columns of Table 5* (never on its CHARM+ columns);
* ``h20``: Table 2's links, the cross rate scaled by the fraction of Table 2's rate the H100
  ring reached (same RDMA NIC class, same test); kernel rate assumed (no published curve);
* ``l20-pcie``: Table 2's links (PCIe: no ring measurement to fit on); kernel rate assumed;
* ``h20-table4``: H20 as the paper's Table 4 ring ran on it: one problem shape from the paper's
  grid and the H20 device's rate, cross rate and per-op cost fitted on *the ring column* of
  Table 4 (``l20-pcie`` unchanged on its L20 rows; RM+ and CHARM+ columns never used);
* ``h200``: this package on H200 nodes: the compute terms ``scripts/gpu_check.py`` measured
  on one H200 (``measurements/h200-gpu-check.json``: kernel curve, head dims, backward
  factor, per-op cost, the fused merge's rate) on the ``h100`` profile's links (HGX H200
  nodes have the H100's NVLink 4 and NICs);
* ``h100-paper-measured``: ``h100-paper`` with that measured kernel (the paper's runs used
  FlashAttention-2 on the same SMs) and the merge rate of PyTorch elementwise ops measured
  there (what a merge written in PyTorch, as ring-flash-attention's and presumably the
  paper's, runs at); its per-op cost stays Table 4's;
* ``cpu-testbed``: ``charm-megatron model --calibrate`` on ``docs/performance/*.csv`` (the
  quiet-machine bench runs; ring rows only).

``--check`` exits 1 if a shipped file differs from what the sources give now.
"""

from __future__ import annotations

import argparse
import glob
import math
import sys
from dataclasses import replace
from pathlib import Path

from charm_megatron.lab.calibration import paper
from charm_megatron.lab.calibration.calibrate import _sim_ms, coordinate_descent
from charm_megatron.model.cluster import Cluster, Profile
from charm_megatron.model.profile_io import PROFILE_DIR, dumps
from charm_megatron.plan.cost import Problem

# The docs' bench runs predate the bench's intra_rate_mbps / cross_burst_kb columns: the rates
# the harness printed before those runs (docs/performance.md, "Method") and the emulator's
# default buckets (charm_megatron.lab.emulate.cluster: 512 KiB cross, 4 MiB intra).
DOCS_BENCH = "docs/performance/*.csv"
DOCS_BENCH_INTRA_GBPS = 0.1118
DOCS_BENCH_CROSS_BURST_KB = 512.0
DOCS_BENCH_INTRA_BURST_KB = 4096.0
DOCS_BENCH_CORES = 2


def fit_kernel_curve(curve: dict[int, float]) -> tuple[float, float]:
    """(long-tile TFLOP/s, rows) of ``rate(L) = R / (1 + 2 * rows / L)`` through a curve
    measured with square tiles of ``L`` rows: least squares of ``1/rate`` on ``1/L``."""
    xs = [1.0 / L for L in curve]
    ys = [1.0 / r for r in curve.values()]
    n = len(xs)
    mx, my = sum(xs) / n, sum(ys) / n
    slope = sum((x - mx) * (y - my) for x, y in zip(xs, ys)) / sum((x - mx) ** 2 for x in xs)
    icept = my - slope * mx
    if icept <= 0 or slope < 0:  # noise (a loaded machine, too few points): no size effect
        return max(curve.values()), 0.0
    return 1.0 / icept, slope / (2.0 * icept)


def _r(x: float) -> float:
    return float(f"{x:.4g}")


def kernel_terms() -> dict[str, object]:
    """Cluster fields from FlashAttention-2's H100 curves (rate at head dim 128 = 1)."""
    r128, rows128 = fit_kernel_curve(paper.FA2_H100_FWD[128])
    r256, _ = fit_kernel_curve(paper.FA2_H100_FWD[256])
    fwd, bwd = paper.FA2_FWD_BWD_UTILISATION
    return {"kernel_q_rows": _r(rows128), "kernel_k_rows": _r(rows128),
            "head_dim_factors": ((128.0, 1.0), (256.0, _r(r256 / r128))),
            "bwd_factor": _r(2.5 * fwd / bwd), "long_tile_tflops_h100": _r(r128)}


# One H200's measurement by scripts/gpu_check.py (2026-12-04, torch 2.11.0+cu130; the run's
# logs: docs/performance/gpu-check/). A profile file whose fit holds the kernel table and the
# overheads it measured.
H200_MEASUREMENT = (Path(__file__).resolve().parents[2] / "model" / "measurements"
                    / "h200-gpu-check.json")

# The compute terms a gpu_check run measures (everything else of its profile is its base's).
MEASURED_FIELDS = ("tflops", "kernel_q_rows", "kernel_k_rows", "head_dim_factors", "bwd_factor",
                   "op_overhead_us", "merge_gbps")


def measured_terms(path: Path = H200_MEASUREMENT) -> tuple[dict[str, object], dict]:
    """(cluster fields of :data:`MEASURED_FIELDS`, the run's fit record) of a gpu_check
    profile file."""
    from charm_megatron.model.profile_io import load_profile

    prof = load_profile(path)
    if not prof.fit.get("checks_ok"):
        raise ValueError(f"{path}: its correctness checks failed; a measured profile needs a "
                         "run whose kernels were right")
    return {f: getattr(prof.cluster, f) for f in MEASURED_FIELDS}, prof.fit


def measured_profiles(h100: Cluster, h100p: Cluster, fit_h100: dict) -> dict[str, Profile]:
    """``h200`` and ``h100-paper-measured`` (module docstring) from :data:`H200_MEASUREMENT`."""
    terms, fit = measured_terms()
    over = fit["overheads"]
    unfused = _r(over["merge_unfused_gbps"])
    rel = str(H200_MEASUREMENT.relative_to(H200_MEASUREMENT.parents[2]))
    kernel = (f"FlashAttention-2 (aten) measured on one {fit['device']}: {terms['tflops']:g} "
              f"TFLOP/s long-tile forward at head dim 128, {terms['kernel_q_rows']:g} rows of "
              f"fixed cost per tile side, backward x{terms['bwd_factor']:g}")
    h200 = replace(h100, **terms)
    out = {"h200": Profile(
        "h200", h200, "2x8",
        f"this package on H200 nodes of 8: the h100 profile's links (NVLink 4, one RDMA NIC per "
        f"GPU, cross rate fitted on Table 5's ring forward) with compute measured by "
        f"scripts/gpu_check.py: {kernel}; {terms['op_overhead_us']:g} us per compute op (a tiny "
        f"tile issued back to back); merges fused ({over['merge_path']}) at "
        f"{terms['merge_gbps']:g} GB/s of partial",
        {**fit_h100, "method": fit_h100["method"] + f"; compute terms measured ({rel})",
         "measured": {"file": rel, "device": fit["device"], "fields": list(MEASURED_FIELDS)}})}
    paper_terms = {f: terms[f] for f in MEASURED_FIELDS if f not in ("op_overhead_us",
                                                                       "merge_gbps")}
    hpm = replace(h100p, merge_gbps=unfused, **paper_terms)
    out["h100-paper-measured"] = Profile(
        "h100-paper-measured", hpm, "2x8",
        f"the h100-paper profile (the paper's implementation: {h100p.op_overhead_us:g} us per "
        f"compute op from Table 4's ring column) with the kernel measured on one "
        f"{fit['device']} ({kernel}) and merges at {unfused:g} GB/s, the rate of PyTorch "
        "elementwise ops measured there (assumed the paper's merge; an H100 has 0.7x the "
        "H200's memory bandwidth); no CHARM+ column used",
        {**fit_h100, "method": fit_h100["method"] + "; op_overhead_us from h20-table4 (Table 4 "
                                                    f"ring column); kernel and merge measured "
                                                    f"({rel})",
         "inputs": {"paper Table 5": "ring", "paper Table 4": "ring"},
         "measured": {"file": rel, "device": fit["device"],
                      "fields": [*paper_terms, "merge_gbps (PyTorch ops)"]}})
    return out


def table5_problem(row: paper.Table5Row) -> Problem:
    return Problem(row.b, row.s, paper.TABLE5_HEADS, paper.TABLE5_HEADS, paper.TABLE5_HEAD_DIM,
                   paper.TABLE5_ELEM, wide_partials=paper.TABLE5_WIDE_PARTIALS)


# The fit uses the ring's *forward* only (k and v in bf16, no partials on the wire). The
# paper's ring backward takes 3.0x its forward at every row, which is what sending dk/dv in
# fp32 gives (kv + 2 kv bytes); the rows are predicted so (paper.TABLE5_WIDE_PARTIALS), and the
# backward stays a prediction the fit never saw.
TABLE5_FIT_PASSES = ("fwd",)


def table5_ring_error(cluster: Cluster) -> float:
    """Mean squared log error of the ring's forward against Table 5."""
    errs = []
    for row in paper.TABLE5:
        prob = table5_problem(row)
        for pas, meas in (("fwd", row.ring_fwd), ("bwd", row.ring_bwd)):
            if pas not in TABLE5_FIT_PASSES:
                continue
            pred = _sim_ms(cluster, row.topology, prob, paper.TABLE5_CAUSAL, "ring", pas)
            errs.append(math.log(pred / meas) ** 2)
    return sum(errs) / len(errs)


# What the Table 4 fit may move on the H20 device: its attention rate, its cross rate and a
# fixed cost per compute op (the paper's ring at 8 H20 and 1792 tokens takes as long as at 4
# H20 with twice the compute per rank: only a fixed cost per step gives that).
TABLE4_FIT_FIELDS = ("tflops", "cross_gbps", "op_overhead_us")


def table4_shapes() -> list[tuple[int, int, int]]:
    """(batch, heads, head dim) of the paper's grid that Table 4's longest row allows."""
    longest = max(r.s for r in paper.TABLE4)
    return [(b, h, d) for b in (4, 6, 8, 12, 16, 24, 32, 48, 64)
            for h in paper.TABLE4_HEADS for d in paper.TABLE4_HEAD_DIMS
            if b * longest <= paper.TABLE4_MAX_TOKENS]


def table4_problem(row: paper.Table4Row, shape: tuple[int, int, int]) -> Problem:
    b, h, d = shape
    return Problem(b, row.s, h, h, d, paper.TABLE4_ELEM)


def table4_ring_error(clusters: dict[str, Cluster], shape: tuple[int, int, int],
                      gpus: tuple[str, ...] = ("L20", "H20")) -> float:
    """Sum of squared log errors of the ring's forward against Table 4's rows of ``gpus``
    (``clusters``: GPU name -> cluster)."""
    return sum(math.log(_sim_ms(clusters[r.gpu], r.topology, table4_problem(r, shape),
                                paper.TABLE4_CAUSAL, "ring", "fwd") / r.ring) ** 2
               for r in paper.TABLE4 if r.gpu in gpus)


def fit_table4(l20: Cluster, h20: Cluster) -> tuple[tuple[int, int, int], Cluster, float]:
    """(shape, fitted H20 cluster, rms log error over the ring column): for every shape of
    :func:`table4_shapes`, the H20 fields of :data:`TABLE4_FIT_FIELDS` by coordinate descent on
    the H20 ring rows; the shape with the least error over all ten ring rows (the L20 rows on
    ``l20`` as shipped: Table 2's PCIe rates make them comm-bound, which pins the bytes)."""
    best: tuple[float, tuple[int, int, int], Cluster] | None = None
    for shape in table4_shapes():
        cl, err = coordinate_descent(
            h20, TABLE4_FIT_FIELDS,
            lambda c, shape=shape: table4_ring_error({"H20": c}, shape, ("H20",)), step=2.0,
            min_step=1.01)
        cl = replace(cl, **{f: _r(getattr(cl, f)) for f in TABLE4_FIT_FIELDS})
        total = table4_ring_error({"L20": l20, "H20": cl}, shape)
        if best is None or total < best[0]:
            best = (total, shape, cl)
    assert best is not None
    return best[1], best[2], math.sqrt(best[0] / len(paper.TABLE4))


def gpu_profiles() -> dict[str, Profile]:
    k = kernel_terms()
    fields = {n: k[n] for n in ("kernel_q_rows", "kernel_k_rows", "head_dim_factors",
                                "bwd_factor")}
    slow = paper.OVERLAP_COMPUTE_SLOWDOWN
    peak, cross, intra = paper.TABLE2["H100"]
    h100 = Cluster(intra_gbps=intra, cross_gbps=cross, tflops=float(k["long_tile_tflops_h100"]),
                   nic="rank", latency_us=10.0, merge_gbps=800.0, op_overhead_us=10.0,
                   intra_port_gbps=450.0, comm_slowdown=slow, **fields)
    h100, err = coordinate_descent(h100, ("cross_gbps",), table5_ring_error, step=1.5,
                                   min_step=1.005)
    h100 = replace(h100, cross_gbps=_r(h100.cross_gbps))
    eff = h100.cross_gbps / cross
    fit_h100 = {"method": "charm_megatron.lab.calibration.refit: cross_gbps by log error on Table 5 ring "
                          "forward (8 numbers); everything else from published sources",
                "inputs": {"paper Table 5": "ring"}, "fit_algos": ["ring"],
                "passes": list(TABLE5_FIT_PASSES), "rms_log_error": round(math.sqrt(err), 4),
                "cross_fraction_of_table2": round(eff, 4)}
    src_k = ("kernel: FlashAttention-2 on H100 (FA-3 paper's forward-speed bars), fitted "
             f"long-tile {k['long_tile_tflops_h100']} TFLOP/s at head dim 128, {k['kernel_q_rows']} "
             "rows of fixed cost per tile side, head dim 256 at "
             f"{fields['head_dim_factors'][1][1]}x; backward x{fields['bwd_factor']} "
             "(FA-2: 73 % / 63 % utilisation); compute +18.9 % while messages move (Lee et al. "
             "2025)")
    out = {
        "h100": Profile(
            "h100", h100, "2x8",
            f"H100 SXM nodes of 8: NVLink {intra} GB/s per message (Table 2), 450 GB/s per port "
            f"(NVLink4); one RDMA NIC per GPU, Table 2 says {cross} GB/s, the ring columns of "
            f"Table 5 (forward) give {h100.cross_gbps:g} GB/s ({eff:.0%}; fitted, CHARM+ columns unused); "
            + src_k, fit_h100),
    }
    peak20, cross20, intra20 = paper.TABLE2["H20"]
    h20 = Cluster(intra_gbps=intra20, cross_gbps=_r(cross20 * eff), tflops=_r(0.6 * peak20),
                  nic="rank", latency_us=10.0, merge_gbps=1000.0, op_overhead_us=10.0,
                  intra_port_gbps=450.0, comm_slowdown=slow, **fields)
    out["h20"] = Profile(
        "h20", h20, "2x8",
        f"2 nodes x 8 H20: NVLink {intra20} GB/s per message (Table 2), 450 GB/s per port; one "
        f"RDMA NIC per GPU at Table 2's {cross20} GB/s x {eff:.2f} (the fraction the H100 ring "
        f"reached; no H20 ring data with a stated problem size); attention assumed 60 % of the "
        f"{peak20} TFLOP/s peak (no published curve), tile and head-dim shape as H100's",
        {"method": "no fit: Table 2 and the H100 profile's ring-derived NIC fraction"})
    peakl, crossl, intral = paper.TABLE2["L20"]
    l20 = Cluster(intra_gbps=intral, cross_gbps=crossl, tflops=_r(0.5 * peakl), nic="node",
                  latency_us=10.0, cross_via_intra=True, merge_gbps=200.0, op_overhead_us=10.0,
                  comm_slowdown=slow, **fields)
    out["l20-pcie"] = Profile(
        "l20-pcie", l20, "2x4",
        f"8x L20 in one dual-NUMA PCIe node (Table 2: {intral} GB/s intra-NUMA, {crossl} GB/s "
        "cross-NUMA); cross traffic shares the inter-socket path (nic=node) and each GPU's x16 "
        f"link; attention assumed 50 % of the {peakl} TFLOP/s peak (no published curve)",
        {"method": "no fit: Table 2 (no L20 ring data with a stated problem size)"})
    shape, h20t4, err4 = fit_table4(l20, h20)
    b, h, d = shape
    out["h20-table4"] = Profile(
        "h20-table4", h20t4, "2x8",
        f"2 nodes x 8 H20 as the paper's Table 4 ring ran on them (its implementation included): "
        f"the h20 profile with attention at {h20t4.tflops:g} TFLOP/s, {h20t4.cross_gbps:g} GB/s "
        f"cross and {h20t4.op_overhead_us:g} us per compute op, fitted on Table 4's ring column "
        f"with its shape assumed B={b}, {h} heads x {d} (fitted too: the table states only S); "
        "RM+ and CHARM+ columns unused",
        {"method": "charm_megatron.lab.calibration.refit.fit_table4: shape from the paper's grid and "
                   f"{', '.join(TABLE4_FIT_FIELDS)} by log error on Table 4's ring column "
                   "(10 numbers; the L20 rows on l20-pcie as shipped)",
         "inputs": {"paper Table 4": "ring"}, "fit_algos": ["ring"], "passes": ["fwd"],
         "shape": {"batch": b, "heads": h, "head_dim": d},
         "rms_log_error": round(err4, 4)})
    # The paper's implementation on H100: the per-op cost its ring shows on H20 (host-side work
    # per kernel, taken as the software's, not the GPU's) on the h100 profile. Table 5's ring is
    # link-bound and hides it, so nothing on H100 can be fitted to it; CHARM+ columns unused.
    h100p = replace(h100, op_overhead_us=h20t4.op_overhead_us)
    out["h100-paper"] = Profile(
        "h100-paper", h100p, "2x8",
        f"the h100 profile with the paper's implementation's cost per compute op, "
        f"{h20t4.op_overhead_us:g} us, read off Table 4's ring column on H20 (profile "
        "h20-table4) and assumed host-side, so the same on H100; for predicting the paper's "
        "runs, not this package's",
        {**fit_h100, "method": fit_h100["method"] + "; op_overhead_us from h20-table4 (Table 4 "
                                                    "ring column)",
         "inputs": {"paper Table 5": "ring", "paper Table 4": "ring"}})
    out.update(measured_profiles(h100, h100p, fit_h100))
    return out


def cpu_testbed(paths: list[str], log=None) -> Profile:
    from charm_megatron.lab.calibration.calibrate import calibrate

    prof = calibrate(paths, name="cpu-testbed", cores=DOCS_BENCH_CORES,
                     intra_gbps=DOCS_BENCH_INTRA_GBPS, cross_burst_kb=DOCS_BENCH_CROSS_BURST_KB,
                     intra_burst_kb=DOCS_BENCH_INTRA_BURST_KB, log=log)
    return replace(prof, topology="2x4", source=prof.source + "; the 2-vCPU emulated cluster "
                   "of CPU-TESTBED.md (--nic node layout; --nic rank: see model.testbed)")


def all_profiles(bench: list[str], log=None) -> dict[str, Profile]:
    out = gpu_profiles()
    out["cpu-testbed"] = cpu_testbed(bench, log)
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m charm_megatron.lab.calibration.refit",
                                 description=__doc__.split("\n\n")[0])
    ap.add_argument("--check", action="store_true", help="compare, do not write")
    ap.add_argument("--bench", default=DOCS_BENCH, help="bench CSVs for cpu-testbed (glob)")
    args = ap.parse_args(argv)
    bench = sorted(glob.glob(args.bench))
    if not bench:
        raise SystemExit(f"refit: no files match {args.bench!r} (run from the repository root)")
    stale = []
    for name, prof in all_profiles(bench, log=print).items():
        path = Path(PROFILE_DIR) / f"{name}.json"
        text = dumps(prof)
        if args.check:
            if not path.is_file() or path.read_text(encoding="utf-8") != text:
                stale.append(name)
        else:
            path.write_text(text, encoding="utf-8")
            print(f"wrote {path}: {prof.cluster.describe()}")
    if stale:
        print(f"stale profiles (rerun python -m charm_megatron.lab.calibration.refit): {stale}")
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
