#!/usr/bin/env python3
"""The Llama-3-like rows of docs/performance.md (*The paper's Table 5 on the emulated GPU
cluster*, issue 23 item 5) from bench CSVs of any emulated point (scripts/emulate_peers.sh
writes them): per point and pass, ring / RM+ / CHARM+ in device ms, CHARM+'s speed-up,
CHARM+ measured / model and measured / bound (beside the model's own time / bound), ring's
emulated time over the model's and over the textbook ring's, and the busiest core.

    python scripts/llama_table.py docs/performance/peers/llama*.csv
"""

from __future__ import annotations

import csv
import sys
from pathlib import Path


def _rows(path: Path) -> dict[tuple[str, str], dict]:
    with open(path) as f:
        return {(r["algo"], r["pass"]): r for r in csv.DictReader(f) if r["status"] == "ok"}


def _ms(row: dict | None) -> str:
    return f"{float(row['median_ms']):.1f}" if row else "-"


def main(paths: list[str]) -> int:
    print("| GPUs | heads q/kv | S | pass | ring | RM+ | CHARM+ | CHARM+ speed-up "
          "| CHARM+ / model | CHARM+ / bound (model / bound) | ring / model | ring / textbook "
          "| busiest core |")
    print("|---|---|---|---|---|---|---|---|---|---|---|---|---|")
    for p in paths:
        rows = _rows(Path(p))
        for pas in ("fwd", "bwd"):
            ring, rmplus, charm = (rows.get((a, pas)) for a in ("ring", "rmplus", "charm"))
            if ring is None or charm is None:
                continue
            r_ms, c_ms = float(ring["median_ms"]), float(charm["median_ms"])
            textbook = (f"{r_ms / float(ring['analytic_ring_ms']):.2f}x"
                        if ring.get("analytic_ring_ms") else "-")
            print(f"| {ring['topology']} | {ring['heads']}/{ring['kv_heads']} "
                  f"| {int(ring['seq']):,} | {pas} | {r_ms:.1f} | {_ms(rmplus)} | {c_ms:.1f} "
                  f"| {r_ms / c_ms:.2f}x | {float(charm['vs_model']):.2f}x "
                  f"| {float(charm['vs_bound']):.2f}x "
                  f"({float(charm['model_ms']) / float(charm['bound_ms']):.2f}x) "
                  f"| {float(ring['vs_model']):.2f}x | {textbook} "
                  f"| {float(ring['busiest_core_pct']):.0f} % |")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
