"""Regenerate the built-in device profiles (``charm_megatron/devices/data/*.json``) from their
sources: the paper's tables (:mod:`.paper`), one GPU measurement and the docs' bench runs.

``python -m charm_megatron.lab.calibration.refit [--check]`` (from the repository root) runs the
recipes of :mod:`charm_megatron.lab.devices` (one module per device, in dependency order:
``h100``, ``h20``, ``l20-pcie``, ``h20-table4``, ``h100-paper``, ``h200``,
``h100-paper-measured``, ``h100-paper-appendix``, ``cpu-testbed``) and writes each profile; ``--check`` exits 1 if a
shipped file differs from what the sources give now. This module holds the fits the recipes
share: FlashAttention-2's H100 kernel curve (:func:`kernel_terms`), the ring forward of Table 5
(:func:`table5_ring_error`) and the ring column of Table 4 (:func:`fit_table4`).
"""

from __future__ import annotations

import argparse
import glob
import math
import sys
from dataclasses import replace

from charm_megatron.devices import DATA_DIR, dumps
from charm_megatron.lab.calibration import paper
from charm_megatron.lab.calibration.calibrate import _sim_ms, coordinate_descent
from charm_megatron.model.cluster import Cluster, Profile
from charm_megatron.plan.cost import Problem

#: The bench runs the ``cpu-testbed`` profile is calibrated on (:mod:`charm_megatron.lab.devices.cpu_testbed`).
DOCS_BENCH = "docs/performance/*.csv"


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


def rnd(x: float) -> float:
    """``x`` to the 4 significant digits a shipped profile keeps."""
    return float(f"{x:.4g}")


def kernel_terms() -> dict[str, object]:
    """Cluster fields from FlashAttention-2's H100 curves (rate at head dim 128 = 1)."""
    r128, rows128 = fit_kernel_curve(paper.FA2_H100_FWD[128])
    r256, _ = fit_kernel_curve(paper.FA2_H100_FWD[256])
    fwd, bwd = paper.FA2_FWD_BWD_UTILISATION
    return {"kernel_q_rows": rnd(rows128), "kernel_k_rows": rnd(rows128),
            "head_dim_factors": ((128.0, 1.0), (256.0, rnd(r256 / r128))),
            "bwd_factor": rnd(2.5 * fwd / bwd), "long_tile_tflops_h100": rnd(r128)}


#: The kernel's shape against tile size and head dim (every GPU profile takes H100's).
KERNEL_SHAPE = ("kernel_q_rows", "kernel_k_rows", "head_dim_factors", "bwd_factor")


def kernel_shape() -> dict[str, object]:
    """The :data:`KERNEL_SHAPE` fields of :func:`kernel_terms`."""
    k = kernel_terms()
    return {n: k[n] for n in KERNEL_SHAPE}


def kernel_source() -> str:
    """Where :func:`kernel_terms` come from, for a profile's source."""
    k = kernel_terms()
    return ("kernel: FlashAttention-2 on H100 (FA-3 paper's forward-speed bars), fitted "
            f"long-tile {k['long_tile_tflops_h100']} TFLOP/s at head dim 128, "
            f"{k['kernel_q_rows']} rows of fixed cost per tile side, head dim 256 at "
            f"{k['head_dim_factors'][1][1]}x; backward x{k['bwd_factor']} "
            "(FA-2: 73 % / 63 % utilisation); compute +18.9 % while messages move (Lee et al. "
            "2025)")


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
        cl = replace(cl, **{f: rnd(getattr(cl, f)) for f in TABLE4_FIT_FIELDS})
        total = table4_ring_error({"L20": l20, "H20": cl}, shape)
        if best is None or total < best[0]:
            best = (total, shape, cl)
    assert best is not None
    return best[1], best[2], math.sqrt(best[0] / len(paper.TABLE4))


def all_profiles(bench: list[str], log=None) -> dict[str, Profile]:
    """Every built-in profile by name, from its recipe (``bench``: the CSVs of ``cpu-testbed``)."""
    # The recipes use this module's fits: imported here, not at the top (a circle).
    from charm_megatron.lab.devices import Inputs, build_all

    return build_all(Inputs(tuple(bench), log))


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
        path = DATA_DIR / f"{name}.json"
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
