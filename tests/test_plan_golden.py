"""Golden plan printouts: every rank's ops, the validator's figures and the bytes per link
class, for a grid of algorithms, CP sizes, groupings, masks, directions and pass orders.

The plans are the project's behaviour: a refactor of the plan layer must leave every printout
identical. Regenerate after an *intended* change of a plan (then review the diff by eye)::

    PYTHONPATH=$PWD python tests/test_plan_golden.py --write

One gzip file per (algorithm, CP size) under ``tests/golden/plans/`` (written with mtime 0, so
regenerating an unchanged plan rewrites identical bytes).
"""

from __future__ import annotations

import argparse
import gzip
import io
import subprocess
import sys
from pathlib import Path

import pytest

from charm_megatron.plan.cost import Problem, traffic
from charm_megatron.plan.registry import build_plan
from charm_megatron.plan.validate import validate

GOLDEN = Path(__file__).parent / "golden" / "plans"
SIZES = (2, 3, 4, 6, 8, 16)
ALGOS = ("ring", "rmplus", "charm", "allgather")
ORDERS = ("split", "joint")
# A concrete problem for the byte counts (GQA, so q and kv blocks differ in size).
PROBLEM = Problem(b=1, s=4096, hq=8, hkv=2, d=64, elem=2)
# `charm-megatron plan` printouts (the CLI's own format, header and table included).
CLI_CASES = (
    ("--cp", "8", "--topology", "2x4", "--causal", "--rank", "3"),
    ("--cp", "6", "--topology", "3x2", "--rank", "1", "--direction", "backward"),
    ("--cp", "4", "--topology", "2x2", "--causal", "--rank", "0", "--algo", "rmplus",
     "--direction", "backward"),
    ("--cp", "16", "--topology", "4x4", "--causal", "--seq", "65536", "--kv-heads", "8"),
    # pass-kv with split visiting blocks (docs/algorithm.md, "Visiting kv in two halves")
    ("--cp", "8", "--topology", "2x4", "--heads", "8", "--kv-heads", "2", "--head-dim", "64",
     "--causal", "--seq", "3072", "--batch", "2", "--dtype", "fp32", "--rank", "0",
     "--split-visiting"),
    ("--cp", "4", "--topology", "2x2", "--heads", "8", "--kv-heads", "1", "--head-dim", "64",
     "--causal", "--rank", "0", "--direction", "backward", "--split-visiting"),
    # pass-q with split counterpart q (docs/algorithm.md, "Counterpart q in two halves")
    ("--cp", "8", "--topology", "2x4", "--heads", "8", "--head-dim", "64", "--causal",
     "--seq", "3072", "--batch", "2", "--dtype", "fp32", "--rank", "0",
     "--split-counterpart-q"),
    ("--cp", "4", "--topology", "2x2", "--heads", "8", "--head-dim", "64", "--rank", "0",
     "--direction", "backward", "--split-counterpart-q"),
    # super-tiles (docs/algorithm.md, "Super-tiles"): RM+ steps of two kv units, all-gather
    ("--cp", "8", "--topology", "2x4", "--heads", "8", "--kv-heads", "2", "--head-dim", "16",
     "--causal", "--seq", "4096", "--dtype", "fp32", "--rank", "1", "--super-tiles", "on"),
    ("--cp", "8", "--topology", "2x4", "--heads", "8", "--kv-heads", "2", "--head-dim", "16",
     "--seq", "4096", "--dtype", "fp32", "--rank", "1", "--direction", "backward",
     "--super-tiles", "on"),
)


