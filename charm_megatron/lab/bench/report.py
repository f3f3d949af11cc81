"""Benchmark output: CSV, JSON, the text table and the speedup-vs-CCR plot."""

from __future__ import annotations

import csv
import json
import math
import os
from collections.abc import Sequence

from charm_megatron.lab.reports.bench_csv import COLUMNS

PASS_TITLES = {"fwd": "Forward", "bwd": "Backward", "fwdbwd": "Forward + Backward"}


def _clean(value):
    """JSON has no NaN / inf: write them as null."""
    if isinstance(value, float) and not math.isfinite(value):
        return None
    return value


def write_csv(rows: Sequence[dict], path: str) -> None:
    """One line per point x algorithm x pass; the columns of ``bench_csv.COLUMNS`` (the fields
    of :class:`~charm_megatron.lab.reports.bench_csv.BenchRow`, its one reader)."""
    with open(path, "w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=COLUMNS, extrasaction="ignore")
        w.writeheader()
        for row in rows:
            out = {}
            for c in COLUMNS:
                v = row.get(c)
                if isinstance(v, float):
                    v = "" if not math.isfinite(v) else f"{v:.6g}"
                out[c] = "" if v is None else v
            w.writerow(out)


def write_json(doc: dict, path: str) -> None:
    def fix(o):
        if isinstance(o, dict):
            return {str(k): fix(v) for k, v in o.items()}
        if isinstance(o, (list, tuple)):
            return [fix(v) for v in o]
        return _clean(o)

    with open(path, "w") as f:
        json.dump(fix(doc), f, indent=1)
        f.write("\n")


def _f(v, fmt: str, missing: str = "-") -> str:
    if v is None or (isinstance(v, float) and not math.isfinite(v)):
        return missing
    return format(v, fmt)


def format_table(rows: Sequence[dict]) -> str:
    """The human-readable result: per point, one line per algorithm and pass."""
    lines: list[str] = []
    by_point: dict[int, list[dict]] = {}
    for r in rows:
        by_point.setdefault(r["point"], []).append(r)
    for _, prs in sorted(by_point.items()):
        r0 = prs[0]
        gqa = f"/{r0['kv_heads']}" if r0["kv_heads"] != r0["heads"] else ""
        ccr = {r["pass"]: r.get("ring_ccr") for r in prs if r.get("ring_ccr") is not None}
        ccr_text = "  ring CCR " + ", ".join(f"{p} {_f(v, '.2f')}" for p, v in ccr.items()) \
            if ccr else ""
        lines.append(f"B={r0['batch']} S={r0['seq']} H={r0['heads']}{gqa}x{r0['head_dim']} "
                     f"{r0['dtype']} {'causal' if r0['causal'] else 'full'}, {r0['world']} ranks, "
                     f"CHARM+ topology {r0['topology']}{ccr_text}")
        lines.append(f"  {'algo':7} {'pass':6} {'median ms':>10} {'[min - max]':>19} "
                     f"{'vs ring':>8} {'bound ms':>9} {'by':>5} {'/bound':>7} {'peak MB':>8}")
        skipped: set[str] = set()
        for r in prs:
            if r["status"] != "ok":
                if r["algo"] not in skipped:  # one line per skipped algorithm, not per pass
                    skipped.add(r["algo"])
                    lines.append(f"  {r['algo']:7} skipped: {r.get('note', '')}")
                continue
            spread = f"[{_f(r.get('min_ms'), '.1f')} - {_f(r.get('max_ms'), '.1f')}]"
            lines.append(
                f"  {r['algo']:7} {r['pass']:6} {_f(r.get('median_ms'), '10.1f'):>10} "
                f"{spread:>19} {_f(r.get('speedup_vs_ring'), '7.2f') + 'x':>8} "
                f"{_f(r.get('bound_ms'), '9.1f'):>9} {r.get('bound_by') or '-':>5} "
                f"{_f(r.get('vs_bound'), '7.2f'):>7} {_f(r.get('peak_mem_mb'), '8.1f'):>8}")
        notes = sorted({r["note"] for r in prs if r.get("note") and r["status"] == "ok"})
        for n in notes:
            lines.append(f"  note: {n}")
        line = auto_line(prs)
        if line:
            lines.append(f"  {line}")
        lines.append("")
    total = auto_total(rows)
    if total:
        lines.append(total)
        lines.append("")
    return "\n".join(lines)


def auto_line(point_rows: Sequence[dict]) -> str | None:
    """One point's ``auto`` summary: its pick, and per pass its median over the fastest
    contender's, flagged ``CHECK`` above the 5 % slack (None without an auto row)."""
    auto = [r for r in point_rows if r["algo"] == "auto" and r["status"] == "ok"
            and r.get("auto_pick")]
    if not auto:
        return None
    parts = []
    for r in auto:
        if r.get("vs_fastest") is None:
            continue
        flag = "  CHECK > 1.05" if r.get("auto_check") == "over" else ""
        alone = (f" (the pick as its own contender: {r['pick_vs_fastest']:.3f})"
                 if r.get("pick_vs_fastest") is not None else "")
        parts.append(f"{r['pass']} {r['vs_fastest']:.3f} of {r['fastest']}{alone}{flag}")
    return (f"auto picked {auto[0]['auto_pick']}; auto / fastest: "
            + ("; ".join(parts) if parts else "no ring/rmplus/charm timed to compare"))


def auto_total(rows: Sequence[dict]) -> str | None:
    """Over the whole grid: the worst ``auto / fastest`` and how many (point, pass) exceed it."""
    vals = [r for r in rows if r["algo"] == "auto" and r.get("vs_fastest") is not None]
    if not vals:
        return None
    worst = max(vals, key=lambda r: r["vs_fastest"])
    over = [r for r in vals if r.get("auto_check") == "over"]
    return (f"auto / fastest of ring, rmplus, charm: worst {worst['vs_fastest']:.3f} (point "
            f"{worst['point']} {worst['pass']}, picked {worst['auto_pick']}, fastest "
            f"{worst['fastest']}); {len(over)} of {len(vals)} (point, pass) over 1.05"
            + (" <- CHECK" if over else ""))


PLOT_SKIPPED = ("plot skipped: matplotlib is not installed; the table and CSV have the numbers "
                "(pip install matplotlib, or the [dev] extra, then rerun to get {path})")


def plot(rows: Sequence[dict], path: str, title: str = "") -> str | None:
    """Speedup over ring against ring's CCR, one panel per pass, one series per algorithm (the
    paper's Figures 6-7). Returns the path, or None when there is nothing to plot or
    matplotlib is missing (then one line says the plot was skipped and how to get it)."""
    try:
        import matplotlib
    except ImportError:
        print(PLOT_SKIPPED.format(path=path))
        return None

    matplotlib.use("Agg")  # no display; imported here so that the CLI starts fast
    import matplotlib.pyplot as plt

    ok = [r for r in rows if r["status"] == "ok" and r.get("speedup_vs_ring") is not None]
    passes = [p for p in PASS_TITLES if any(r["pass"] == p for r in ok)]
    if not passes:
        return None
    have_ccr = all(r.get("ring_ccr") is not None for r in ok)
    fig, axes = plt.subplots(1, len(passes), figsize=(4.6 * len(passes), 3.8), squeeze=False)
    algos = list(dict.fromkeys(r["algo"] for r in ok))
    markers = {"ring": "o", "rmplus": "s", "charm": "^", "torch": "D", "auto": "*"}
    for ax, p in zip(axes[0], passes):
        for algo in algos:
            pts = sorted((r.get("ring_ccr") if have_ccr else r["point"], r["speedup_vs_ring"],
                          r.get("speedup_min"), r.get("speedup_max"))
                         for r in ok if r["pass"] == p and r["algo"] == algo)
            if not pts or algo == "ring":
                continue
            xs = [x[0] for x in pts]
            ys = [x[1] for x in pts]
            lo = [max(0.0, y - (x[2] if x[2] is not None else y)) for x, y in zip(pts, ys)]
            hi = [max(0.0, (x[3] if x[3] is not None else y) - y) for x, y in zip(pts, ys)]
            ax.errorbar(xs, ys, yerr=[lo, hi], marker=markers.get(algo, "x"), linestyle="",
                        capsize=2, label=algo)
        ax.axhline(1.0, color="grey", linewidth=0.8, linestyle="--", label="ring")
        ax.set_title(PASS_TITLES[p])
        ax.set_xlabel("ring CCR (compute / communication)" if have_ccr else "grid point")
        ax.set_ylabel("speedup over ring")
        ax.grid(True, alpha=0.3)
    axes[0][0].legend(fontsize=8)
    if title:
        fig.suptitle(title, fontsize=9)
    fig.tight_layout()
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path
