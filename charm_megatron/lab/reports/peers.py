"""``charm-megatron report peers``: every contender a user can pick, side by side
(docs/performance.md, *Against every CP a user can pick* and *Sliding windows*).

One row per bench CSV (one point each, as scripts/emulate_peers.sh, emulate_window.sh and
bench_gqa.sh write them): each contender's forward + backward ms with its lower bound in
brackets and its speed-up over ring, then the fastest, auto's pick and auto's time over the
fastest's (issue 24's target: within 5 %; bold above it), on an emulated GPU cluster the
fastest of TransformerEngine's CP types as shipped *by the model* on the run's device (TE's
kernel curve; its time over the fastest of our contenders by the same model), and the busiest core of an emulated
GPU run.

A contender the CSV has no row for is ``refused (not run)`` where the registry refuses the
point's shape (``a2a`` where the heads do not divide), ``-`` otherwise; a row the bench
skipped shows its status. The busiest-core column is left out when no run measured it (CPU
testbed runs).
"""

from __future__ import annotations

import argparse
import re
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from charm_megatron.lab.reports.bench_csv import OFF_MODEL_NOTE, BenchRow, by_algo, read_rows
from charm_megatron.lab.reports.te_shipped import te_beside

ORDER = ("ring", "rmplus", "charm", "allgather", "a2a", "a2a+p2p", "auto")
#: auto / fastest above this is bold (charm_megatron.lab.bench.analysis.AUTO_SLACK: issue 12's 5 %).
AUTO_SLACK = 1.05
_MODEL_PICK = re.compile(r"the model's pick (\S+)")


@dataclass(frozen=True)
class PeerPoint:
    """One CSV's forward + backward rows, by algorithm."""

    name: str
    rows: dict[str, BenchRow]

    @property
    def any(self) -> BenchRow:
        return next(iter(self.rows.values()))

    def label(self) -> str:
        r = self.any
        where = r.device_model or "CPU testbed, wall ms"
        window = f", window {r.window[0]}" if r.window else ""
        return (f"{self.name} ({where}, {r.heads}/{r.kv_heads}x{r.head_dim}, "
                f"{'causal' if r.causal else 'full'}{window})")

    def sort_key(self) -> tuple:
        r = self.any
        return (r.device_model or "", r.topology or "", r.heads or 0, r.kv_heads or 0,
                r.seq or 0, -r.window[0] if r.window else float("-inf"), self.name)


def load(path: str | Path) -> PeerPoint:
    p = Path(path)
    rows = by_algo(read_rows(p), "fwdbwd")
    if not rows:
        raise ValueError(f"{p}: no fwdbwd rows")
    return PeerPoint(p.parent.name if p.stem == "results" else p.stem, rows)


def _absent(algo: str, r: BenchRow) -> str:
    """The cell of a contender the run did not time."""
    from charm_megatron.plan.registry import CallTraits, find, refusal, uses_topology

    if find(algo) is None or r.topology is None or r.heads is None:
        return "-"
    nodes, per = (int(x) for x in r.topology.split("x"))
    groups = (tuple(tuple(range(i * per, (i + 1) * per)) for i in range(nodes))
              if uses_topology(algo) else (tuple(range(nodes * per)),))
    traits = CallTraits(groups, r.heads, r.kv_heads, windowed=r.window is not None)
    return "refused (not run)" if refusal(algo, traits) is not None else "-"