def groupings(n: int) -> list[tuple[int, int]]:
    """``(G, M)`` for every way to cut ``n`` ranks into ``G`` equal groups of ``M``."""
    return [(g, n // g) for g in range(1, n + 1) if n % g == 0]


def _groups(g: int, m: int) -> list[list[int]]:
    return [list(range(i * m, (i + 1) * m)) for i in range(g)]


def cases(algo: str, n: int) -> list[tuple[tuple[int, int], bool, str, str]]:
    """(grouping, causal, direction, order) of the grid. ring, rmplus and allgather build flat plans
    whatever the grouping or order (checked by ``test_flat_algorithms_ignore_grouping``)."""
    grid = groupings(n) if algo == "charm" else [(1, n)]
    orders = ORDERS if algo == "charm" else ("split",)
    return [(gm, causal, direction, order) for gm in grid for causal in (False, True)
            for direction in ("forward", "backward") for order in orders]


def dump(algo: str, n: int) -> str:
    """The printout of every case of ``(algo, n)``."""
    out = io.StringIO()
    for (g, m), causal, direction, order in cases(algo, n):
        groups = _groups(g, m)
        plan = build_plan(algo, direction, groups, causal, pass_order=order)
        stats = validate(plan)
        t = traffic(plan, PROBLEM, groups)
        mask = "causal" if causal else "full"
        out.write(f"## {algo} {direction} groups={g}x{m} {mask} order={order}\n")
        out.write(f"# critical_path={stats.critical_path} messages={stats.messages} "
                  f"tiles={stats.tiles}\n")
        out.write(f"# bytes intra={t.intra!r} cross={t.cross!r}\n")
        for r in range(n):
            out.write(f"rank {r}:\n{plan.describe(r)}\n")
    return out.getvalue()


def cli_dump() -> str:
    out = io.StringIO()
    for args in CLI_CASES:
        res = subprocess.run([sys.executable, "-m", "charm_megatron.cli", "plan", *args],
                             capture_output=True, text=True, timeout=120, check=True)
        out.write(f"$ charm-megatron plan {' '.join(args)}\n{res.stdout}")
    return out.getvalue()


def _path(algo: str, n: int) -> Path:
    return GOLDEN / f"{algo}-n{n}.txt.gz"


def _write_gz(path: Path, text: str) -> None:
    with open(path, "wb") as f, gzip.GzipFile(fileobj=f, mode="wb", mtime=0) as gz:
        gz.write(text.encode())


def _first_difference(got: str, want: str) -> str:
    header = ""
    for i, (a, b) in enumerate(zip(got.splitlines(), want.splitlines())):
        if a.startswith("## "):
            header = a
        if a != b:
            return f"line {i + 1} (in {header or 'the start'}):\n  got:    {a}\n  golden: {b}"
    return f"lengths differ: got {len(got.splitlines())} lines, golden {len(want.splitlines())}"


@pytest.mark.parametrize("algo", ALGOS)
@pytest.mark.parametrize("n", SIZES)
def test_plan_printouts_match_golden(algo: str, n: int) -> None:
    got = dump(algo, n)
    want = gzip.decompress(_path(algo, n).read_bytes()).decode()
    assert got == want, _first_difference(got, want)


def test_cli_printouts_match_golden() -> None:
    got = cli_dump()
    want = (GOLDEN / "cli.txt").read_text()
    assert got == want, _first_difference(got, want)


@pytest.mark.parametrize("algo", ("ring", "rmplus", "allgather"))
def test_flat_algorithms_ignore_grouping(algo: str) -> None:
    # Why the grid holds the flat algorithms only flat: any grouping or pass order gives the same ops.
    for n in SIZES:
        flat = build_plan(algo, "forward", _groups(1, n), True)
        for g, m in groupings(n):
            for direction in ("forward", "backward"):
                ref = build_plan(algo, direction, _groups(1, n), True)
                for order in ORDERS:
                    plan = build_plan(algo, direction, _groups(g, m), True, pass_order=order)
                    assert plan.ops == ref.ops
        assert flat.groups == (tuple(range(n)),)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--write", action="store_true", help="rewrite the golden files")
    args = parser.parse_args()
    if not args.write:
        parser.error("pass --write to regenerate the goldens")
    GOLDEN.mkdir(parents=True, exist_ok=True)
    for algo in ALGOS:
        for n in SIZES:
            _write_gz(_path(algo, n), dump(algo, n))
    (GOLDEN / "cli.txt").write_text(cli_dump())


if __name__ == "__main__":
    main()
