"""The one reader of the benchmark CSV (``charm-megatron bench --out DIR`` writes DIR/results.csv).

Every column the bench writes is a typed field of :class:`BenchRow`, in the file's order;
:data:`COLUMNS` (what :func:`charm_megatron.lab.bench.report.write_csv` writes) is derived from
it, so the column names live here and nowhere else. Reports, the model's measured points and
the scripts read the CSV through :func:`read_rows` and use the fields, never string keys.

Files written before a column existed are read too: a missing or empty cell is ``None`` (a
missing ``kv_heads`` is ``heads``, a missing ``off_model`` is :func:`off_model` of
``vs_model``). Only ``point``, ``algo`` and ``pass`` must be present.
"""

from __future__ import annotations

import csv
import dataclasses
import math
import types
import typing
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from pathlib import Path

#: field name -> column name where the column is not a Python identifier
_COLUMN_OF = {"pass_": "pass"}

#: How far from the model (``|vs_model - 1|``) an emulated time may be before its row is
#: flagged ``off_model`` (issue 41): such a row is not quoted as a headline.
MODEL_TOLERANCE = 0.10
#: The mark the reports put after a flagged row's time, and the footnote that explains it.
OFF_MODEL_MARK = "\u2020"
OFF_MODEL_NOTE = f"{OFF_MODEL_MARK} more than 10 % off the model: not a headline"


def off_model(vs_model: float | None) -> bool | None:
    """``True`` when an emulated time is more than :data:`MODEL_TOLERANCE` off the model's
    (``vs_model``: measured / model), ``None`` without a model ratio."""
    return None if vs_model is None else abs(vs_model - 1) > MODEL_TOLERANCE


@dataclass(frozen=True, kw_only=True)
class BenchRow:
    """One line of results.csv: one grid point x algorithm x pass. Times in milliseconds
    (device time on an emulated GPU cluster, wall time otherwise), rates in MB/s."""

    # The point: its problem and where it ran.
    point: int
    batch: int | None = None
    seq: int | None = None  # whole sequence (over the CP group)
    heads: int | None = None
    kv_heads: int | None = None
    head_dim: int | None = None
    dtype: str | None = None  # bf16 | fp32 | ...
    causal: bool | None = None
    window: tuple[int, int] | None = None  # (left, right); None: no window
    world: int | None = None
    topology: str | None = None  # e.g. "2x4"
    mode: str | None = None  # netns | software | local | torchrun
    nic: str | None = None  # node | rank
    algo: str
    pass_: str  # fwd | bwd | fwdbwd (the column "pass")
    status: str | None = None  # ok | skipped
    iters: int | None = None
    # The timings over the timed rounds.
    median_ms: float | None = None
    min_ms: float | None = None
    q1_ms: float | None = None
    q3_ms: float | None = None
    max_ms: float | None = None
    speedup_vs_ring: float | None = None  # median of per-round ring / algorithm ratios
    speedup_min: float | None = None
    speedup_max: float | None = None
    # Ring's compute / communication ratio and its two parts; the lower bound and its inputs.
    ring_ccr: float | None = None
    ring_compute_ms: float | None = None
    ring_comm_ms: float | None = None
    compute_only_ms: float | None = None
    cpu_work_ms: float | None = None
    run_cpu_ms: float | None = None
    cross_link_mb: float | None = None
    cross_rate_mbps: float | None = None
    bound_ms: float | None = None
    bound_by: str | None = None  # link | cpu | compute
    vs_bound: float | None = None
    peak_mem_mb: float | None = None
    # What `charm-megatron model --calibrate` needs beyond the above (older files lack them).
    cores: int | None = None
    intra_rate_mbps: float | None = None
    cross_burst_kb: float | None = None
    # The auto contender's rows: what it ran, the fastest registered algorithm at this point
    # and pass, auto's median over that one's, "over" when that exceeds AUTO_SLACK, and the
    # pick's own median (as a contender) over the fastest's.
    auto_pick: str | None = None
    fastest: str | None = None
    vs_fastest: float | None = None
    auto_check: str | None = None  # ok | over
    pick_vs_fastest: float | None = None
    # An emulated GPU cluster (--device-model): every *_ms above is device time; the run's
    # dilation and wire scale, the busiest core while calls were timed (cpu_limited above
    # 70 %), the performance model's prediction on the same profile and the textbook ring.
    device_model: str | None = None
    dilation: float | None = None
    wire_scale: str | None = None  # e.g. "16x14"
    # virtual: the timed device's ops and posts on each rank's virtual clock, calls timed on
    # it (--device-clock virtual, issue 41; the software links in virtual start order since
    # 2026-12-06, virtual-post-order: in wall post order); async: ops queued like a GPU's
    # stream on the wall
    # clock; sync: every op slept at its call (--sync-device, and every run before the
    # column), the host's own CPU work then in the device time.
    device_clock: str | None = None
    busiest_core_pct: float | None = None
    cpu_limited: bool | None = None
    model_ms: float | None = None
    vs_model: float | None = None
    off_model: bool | None = None  # |vs_model - 1| > MODEL_TOLERANCE: never a headline
    analytic_ring_ms: float | None = None
    # The wire dtype of partial results (--partials): input or fp32.
    partials: str | None = None
    # The auto contender's measured shortlist margin (--auto-tune; empty: the model's pick).
    auto_tune: str | None = None
    note: str | None = None

    @property
    def ok(self) -> bool:
        """The row was timed (not skipped)."""
        return self.status == "ok"

    @property
    def mark(self) -> str:
        """:data:`OFF_MODEL_MARK` for a row flagged ``off_model``, else nothing."""
        return OFF_MODEL_MARK if self.off_model else ""

    @property
    def pas(self) -> str:
        """The pass, under the name the model uses."""
        return self.pass_

    @classmethod
    def from_mapping(cls, cells: Mapping[str, str | None]) -> BenchRow:
        """A row from ``csv.DictReader``'s dict (column -> text); unknown columns are ignored."""
        values = {}
        for f in dataclasses.fields(cls):
            text = cells.get(_COLUMN_OF.get(f.name, f.name))
            values[f.name] = None if text in (None, "") else _PARSERS[f.name](text)
        if values["kv_heads"] is None:
            values["kv_heads"] = values["heads"]
        if values["off_model"] is None:  # files written before the column
            values["off_model"] = off_model(values["vs_model"])
        missing = [_COLUMN_OF.get(n, n) for n in ("point", "algo", "pass_") if values[n] is None]
        if missing:
            raise ValueError(f"bench row without {', '.join(missing)}: {dict(cells)}")
        return cls(**values)

    def cells(self) -> dict[str, object]:
        """column -> value (as :func:`charm_megatron.lab.bench.report.write_csv` takes them)."""
        return {_COLUMN_OF.get(f.name, f.name): getattr(self, f.name)
                for f in dataclasses.fields(self)}


