"""``charm-megatron demo``: the training demo end to end (small), its log format, its checks."""

from __future__ import annotations

import io
import json
import re

import pytest

from charm_megatron.cli import main
from charm_megatron.launch.compare import compare, label_for, parse_log
from charm_megatron.train_demo.megatron_log import (
    IterationRecord,
    argument_dump,
    format_iteration,
    padded_vocab_size,
)
from charm_megatron.train_demo.train import summarize

# The fixture log line (tests/fixtures/logs/loose/ring-test.log), as Megatron-LM prints it.
MEGATRON_LINE = (
    " [2024-05-01 10:00:02] iteration        1/       6 | consumed samples:            4 | "
    "elapsed time per iteration (ms): 5000.0 | throughput per GPU (TFLOP/s/GPU): 50.0 | "
    "learning rate: 1.500000E-04 | global batch size:     4 | lm loss: 1.000000E+01 | "
    "loss scale: 1.0 | grad norm: 1.450 | number of skipped iterations:   0 | "
    "number of nan iterations:   0 |")


def test_iteration_line_is_megatrons_format() -> None:
    rec = IterationRecord(iteration=1, train_iters=6, consumed_samples=4, elapsed_ms=5000.0,
                          learning_rate=1.5e-4, global_batch_size=4, lm_loss=10.0,
                          grad_norm=1.45, throughput_tflops=50.0,
                          timestamp="2024-05-01 10:00:02")
    assert format_iteration(rec) == MEGATRON_LINE


def test_log_round_trips_through_compare(tmp_path) -> None:
    log = tmp_path / "gpt-tiny-cpu" / "demo-s4096-gb1" / "charm" / "train-demo.log"
    log.parent.mkdir(parents=True)
    lines = [argument_dump({"cp_comm_type": ["charm"], "seq_length": 4096,
                            "global_batch_size": 1})]
    for it in range(1, 5):
        lines.append(format_iteration(IterationRecord(
            iteration=it, train_iters=4, consumed_samples=it, elapsed_ms=100.0 + it,
            learning_rate=1e-3, global_batch_size=1, lm_loss=7.0 - it / 10, grad_norm=0.5)))
    log.write_text("\n".join(lines) + "\n")
    parsed = parse_log(log)
    assert [e.iteration for e in parsed.entries] == [1, 2, 3, 4]
    assert parsed.entries[-1].lm_loss == pytest.approx(6.6)
    assert parsed.entries[0].tflops_per_gpu is None  # left out, as without --log-throughput
    assert parsed.args["cp_comm_type"] == "['charm']"
    label = label_for(parsed)
    assert (label.config, label.run, label.comm_type) == ("gpt-tiny-cpu", "demo-s4096-gb1", "charm")
    (row,) = compare([log], skip=2)
    assert row.iterations == 2 and row.median_ms == pytest.approx(103.5)


def test_padded_vocab_is_megatrons() -> None:
    # NullTokenizer(1024) has 1025 ids (EOD added); Megatron pads to a multiple of 128 x TP.
    assert padded_vocab_size(1025) == 1152
    assert padded_vocab_size(1024) == 1024
    assert padded_vocab_size(1025, 128, 2) == 1280


def test_summary_measures_loss_disagreement() -> None:
    def recs(losses: list[float], ms: list[float]) -> list[dict]:
        return [{"lm_loss": x, "elapsed_ms": t} for x, t in zip(losses, ms)]

    s = summarize({"ring": recs([7.0, 6.0, 5.0, 4.0], [9, 9, 10, 12]),
                   "charm": recs([7.0, 6.0, 5.0 + 5e-3, 4.0], [9, 9, 5, 6])}, skip=2)
    assert s["median_ms"] == {"ring": 11.0, "charm": 5.5}
    assert s["loss_abs_diff"] == pytest.approx(5e-3)
    assert s["loss_rel_diff"] == pytest.approx(1e-3)


def test_operator_options_need_operator(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["demo", "--heads", "4"]) == 2
    assert "--heads belong to the operator demo" in capsys.readouterr().err


def test_bad_override_is_a_usage_error(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["demo", "--set", "seq_lenght=5"]) == 2
    assert "seq_lenght" in capsys.readouterr().err


def test_bad_nic_is_refused_before_anything_runs(tmp_path) -> None:
    from charm_megatron.train_demo.runner import run_demo

    with pytest.raises(ValueError, match="nic must be 'node'.*or 'rank'"):
        run_demo(nic="switch", out=tmp_path, stream=io.StringIO())
    assert not any(tmp_path.iterdir())  # nothing was written, no rank was started


def test_demo_end_to_end(tmp_path) -> None:
    """Ring and CHARM+ train the tiny GPT (4 ranks, CP 4, 2x2) for 4 iterations; inside the
    emulated cluster when namespaces are available, else over loopback."""
    pytest.importorskip("megatron.core")
    from charm_megatron.lab.emulate import available
    from charm_megatron.train_demo.runner import run_demo

    out = io.StringIO()
    result = run_demo(overrides={"seq_length": "512", "train_iters": "4"}, out=tmp_path,
                      cross_rate="200mbit", intra_rate="1600mbit", timeout_s=240, stream=out)
    text = out.getvalue()
    assert result.rc == 0, text
    assert result.mode == ("netns" if available()[0] else "loopback")
    if result.mode == "netns":
        assert "measured: cross-node, one pair:" in text
    else:
        assert "no slow link is emulated" in text
    # Same weights, same data: the loss curves agree to fp32 rounding.
    assert result.loss_rel_diff <= 1e-4, text
    assert "loss curves AGREE" in text
    # The compare table, and the result table with both comm types.
    assert "speedup = baseline median / median; baseline per run: ring" in text
    assert re.search(r"charm is (as fast as|[\d.]+x (faster|slower) than) ring per iteration", text)
    for comm in ("ring", "charm"):
        log = tmp_path / "gpt-tiny-cpu" / "demo-s4096-gb1" / comm / "train-demo.log"
        assert result.log_paths[comm] == log
        parsed = parse_log(log)
        assert [e.iteration for e in parsed.entries] == [1, 2, 3, 4]
        assert all(e.lm_loss and e.grad_norm is not None and e.iter_time_ms
                   for e in parsed.entries)
        # lr warm-up over 2 iterations from 0, as Megatron: the first step does not move.
        assert parsed.entries[0].learning_rate == pytest.approx(5e-4)
        meta = json.loads((log.parent / "meta.json").read_text())
        assert (meta["config"], meta["run"], meta["comm_type"]) == (
            "gpt-tiny-cpu", "demo-s4096-gb1", comm)
        assert meta["demo"]["link"] == result.mode
        assert meta["demo"]["overrides"] == {"seq_length": "512", "train_iters": "4"}
    rows = compare([tmp_path / "gpt-tiny-cpu"])
    assert [r.comm_type for r in rows] == ["ring", "charm"]
    assert rows[1].baseline == "ring" and rows[1].speedup is not None
    assert (tmp_path / "compare.csv").is_file()
    # Losses fall (the mock data is learnable) and match between the two logs.
    assert rows[0].lm_loss == pytest.approx(rows[1].lm_loss, rel=1e-4)
