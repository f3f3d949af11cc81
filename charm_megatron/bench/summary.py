"""Several benchmark runs side by side, as a Markdown table (for docs/performance.md).

``python -m charm_megatron.bench.summary runs/performance/*/results.csv [--passes fwd,fwdbwd]``

One line per run, point and pass: ring's median time and CCR, then each other algorithm's
median time, speedup over ring (median of per-round ratios), measured/bound and its
*ceiling*: ring's median time over the algorithm's lower bound, the most it could gain over
ring on this machine in that run (an algorithm at its bound reaches it; a target above it
cannot be met there).
"""

from __future__ import annotations

import argparse
import csv
import json
import os
import sys
from collections.abc import Sequence


def _num(v: str) -> float | None:
    try:
        return float(v)
    except (TypeError, ValueError):
        return None


def _fmt(v: float | None, spec: str) -> str:
    return "-" if v is None else format(v, spec)


def load(path: str) -> tuple[str, list[dict]]:
    """(label, rows) of one results.csv; the label says cluster shape, NIC model and mode."""
    with open(path) as f:
        rows = list(csv.DictReader(f))
    label = os.path.basename(os.path.dirname(os.path.abspath(path)))
    meta_path = os.path.join(os.path.dirname(path), "results.json")
    if os.path.exists(meta_path):
        with open(meta_path) as f:
            meta = json.load(f)["meta"]
        groups = meta.get("hw_groups")
        shape = f"{len(groups)}x{len(groups[0])}" if groups else f"{meta['world']} ranks"
        label = f"{shape} {meta['mode']}" + (f" nic={meta['nic']}" if meta.get("nic") else "")
        if meta.get("link_model") not in (None, "tbf"):  # tbf: the default link model
            label += f" {meta['link_model']}"
        cross = (meta.get("rates_Bps") or {}).get("configured_cross")
        if cross:
            label += f" {cross * 8 / 1e6:.0f} Mbit/s"
    return label, rows


def table(runs: Sequence[tuple[str, list[dict]]], passes: Sequence[str]) -> str:
    algos: list[str] = []
    for _, rows in runs:
        for r in rows:
            if r["algo"] != "ring" and r["algo"] not in algos:
                algos.append(r["algo"])
    head = ["run", "S", "heads", "pass", "ring CCR", "ring ms", "ring /bound"]
    for a in algos:
        head += [f"{a} ms", f"{a} vs ring", f"{a} /bound", f"{a} ceiling"]
        if a == "auto":
            head += ["auto pick", "auto / fastest"]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for label, rows in runs:
        index = {(r["point"], r["algo"], r["pass"]): r for r in rows}
        points = sorted({int(r["point"]) for r in rows})
        for p in points:
            for ps in passes:
                ring = index.get((str(p), "ring", ps))
                if ring is None:
                    continue
                kv = ring.get("kv_heads") or ring["heads"]
                heads = (f"{ring['heads']}{'/' + kv if kv != ring['heads'] else ''}"
                         f"x{ring['head_dim']} {ring.get('dtype', '')}").strip()
                cells = [label, ring["seq"], heads, ps, _fmt(_num(ring["ring_ccr"]), ".2f"),
                         _fmt(_num(ring["median_ms"]), ".0f"), _fmt(_num(ring["vs_bound"]), ".2f")]
                for a in algos:
                    r = index.get((str(p), a, ps))
                    if r is None or r["status"] != "ok":
                        cells += ["skipped" if r is not None else "-", "-", "-", "-"]
                        cells += ["-", "-"] if a == "auto" else []
                        continue
                    cells += [_fmt(_num(r["median_ms"]), ".0f"),
                              _fmt(_num(r["speedup_vs_ring"]), ".2f") + "x",
                              _fmt(_num(r["vs_bound"]), ".2f"),
                              _ceiling(ring, r)]
                    if a == "auto":
                        cells += [r.get("auto_pick") or "-", _versus(r)]
                lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def _ceiling(ring: dict, row: dict) -> str:
    """Ring's median over ``row``'s lower bound (``2.20x``), ``-`` without a bound."""
    ring_ms, bound = _num(ring.get("median_ms", "")), _num(row.get("bound_ms", ""))
    if ring_ms is None or not bound:
        return "-"
    return f"{ring_ms / bound:.2f}x"


def _versus(row: dict) -> str:
    """``1.02 (charm)``; ``**1.08 (ring) CHECK**`` above the 5 % slack."""
    v = _num(row.get("vs_fastest", ""))
    if v is None:
        return "-"
    alone = _num(row.get("pick_vs_fastest", ""))
    text = f"{v:.2f} ({row.get('fastest') or '?'}" + (
        f"; pick alone {alone:.2f})" if alone is not None else ")")
    return f"**{text} CHECK**" if row.get("auto_check") == "over" else text


def auto_lines(runs: Sequence[tuple[str, list[dict]]], passes: Sequence[str]) -> list[str]:
    """Below the table: per run, the worst auto / fastest and the (point, pass) over 1.05."""
    out = []
    for label, rows in runs:
        vals = [(r, _num(r.get("vs_fastest", ""))) for r in rows
                if r["algo"] == "auto" and r["pass"] in passes]
        vals = [(r, v) for r, v in vals if v is not None]
        if not vals:
            continue
        worst_r, worst = max(vals, key=lambda x: x[1])
        over = [r for r, _ in vals if r.get("auto_check") == "over"]
        out.append(f"- {label}: auto / fastest worst {worst:.2f} (S={worst_r['seq']} "
                   f"{worst_r['pass']}, picked {worst_r.get('auto_pick')}, fastest "
                   f"{worst_r.get('fastest')}); {len(over)} of {len(vals)} over 1.05"
                   + ("".join(f"; CHECK S={r['seq']} {r['pass']}" for r in over)))
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m charm_megatron.bench.summary",
                                 description=__doc__.splitlines()[0])
    ap.add_argument("csv", nargs="+", help="results.csv files of charm-megatron bench runs")
    ap.add_argument("--passes", default="fwd,fwdbwd", help="passes to show (fwd,bwd,fwdbwd)")
    args = ap.parse_args(argv)
    runs = [load(p) for p in args.csv]
    passes = [p for p in args.passes.split(",") if p]
    print(table(runs, passes))
    extra = auto_lines(runs, passes)
    if extra:
        print()
        print("\n".join(extra))
    return 0


if __name__ == "__main__":
    sys.exit(main())