def _bool(text: str) -> bool:
    if text in ("True", "true", "1"):
        return True
    if text in ("False", "false", "0"):
        return False
    raise ValueError(f"not a boolean: {text!r}")


def _int(text: str) -> int:
    x = float(text)
    if not x.is_integer():
        raise ValueError(f"not an integer: {text!r}")
    return int(x)


def _float(text: str) -> float | None:
    x = float(text)
    return x if math.isfinite(x) else None


def _window(text: str) -> tuple[int, int]:
    left, right = (int(w) for w in text.split(","))
    return left, right


def _parser(tp) -> typing.Callable[[str], object]:
    args = [a for a in typing.get_args(tp) if a is not type(None)]
    base = args[0] if isinstance(tp, types.UnionType) or typing.get_origin(tp) is typing.Union \
        else tp
    if base is bool:
        return _bool
    if base is int:
        return _int
    if base is float:
        return _float
    if base is str:
        return str
    if typing.get_origin(base) is tuple:
        return _window
    raise TypeError(f"no parser for {tp!r}")


_HINTS = typing.get_type_hints(BenchRow)
_PARSERS = {f.name: _parser(_HINTS[f.name]) for f in dataclasses.fields(BenchRow)}

#: The CSV's columns, in the order the bench writes them.
COLUMNS: list[str] = [_COLUMN_OF.get(f.name, f.name) for f in dataclasses.fields(BenchRow)]


def read_rows(path: str | Path) -> list[BenchRow]:
    """Every row of one bench CSV. Raises ``ValueError`` for a missing file or one that is
    not a bench CSV (no ``median_ms`` column)."""
    p = Path(path)
    if not p.is_file():
        raise ValueError(f"bench output {str(p)!r} does not exist (charm-megatron bench "
                         "--out DIR writes DIR/results.csv)")
    with open(p, newline="", encoding="utf-8") as f:
        reader = csv.DictReader(f)
        if "median_ms" not in (reader.fieldnames or ()):
            raise ValueError(f"{p}: not a charm-megatron bench results.csv (no median_ms "
                             "column)")
        return [BenchRow.from_mapping(r) for r in reader]


def by_algo(rows: Iterable[BenchRow], pas: str, *, ok_only: bool = False) -> dict[str, BenchRow]:
    """``{algo: row}`` of one pass (the last row wins, as one point per file is the rule)."""
    return {r.algo: r for r in rows if r.pass_ == pas and (r.ok or not ok_only)}


def by_algo_pass(rows: Iterable[BenchRow]) -> dict[tuple[str, str], BenchRow]:
    """``{(algo, pass): row}`` of the timed rows."""
    return {(r.algo, r.pass_): r for r in rows if r.ok}
