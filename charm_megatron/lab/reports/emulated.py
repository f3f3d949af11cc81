"""The emulated GPU cluster against the paper (docs/performance.md): ``charm-megatron report
table5``, ``table4`` and ``llama``, each from bench CSVs of emulated runs (device time).

* ``table5 DIR``: every row of the paper's Table 5 (its H100 measurement) beside the emulated
  ring / RM+ / CHARM+ in device ms, the speed-ups, CHARM+'s measured / model and measured /
  bound (beside the model's own time / bound) and the busiest core. ``DIR`` holds the runs of
  scripts/emulate_table5.sh (``DIR/2x8-b16-s26880/results.csv``) or copies named after the
  row (``DIR/2x8-b16-s26880.csv``, as kept in docs/performance/emulated-t5).

Every table also gives the fastest of TransformerEngine's CP types as shipped at the row's
point, by the model on the run's device as shipped (its time over the fastest of the run's
contenders of ours by the same model: above 1, ours is faster); it was not emulated.
* ``table4 DIR``: every row of the paper's Table 4 (``charm_megatron.lab.calibration.paper``) beside the
  emulated ring / RM+ / CHARM+ forward, the speed-ups, each emulated time over the model's
  and CHARM+'s over its bound (runs of scripts/emulate_table4.sh, ``DIR/h20-2x8...``).
* ``llama CSV...``: per point and pass, ring / RM+ / CHARM+, CHARM+'s speed-up, measured /
  model and / bound, ring over the model and over the textbook ring, the busiest core; rows
  sorted by cluster, heads and sequence.
"""

from __future__ import annotations

import argparse
from collections.abc import Sequence
from pathlib import Path

from charm_megatron.lab.reports.bench_csv import OFF_MODEL_NOTE, BenchRow, by_algo_pass, read_rows

#: The paper's TASP forward ms per Table 5 row (topology, batch, seq): its RM+ stand-in (the
#: paper has no TASP backward). Ring and CHARM+ are :data:`charm_megatron.lab.calibration.paper.TABLE5`.
TASP_FWD = {
    ("2x8", 16, 26880): 98.01, ("2x8", 16, 13440): 49.27, ("2x8", 64, 6720): 97.65,
    ("2x8", 128, 3360): 97.15, ("4x8", 16, 31744): 183.22, ("4x8", 16, 15872): 93.30,
    ("4x8", 64, 7936): 182.93, ("4x8", 128, 3968): 183.09,
}


def run_csv(out: Path, name: str) -> Path | None:
    """A run's results: ``out/name/results.csv``, or a copy ``out/name.csv``."""
    for path in (out / name / "results.csv", out / f"{name}.csv"):
        if path.exists():
            return path
    return None


def _x(v: float | None, spec: str = ".2f") -> str:
    return "-" if v is None else f"{v:{spec}}x"


def _table(lines: list[str], rows: Sequence[BenchRow | None]) -> str:
    """The table's lines, then :data:`OFF_MODEL_NOTE` if a row shown is flagged off_model."""
    note = any(r is not None and r.off_model for r in rows)
    return "\n".join(lines) + "\n" + (f"\n{OFF_MODEL_NOTE}\n" if note else "")


def _te(rows: Sequence[BenchRow | None], pass_: str) -> str:
    """The fastest of TransformerEngine's CP types as shipped at these rows' point, by the
    model on their device, with its time over the fastest of ours by the model
    (:func:`~charm_megatron.lab.reports.te_shipped.te_beside`)."""
    from charm_megatron.lab.reports.te_shipped import te_beside

    got = [r for r in rows if r is not None]
    return te_beside(got[0], [r.algo for r in got], pass_) if got else "-"


# ---- table5 ------------------------------------------------------------------------------

