#!/usr/bin/env python3
"""Emulated GPU-cluster runs against the model with either link order (docs/model.md, *Link
order*): for every contender and pass of the given bench CSVs, the emulated device ms, the
model's prediction with links shared fairly (``fair``, the CSV's own ``model_ms`` before
2026-12-04) and with transfers served in the order they started (``fifo``, what the software
link model does), and emulated / each.

    python scripts/link_order_check.py docs/performance/emulated-t5/paper-measured/*.csv

The cluster is rebuilt as the bench built it (the device profile, the row's NIC model, its
real link rates when given), and a row's recomputed ``fair`` prediction is checked against the
CSV's ``model_ms``, so a rebuilt cluster that differs from the run's is reported, not used.
"""

from __future__ import annotations

import csv
import sys

from charm_megatron.bench.config import element_size
from charm_megatron.model import get_profile, predict
from charm_megatron.plan.cost import Problem


def _prediction(row: dict, order: str) -> float:
    cluster = get_profile(row["device_model"]).cluster.with_(nic=row["nic"] or None,
                                                             link_order=order)
    nodes, per = (int(x) for x in row["topology"].split("x"))
    groups = [list(range(i * per, (i + 1) * per)) for i in range(nodes)]
    problem = Problem(int(row["batch"]), int(row["seq"]), int(row["heads"]),
                      int(row["kv_heads"]), int(row["head_dim"]), element_size(row["dtype"]),
                      wide_partials=row.get("partials") == "fp32")
    causal = row["causal"] == "True"
    pred = predict(row["algo"], groups, problem, cluster, causal, tune=True)
    return {"fwd": pred.forward.time_s, "bwd": pred.backward.time_s,
            "fwdbwd": pred.total_s}[row["pass"]] * 1e3


def main(paths: list[str]) -> int:
    print("| run | algo | pass | emulated ms | model, fair | model, fifo | emulated / fair "
          "| emulated / fifo |")
    print("|---|---|---|---|---|---|---|---|")
    for path in paths:
        with open(path, newline="") as f:
            rows = [r for r in csv.DictReader(f) if r.get("device_model") and r["status"] == "ok"
                    and r["pass"] in ("fwd", "bwd") and r["algo"] != "auto"]
        for row in rows:
            em = float(row["median_ms"])
            fair, fifo = _prediction(row, "fair"), _prediction(row, "fifo")
            if row.get("model_ms") and abs(fair / float(row["model_ms"]) - 1) > 0.005:
                print(f"| {path} | {row['algo']} | {row['pass']} | rebuilt cluster predicts "
                      f"{fair:.1f}, the run's model {row['model_ms']}: skipped | | | | |")
                continue
            name = path.rsplit("/", 1)[-1].removesuffix(".csv")
            print(f"| {name} | {row['algo']} | {row['pass']} | {em:.1f} | {fair:.1f} | "
                  f"{fifo:.1f} | {em / fair:.3f} | {em / fifo:.3f} |")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
