"""``charm-megatron compare`` on Megatron-LM log fixtures (``tests/fixtures/logs``).

The fixtures follow ``training_log`` / ``report_memory`` / ``_print_args`` of Megatron-LM
core_v0.16.1 character for character. The expected numbers below are worked by hand from the
iteration times in the logs (see the comments).
"""

from __future__ import annotations

import csv
import json
from pathlib import Path

import pytest

from charm_megatron import cli
from charm_megatron.launch.compare import (
    CSV_COLUMNS,
    CompareRow,
    Label,
    compare,
    format_table,
    label_for,
    parse_log,
    write_csv,
)

LOGS = Path(__file__).parent / "fixtures" / "logs"
P2P = LOGS / "runs" / "gpt-350m" / "scale-s2048-gb16" / "p2p" / "train-1001.log"
CHARM = LOGS / "runs" / "gpt-350m" / "scale-s2048-gb16" / "charm" / "train-1002.log"
ADHOC = LOGS / "adhoc" / "job-77" / "out.log"
LOOSE = LOGS / "loose" / "ring-test.log"


def rows_by_key(rows: list[CompareRow]) -> dict[tuple[str, str, str], CompareRow]:
    return {(r.config, r.run, r.comm_type): r for r in rows}


# --------------------------------------------------------------------------- parse_log
def test_parse_the_documented_line(tmp_path: Path) -> None:
    log = tmp_path / "x.log"
    log.write_text(
        " [2024-05-01 10:00:00] iteration       20/     100 | consumed samples:  320 | "
        "elapsed time per iteration (ms): 1234.5 | throughput per GPU (TFLOP/s/GPU): 100.1 | "
        "learning rate: 1.0E-04 | global batch size:    16 | lm loss: 7.1234E+00 | "
        "loss scale: 1.0 | grad norm: 1.234 | number of skipped iterations:   0 | "
        "number of nan iterations:   0 |\n"
        "[Rank 3] (after 20 iterations) memory (MB) | allocated: 100.5 | max allocated: 200.25 "
        "| reserved: 300.0 | max reserved: 400.0\n")
    parsed = parse_log(log)
    (e,) = parsed.entries
    assert (e.iteration, e.train_iters, e.timestamp) == (20, 100, "2024-05-01 10:00:00")
    assert (e.iter_time_ms, e.tflops_per_gpu, e.learning_rate) == (1234.5, 100.1, 1e-4)
    assert (e.global_batch_size, e.lm_loss, e.loss_scale, e.grad_norm) == (16, 7.1234, 1.0, 1.234)
    assert (e.consumed_samples, e.skipped_iterations, e.nan_iterations) == (320, 0, 0)
    (m,) = parsed.memory
    assert (m.rank, m.iteration, m.allocated, m.max_allocated, m.reserved, m.max_reserved) == (
        3, 20, 100.5, 200.25, 300.0, 400.0)


def test_parse_fixture_with_prefixes_and_missing_values() -> None:
    parsed = parse_log(CHARM)  # every line carries srun --label's "0: " prefix
    assert [e.iteration for e in parsed.entries] == list(range(1, 11))
    by_it = {e.iteration: e for e in parsed.entries}
    assert by_it[1].timestamp == "2024-05-01 10:00:02.123456"
    assert by_it[4].tflops_per_gpu is None and by_it[4].iter_time_ms == 810.0
    assert by_it[7].iter_time_ms is None and by_it[7].lm_loss == pytest.approx(7.7)
    assert by_it[9].lm_loss is None and by_it[10].lm_loss == pytest.approx(6.51)
    assert [(m.rank, m.iteration, m.max_allocated) for m in parsed.memory] == [
        (0, 1, 9000.0), (0, 2, 11000.0)]
    assert parsed.args["cp_comm_type"] == "['charm']" and parsed.args["seq_length"] == "2048"


def test_repeated_iterations_keep_the_last_line_and_garbage_is_ignored(tmp_path: Path) -> None:
    log = tmp_path / "restart.log"
    log.write_text(
        "iteration        1/       3 | elapsed time per iteration (ms): 50.0 |\n"
        "iteration        2/       3 | elapsed time per iteration (ms): 60.0 |\n"
        "Traceback: node failure; restarting\n"
        "iteration        2/       3 | elapsed time per iteration (ms): 70.0 | lm loss: nan |\n"
        "iteration        3/       3 | elapsed time per iteration (ms): abc |\n")
    entries = parse_log(log).entries
    assert [(e.iteration, e.iter_time_ms) for e in entries] == [(1, 50.0), (2, 70.0), (3, None)]
    assert entries[1].lm_loss != entries[1].lm_loss  # nan is kept as nan


