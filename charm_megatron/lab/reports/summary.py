"""``charm-megatron report summary``: several benchmark runs side by side, as a Markdown table
(docs/performance.md, docs/performance/*/summary.md).

``charm-megatron report summary runs/performance/*/results.csv [--passes fwd,fwdbwd]``

One line per run, point and pass: ring's median time and CCR, then each other algorithm's
median time, speedup over ring (median of per-round ratios), measured/bound and its
*ceiling*: ring's median time over the algorithm's lower bound, the most it could gain over
ring on this machine in that run (an algorithm at its bound reaches it; a target above it
cannot be met there). Below the table, per run with an ``auto`` contender, its worst
``auto / fastest``.

A run's label is its cluster shape, mode, NIC, link model and configured cross rate, read from
the ``results.json`` beside a ``results.csv``; a CSV without one (a copy under docs/) is
labelled by its file name, or by ``--label`` (one per CSV, in order).
"""

from __future__ import annotations

import argparse
import json
import os
from collections.abc import Sequence

from charm_megatron.lab.reports.bench_csv import OFF_MODEL_NOTE, BenchRow, read_rows

Run = tuple[str, list[BenchRow]]


def _fmt(v: float | None, spec: str) -> str:
    return "-" if v is None else format(v, spec)


def load(path: str) -> Run:
    """(label, rows) of one bench CSV; the label says cluster shape, NIC model and mode."""
    rows = read_rows(path)
    if os.path.basename(path) == "results.csv":
        label = os.path.basename(os.path.dirname(os.path.abspath(path)))
    else:
        label = os.path.splitext(os.path.basename(path))[0]
    meta_path = os.path.join(os.path.dirname(path), "results.json")
    if os.path.basename(path) == "results.csv" and os.path.exists(meta_path):
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


def table(runs: Sequence[Run], passes: Sequence[str]) -> str:
    algos: list[str] = []
    for _, rows in runs:
        for r in rows:
            if r.algo != "ring" and r.algo not in algos:
                algos.append(r.algo)
    head = ["run", "S", "heads", "pass", "ring CCR", "ring ms", "ring /bound"]
    for a in algos:
        head += [f"{a} ms", f"{a} vs ring", f"{a} /bound", f"{a} ceiling"]
        if a == "auto":
            head += ["auto pick", "auto / fastest"]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    flagged = False
    for label, rows in runs:
        index = {(r.point, r.algo, r.pass_): r for r in rows}
        for p in sorted({r.point for r in rows}):
            for ps in passes:
                ring = index.get((p, "ring", ps))
                if ring is None:
                    continue
                kv = ring.kv_heads
                heads = (f"{ring.heads}{f'/{kv}' if kv != ring.heads else ''}"
                         f"x{ring.head_dim} {ring.dtype or ''}").strip()
                cells = [label, str(ring.seq), heads, ps, _fmt(ring.ring_ccr, ".2f"),
                         _fmt(ring.median_ms, ".0f") + ring.mark, _fmt(ring.vs_bound, ".2f")]
                flagged = flagged or bool(ring.off_model)
                for a in algos:
                    r = index.get((p, a, ps))
                    if r is None or not r.ok:
                        cells += ["skipped" if r is not None else "-", "-", "-", "-"]
                        cells += ["-", "-"] if a == "auto" else []
                        continue
                    flagged = flagged or bool(r.off_model)
                    cells += [_fmt(r.median_ms, ".0f") + r.mark,
                              _fmt(r.speedup_vs_ring, ".2f") + "x",
                              _fmt(r.vs_bound, ".2f"), _ceiling(ring, r)]
                    if a == "auto":
                        cells += [r.auto_pick or "-", _versus(r)]
                lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines + (["", OFF_MODEL_NOTE] if flagged else []))


def _ceiling(ring: BenchRow, row: BenchRow) -> str:
    """Ring's median over ``row``'s lower bound (``2.20x``), ``-`` without a bound."""
    if ring.median_ms is None or not row.bound_ms:
        return "-"
    return f"{ring.median_ms / row.bound_ms:.2f}x"


def _versus(row: BenchRow) -> str:
    """``1.02 (charm)``; ``**1.08 (ring) CHECK**`` above the 5 % slack."""
    if row.vs_fastest is None:
        return "-"
    alone = row.pick_vs_fastest
    text = f"{row.vs_fastest:.2f} ({row.fastest or '?'}" + (
        f"; pick alone {alone:.2f})" if alone is not None else ")")
    return f"**{text} CHECK**" if row.auto_check == "over" else text


def auto_lines(runs: Sequence[Run], passes: Sequence[str]) -> list[str]:
    """Below the table: per run, the worst auto / fastest and the (point, pass) over 1.05."""
    out = []
    for label, rows in runs:
        vals = [r for r in rows
                if r.algo == "auto" and r.pass_ in passes and r.vs_fastest is not None]
        if not vals:
            continue
        worst = max(vals, key=lambda r: r.vs_fastest)
        over = [r for r in vals if r.auto_check == "over"]
        out.append(f"- {label}: auto / fastest worst {worst.vs_fastest:.2f} (S={worst.seq} "
                   f"{worst.pass_}, picked {worst.auto_pick}, fastest "
                   f"{worst.fastest}); {len(over)} of {len(vals)} over 1.05"
                   + ("".join(f"; CHECK S={r.seq} {r.pass_}" for r in over)))
    return out


def make(paths: Sequence[str], passes: Sequence[str] = ("fwd", "fwdbwd"),
         labels: Sequence[str] | None = None) -> str:
    """The report's text: the table, then the ``auto`` lines if any."""
    runs = [load(p) for p in paths]
    if labels:
        if len(labels) != len(runs):
            raise ValueError(f"--label given {len(labels)} times for {len(runs)} CSVs: give "
                             "one per CSV, in order")
        runs = [(label, rows) for label, (_, rows) in zip(labels, runs)]
    text = table(runs, passes)
    extra = auto_lines(runs, passes)
    return text + ("\n\n" + "\n".join(extra) if extra else "") + "\n"


def register(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("csv", nargs="+", help="results.csv files of charm-megatron bench runs")
    parser.add_argument("--passes", default="fwd,fwdbwd", help="passes to show (fwd,bwd,fwdbwd)")
    parser.add_argument("--label", action="append", default=None, metavar="TEXT",
                        help="a run's label, once per CSV in order (default: from the "
                             "results.json beside results.csv, else the file name)")


def run(args: argparse.Namespace) -> int:
    passes = [p for p in args.passes.split(",") if p]
    print(make(args.csv, passes, args.label), end="")
    return 0