def table5(out: str | Path, algos: Sequence[str] = ("ring", "rmplus", "charm"),
           vs_paper: bool = False) -> str:
    """The Table 5 comparison (Markdown). Without ``rmplus`` in ``algos`` the RM+ column is
    left out; ``vs_paper`` adds emulated CHARM+ over the paper's (runs on a device of the
    paper's implementation: no TransformerEngine column, its host costs are not TE's)."""
    from charm_megatron.lab.calibration import paper

    rm = "rmplus" in algos
    head = ["GPUs", "B", "S", "pass", "ring (paper)"] + (["RM+ (paper's TASP)"] if rm else []) \
        + ["CHARM+ (paper)"] + (["CHARM+ / paper"] if vs_paper else []) \
        + ["CHARM+ speed-up (paper)", "CHARM+ / model", "CHARM+ / bound (model / bound)"] \
        + ([] if vs_paper else ["fastest TE, model (TE / ours, model)"]) + ["busiest core"]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    shown: list[BenchRow | None] = []
    for row in paper.TABLE5:
        path = run_csv(Path(out), f"{row.topology}-b{row.b}-s{row.s}")
        if path is None:
            continue
        got = by_algo_pass(read_rows(path))
        for p, p_ring, p_charm in (("fwd", row.ring_fwd, row.charm_fwd),
                                   ("bwd", row.ring_bwd, row.charm_bwd)):
            ring, rmplus, charm = (got.get((a, p)) for a in ("ring", "rmplus", "charm"))
            if ring is None or charm is None:
                continue
            shown += [ring, charm] + ([rmplus] if rm else [])
            cells = [row.topology, str(row.b), f"{row.s:,}", p,
                     f"{ring.median_ms:.1f}{ring.mark} ({p_ring})"]
            if rm:
                tasp = TASP_FWD[(row.topology, row.b, row.s)] if p == "fwd" else "-"
                cells.append((f"{rmplus.median_ms:.1f}{rmplus.mark}" if rmplus else "-")
                             + f" ({tasp})")
            cells.append(f"{charm.median_ms:.1f}{charm.mark} ({p_charm})")
            if vs_paper:
                cells.append(_x(charm.median_ms / p_charm))
            cells += [f"{ring.median_ms / charm.median_ms:.2f}x ({p_ring / p_charm:.2f}x)",
                      _x(charm.vs_model),
                      f"{_x(charm.vs_bound)} ({_x(charm.model_ms / charm.bound_ms)})"]
            if not vs_paper:  # a device of the paper's implementation is not TE's
                cells.append(_te([ring, rmplus, charm], p))
            cells.append(f"{charm.busiest_core_pct:.0f} %")
            lines.append("| " + " | ".join(cells) + " |")
    return _table(lines, shown)


# ---- table4 ------------------------------------------------------------------------------

def _cell(got: dict[str, BenchRow], algo: str, paper_ms: float | None) -> str:
    if algo not in got or paper_ms is None:
        return "-"
    return f"{got[algo].median_ms:.2f}{got[algo].mark} ({paper_ms})"


def _speedup(ms: dict[str, float], paper_ring: float, algo: str, paper_ms: float | None) -> str:
    """Speed-up over ring, emulated (paper's)."""
    if algo not in ms or paper_ms is None:
        return "-"
    return f"{ms['ring'] / ms[algo]:.2f}x ({paper_ring / paper_ms:.2f}x)"