# --------------------------------------------------------------------------- labels
def test_labels_from_layout_meta_and_argument_dump() -> None:
    assert label_for(parse_log(P2P)) == Label("gpt-350m", "scale-s2048-gb16", "p2p")
    assert label_for(parse_log(ADHOC)) == Label("gpt-350m", "scale-s4096-gb8", "charm")
    # No layout and no meta.json: the comm type and run come from Megatron's argument dump.
    assert label_for(parse_log(LOOSE)) == Label(None, "s8192-gb4", "ring")
    assert Label.parse("charm") == Label(None, None, "charm")
    assert Label.parse("c/r/p2p") == Label("c", "r", "p2p")
    with pytest.raises(ValueError):
        Label.parse("a/b/c/d")


# --------------------------------------------------------------------------- compare
def test_compare_numbers() -> None:
    rows = rows_by_key(compare([LOGS]))
    assert set(rows) == {
        ("gpt-350m", "scale-s2048-gb16", "p2p"), ("gpt-350m", "scale-s2048-gb16", "charm"),
        ("gpt-350m", "scale-s4096-gb8", "p2p"), ("gpt-350m", "scale-s4096-gb8", "charm"),
        ("-", "s8192-gb4", "ring")}

    # p2p: 10 iterations, skip 2 -> 1000 1010 990 1020 1000 980 1005 995
    # sorted 980 990 995 1000 1000 1005 1010 1020: median 1000, p25 990+.75*5, p75 1005+.25*5
    p2p = rows[("gpt-350m", "scale-s2048-gb16", "p2p")]
    assert (p2p.iterations, p2p.median_ms, p2p.p25_ms, p2p.p75_ms) == (8, 1000.0, 993.75, 1006.25)
    assert (p2p.min_ms, p2p.max_ms, p2p.mean_ms) == (980.0, 1020.0, 1000.0)
    assert (p2p.speedup, p2p.baseline) == (1.0, "p2p")
    # throughput of iterations 3..10, sorted 88.2 89.1 89.6 90.0 90.0 90.5 90.9 91.8
    assert p2p.tflops_per_gpu == pytest.approx(90.0)
    assert (p2p.last_iteration, p2p.lm_loss) == (10, 6.5)
    # memory: max over ranks 0 and 8 and both reports
    assert (p2p.max_allocated_mb, p2p.max_reserved_mb) == (12100.25, 14000.0)

    # charm: iteration 7 has no time -> 7 values 790 795 800 800 805 810 820
    charm = rows[("gpt-350m", "scale-s2048-gb16", "charm")]
    assert (charm.iterations, charm.median_ms, charm.p25_ms, charm.p75_ms) == (7, 800.0, 797.5, 807.5)
    assert charm.speedup == pytest.approx(1.25) and charm.baseline == "p2p"
    assert charm.lm_loss == pytest.approx(6.51) and charm.max_allocated_mb == 11000.0
    # throughput: iterations 4 and 7 lack it -> 112.5 113.9 111.8 113.2 112.5 109.8
    assert charm.tflops_per_gpu == pytest.approx(112.5)

    # scale-s4096-gb8: p2p from the layout, charm from meta.json elsewhere; no memory, no TFLOP/s
    p2p4 = rows[("gpt-350m", "scale-s4096-gb8", "p2p")]
    charm4 = rows[("gpt-350m", "scale-s4096-gb8", "charm")]
    assert (p2p4.median_ms, p2p4.p25_ms, p2p4.p75_ms) == (1100.0, 1092.5, 1100.0)
    assert p2p4.tflops_per_gpu is None and p2p4.max_allocated_mb is None
    assert charm4.median_ms == 880.0 and charm4.speedup == pytest.approx(1100 / 880)

    # a run with only charm-megatron's ring: the ring is its own baseline
    ring = rows[("-", "s8192-gb4", "ring")]
    assert (ring.iterations, ring.median_ms, ring.baseline, ring.speedup) == (4, 600.0, "ring", 1.0)


def test_rows_are_ordered_baseline_first() -> None:
    rows = compare([LOGS])
    assert [(r.run, r.comm_type) for r in rows] == [
        ("s8192-gb4", "ring"), ("scale-s2048-gb16", "p2p"), ("scale-s2048-gb16", "charm"),
        ("scale-s4096-gb8", "p2p"), ("scale-s4096-gb8", "charm")]


