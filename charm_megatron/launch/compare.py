"""``charm-megatron compare``: iteration times of Megatron-LM training logs, ring vs CHARM+.

::

    charm-megatron compare runs/gpt-350m --out results/
    charm-megatron compare ring.log charm.log --label scale/p2p --label scale/charm

Reads the lines Megatron-LM's ``training_log`` prints (``megatron/training/training.py``)::

     [2024-05-01 10:00:00.123456] iteration       20/      50 | consumed samples: 320 |
     elapsed time per iteration (ms): 1234.5 | throughput per GPU (TFLOP/s/GPU): 100.1 |
     learning rate: 1.000000E-04 | global batch size:    16 | lm loss: 7.123400E+00 |
     loss scale: 1.0 | grad norm: 1.234 | number of skipped iterations:   0 | ...

(one line in a log), the ``report_memory`` lines (``[Rank 0] (after 10 iterations) memory (MB) |
allocated: ... | max allocated: ... | reserved: ... | max reserved: ...``) and the argument dump
Megatron prints at start-up (``  cp_comm_type .......... ['p2p']``). Prefixes that ``srun
--label`` or ``torchrun --tee`` put before a line are ignored.

Each log is labelled (config, run, comm type), first found wins per part: ``--label``; a
``meta.json`` next to the log (written by ``scripts/slurm/launch.sh``); the directory layout
``runs/<config>/<run>/<comm>/``; the argument dump (comm type from ``cp_comm_type``, run from
``seq_length`` and ``global_batch_size``). Logs with the same label are pooled.

The first ``--skip`` logged iterations of every log are dropped: Megatron logs iteration 1 on
its own (start-up included) and does not reset its timer after it, so the next line is skewed
too; compilation and allocator warm-up add more. See ``docs/compare.md``.
"""

from __future__ import annotations

import argparse
import csv
import json
import math
import os
import re
import sys
from collections.abc import Iterable, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path

from charm_megatron.launch.args_cli import COMM_TYPES
from charm_megatron.plan.registry import NameView

__all__ = [
    "CompareRow",
    "IterationEntry",
    "Label",
    "MemoryEntry",
    "ParsedLog",
    "compare",
    "format_table",
    "label_for",
    "parse_log",
    "plot",
    "register",
    "run",
    "write_csv",
]

#: Comm types in table order; the first present of BASELINES is the speedup reference.
COMM_ORDER = NameView(lambda: tuple(COMM_TYPES))
#: Megatron's own ring first, then charm-megatron's ring.
BASELINES: tuple[str, ...] = ("p2p", "ring")
#: File suffixes read when a directory is given.
LOG_SUFFIXES: tuple[str, ...] = (".log", ".out")
DEFAULT_SKIP = 2

_ITERATION = re.compile(r"\biteration\s+(\d+)\s*/\s*(\d+)\s*\|")
_TIMESTAMP = re.compile(r"\[(\d{4}-\d\d-\d\d \d\d:\d\d:\d\d(?:\.\d+)?)\]\s*$")
_MEMORY = re.compile(r"\[Rank (\d+)\]\s*\(((?:after|before)[^)]*)\)\s*memory \(MB\)(.*)$")
_AFTER_ITERS = re.compile(r"after (\d+) iterations")
_ARG = re.compile(r"^\s*(?:\S+:\s+)?([a-z_][a-z0-9_]*) \.{3,} (.*?)\s*$")
_ARGS_BEGIN = re.compile(r"-{4,} arguments -{4,}")
_ARGS_END = re.compile(r"-{4,} end of arguments -{4,}")

# training_log field names -> IterationEntry attributes.
_FIELDS = {
    "elapsed time per iteration (ms)": "iter_time_ms",
    "throughput per GPU (TFLOP/s/GPU)": "tflops_per_gpu",
    "learning rate": "learning_rate",
    "global batch size": "global_batch_size",
    "lm loss": "lm_loss",
    "loss scale": "loss_scale",
    "grad norm": "grad_norm",
    "consumed samples": "consumed_samples",
    "number of skipped iterations": "skipped_iterations",
    "number of nan iterations": "nan_iterations",
}


