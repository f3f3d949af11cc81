#!/usr/bin/env python3
"""The Markdown table of docs/performance.md's Table 4 section from the runs of
scripts/emulate_table4.sh: every row of the paper's Table 4 (``charm_megatron.model.paper``)
beside the emulated ring / RM+ / CHARM+ forward in device ms, the speed-ups, and each
emulated time over the model's and CHARM+'s over its bound.

    python scripts/table4_summary.py runs/emulated-t4      # or docs/performance/emulated-t4
"""

from __future__ import annotations

import csv
import sys
from pathlib import Path

from charm_megatron.model import paper


def _csv(out: Path, name: str) -> Path | None:
    """A run's results: its directory's results.csv, or a copy named after it."""
    for path in (out / name / "results.csv", out / f"{name}.csv"):
        if path.exists():
            return path
    return None


def _cell(ms: dict[str, float], algo: str, paper_ms: float | None) -> str:
    return "-" if algo not in ms or paper_ms is None else f"{ms[algo]:.2f} ({paper_ms})"


def _speedup(ms: dict[str, float], paper_ring: float, algo: str, paper_ms: float | None) -> str:
    """Speed-up over ring, emulated (paper's)."""
    if algo not in ms or paper_ms is None:
        return "-"
    return f"{ms['ring'] / ms[algo]:.2f}x ({paper_ring / paper_ms:.2f}x)"


def main(out: str) -> int:
    lines = [
        "| GPUs | S | ring (paper) | RM+ (paper) | CHARM+ (paper) | RM+ speed-up (paper) | "
        "CHARM+ speed-up (paper) | ring / paper | CHARM+ / paper | emulated / model: ring, RM+, "
        "CHARM+ | CHARM+ / bound | busiest core |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for row in paper.TABLE4:
        path = _csv(Path(out), f"{row.gpu.lower()}-{row.topology}")
        if path is None:
            continue
        with open(path) as f:
            got = {r["algo"]: r for r in csv.DictReader(f)
                   if r["status"] == "ok" and r["pass"] == "fwd" and int(r["seq"]) == row.s}
        if "ring" not in got:
            continue
        ms = {a: float(r["median_ms"]) for a, r in got.items()}
        ring = ms["ring"]

        vs_model = ", ".join(f"{float(got[a]['vs_model']):.2f}" if a in got else "-"
                             for a in ("ring", "rmplus", "charm"))
        charm = got.get("charm")
        charm_vs_paper = (f"{ms['charm'] / row.charm:.2f}x"
                          if charm is not None and row.charm is not None else "-")
        charm_vs_bound = f"{float(charm['vs_bound']):.2f}x" if charm is not None else "-"
        lines.append(
            f"| {row.topology} {row.gpu} | {row.s} | {_cell(ms, 'ring', row.ring)} | "
            f"{_cell(ms, 'rmplus', row.rmplus)} | {_cell(ms, 'charm', row.charm)} | "
            f"{_speedup(ms, row.ring, 'rmplus', row.rmplus)} | {_speedup(ms, row.ring, 'charm', row.charm)} | "
            f"{ring / row.ring:.2f}x | {charm_vs_paper} | {vs_model} | {charm_vs_bound} | "
            f"{float(got['ring']['busiest_core_pct']):.0f} % |")
    print("\n".join(lines))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1] if len(sys.argv) > 1 else "runs/emulated-t4"))
