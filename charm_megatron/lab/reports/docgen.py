"""Regenerate the numbers in docs/model.md from the shipped profiles and measurements.

``charm-megatron report docgen [--check] [--fast] [FILE]`` (default docs/model.md; also
``python -m charm_megatron.lab.reports.docgen``). Blocks between markers are rewritten::

    <!-- gen:cmd charm-megatron model --profile h100 --causal --grid 16k,32k -->
    ...the command and its output, fenced...
    <!-- gen:end -->

    <!-- gen:report table4 docs/performance/emulated-t4 -->
    Made by `charm-megatron report table4 docs/performance/emulated-t4`:
    ...the report's Markdown table (words with * ? [ are globbed, sorted)...
    <!-- gen:end -->

    <!-- gen:headline -->         the aims, met or not (top of the page)
    <!-- gen:accuracy-cpu -->     the CPU testbed profile against docs/performance/*.csv
    <!-- gen:accuracy-paper [PROFILE] -->  a profile (h100) against the paper's Table 5
    <!-- gen:accuracy-table4 -->  l20-pcie / h20-table4 against the paper's Table 4
    <!-- gen:holdout -->          (slow) fit on the 2x2 runs only, judged on the 2x4 runs
    <!-- gen:diagnostic -->       (slow) the intra rate that would reproduce Table 5's CHARM+

``--check`` exits 1 when a block differs (``--fast`` skips the slow blocks); the tests run it.
Nothing in those blocks is typed by hand.
"""

from __future__ import annotations

import argparse
import contextlib
import glob
import io
import re
import shlex
import sys
from collections.abc import Callable
from dataclasses import replace
from pathlib import Path

BENCH_GLOB = "docs/performance/*.csv"
SLOW = ("holdout", "diagnostic")
_BLOCK = re.compile(r"(<!-- gen:(?P<what>[a-z0-9-]+)(?P<arg>[^>]*?)\s*-->\n)(?P<body>.*?)"
                    r"(<!-- gen:end -->)", re.S)


def _cmd(arg: str) -> str:
    from charm_megatron.cli import main

    words = shlex.split(arg)
    if words[:1] != ["charm-megatron"]:
        raise ValueError(f"gen:cmd runs charm-megatron commands only, got {arg!r}")
    buf = io.StringIO()
    with contextlib.redirect_stdout(buf):
        rc = main(words[1:])
    if rc:
        raise RuntimeError(f"{arg!r} exited {rc}")
    return f"```\n$ {arg}\n{buf.getvalue()}```\n"


def _report(arg: str) -> str:
    """``charm-megatron report ARG``'s output under a line naming the command."""
    from charm_megatron.cli import main

    words = []
    for w in shlex.split(arg):
        matches = sorted(glob.glob(w)) if any(c in w for c in "*?[") else []
        words += matches or [w]
    buf = io.StringIO()
    with contextlib.redirect_stdout(buf):
        rc = main(["report", *words])
    if rc:
        raise RuntimeError(f"charm-megatron report {arg!r} exited {rc}")
    return f"Made by `charm-megatron report {arg}`:\n\n{buf.getvalue()}"


def _grouped(settings) -> dict:
    groups: dict[str, list] = {}
    for st in settings:
        groups.setdefault(st.group, []).append(st)
    groups["all"] = settings
    return groups


def accuracy_cpu(_: str = "") -> str:
    from charm_megatron.lab.calibration import accuracy
    from charm_megatron.lab.calibration.measured import load_points
    from charm_megatron.model import get_profile

    prof = get_profile("cpu-testbed")
    st = accuracy.bench_settings(load_points(sorted(glob.glob(BENCH_GLOB))), prof)
    return (accuracy.summary_table(_grouped(st)) + "\n\n<details><summary>every point"
            "</summary>\n\n" + accuracy.detail_table(st) + "\n\n</details>\n")


def accuracy_paper(arg: str = "") -> str:
    """Table 5 against the profile named by the block's argument (default h100)."""
    from charm_megatron.lab.calibration import accuracy
    from charm_megatron.model import get_profile

    st = accuracy.table5_settings(get_profile(arg.strip() or "h100"))
    return accuracy.summary_table(_grouped(st)) + "\n\n" + accuracy.detail_table(st) + "\n"