@dataclass
class IterationEntry:
    """One ``training_log`` line; a field the line lacks (or garbles) is ``None``."""

    iteration: int
    train_iters: int
    timestamp: str | None = None
    iter_time_ms: float | None = None
    tflops_per_gpu: float | None = None
    learning_rate: float | None = None
    global_batch_size: float | None = None
    lm_loss: float | None = None
    loss_scale: float | None = None
    grad_norm: float | None = None
    consumed_samples: float | None = None
    skipped_iterations: float | None = None
    nan_iterations: float | None = None
    extra: dict[str, str] = field(default_factory=dict)


@dataclass
class MemoryEntry:
    """One ``report_memory`` line (MB)."""

    rank: int
    iteration: int | None
    allocated: float | None = None
    max_allocated: float | None = None
    reserved: float | None = None
    max_reserved: float | None = None


@dataclass(frozen=True)
class Label:
    """What a log measured; ``None`` parts are unknown."""

    config: str | None = None
    run: str | None = None
    comm_type: str | None = None

    def merged(self, other: Label) -> Label:
        """Fill this label's unknown parts from ``other``."""
        return Label(self.config or other.config, self.run or other.run,
                     self.comm_type or other.comm_type)

    @classmethod
    def parse(cls, text: str) -> Label:
        """``comm``, ``run/comm`` or ``config/run/comm`` (the ``--label`` syntax)."""
        parts = [p.strip() or None for p in text.split("/")]
        if not 1 <= len(parts) <= 3:
            raise ValueError(f"--label {text!r}: expected COMM, RUN/COMM or CONFIG/RUN/COMM")
        parts = [None] * (3 - len(parts)) + parts
        return cls(*parts)


@dataclass
class ParsedLog:
    """What :func:`parse_log` found in one file."""

    path: Path
    entries: list[IterationEntry]
    memory: list[MemoryEntry]
    args: dict[str, str]


@dataclass
class CompareRow:
    """One (config, run, comm type) of the comparison; times in ms."""

    config: str
    run: str
    comm_type: str
    logs: int
    iterations: int
    median_ms: float | None
    p25_ms: float | None
    p75_ms: float | None
    min_ms: float | None
    max_ms: float | None
    mean_ms: float | None
    speedup: float | None
    baseline: str | None
    tflops_per_gpu: float | None
    last_iteration: int | None
    lm_loss: float | None
    max_allocated_mb: float | None
    max_reserved_mb: float | None

    @property
    def iqr_ms(self) -> float | None:
        """Interquartile range ``p75 - p25``."""
        if self.p25_ms is None or self.p75_ms is None:
            return None
        return self.p75_ms - self.p25_ms


# --------------------------------------------------------------------------- parsing
def _number(text: str) -> float | None:
    try:
        return float(text.strip().split()[0])
    except (ValueError, IndexError):
        return None


def _fields(text: str) -> dict[str, str]:
    out: dict[str, str] = {}
    for part in text.split("|"):
        key, sep, value = part.partition(":")
        if sep and key.strip():
            out[key.strip()] = value.strip()
    return out


def _parse_iteration(line: str, m: re.Match[str]) -> IterationEntry:
    ts = _TIMESTAMP.search(line[: m.start()])
    entry = IterationEntry(int(m.group(1)), int(m.group(2)), ts.group(1) if ts else None)
    for key, value in _fields(line[m.end():]).items():
        attr = _FIELDS.get(key)
        if attr is None:
            entry.extra[key] = value
        else:
            setattr(entry, attr, _number(value))
    return entry