def table(points: Sequence[PeerPoint], labels: Sequence[str] | None = None,
          algos: Sequence[str] | None = None, digits: int = 1, model_pick: bool = False,
          pick_in_auto: bool = False) -> str:
    """The Markdown table. ``digits``: decimals of the ms; ``model_pick``: the pick column
    reads ``ran (the model's pick)``, bold where the measurement overruled the model;
    ``pick_in_auto``: auto's pick in its own cell, no fastest / pick / ratio columns."""
    labels = list(labels) if labels else [p.label() for p in points]
    if len(labels) != len(points):
        raise ValueError(f"--label given {len(labels)} times for {len(points)} CSVs: give one "
                         "per CSV, in order")
    algos = list(algos) if algos else [a for a in ORDER if any(a in p.rows for p in points)]
    core = any(p.any.busiest_core_pct is not None for p in points)
    te = any(p.any.device_model for p in points)
    head = ["point", *(("auto (pick)" if pick_in_auto and a == "auto" else a) for a in algos)]
    if not pick_in_auto:
        head += ["fastest", "auto ran (the model's pick)" if model_pick else "auto picks",
                 "auto / fastest"]
    head += ["fastest TE, model (TE / ours, model)"] if te else []
    head += ["busiest core"] if core else []
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    flagged = False
    for point, label in zip(points, labels):
        r = point.rows
        cells = []
        for algo in algos:
            x = r.get(algo)
            if x is None:
                cells.append(_absent(algo, point.any))
            elif not x.ok:  # refused by the bench (heads that do not divide)
                cells.append(x.status or "-")
            else:
                flagged = flagged or bool(x.off_model)
                cell = (f"{x.median_ms:.{digits}f}{x.mark} ({x.bound_ms:.{digits}f}) "
                        f"{x.speedup_vs_ring:.2f}x")
                if pick_in_auto and algo == "auto":
                    cell += f" ({x.auto_pick or '-'})"
                cells.append(cell)
        if not pick_in_auto:
            plain = {a: x.median_ms for a, x in r.items() if a != "auto" and x.ok}
            fastest = min(plain, key=plain.__getitem__)
            auto = r.get("auto")
            pick = (auto.auto_pick if auto else None) or "-"
            if model_pick and auto is not None:
                m = _MODEL_PICK.search(auto.note or "")
                model = m.group(1) if m else "-"
                pick = f"{pick} ({model})" if model == pick else f"**{pick} ({model})**"
            ratio = "-"
            if auto is not None and auto.ok:
                ratio = f"{auto.median_ms / plain[fastest]:.3f}"
                ratio = f"**{ratio}**" if auto.median_ms / plain[fastest] > AUTO_SLACK else ratio
            cells += [fastest, pick, ratio]
        if te:
            cells.append(te_beside(point.any, [a for a, x in r.items() if x.ok]))
        if core:
            pct = point.any.busiest_core_pct  # measured only on emulated GPU runs
            cells.append(f"{pct:.0f} %" if pct is not None else "-")
        lines.append(f"| {label} | " + " | ".join(cells) + " |")
    return "\n".join(lines) + "\n" + (f"\n{OFF_MODEL_NOTE}\n" if flagged else "")


def make(paths: Sequence[str | Path], labels: Sequence[str] | None = None,
         algos: Sequence[str] | None = None, sort: bool = False, digits: int = 1,
         model_pick: bool = False, pick_in_auto: bool = False) -> str:
    points = [load(p) for p in paths]
    if sort:
        if labels:
            raise ValueError("--sort and --label do not go together (labels follow the CSVs)")
        points.sort(key=PeerPoint.sort_key)
    return table(points, labels, algos, digits, model_pick, pick_in_auto)


def register(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("csv", nargs="+", help="bench CSVs, one point each, e.g. "
                                               "docs/performance/peers/*.csv")
    parser.add_argument("--label", action="append", default=None, metavar="TEXT",
                        help="a row's label, once per CSV in order (default: the file name, "
                             "cluster and shape)")
    parser.add_argument("--algos", default=None,
                        help=f"contender columns (default: those of {','.join(ORDER)} that "
                             "any CSV has)")
    parser.add_argument("--sort", action="store_true",
                        help="rows by device, topology, heads, sequence and window (default: "
                             "in the order given)")
    parser.add_argument("--digits", type=int, default=1, help="decimals of the ms (default 1)")
    parser.add_argument("--model-pick", action="store_true",
                        help="the pick column shows what auto ran and, in brackets, the "
                             "model's pick (auto --auto-tune runs), bold where they differ")
    parser.add_argument("--pick-in-auto", action="store_true",
                        help="auto's pick in its cell; no fastest / pick / ratio columns")


def run(args: argparse.Namespace) -> int:
    print(make(args.csv, args.label, args.algos.split(",") if args.algos else None, args.sort,
               args.digits, args.model_pick, args.pick_in_auto), end="")
    return 0