def accuracy_table4(_: str = "") -> str:
    from charm_megatron.lab.calibration import accuracy
    from charm_megatron.model import get_profile

    prof = get_profile("h20-table4")
    sh = prof.fit["shape"]
    st = accuracy.table4_settings()
    return (f"Shape fitted on the ring column: B={sh['batch']}, {sh['heads']} heads x "
            f"{sh['head_dim']}, full attention, bf16; H20 device `{prof.cluster.describe()}` "
            f"(rms log error over the 10 ring numbers {prof.fit['rms_log_error']:.3f}). "
            "`*`: calibrated on.\n\n" + accuracy.summary_table(_grouped(st)) + "\n\n"
            + accuracy.table4_detail() + f"\n\nOn the {len(st)} rows with CHARM+: "
            + _aims(st) + ".\n")


def _aims(settings) -> str:
    """The issue's aims on the points not calibrated on: speed-up within 30 % median, the right
    winner at >= 95 %."""
    from charm_megatron.lab.calibration import accuracy

    s = accuracy.summarize(settings)
    sp = sorted(abs(e) for e in s.speedup_new)
    med = sp[len(sp) // 2] if len(sp) % 2 else 0.5 * (sp[len(sp) // 2 - 1] + sp[len(sp) // 2])
    worst = max(s.speedup_new, key=abs)
    win = sum(s.winners_new) / len(s.winners_new)
    verdict = ("both aims met" if med <= 0.30 and win >= 0.95 else
               "speed-up aim NOT met" if win >= 0.95 else
               "winner aim NOT met" if med <= 0.30 else "neither aim met")
    return (f"speed-up error median {med:.0%} (worst {worst:+.0%}), right winner at "
            f"{sum(s.winners_new)}/{len(s.winners_new)} ({win:.0%}): {verdict}")


def headline(_: str = "") -> str:
    """The short verdict at the top of docs/model.md."""
    from charm_megatron.lab.calibration import accuracy
    from charm_megatron.lab.calibration.measured import load_points
    from charm_megatron.model import get_profile

    cpu = accuracy.bench_settings(load_points(sorted(glob.glob(BENCH_GLOB))),
                                  get_profile("cpu-testbed"))
    t5 = accuracy.table5_settings(get_profile("h100"))
    t5p = accuracy.table5_settings(get_profile("h100-paper"))
    t5m = accuracy.table5_settings(get_profile("h100-paper-measured"))
    t4 = accuracy.table4_settings()

    def charm(st) -> str:
        errs = accuracy.summarize(st).charm_new
        a = sorted(abs(e) for e in errs)
        med = a[len(a) // 2] if len(a) % 2 else 0.5 * (a[len(a) // 2 - 1] + a[len(a) // 2])
        fast = sum(e < 0 for e in errs)
        side = ("predicted too fast" if fast > len(errs) / 2 else
                "predicted too slow" if fast < len(errs) / 2 else "either side")
        return f"CHARM+ time error median {med:.0%}, {side}"

    return (f"- CPU testbed (profile calibrated on the ring rows only), over the {len(cpu)} "
            f"measured points: {_aims(cpu)}.\n"
            f"- Paper Table 5 on this package's costs (h100 profile: compute measured on one "
            f"H200, cross rate calibrated on ring forward only), {len(t5)} points: "
            f"{_aims(t5)}; {charm(t5)}.\n"
            f"- Paper Table 5 with the paper's per-op cost (h100-paper: h100 plus the cost per "
            f"compute op read off Table 4's ring column), {len(t5p)} points: {_aims(t5p)}; "
            f"{charm(t5p)}.\n"
            f"- Paper Table 5 with that per-op cost and the PyTorch-ops merge rate measured on "
            f"one H200 (h100-paper-measured), {len(t5m)} points: {_aims(t5m)}; {charm(t5m)}.\n"
            f"- Paper Table 4, its {len(t4)} rows with CHARM+ (l20-pcie; h20-table4, shape and "
            f"device fitted on its ring column): {_aims(t4)}; {charm(t4)}.\n")


def holdout(_: str = "") -> str:
    """Fit on the 2x2 files, judge every 2x4 point (none of them seen by the fit)."""
    from charm_megatron.lab.calibration import accuracy
    from charm_megatron.lab.calibration.measured import load_points
    from charm_megatron.lab.devices.cpu_testbed import cpu_testbed

    files = sorted(glob.glob(BENCH_GLOB))
    train = [f for f in files if Path(f).name.startswith("2x2")]
    test = [f for f in files if f not in train]
    prof = cpu_testbed(train)
    st = accuracy.bench_settings(load_points(test), prof)
    names = ", ".join(Path(f).name for f in train)
    return (f"Fitted on the ring rows of {names} only: `{prof.cluster.describe()}`\n\n"
            + accuracy.summary_table(_grouped(st)) + f"\n\nOn these {len(st)} points: "
            + _aims(st) + ".\n")


def diagnostic(_: str = "") -> str:
    """What intra rate the CHARM+ forward columns of Table 5 imply (not shipped anywhere)."""
    import math

    from charm_megatron.lab.calibration import paper
    from charm_megatron.lab.calibration.calibrate import _sim_ms, coordinate_descent
    from charm_megatron.lab.calibration.refit import table5_problem
    from charm_megatron.model import get_profile

    base = get_profile("h100").cluster

    def err(cl) -> float:
        e = [math.log(_sim_ms(cl, r.topology, table5_problem(r), paper.TABLE5_CAUSAL, "charm",
                              "fwd") / r.charm_fwd) ** 2 for r in paper.TABLE5]
        return sum(e) / len(e)

    def with_intra(cl, x):
        return replace(cl, intra_gbps=x, intra_port_gbps=None)

    from charm_megatron.lab.calibration import accuracy
    from charm_megatron.model.cluster import Profile

    start = with_intra(base, 100.0)
    fitted, e = coordinate_descent(start, ("intra_gbps",), err, step=1.6, min_step=1.01)
    prof = Profile("diagnostic", fitted, "2x8", "", {"inputs": {"paper Table 5": "ring"},
                                                     "passes": ["fwd"]})
    st = accuracy.table5_settings(prof)
    return (f"Fitting only the intra rate on the CHARM+ forward columns (a diagnostic, not a "
            f"profile): {fitted.intra_gbps:.0f} GB/s per rank, {fitted.intra_gbps / 365.1:.0%} "
            f"of Table 2's 365.1; rms log error of CHARM+ forward then {math.sqrt(e):.2f}. "
            "Everything against Table 5 with that rate (CHARM+ forward now fitted, so this is "
            "not a test):\n\n" + accuracy.summary_table({"Table 5, diagnostic": st}) + "\n")


GENERATORS: dict[str, Callable[[str], str]] = {
    "cmd": _cmd, "report": _report, "headline": headline, "accuracy-cpu": accuracy_cpu, "accuracy-paper": accuracy_paper,
    "accuracy-table4": accuracy_table4,
    "holdout": holdout, "diagnostic": diagnostic,
}


def regenerate(text: str, *, fast: bool = False, skip: tuple[str, ...] = ()
               ) -> tuple[str, list[str]]:
    """(new text, labels of the blocks that changed); blocks of a kind in ``skip`` (e.g.
    ``report``, which tests/test_reports.py checks on its own) are left as they are."""
    changed: list[str] = []

    def sub(m: re.Match) -> str:
        what, arg, body = m.group("what"), m.group("arg").strip(), m.group("body")
        if what not in GENERATORS:
            raise ValueError(f"unknown generated block {what!r}")
        if (fast and what in SLOW) or what in skip:
            return m.group(0)
        new = GENERATORS[what](arg)
        if new != body:
            changed.append(f"{what} {arg}".strip())
        return m.group(1) + new + m.group(5)

    return _BLOCK.sub(sub, text), changed


def register(ap: argparse.ArgumentParser) -> None:
    ap.add_argument("file", nargs="?", default="docs/model.md")
    ap.add_argument("--check", action="store_true", help="exit 1 if a block is stale")
    ap.add_argument("--fast", action="store_true", help=f"skip the slow blocks {SLOW}")


def run(args: argparse.Namespace) -> int:
    path = Path(args.file)
    new, changed = regenerate(path.read_text(encoding="utf-8"), fast=args.fast)
    if args.check:
        if changed:
            print(f"{path}: stale generated blocks (charm-megatron report docgen {path}): "
                  f"{changed}")
            return 1
        return 0
    path.write_text(new, encoding="utf-8")
    print(f"{path}: regenerated {len(changed)} block(s): {changed}")
    return 0


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m charm_megatron.lab.reports.docgen",
                                 description=__doc__.split("\n\n")[0])
    register(ap)
    return run(ap.parse_args(argv))


if __name__ == "__main__":
    sys.exit(main())