def _parse_memory(m: re.Match[str]) -> MemoryEntry:
    after = _AFTER_ITERS.search(m.group(2))
    entry = MemoryEntry(int(m.group(1)), int(after.group(1)) if after else None)
    for key, value in _fields(m.group(3)).items():
        attr = key.replace(" ", "_")
        if attr in ("allocated", "max_allocated", "reserved", "max_reserved"):
            setattr(entry, attr, _number(value))
    return entry


def parse_log(path: str | os.PathLike[str]) -> ParsedLog:
    """Parse one Megatron-LM log: iteration lines, memory lines and the argument dump.

    A repeated iteration number (a restarted job appending to the same log) keeps its last
    line. Unreadable bytes are replaced, never fatal.
    """
    p = Path(path)
    by_iteration: dict[int, IterationEntry] = {}
    memory: list[MemoryEntry] = []
    args: dict[str, str] = {}
    in_args = False
    with p.open(encoding="utf-8", errors="replace") as fh:
        for line in fh:
            line = line.rstrip("\n")
            m = _ITERATION.search(line)
            if m:
                entry = _parse_iteration(line, m)
                by_iteration.pop(entry.iteration, None)  # keep file order of the last copy
                by_iteration[entry.iteration] = entry
                continue
            mm = _MEMORY.search(line)
            if mm:
                memory.append(_parse_memory(mm))
                continue
            if _ARGS_BEGIN.search(line):
                in_args = True
            elif _ARGS_END.search(line):
                in_args = False
            elif in_args:
                am = _ARG.match(line)
                if am:
                    args[am.group(1)] = am.group(2)
    entries = sorted(by_iteration.values(), key=lambda e: e.iteration)
    return ParsedLog(p, entries, memory, args)


# --------------------------------------------------------------------------- labels
def _comm_from_args(value: str | None) -> str | None:
    # Megatron prints the list it parsed: ['p2p'] (one type for all layers).
    if not value:
        return None
    names = re.findall(r"[A-Za-z0-9+_-]+", value)
    return names[0] if len(set(names)) == 1 else None


def label_for(log: ParsedLog) -> Label:
    """The label a log's own files say: ``meta.json``, then the directory layout, then the
    argument dump in the log."""
    label = Label()
    meta = log.path.parent / "meta.json"
    if meta.is_file():
        try:
            data = json.loads(meta.read_text(encoding="utf-8"))
        except (OSError, ValueError):
            data = {}
        if isinstance(data, dict):
            label = label.merged(Label(
                *(str(data[k]) if data.get(k) not in (None, "") else None
                  for k in ("config", "run", "comm_type"))))
    parents = log.path.resolve().parents
    if len(parents) >= 3 and parents[0].name in COMM_ORDER:
        label = label.merged(Label(parents[2].name, parents[1].name, parents[0].name))
    seq, gbs = log.args.get("seq_length"), log.args.get("global_batch_size")
    run = f"s{seq}-gb{gbs}" if seq and gbs and seq != "None" and gbs != "None" else None
    return label.merged(Label(None, run, _comm_from_args(log.args.get("cp_comm_type"))))


def _log_files(path: Path) -> list[Path]:
    if path.is_dir():
        return sorted(p for p in path.rglob("*") if p.is_file() and p.suffix in LOG_SUFFIXES)
    return [path]


# --------------------------------------------------------------------------- statistics
def _quantile(sorted_values: Sequence[float], q: float) -> float:
    """Linear interpolation between order statistics (numpy's default)."""
    pos = (len(sorted_values) - 1) * q
    lo = math.floor(pos)
    hi = min(lo + 1, len(sorted_values) - 1)
    return sorted_values[lo] + (sorted_values[hi] - sorted_values[lo]) * (pos - lo)


def _kept(entries: list[IterationEntry], skip: int, skip_iters: int) -> list[IterationEntry]:
    return [e for e in entries[skip:] if e.iteration > skip_iters]


def _max(values: Iterable[float | None]) -> float | None:
    present = [v for v in values if v is not None]
    return max(present) if present else None


