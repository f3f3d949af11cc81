"""The paper's appendix Tables 9 and 10: its implementation on 2x8 H100 from small to large
per-rank sizes, and how far the model lands from it.

The rows (``devices/measurements/paper-h100-2x8-tables-9-10.tsv``, copied from the paper: 16
H100s, 12 heads x 192, bf16, batch 1-128, sequence 3,360-215,040) give ring and CHARM+ times per
pass. Table 10 (backward) has no TASP column: the file leaves it empty.

**The mask.** The appendix calls the mask full, but its CHARM+ forward at ``B=1, S=215,040``
takes 66.7 ms, less than the 86.0 ms it gives as the computation time, and ring and TASP take
that computation time or more. That is what causal attention in the *contiguous* layout (no
load balancing) gives: the last rank's queries see every key, so ring and TASP, which compute
each query's tiles where the query lives, pay a full attention's compute on it, while
CHARM+'s query exchange spreads the tiles. The rows are modelled so (:func:`problem`: a
non-causal call with the causal window ``(S, 0)``, whose plans hold only the tiles and
messages the mask needs) with partials in fp32 (the paper's Table 5 convention,
:data:`~charm_megatron.lab.calibration.paper.TABLE5_WIDE_PARTIALS`).

**Fit and check.** :data:`FIT_SEQS` are the rows the ``h100-paper-appendix`` profile may be
fitted on (every other sequence length, both ends: 3,360, 13,440, 53,760 and 215,040, 30
row-passes); the other lengths (6,720, 26,880, 107,520; 24 row-passes) are the check. The
paper's 4x8 appendix tables are not in the file: they are kept back.
"""

from __future__ import annotations

import csv
import functools
import math
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from charm_megatron.devices import MEASUREMENTS_DIR
from charm_megatron.lab.calibration.accuracy import Setting, _median
from charm_megatron.model.cluster import Cluster
from charm_megatron.plan.cost import Problem

APPENDIX_TSV = MEASUREMENTS_DIR / "paper-h100-2x8-tables-9-10.tsv"
TOPOLOGY = "2x8"
HEADS, HEAD_DIM, ELEM = 12, 192, 2
#: Sequence lengths whose rows a fit may use; the rest are the check.
FIT_SEQS = (3360, 13440, 53760, 215040)
#: How the rows' mask is modelled (docs/model.md): recorded in the profiles fitted on them.
MASK = "causal, contiguous layout (no load balancing)"
_PASSES = {"forward": "fwd", "backward": "bwd"}


@dataclass(frozen=True)
class AppendixRow:
    """One row-pass: ``pas`` (``fwd`` / ``bwd``), batch ``b``, sequence ``s``; the paper's
    ring and CHARM+ times and its communication and computation times, ms."""

    pas: str
    b: int
    s: int
    ring: float
    charm: float
    t_comm: float
    t_comp: float

    @property
    def fit(self) -> bool:
        """True if a fit may use this row (:data:`FIT_SEQS`)."""
        return self.s in FIT_SEQS

    @property
    def label(self) -> str:
        return f"B={self.b} S={self.s} {self.pas}"


def load_rows(path: Path = APPENDIX_TSV) -> tuple[AppendixRow, ...]:
    """Every row-pass of the file; :class:`ValueError` names a row it cannot read."""
    out = []
    with open(path, encoding="utf-8", newline="") as f:
        lines = csv.reader(f, delimiter="\t")
        header = next(lines, [])
        for i, cells in enumerate(lines, start=2):
            rec = dict(zip(header, cells))
            try:
                out.append(AppendixRow(_PASSES[rec["pass"]], int(rec["batch"]),
                                       int(rec["seq"]), float(rec["ring_ms"]),
                                       float(rec["charm_ms"]), float(rec["t_comm_ms"]),
                                       float(rec["t_comp_ms"])))
            except (KeyError, TypeError, ValueError) as exc:
                raise ValueError(f"{path}:{i}: not an appendix row ({exc})") from None
    return tuple(out)


def problem(row: AppendixRow) -> Problem:
    """The row's attention call (see the module: causal in the contiguous layout)."""
    return Problem(row.b, row.s, HEADS, HEADS, HEAD_DIM, ELEM, window=(row.s, 0),
                   wide_partials=True)


@functools.lru_cache(maxsize=1024)  # a pure function: reports and tests ask again per row
def predict(cluster: Cluster, row: AppendixRow) -> tuple[float, float]:
    """The model's (ring ms, CHARM+ ms) for the row."""
    from charm_megatron.lab.calibration.calibrate import _sim_ms

    prob = problem(row)
    return tuple(_sim_ms(cluster, TOPOLOGY, prob, False, algo, row.pas)
                 for algo in ("ring", "charm"))


#: The power of the log errors a fit averages: 4 weighs the worst rows more than squares do
#: (the aim is a bound on the worst row as well as the median).
FIT_POWER = 4


def fit_loss(cluster: Cluster, rows: Sequence[AppendixRow]) -> float:
    """What a fit on ``rows`` minimises: the mean :data:`FIT_POWER`-th power of the log errors
    of the ring time and of CHARM+'s speed-up over ring (the speed-up is what the model is
    asked for; the ring time pins the scale)."""
    errs = 0.0
    for row in rows:
        ring, charm = predict(cluster, row)
        errs += abs(math.log(ring / row.ring)) ** FIT_POWER
        errs += abs(math.log((ring / charm) / (row.ring / row.charm))) ** FIT_POWER
    return errs / (2 * len(rows))


def settings(cluster: Cluster, rows: Sequence[AppendixRow] | None = None,
             fitted_on_charm: bool = True) -> list[Setting]:
    """Every row as an accuracy :class:`Setting`, grouped ``fit rows`` / ``check rows``; a fit
    row's ring and CHARM+ times are marked *calibrated on* (``fitted_on_charm``: the fit
    used its CHARM+ column too)."""
    out = []
    for row in rows if rows is not None else load_rows():
        ring, charm = predict(cluster, row)
        fitted = frozenset(({"ring", "charm"} if fitted_on_charm else {"ring"})
                           if row.fit else ())
        group = f"paper appendix {TOPOLOGY} {'fit' if row.fit else 'check'} rows"
        out.append(Setting(group, row.label, {"ring": row.ring, "charm": row.charm},
                           {"ring": ring, "charm": charm}, fitted))
    return out


def speedup_stats(sts: Sequence[Setting]) -> tuple[float, float, int]:
    """(median |speed-up error|, worst |speed-up error|, rows with the right winner)."""
    errs = [abs(st.speedup_err) for st in sts]
    return _median(errs), max(errs), sum(st.winner_ok for st in sts)


def summary(sts: Sequence[Setting]) -> str:
    """Markdown: the speed-up error and winners of the fit rows, the check rows and all."""
    lines = ["| rows | row-passes | speed-up error, median | worst | right winner |",
             "|---|---|---|---|---|"]
    groups: dict[str, list[Setting]] = {}
    for st in sts:
        groups.setdefault(st.group, []).append(st)
    groups["all"] = list(sts)
    for name, group in groups.items():
        med, worst, ok = speedup_stats(group)
        lines.append(f"| {name} | {len(group)} | {med:.1%} | {worst:.1%} | {ok}/{len(group)} |")
    return "\n".join(lines)