def table4(out: str | Path) -> str:
    """The Table 4 comparison (Markdown), forward only."""
    from charm_megatron.lab.calibration import paper

    lines = [
        "| GPUs | S | ring (paper) | RM+ (paper) | CHARM+ (paper) | RM+ speed-up (paper) | "
        "CHARM+ speed-up (paper) | ring / paper | CHARM+ / paper | emulated / model: ring, RM+, "
        "CHARM+ | CHARM+ / bound | fastest TE, model (TE / ours, model) | busiest core |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    shown: list[BenchRow | None] = []
    for row in paper.TABLE4:
        path = run_csv(Path(out), f"{row.gpu.lower()}-{row.topology}")
        if path is None:
            continue
        got = {r.algo: r for r in read_rows(path) if r.ok and r.pass_ == "fwd" and r.seq == row.s}
        if "ring" not in got:
            continue
        ms = {a: r.median_ms for a, r in got.items()}
        shown += [got[a] for a in ("ring", "rmplus", "charm") if a in got]
        vs_model = ", ".join(f"{got[a].vs_model:.2f}" if a in got else "-"
                             for a in ("ring", "rmplus", "charm"))
        charm = got.get("charm")
        charm_vs_paper = (f"{ms['charm'] / row.charm:.2f}x"
                          if charm is not None and row.charm is not None else "-")
        charm_vs_bound = _x(charm.vs_bound) if charm is not None else "-"
        lines.append(
            f"| {row.topology} {row.gpu} | {row.s} | {_cell(got, 'ring', row.ring)} | "
            f"{_cell(got, 'rmplus', row.rmplus)} | {_cell(got, 'charm', row.charm)} | "
            f"{_speedup(ms, row.ring, 'rmplus', row.rmplus)} | "
            f"{_speedup(ms, row.ring, 'charm', row.charm)} | "
            f"{ms['ring'] / row.ring:.2f}x | {charm_vs_paper} | {vs_model} | {charm_vs_bound} | "
            f"{_te(list(got.values()), 'fwd')} | {got['ring'].busiest_core_pct:.0f} % |")
    return _table(lines, shown)


# ---- llama -------------------------------------------------------------------------------

def _ms(row: BenchRow | None) -> str:
    return f"{row.median_ms:.1f}{row.mark}" if row else "-"


def llama(paths: Sequence[str | Path]) -> str:
    """Per point and pass, ring / RM+ / CHARM+ on an emulated cluster (Markdown); rows by
    cluster, query heads and sequence."""
    runs = [by_algo_pass(read_rows(p)) for p in paths]
    runs = [r for r in runs if ("ring", "fwd") in r or ("ring", "bwd") in r]

    def order(rows: dict[tuple[str, str], BenchRow]):
        r = next(iter(rows.values()))
        return (r.topology or "", r.heads or 0, r.kv_heads or 0, r.seq or 0)

    lines = ["| GPUs | heads q/kv | S | pass | ring | RM+ | CHARM+ | CHARM+ speed-up "
             "| CHARM+ / model | CHARM+ / bound (model / bound) | ring / model | ring / textbook "
             "| fastest TE, model (TE / ours, model) | busiest core |",
             "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
    shown: list[BenchRow | None] = []
    for rows in sorted(runs, key=order):
        for pas in ("fwd", "bwd"):
            ring, rmplus, charm = (rows.get((a, pas)) for a in ("ring", "rmplus", "charm"))
            if ring is None or charm is None:
                continue
            shown += [ring, rmplus, charm]
            r_ms, c_ms = ring.median_ms, charm.median_ms
            textbook = _x(r_ms / ring.analytic_ring_ms) if ring.analytic_ring_ms else "-"
            lines.append(
                f"| {ring.topology} | {ring.heads}/{ring.kv_heads} | {ring.seq:,} | {pas} "
                f"| {_ms(ring)} | {_ms(rmplus)} | {_ms(charm)} | {r_ms / c_ms:.2f}x "
                f"| {_x(charm.vs_model)} | {_x(charm.vs_bound)} "
                f"({_x(charm.model_ms / charm.bound_ms)}) | {_x(ring.vs_model)} | {textbook} "
                f"| {_te([r for (_, p), r in rows.items() if p == pas and r.ok], pas)} "
                f"| {ring.busiest_core_pct:.0f} % |")
    return _table(lines, shown)


# ---- the subcommands ---------------------------------------------------------------------

def register_table5(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("dir", help="runs of scripts/emulate_table5.sh (DIR/ROW/results.csv) "
                                    "or copies DIR/ROW.csv, e.g. docs/performance/emulated-t5")
    parser.add_argument("--algos", default="ring,rmplus,charm",
                        help="contenders shown (ring and charm always; rmplus optional)")
    parser.add_argument("--vs-paper", action="store_true",
                        help="add emulated CHARM+ over the paper's CHARM+")


def run_table5(args: argparse.Namespace) -> int:
    print(table5(args.dir, args.algos.split(","), args.vs_paper), end="")
    return 0


def register_table4(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("dir", help="runs of scripts/emulate_table4.sh (DIR/h20-2x8/results.csv)"
                                    " or copies DIR/h20-2x8.csv, e.g. "
                                    "docs/performance/emulated-t4")


def run_table4(args: argparse.Namespace) -> int:
    print(table4(args.dir), end="")
    return 0


def register_llama(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("csv", nargs="+", help="bench CSVs of emulated points, e.g. "
                                               "docs/performance/peers/llama*.csv")


def run_llama(args: argparse.Namespace) -> int:
    print(llama(args.csv), end="")
    return 0
