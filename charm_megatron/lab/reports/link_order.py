"""``charm-megatron report link-order``: emulated GPU-cluster runs against the model with
either link order (docs/model.md, *Link order*): for every contender and pass of the given
bench CSVs, the emulated device ms, the model's prediction with links shared fairly
(``fair``, the CSV's own ``model_ms`` before 2026-12-04) and with transfers served in the order
they started (``fifo``, what the software link model does; the CSV's ``model_ms`` since), and
emulated / each.

    charm-megatron report link-order docs/performance/emulated-t5/paper-measured/*.csv

The cluster is rebuilt as the bench built it (the device profile, the row's NIC model), and a
row's recomputed prediction (either order) is checked against the CSV's ``model_ms``, so a
rebuilt cluster or settings that differ from the run's (e.g. CHARM+ run with ``--setting
head_parallel=1``, which the CSV does not record) are reported, not used.
"""

from __future__ import annotations

import argparse
from collections.abc import Sequence
from pathlib import Path

from charm_megatron.lab.reports.bench_csv import BenchRow, read_rows


def prediction(row: BenchRow, order: str) -> float:
    """The model's ms for ``row``'s algorithm and pass with links served in ``order``."""
    from charm_megatron.lab.bench.config import element_size
    from charm_megatron.model import get_profile, predict
    from charm_megatron.plan.cost import Problem

    cluster = get_profile(row.device_model).cluster.with_(nic=row.nic or None, link_order=order)
    nodes, per = (int(x) for x in row.topology.split("x"))
    groups = [list(range(i * per, (i + 1) * per)) for i in range(nodes)]
    problem = Problem(row.batch, row.seq, row.heads, row.kv_heads, row.head_dim,
                      element_size(row.dtype), wide_partials=row.partials == "fp32")
    pred = predict(row.algo, groups, problem, cluster, bool(row.causal), tune=True)
    return {"fwd": pred.forward.time_s, "bwd": pred.backward.time_s,
            "fwdbwd": pred.total_s}[row.pass_] * 1e3


def table(paths: Sequence[str | Path]) -> str:
    lines = ["| run | algo | pass | emulated ms | model, fair | model, fifo | emulated / fair "
             "| emulated / fifo |",
             "|---|---|---|---|---|---|---|---|"]
    for path in paths:
        rows = [r for r in read_rows(path) if r.device_model and r.ok
                and r.pass_ in ("fwd", "bwd") and r.algo != "auto"]
        name = Path(path).stem
        for row in rows:
            em = row.median_ms
            fair, fifo = prediction(row, "fair"), prediction(row, "fifo")
            # The run's own model was the fair one before 2026-12-04 and the in-order one since
            # (the bench tells the model its links' order): either matching says the cluster
            # and the settings were rebuilt as the run had them.
            if row.model_ms and min(abs(fair / row.model_ms - 1),
                                    abs(fifo / row.model_ms - 1)) > 0.005:
                lines.append(f"| {path} | {row.algo} | {row.pass_} | rebuilt cluster predicts "
                             f"{fair:.1f} / {fifo:.1f}, the run's model {row.model_ms:g}: "
                             "skipped | | | | |")
                continue
            lines.append(f"| {name} | {row.algo} | {row.pass_} | {em:.1f} | {fair:.1f} | "
                         f"{fifo:.1f} | {em / fair:.3f} | {em / fifo:.3f} |")
    return "\n".join(lines) + "\n"


def register(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("csv", nargs="+", help="bench CSVs of emulated GPU-cluster runs")


def run(args: argparse.Namespace) -> int:
    print(table(args.csv), end="")
    return 0
