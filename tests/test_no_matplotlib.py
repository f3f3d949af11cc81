"""``bench`` and ``compare`` without matplotlib: table and CSV, and one line saying the plot was
skipped and how to get it (matplotlib is blocked with ``sys.modules[...] = None``)."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

from charm_megatron import cli
from charm_megatron.lab.bench import report

LOGS = Path(__file__).parent / "fixtures" / "logs"


@pytest.fixture
def no_matplotlib(monkeypatch: pytest.MonkeyPatch) -> None:
    for name in [m for m in sys.modules if m == "matplotlib" or m.startswith("matplotlib.")]:
        monkeypatch.delitem(sys.modules, name)
    monkeypatch.setitem(sys.modules, "matplotlib", None)  # import matplotlib -> ImportError


def test_bench_plot_is_skipped_with_one_line(no_matplotlib, tmp_path, capsys) -> None:
    rows = [{"status": "ok", "speedup_vs_ring": 1.2, "pass": "fwd", "algo": "charm",
             "ring_ccr": 0.5}]
    assert report.plot(rows, str(tmp_path / "speedup_vs_ccr.png")) is None
    out = capsys.readouterr().out.strip().splitlines()
    assert len(out) == 1 and "plot skipped" in out[0] and "pip install matplotlib" in out[0]
    assert not (tmp_path / "speedup_vs_ccr.png").exists()


def test_compare_writes_table_and_csv_and_says_plot_skipped(no_matplotlib, tmp_path,
                                                           capsys) -> None:
    rc = cli.main(["compare", str(LOGS / "runs"), "--out", str(tmp_path)])
    out = capsys.readouterr().out
    assert rc == 0
    assert "scale-s2048-gb16" in out and (tmp_path / "compare.csv").exists()
    skipped = [line for line in out.splitlines() if "plot skipped" in line]
    assert len(skipped) == 1 and "pip install matplotlib" in skipped[0]
    assert not (tmp_path / "compare.png").exists()
