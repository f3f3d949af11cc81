"""How far the model lands from measurements: ``charm-megatron model --accuracy``.

For every measured setting (a bench CSV row group, or a row of the paper's Table 5) it predicts
ring and CHARM+ (and RM+ where measured), and reports the errors of ring time, CHARM+ time and
CHARM+'s speed-up over ring, and whether the predicted fastest algorithm is the measured
fastest. Each quantity is marked *calibrated on* when the profile's fit used that very number
(``profile.fit``), otherwise it is a prediction the fit never saw. docs/model.md's accuracy
tables are this module's output.
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, replace

from charm_megatron.lab.calibration.calibrate import predict_ms
from charm_megatron.lab.calibration.measured import Point
from charm_megatron.model.cluster import Profile
from charm_megatron.plan.registry import names as algorithm_names


@dataclass(frozen=True)
class Setting:
    """One measured setting: its label, the measured and predicted time per algorithm (ms),
    and which algorithms' times the profile was fitted on."""

    group: str  # what the row belongs to (a cluster, or "paper Table 5")
    label: str
    measured: dict[str, float]
    predicted: dict[str, float]
    fitted: frozenset[str]

    def err(self, algo: str) -> float:
        return self.predicted[algo] / self.measured[algo] - 1.0

    @property
    def speedup_measured(self) -> float:
        return self.measured["ring"] / self.measured["charm"]

    @property
    def speedup_predicted(self) -> float:
        return self.predicted["ring"] / self.predicted["charm"]

    @property
    def speedup_err(self) -> float:
        return self.speedup_predicted / self.speedup_measured - 1.0

    def winner(self, times: dict[str, float]) -> str:
        order = [a for a in algorithm_names() if a in self.measured]
        return min(order, key=lambda a: (times[a], order.index(a)))

    @property
    def winner_ok(self) -> bool:
        return self.winner(self.measured) == self.winner(self.predicted)


def bench_settings(points: Iterable[Point], profile: Profile) -> list[Setting]:
    """Settings from bench points, predicted with ``profile`` (each point's NIC model)."""
    fit_files = set(profile.fit.get("inputs", {}))
    fit_algos = set(profile.fit.get("fit_algos", []))
    fit_passes = set(profile.fit.get("passes", []))
    by_key: dict[tuple, dict[str, Point]] = defaultdict(dict)
    for pt in points:
        by_key[pt.key][pt.algo] = pt
    out = []
    for algos in by_key.values():
        if "ring" not in algos or "charm" not in algos:
            continue
        any_pt = algos["ring"]
        meas = {a: p.median_ms for a, p in algos.items()}
        pred = {a: predict_ms(profile.cluster, p) for a, p in algos.items()}
        fitted = frozenset(a for a in algos if any_pt.source in fit_files and a in fit_algos
                           and any_pt.pas in fit_passes)
        group = f"{any_pt.topology} nic={any_pt.nic}"
        pb = any_pt.problem
        kv = f"/{pb.hkv}" if pb.hkv != pb.hq else ""
        label = f"S={pb.s} {pb.hq}{kv}x{pb.d} {any_pt.pas}"
        out.append(Setting(group, label, meas, pred, fitted))
    return out


