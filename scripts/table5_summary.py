#!/usr/bin/env python3
"""The Markdown table of docs/emulator.md from the runs of scripts/emulate_table5.sh: for every
row, ring / RM+ / CHARM+ in device ms beside the paper's Table 5 (its measurement on H100s),
the speed-ups, CHARM+'s measured / model and measured / bound (beside the model's own
time / bound: what the schedule leaves exposed, before the emulator adds anything).

    python scripts/table5_summary.py runs/emulated-t5      # or docs/performance/emulated-t5
"""

from __future__ import annotations

import csv
import sys
from pathlib import Path

# The paper's Table 5 (CHARM+ paper, H100, 12 heads x 192, bf16, full attention), ms:
# (topology, batch, seq) -> (ring fwd, CHARM+ fwd, ring bwd, CHARM+ bwd, TASP fwd); the paper
# has no TASP backward.
PAPER = {
    ("2x8", 16, 26880): (149.97, 63.93, 449.58, 141.52, 98.01),
    ("2x8", 16, 13440): (72.65, 31.84, 226.46, 65.35, 49.27),
    ("2x8", 64, 6720): (141.75, 61.80, 448.84, 123.32, 97.65),
    ("2x8", 128, 3360): (140.55, 61.54, 450.01, 121.99, 97.15),
    ("4x8", 16, 31744): (185.42, 68.17, 559.34, 146.01, 183.22),
    ("4x8", 16, 15872): (89.27, 34.64, 279.85, 70.62, 93.30),
    ("4x8", 64, 7936): (179.13, 66.48, 556.25, 134.48, 182.93),
    ("4x8", 128, 3968): (178.51, 66.43, 560.63, 133.05, 183.09),
}


def _csv(out: Path, name: str) -> Path | None:
    """A row's results: a run directory's results.csv, or a copy named after the row (as
    kept in docs/performance/emulated-t5)."""
    for path in (out / name / "results.csv", out / f"{name}.csv"):
        if path.exists():
            return path
    return None


def _rows(path: Path) -> dict[tuple[str, str], dict]:
    with open(path) as f:
        return {(r["algo"], r["pass"]): r for r in csv.DictReader(f) if r["status"] == "ok"}


def main(out: str) -> int:
    lines = [
        "| GPUs | B | S | pass | ring (paper) | RM+ (paper's TASP) | CHARM+ (paper) | CHARM+ speed-up (paper) "
        "| CHARM+ / model | CHARM+ / bound (model / bound) | busiest core |",
        "|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for (topo, b, s), paper in PAPER.items():
        path = _csv(Path(out), f"{topo}-b{b}-s{s}")
        if path is None:
            continue
        rows = _rows(path)
        for i, p in enumerate(("fwd", "bwd")):
            ring, rmplus, charm = (rows.get((a, p)) for a in ("ring", "rmplus", "charm"))
            if ring is None or charm is None:
                continue
            ms = {a: float(r["median_ms"]) for a, r in (("ring", ring), ("charm", charm))}
            p_ring, p_charm = paper[2 * i], paper[2 * i + 1]
            rm = f"{float(rmplus['median_ms']):.1f}" if rmplus else "-"
            rm += f" ({paper[4]})" if p == "fwd" else " (-)"
            lines.append(
                f"| {topo} | {b} | {s:,} | {p} | {ms['ring']:.1f} ({p_ring}) | {rm} "
                f"| {ms['charm']:.1f} ({p_charm}) | {ms['ring'] / ms['charm']:.2f}x "
                f"({p_ring / p_charm:.2f}x) | {float(charm['vs_model']):.2f}x "
                f"| {float(charm['vs_bound']):.2f}x "
                f"({float(charm['model_ms']) / float(charm['bound_ms']):.2f}x) "
                f"| {float(charm['busiest_core_pct']):.0f} % |")
    print("\n".join(lines))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1] if len(sys.argv) > 1 else "runs/emulated-t5"))