def _natural(text: str) -> list[object]:
    # s2048 before s16384: compare digit runs as numbers.
    return [int(t) if t.isdigit() else t for t in re.split(r"(\d+)", text)]


def compare(
    paths: Sequence[str | os.PathLike[str]],
    labels: Sequence[str | Label | None] | None = None,
    skip: int = DEFAULT_SKIP,
    skip_iters: int = 0,
) -> list[CompareRow]:
    """Parse the logs under ``paths`` (files or directories), pool them by label, summarise.

    ``labels``: one per path (``COMM``, ``RUN/COMM``, ``CONFIG/RUN/COMM`` or a :class:`Label`),
    applied to every log under that path before the log's own labels. ``skip``: logged
    iterations dropped at the start of each log; ``skip_iters``: also drop iterations up to
    this number. Rows come sorted by config, run, then comm type (baselines first); logs
    without iteration lines are ignored.
    """
    if labels is not None and len(labels) != len(paths):
        raise ValueError(f"got {len(labels)} labels for {len(paths)} paths; give one per path")
    groups: dict[tuple[str, str, str], list[ParsedLog]] = {}
    for i, raw in enumerate(paths):
        given = labels[i] if labels is not None else None
        if isinstance(given, str):
            given = Label.parse(given)
        for file in _log_files(Path(raw)):
            log = parse_log(file)
            if not log.entries:
                continue
            label = (given or Label()).merged(label_for(log))
            key = (label.config or "-", label.run or file.stem, label.comm_type or "?")
            groups.setdefault(key, []).append(log)

    rows: list[CompareRow] = []
    for (config, run_name, comm), logs in groups.items():
        kept = [e for log in logs for e in _kept(log.entries, skip, skip_iters)]
        times = sorted(e.iter_time_ms for e in kept if e.iter_time_ms is not None)
        tflops = sorted(e.tflops_per_gpu for e in kept if e.tflops_per_gpu is not None)
        last = max((e for log in logs for e in log.entries), key=lambda e: e.iteration)
        memory = [m for log in logs for m in log.memory]
        rows.append(CompareRow(
            config=config, run=run_name, comm_type=comm, logs=len(logs), iterations=len(times),
            median_ms=_quantile(times, 0.5) if times else None,
            p25_ms=_quantile(times, 0.25) if times else None,
            p75_ms=_quantile(times, 0.75) if times else None,
            min_ms=times[0] if times else None, max_ms=times[-1] if times else None,
            mean_ms=sum(times) / len(times) if times else None,
            speedup=None, baseline=None,
            tflops_per_gpu=_quantile(tflops, 0.5) if tflops else None,
            last_iteration=last.iteration, lm_loss=last.lm_loss,
            max_allocated_mb=_max(m.max_allocated for m in memory),
            max_reserved_mb=_max(m.max_reserved for m in memory),
        ))

    # Speedup over the ring of the same config and run: Megatron's p2p, else our ring.
    for row in rows:
        peers = {r.comm_type: r for r in rows if (r.config, r.run) == (row.config, row.run)}
        base = next((peers[b] for b in BASELINES if b in peers and peers[b].median_ms), None)
        if base is not None and row.median_ms:
            row.baseline = base.comm_type
            row.speedup = base.median_ms / row.median_ms

    def order(r: CompareRow) -> tuple[object, ...]:
        rank = COMM_ORDER.index(r.comm_type) if r.comm_type in COMM_ORDER else len(COMM_ORDER)
        return (_natural(r.config), _natural(r.run), rank, r.comm_type)

    return sorted(rows, key=order)


# --------------------------------------------------------------------------- output
def _fmt(value: float | int | None, spec: str = ".1f") -> str:
    if value is None:
        return "-"
    return format(value, spec)


