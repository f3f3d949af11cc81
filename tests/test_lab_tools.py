"""The lab's two measurement tools that print docs tables by hand-run commands: the CPU tile
rates (lab/bench/tile_rates.py) and the bound-gap report (lab/reports/bound_gap.py), each run
here on a small case."""

from __future__ import annotations

import re

import pytest

from charm_megatron.lab.bench import tile_rates
from charm_megatron.lab.reports import bound_gap


def test_tile_rates_times_each_shape_in_parallel_processes():
    lines = tile_rates.table(procs=2, shapes=((64, 2), (128, 1)))
    rows = [line.split() for line in lines[2:]]
    assert [r[:3] for r in rows] == [["True", "64", "2"], ["True", "128", "1"],
                                     ["False", "64", "2"], ["False", "128", "1"]]
    for r in rows:
        fwd, bwd = float(r[3]), float(r[4])
        assert fwd > 0 and bwd > 0


def test_bound_gap_rows_are_at_or_above_their_bound(monkeypatch):
    monkeypatch.setattr(bound_gap, "LLAMA", [("2x8", 32, 131072)])
    lines = bound_gap.table("h100", llama=True, partials="fp32")
    data = [line for line in lines if line.startswith("| 2x8")]
    assert [line.split("|")[3].strip() for line in data] == ["fwd", "bwd"]
    for line in data:
        cells = [c.strip() for c in line.split("|")[1:-1]]
        bound, model, ratio = float(cells[3]), float(cells[4]), float(cells[5][:-1])
        assert 0 < bound <= model * 1.0001
        assert abs(ratio - model / bound) < 0.02
        assert all(re.fullmatch(r"-?\d+%|-", c) for c in cells[6:])


def test_head_parallel_report_puts_auto_at_or_below_the_paper_charm_and_above_its_bound():
    from charm_megatron.lab.reports import head_parallel

    lines = head_parallel.table("h200", ["2x8"], ["rank"], only="Qwen")
    (row,) = [line for line in lines if line.startswith("| 2x8")]
    cells = [c.strip() for c in row.split("|")[1:-1]]
    assert cells[2] == "Qwen 28/4 32k" and cells[4] == "-"  # a2a+p2p refuses 4 kv heads on 8
    one, auto = float(cells[5]), float(cells[6].split()[0])
    assert auto <= one and re.fullmatch(r"\d+\.\d \((1|2|4)\)", cells[6])
    assert all(float(c[:-1]) >= 1.0 for c in cells[9:11])  # never below its bound


def test_head_parallel_report_pairs_each_emulated_run_with_its_degree_one_run():
    from pathlib import Path

    from charm_megatron.lab.reports import head_parallel

    docs = sorted(str(p) for p in (Path(__file__).parents[1] / "docs" / "performance" /
                                   "head-parallel").glob("*.csv"))
    lines = head_parallel.emulated(docs, te=False)  # TE's column: test_te_contenders.py
    rows = [line for line in lines if line.startswith("| ") and "(h100)" in line]
    assert len(rows) == len(docs) // 2
    for line in rows:
        cells = [c.strip() for c in line.split("|")[1:-1]]
        one, auto = float(cells[4].split()[0].rstrip("†")), float(cells[5].split()[0].rstrip("†"))
        # the cells are rounded to 0.01 ms, the ratio is of the unrounded times
        assert float(cells[7].rstrip("x")) == pytest.approx(one / auto, abs=0.01)