def test_skip_options() -> None:
    (row,) = compare([P2P], skip=0)
    assert row.iterations == 10 and row.max_ms == 9000.0
    (row,) = compare([P2P], skip=0, skip_iters=5)
    assert row.iterations == 5 and row.median_ms == 1000.0  # it6..10: 1020 1000 980 1005 995
    (row,) = compare([P2P], skip=9)
    assert (row.iterations, row.median_ms, row.p25_ms, row.lm_loss) == (1, 995.0, 995.0, 6.5)
    (row,) = compare([P2P], skip=20)
    assert row.iterations == 0 and row.median_ms is None and row.speedup is None
    assert row.lm_loss == 6.5  # the last iteration is reported even when all were skipped


def test_labels_given_and_pooled() -> None:
    rows = rows_by_key(compare([P2P, LOOSE, CHARM], labels=["x/r/p2p", "x/r/p2p", "x/r/charm"]))
    assert set(rows) == {("x", "r", "p2p"), ("x", "r", "charm")}
    pooled = rows[("x", "r", "p2p")]
    assert pooled.logs == 2 and pooled.iterations == 8 + 4
    with pytest.raises(ValueError, match="one per path"):
        compare([P2P, CHARM], labels=["p2p"])


def test_table_and_csv(tmp_path: Path) -> None:
    rows = compare([LOGS])
    table = format_table(rows)
    lines = table.splitlines()
    assert lines[0].split()[:5] == ["config", "run", "comm", "logs", "iters"]
    charm_line = next(line for line in lines if "scale-s2048-gb16" in line and "charm" in line)
    assert "800.0" in charm_line and "797.5-807.5" in charm_line and "790.0-820.0" in charm_line
    assert "1.25x" in charm_line and "6.5100" in charm_line and "11000" in charm_line
    p2p4 = next(line for line in lines if "scale-s4096-gb8" in line and "p2p" in line)
    assert p2p4.split()[-4:] == ["-", "8", "7.9000", "-"]  # no TFLOP/s, no memory

    path = write_csv(rows, tmp_path / "c.csv")
    with path.open() as fh:
        data = list(csv.DictReader(fh))
    assert tuple(data[0]) == CSV_COLUMNS and len(data) == len(rows)
    charm = next(d for d in data if d["run"] == "scale-s2048-gb16" and d["comm_type"] == "charm")
    assert float(charm["median_ms"]) == 800.0 and float(charm["iqr_ms"]) == 10.0
    assert float(charm["speedup"]) == 1.25 and charm["baseline"] == "p2p"
    assert charm["max_reserved_mb"] == "11800.0"
    p2p4 = next(d for d in data if d["run"] == "scale-s4096-gb8" and d["comm_type"] == "p2p")
    assert p2p4["tflops_per_gpu"] == "" and p2p4["max_allocated_mb"] == ""


def test_cli_writes_table_csv_and_png(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    pytest.importorskip("matplotlib")
    rc = cli.main(["compare", str(LOGS / "runs"), str(LOGS / "adhoc"), "--out", str(tmp_path)])
    out = capsys.readouterr().out
    assert rc == 0
    assert "scale-s2048-gb16" in out and "1.25x" in out
    png = tmp_path / "compare.png"
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and png.stat().st_size > 5000
    with (tmp_path / "compare.csv").open() as fh:
        assert len(list(csv.DictReader(fh))) == 4


def test_cli_no_plot_and_errors(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert cli.main(["compare", str(P2P), "--out", str(tmp_path), "--no-plot"]) == 0
    assert (tmp_path / "compare.csv").is_file() and not (tmp_path / "compare.png").exists()
    empty = tmp_path / "empty.log"
    empty.write_text("no iterations here\n")
    capsys.readouterr()
    assert cli.main(["compare", str(empty)]) == 1
    assert "no Megatron-LM iteration lines" in capsys.readouterr().err
    assert cli.main(["compare", str(tmp_path / "missing.log")]) == 2
    assert cli.main(["compare", str(P2P), "--skip", "-1"]) == 2
    assert cli.main(["compare", str(P2P), str(CHARM), "--label", "p2p"]) == 2


def test_meta_json_fixture_is_what_launch_writes() -> None:
    # launch.sh writes `charm-megatron args --format json` as meta.json; compare reads these keys.
    meta = json.loads((ADHOC.parent / "meta.json").read_text())
    assert {"config", "run", "comm_type"} <= set(meta)