def format_table(rows: Sequence[CompareRow]) -> str:
    """A plain-text table, one line per row (``-`` for a missing value)."""
    header = ["config", "run", "comm", "logs", "iters", "median ms", "IQR ms", "min-max ms",
              "speedup", "TFLOP/s/GPU", "last iter", "lm loss", "max alloc MB"]
    body = []
    for r in rows:
        spread = "-" if r.p25_ms is None else f"{r.p25_ms:.1f}-{r.p75_ms:.1f}"
        minmax = "-" if r.min_ms is None else f"{r.min_ms:.1f}-{r.max_ms:.1f}"
        speedup = "-" if r.speedup is None else f"{r.speedup:.2f}x"
        body.append([r.config, r.run, r.comm_type, str(r.logs), str(r.iterations),
                     _fmt(r.median_ms), spread, minmax, speedup, _fmt(r.tflops_per_gpu),
                     _fmt(r.last_iteration, "d"), _fmt(r.lm_loss, ".4f"),
                     _fmt(r.max_allocated_mb, ".0f")])
    widths = [max(len(row[i]) for row in [header, *body]) for i in range(len(header))]
    numeric = set(range(3, len(header)))

    def line(cells: list[str]) -> str:
        return "  ".join(c.rjust(w) if i in numeric else c.ljust(w)
                         for i, (c, w) in enumerate(zip(cells, widths))).rstrip()

    out = [line(header), line(["-" * w for w in widths])] + [line(b) for b in body]
    bases = sorted({r.baseline for r in rows if r.baseline})
    out.append(f"speedup = baseline median / median; baseline per run: "
               f"{', '.join(bases) if bases else 'none (no p2p or ring log)'}")
    return "\n".join(out)


CSV_COLUMNS: tuple[str, ...] = (
    "config", "run", "comm_type", "logs", "iterations", "median_ms", "p25_ms", "p75_ms",
    "iqr_ms", "min_ms", "max_ms", "mean_ms", "speedup", "baseline", "tflops_per_gpu",
    "last_iteration", "lm_loss", "max_allocated_mb", "max_reserved_mb",
)


def write_csv(rows: Sequence[CompareRow], path: str | os.PathLike[str]) -> Path:
    """Write ``rows`` as CSV (columns :data:`CSV_COLUMNS`; empty cell = missing)."""
    p = Path(path)
    with p.open("w", newline="", encoding="utf-8") as fh:
        writer = csv.DictWriter(fh, fieldnames=CSV_COLUMNS)
        writer.writeheader()
        for r in rows:
            data = asdict(r)
            data["iqr_ms"] = r.iqr_ms
            writer.writerow({k: "" if data[k] is None else data[k] for k in CSV_COLUMNS})
    return p


def plot(rows: Sequence[CompareRow], path: str | os.PathLike[str]) -> Path:
    """A grouped bar chart of median iteration time (bars: comm types; whiskers: IQR)."""
    import matplotlib

    matplotlib.use("Agg")  # files only; no display on cluster login nodes
    import matplotlib.pyplot as plt

    runs = list(dict.fromkeys((r.config, r.run) for r in rows))
    comms = sorted(dict.fromkeys(r.comm_type for r in rows),
                   key=lambda c: COMM_ORDER.index(c) if c in COMM_ORDER else len(COMM_ORDER))
    width = 0.8 / max(1, len(comms))
    fig, ax = plt.subplots(figsize=(max(6.0, 1.2 * len(runs) * max(1, len(comms)) / 2 + 2), 4.5))
    for j, comm in enumerate(comms):
        xs, heights, low, high, notes = [], [], [], [], []
        for i, key in enumerate(runs):
            row = next((r for r in rows if (r.config, r.run) == key and r.comm_type == comm),
                       None)
            if row is None or row.median_ms is None:
                continue
            xs.append(i + (j - (len(comms) - 1) / 2) * width)
            heights.append(row.median_ms)
            low.append(row.median_ms - (row.p25_ms if row.p25_ms is not None else row.median_ms))
            high.append((row.p75_ms if row.p75_ms is not None else row.median_ms) - row.median_ms)
            notes.append(row.speedup if row.baseline and row.baseline != comm else None)
        bars = ax.bar(xs, heights, width, yerr=[low, high], capsize=3, label=comm)
        for bar, note in zip(bars, notes):
            if note is not None:
                ax.annotate(f"{note:.2f}x", (bar.get_x() + bar.get_width() / 2, bar.get_height()),
                            xytext=(0, 4), textcoords="offset points", ha="center", fontsize=7)
    configs = {c for c, _ in runs}
    ax.set_xticks(range(len(runs)))
    ax.set_xticklabels([r if len(configs) == 1 else f"{c}\n{r}" for c, r in runs],
                       rotation=30, ha="right", fontsize=8)
    ax.set_ylabel("median iteration time (ms)")
    ax.set_title("Iteration time by CP comm type" + (f" ({next(iter(configs))})"
                                                      if len(configs) == 1 else ""))
    ax.legend(title="cp-comm-type", fontsize=8)
    ax.grid(axis="y", alpha=0.3)
    fig.tight_layout()
    out = Path(path)
    fig.savefig(out, dpi=120)
    plt.close(fig)
    return out


