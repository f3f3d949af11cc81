"""Measured points: rows of ``charm-megatron bench`` output (results.csv), read for the model.

Both the files written before the bench recorded ``cores`` / ``intra_rate_mbps`` and the newer
ones are read; what an old file lacks is given by the caller (``--cores``, ``--intra-gbps``).
"""

from __future__ import annotations

import csv
import hashlib
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path

from charm_megatron.plan.cost import ELEM_BYTES, Problem
from charm_megatron.plan.registry import names as algorithm_names

PASSES = ("fwd", "bwd", "fwdbwd")


@dataclass(frozen=True)
class Point:
    """One (cluster, problem, algorithm, pass) measurement; times in milliseconds."""

    source: str  # file name (no directory): what a profile's fit records
    topology: str  # e.g. "2x4"
    nic: str  # "node" | "rank"
    problem: Problem
    causal: bool
    algo: str
    pas: str  # fwd | bwd | fwdbwd
    median_ms: float
    compute_only_ms: float | None
    ring_compute_ms: float | None
    ring_comm_ms: float | None
    cross_mbps: float | None
    intra_mbps: float | None
    cores: int | None
    mode: str = "netns"  # how the bench ran the ranks: netns | software | local | torchrun
    cross_burst_kb: float | None = None
    cpu_work_ms: float | None = None  # CPU of the compute-only run, summed over ranks
    run_cpu_ms: float | None = None  # CPU of the real run, summed over ranks

    @property
    def key(self) -> tuple:
        """Identifies the point's setting (everything but the algorithm)."""
        return (self.source, self.topology, self.nic, self.problem, self.causal, self.pas)


def _f(row: dict, name: str) -> float | None:
    v = row.get(name, "")
    return float(v) if v not in ("", None) else None


def load_points(paths: Iterable[str | Path]) -> list[Point]:
    """The ``ok`` rows of ring / rmplus / charm from bench CSVs (``torch`` rows are skipped:
    the model replays our plans only)."""
    out: list[Point] = []
    for path in paths:
        p = Path(path)
        if not p.is_file():
            raise ValueError(f"bench output {str(p)!r} does not exist (charm-megatron bench "
                             "--out DIR writes DIR/results.csv)")
        with open(p, newline="", encoding="utf-8") as f:
            rows = list(csv.DictReader(f))
        if not rows or "median_ms" not in rows[0]:
            raise ValueError(f"{p}: not a charm-megatron bench results.csv (no median_ms column)")
        for row in rows:
            # The model replays our own plans only ("torch" rows are skipped).
            if row.get("status") != "ok" or row.get("algo") not in algorithm_names():
                continue
            if row.get("pass") not in PASSES:
                continue
            heads, kvh = int(row["heads"]), int(row.get("kv_heads") or row["heads"])
            # A windowed run (bench --window) is replayed with its window's plans.
            window = row.get("window") or ""
            prob = Problem(int(row["batch"]), int(row["seq"]), heads, kvh, int(row["head_dim"]),
                           ELEM_BYTES[row["dtype"]],
                           window=tuple(int(w) for w in window.split(",")) if window else None)
            cores = row.get("cores")
            out.append(Point(p.name, row["topology"], row.get("nic") or "rank", prob,
                             row["causal"] in ("True", "true", "1"), row["algo"], row["pass"],
                             float(row["median_ms"]), _f(row, "compute_only_ms"),
                             _f(row, "ring_compute_ms"), _f(row, "ring_comm_ms"),
                             _f(row, "cross_rate_mbps"), _f(row, "intra_rate_mbps"),
                             int(float(cores)) if cores else None, row.get("mode") or "netns",
                             _f(row, "cross_burst_kb"), _f(row, "cpu_work_ms"),
                             _f(row, "run_cpu_ms")))
    if not out:
        raise ValueError("no usable rows (status ok, algo ring/rmplus/charm) in "
                         f"{', '.join(str(p) for p in paths)}")
    return out


def file_digest(paths: Sequence[str | Path]) -> dict[str, str]:
    """``{file name: sha256 prefix}``: what a fit records, so a test can tell a stale profile."""
    return {Path(p).name: hashlib.sha256(Path(p).read_bytes()).hexdigest()[:16] for p in paths}
