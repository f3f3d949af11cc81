"""Measured points: rows of ``charm-megatron bench`` output (results.csv), read for the model
(through the one reader of that file, :mod:`charm_megatron.lab.reports.bench_csv`).

Both the files written before the bench recorded ``cores`` / ``intra_rate_mbps`` and the newer
ones are read; what an old file lacks is given by the caller (``--cores``, ``--intra-gbps``).
"""

from __future__ import annotations

import hashlib
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path

from charm_megatron.commands.flags import ELEM_BYTES
from charm_megatron.plan.cost import Problem
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


def load_points(paths: Iterable[str | Path]) -> list[Point]:
    """The ``ok`` rows of ring / rmplus / charm from bench CSVs (``torch`` rows are skipped:
    the model replays our plans only)."""
    # Imported here: the runtime imports this package (algo="auto"), never the lab.
    from charm_megatron.lab.reports.bench_csv import read_rows

    out: list[Point] = []
    for path in paths:
        p = Path(path)
        for row in read_rows(p):
            # The model replays our own plans only ("torch" rows are skipped).
            if not row.ok or row.algo not in algorithm_names() or row.pass_ not in PASSES:
                continue
            # A windowed run (bench --window) is replayed with its window's plans.
            prob = Problem(row.batch, row.seq, row.heads, row.kv_heads, row.head_dim,
                           ELEM_BYTES[row.dtype], window=row.window)
            out.append(Point(p.name, row.topology, row.nic or "rank", prob, bool(row.causal),
                             row.algo, row.pass_, row.median_ms, row.compute_only_ms,
                             row.ring_compute_ms, row.ring_comm_ms, row.cross_rate_mbps,
                             row.intra_rate_mbps, row.cores, row.mode or "netns",
                             row.cross_burst_kb, row.cpu_work_ms, row.run_cpu_ms))
    if not out:
        raise ValueError("no usable rows (status ok, algo ring/rmplus/charm) in "
                         f"{', '.join(str(p) for p in paths)}")
    return out


def file_digest(paths: Sequence[str | Path]) -> dict[str, str]:
    """``{file name: sha256 prefix}``: what a fit records, so a test can tell a stale profile."""
    return {Path(p).name: hashlib.sha256(Path(p).read_bytes()).hexdigest()[:16] for p in paths}
