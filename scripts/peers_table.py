#!/usr/bin/env python3
"""The Markdown table "Against every CP a user can pick" of docs/performance.md from bench
CSVs (one file per point, as scripts/emulate_peers.sh writes them): for every point, each
contender's forward + backward device ms with its lower bound, the speed-up over ring, the
fastest, auto's pick and auto's time over the fastest's (issue 24's target: within 5 %).

    python scripts/peers_table.py docs/performance/peers/*.csv
"""

from __future__ import annotations

import csv
import sys
from pathlib import Path

ORDER = ("ring", "rmplus", "charm", "allgather", "a2a", "a2a+p2p", "auto")


def rows(path: Path) -> dict[str, dict]:
    with open(path) as f:
        return {r["algo"]: r for r in csv.DictReader(f) if r["pass"] == "fwdbwd"}


def main(paths: list[str]) -> int:
    print("| point | " + " | ".join(ORDER)
          + " | fastest | auto picks | auto / fastest | busiest core |")
    print("|---|" + "---|" * (len(ORDER) + 4))
    for p in paths:
        r = rows(Path(p))
        any_row = next(iter(r.values()))
        cells = []
        for algo in ORDER:
            if algo not in r:
                cells.append("-")
                continue
            if r[algo]["status"] != "ok":  # refused here (heads that do not divide)
                cells.append(r[algo]["status"])
                continue
            x = r[algo]
            cells.append(f"{float(x['median_ms']):.1f} ({float(x['bound_ms']):.1f}) "
                         f"{float(x['speedup_vs_ring']):.2f}x")
        plain = {a: float(x["median_ms"]) for a, x in r.items()
                 if a != "auto" and x["status"] == "ok"}
        fastest = min(plain, key=plain.get)
        pick = r.get("auto", {}).get("auto_pick", "") or "-"
        ratio = (f"{float(r['auto']['median_ms']) / plain[fastest]:.3f}" if "auto" in r
                 else "-")
        name = Path(p).parent.name if Path(p).stem == "results" else Path(p).stem
        where = any_row["device_model"] or "CPU testbed, wall ms"
        core = any_row["busiest_core_pct"]  # measured only on emulated GPU runs
        core = f"{float(core):.0f} %" if core else "-"
        print(f"| {name} ({where}, {any_row['heads']}/"
              f"{any_row['kv_heads']}x{any_row['head_dim']}, "
              f"{'causal' if any_row['causal'] == 'True' else 'full'}) | "
              + " | ".join(cells) + f" | {fastest} | {pick} | {ratio} | {core} |")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