def _median(xs: Sequence[float]) -> float:
    s = sorted(xs)
    n = len(s)
    return s[n // 2] if n % 2 else 0.5 * (s[n // 2 - 1] + s[n // 2])


def _stat(errs: Sequence[float]) -> str:
    if not errs:
        return "-"
    a = [abs(e) for e in errs]
    worst = max(errs, key=abs)
    return f"{_median(a):.0%} / {worst:+.0%} ({len(a)})"


@dataclass(frozen=True)
class Summary:
    """Median |error| and worst error per quantity, split calibrated-on / not."""

    ring_fit: list[float]
    ring_new: list[float]
    charm_fit: list[float]
    charm_new: list[float]
    speedup_fit: list[float]
    speedup_new: list[float]
    winners_fit: list[bool]
    winners_new: list[bool]


def summarize(settings: Sequence[Setting]) -> Summary:
    s = Summary([], [], [], [], [], [], [], [])
    for st in settings:
        (s.ring_fit if "ring" in st.fitted else s.ring_new).append(st.err("ring"))
        (s.charm_fit if "charm" in st.fitted else s.charm_new).append(st.err("charm"))
        # A speed-up / winner is "calibrated on" only if every time in it was fitted.
        both = {"ring", "charm"} <= st.fitted
        (s.speedup_fit if both else s.speedup_new).append(st.speedup_err)
        every = set(st.measured) <= st.fitted
        (s.winners_fit if every else s.winners_new).append(st.winner_ok)
    return s


def _winners(ok: Sequence[bool]) -> str:
    return f"{sum(ok)}/{len(ok)} ({sum(ok) / len(ok):.0%})" if ok else "-"


def summary_table(groups: dict[str, Sequence[Setting]]) -> str:
    """Markdown: one row per group (and all), median |err| / worst err (count)."""
    lines = ["| points | ring time, calibrated on | ring time, not | CHARM+ time, not | "
             "RM+ time, not | speed-up, not | right winner, not |",
             "|---|---|---|---|---|---|---|"]
    for name, sts in groups.items():
        s = summarize(sts)
        rm = [st.err("rmplus") for st in sts if "rmplus" in st.measured]
        lines.append(f"| {name} | {_stat(s.ring_fit)} | {_stat(s.ring_new)} | "
                     f"{_stat(s.charm_new + s.charm_fit)} | {_stat(rm)} | "
                     f"{_stat(s.speedup_new + s.speedup_fit)} | "
                     f"{_winners(s.winners_new + s.winners_fit)} |")
    return "\n".join(lines)


def detail_table(settings: Sequence[Setting]) -> str:
    """Markdown: every setting, measured vs predicted."""
    lines = ["| cluster | point | ring ms meas / model | CHARM+ ms meas / model | speed-up meas / "
             "model | winner meas / model |", "|---|---|---|---|---|---|"]
    for st in settings:
        fit = "*" if "ring" in st.fitted else ""
        lines.append(
            f"| {st.group} | {st.label} | {st.measured['ring']:.0f} / {st.predicted['ring']:.0f}"
            f"{fit} | {st.measured['charm']:.0f} / {st.predicted['charm']:.0f} | "
            f"{st.speedup_measured:.2f} / {st.speedup_predicted:.2f} | "
            f"{st.winner(st.measured)} / {st.winner(st.predicted)} |")
    return "\n".join(lines)


def table5_settings(profile: Profile) -> list[Setting]:
    """The paper's Table 5 rows (ring and CHARM+, forward and backward) against ``profile``."""
    from charm_megatron.lab.calibration import paper
    from charm_megatron.lab.calibration.calibrate import _sim_ms
    from charm_megatron.lab.calibration.refit import table5_problem

    fitted_on = profile.fit.get("inputs", {}).get("paper Table 5")
    fit_passes = set(profile.fit.get("passes", []))
    # A profile fitted on the appendix rows models the paper's mask as they show it (causal,
    # contiguous: lab/calibration/appendix.py) and saw both columns of its 2x8 fit rows.
    contiguous = "paper_mask" in profile.fit
    appendix_seqs = set(profile.fit.get("appendix_fit_seqs", []))
    out = []
    for row in paper.TABLE5:
        prob = table5_problem(row)
        if contiguous:
            prob = replace(prob, window=(row.s, 0))
        for pas, ring, charm in (("fwd", row.ring_fwd, row.charm_fwd),
                                 ("bwd", row.ring_bwd, row.charm_bwd)):
            pred = {a: _sim_ms(profile.cluster, row.topology, prob,
                               paper.TABLE5_CAUSAL and not contiguous, a, pas)
                    for a in ("ring", "charm")}
            fitted = frozenset({"ring"} if fitted_on == "ring" and pas in fit_passes else ())
            if row.topology == "2x8" and row.s in appendix_seqs:
                fitted = frozenset({"ring", "charm"})
            out.append(Setting(f"paper Table 5 {row.topology}", f"B={row.b} S={row.s} {pas}",
                               {"ring": ring, "charm": charm}, pred, fitted))
    return out


def _table4_clusters() -> tuple[dict, tuple[int, int, int]]:
    """Table 4's clusters per GPU (L20: ``l20-pcie``; H20: ``h20-table4``) and the shape
    ``h20-table4`` was fitted with."""
    from charm_megatron.devices import get_profile

    h20 = get_profile("h20-table4")
    sh = h20.fit["shape"]
    return ({"L20": get_profile("l20-pcie").cluster, "H20": h20.cluster},
            (sh["batch"], sh["heads"], sh["head_dim"]))


def table4_predictions() -> list[tuple[object, dict[str, float]]]:
    """Every row of the paper's Table 4 with the model's forward ms per algorithm it ran."""
    from charm_megatron.lab.calibration import paper
    from charm_megatron.lab.calibration.calibrate import _sim_ms
    from charm_megatron.lab.calibration.refit import table4_problem

    clusters, shape = _table4_clusters()
    out = []
    for row in paper.TABLE4:
        algos = ("ring", "rmplus") + (("charm",) if row.charm is not None else ())
        out.append((row, {a: _sim_ms(clusters[row.gpu], row.topology, table4_problem(row, shape),
                                     paper.TABLE4_CAUSAL, a, "fwd") for a in algos}))
    return out


def table4_settings() -> list[Setting]:
    """The rows of Table 4 where the paper ran CHARM+ (ring, RM+ and CHARM+; the ring column
    is what ``h20-table4`` was fitted on)."""
    out = []
    for row, pred in table4_predictions():
        if row.charm is None:
            continue
        meas = {"ring": row.ring, "rmplus": row.rmplus, "charm": row.charm}
        out.append(Setting(f"paper Table 4 {row.gpu} {row.topology}", f"S={row.s} fwd", meas,
                           pred, frozenset({"ring"})))
    return out


def table4_detail() -> str:
    """Markdown: every row of Table 4, the paper's ms / the model's."""
    lines = ["| GPUs | S | ring ms paper / model* | RM+ ms paper / model | CHARM+ ms paper / "
             "model | RM+ speed-up paper / model | CHARM+ speed-up paper / model |",
             "|---|---|---|---|---|---|---|"]
    for row, p in table4_predictions():
        gpus = f"{row.topology} {row.gpu}"
        charm = (f"{row.charm:.2f} / {p['charm']:.2f}" if row.charm is not None else "-")
        ch_sp = (f"{row.ring / row.charm:.2f} / {p['ring'] / p['charm']:.2f}"
                 if row.charm is not None else "-")
        lines.append(f"| {gpus} | {row.s} | {row.ring:.2f} / {p['ring']:.2f} | "
                     f"{row.rmplus:.2f} / {p['rmplus']:.2f} | {charm} | "
                     f"{row.ring / row.rmplus:.2f} / {p['ring'] / p['rmplus']:.2f} | {ch_sp} |")
    return "\n".join(lines)