# --------------------------------------------------------------------------- CLI
def register(parser: argparse.ArgumentParser) -> None:
    """Add the ``compare`` subcommand's arguments."""
    parser.add_argument("paths", nargs="+", metavar="LOG_OR_DIR",
                        help="Megatron-LM logs, or directories searched for *.log / *.out "
                        "(e.g. runs/gpt-350m written by scripts/slurm)")
    parser.add_argument("--label", action="append", default=None, metavar="[[CONFIG/]RUN/]COMM",
                        help="label of each LOG_OR_DIR, in order (give one per path); overrides "
                        "meta.json, the directory layout and the log's argument dump")
    parser.add_argument("--skip", type=int, default=DEFAULT_SKIP, metavar="N",
                        help=f"drop the first N logged iterations of each log (warm-up; "
                        f"default {DEFAULT_SKIP})")
    parser.add_argument("--skip-iters", type=int, default=0, metavar="K",
                        help="also drop iterations numbered <= K (default 0)")
    parser.add_argument("--out", metavar="DIR",
                        help="write DIR/compare.csv and DIR/compare.png")
    parser.add_argument("--no-plot", action="store_true", help="with --out: CSV only")


def run(args: argparse.Namespace) -> int:
    """Print the table; with ``--out`` write the CSV and PNG. 1 when no log had iterations."""
    if args.skip < 0 or args.skip_iters < 0:
        print("charm-megatron compare: --skip and --skip-iters must be >= 0", file=sys.stderr)
        return 2
    missing = [p for p in args.paths if not Path(p).exists()]
    if missing:
        print(f"charm-megatron compare: no such file or directory: {missing[0]}", file=sys.stderr)
        return 2
    try:
        rows = compare(args.paths, args.label, skip=args.skip, skip_iters=args.skip_iters)
    except ValueError as exc:
        print(f"charm-megatron compare: {exc}", file=sys.stderr)
        return 2
    if not rows:
        print("charm-megatron compare: no Megatron-LM iteration lines ('iteration N/ M |') in "
              + ", ".join(args.paths), file=sys.stderr)
        return 1
    print(format_table(rows))
    if args.out:
        out = Path(args.out)
        out.mkdir(parents=True, exist_ok=True)
        print(f"wrote {write_csv(rows, out / 'compare.csv')}")
        if not args.no_plot:
            try:
                print(f"wrote {plot(rows, out / 'compare.png')}")
            except ImportError:
                print("charm-megatron compare: plot skipped: matplotlib is not installed; the "
                      "table and CSV have the numbers (pip install matplotlib, or the [dev] "
                      f"extra, then rerun to get {out / 'compare.png'})")
    return 0
