"""Issue 41 item 4: ``--dilation auto`` sized on the shortest dependent unit of any contender,
and emulated rows more than 10 % off the model flagged in the CSV and marked in the reports."""

from __future__ import annotations

import csv

import pytest

from charm_megatron.devices import get_profile
from charm_megatron.lab.bench.config import Point
from charm_megatron.lab.bench.gpu_emulation import MAX_DILATION, MIN_DILATION, auto_dilation
from charm_megatron.lab.bench.report import write_csv
from charm_megatron.lab.reports import emulated, peers, summary
from charm_megatron.lab.reports.bench_csv import (
    COLUMNS,
    OFF_MODEL_MARK,
    OFF_MODEL_NOTE,
    BenchRow,
    off_model,
    read_rows,
)

H100 = get_profile("h100").cluster
GROUPS_2X4 = ((0, 1, 2, 3), (4, 5, 6, 7))
# Causal, on the H100 profile (measured costs): ring's forward step ~0.6 ms, CHARM+'s shortest
# dependent unit shorter (at batch 1 both give the same dilation on the measured costs).
POINT = Point(0, 2, 32768, 8, 8, 64)


def test_a_contender_with_a_shorter_dependent_unit_raises_the_dilation():
    ring = auto_dilation(H100, [POINT], GROUPS_2X4, True, 2)
    both = auto_dilation(H100, [POINT], GROUPS_2X4, True, 2, ["ring", "charm"])
    assert MIN_DILATION < ring < both <= MAX_DILATION
    # Names that are not registered contenders (torch, auto) change nothing; nor does order.
    assert auto_dilation(H100, [POINT], GROUPS_2X4, True, 2, ["torch", "auto", "ring"]) == ring
    assert auto_dilation(H100, [POINT], GROUPS_2X4, True, 2, ["charm", "ring"]) == both


def test_ring_alone_gives_its_forward_step():
    """Ring's forward has n - 1 chained messages: n units, its step as before the change."""
    from charm_megatron.model import predict
    from charm_megatron.plan.cost import Problem

    fwd = predict("ring", GROUPS_2X4, Problem(2, 32768, 8, 8, 64, 2), H100, True).forward
    d = 0.5 / (fwd.time_s / 8)
    digits = 10 ** (len(str(int(d))) - 2)
    assert auto_dilation(H100, [POINT], GROUPS_2X4, True, 2) == round(d / digits) * digits


def test_a_refused_contender_is_skipped():
    # a2a splits the heads over the 8 CP ranks: 4 heads do not divide.
    point = Point(0, 1, 32768, 4, 4, 64)
    assert auto_dilation(H100, [point], GROUPS_2X4, True, 2, ["ring", "a2a"]) == \
        auto_dilation(H100, [point], GROUPS_2X4, True, 2)


@pytest.mark.parametrize("vs_model, flag", [(1.0, False), (1.09, False), (0.91, False),
                                            (1.11, True), (0.85, True), (None, None)])
def test_off_model_from_vs_model(vs_model, flag):
    assert off_model(vs_model) is flag
    cells = {"point": "0", "algo": "charm", "pass": "fwd",
             "vs_model": "" if vs_model is None else str(vs_model)}
    assert BenchRow.from_mapping(cells).off_model is flag  # an old CSV: no off_model column
    row = BenchRow.from_mapping({**cells, "off_model": "" if flag is None else str(flag)})
    assert row.off_model is flag
    assert row.mark == (OFF_MODEL_MARK if flag else "")


def test_the_column_is_written_and_read(tmp_path):
    assert COLUMNS.index("off_model") == COLUMNS.index("vs_model") + 1
    path = tmp_path / "results.csv"
    write_csv([{"point": 0, "algo": "ring", "pass": "fwd", "vs_model": 1.2, "off_model": True},
               {"point": 0, "algo": "torch", "pass": "fwd"}], str(path))
    with open(path, newline="") as f:
        assert [r["off_model"] for r in csv.DictReader(f)] == ["True", ""]
    assert [r.off_model for r in read_rows(path)] == [True, None]


def _row(algo: str, pas: str, ms: float, vs_model: float) -> dict:
    return {"point": 0, "batch": 1, "seq": 32768, "heads": 32, "kv_heads": 8, "head_dim": 128,
            "causal": True, "topology": "2x8", "algo": algo, "pass": pas, "status": "ok",
            "median_ms": ms, "bound_ms": ms / 2, "speedup_vs_ring": 1.0, "vs_bound": 2.0,
            "model_ms": ms / vs_model, "vs_model": vs_model, "off_model": off_model(vs_model),
            "device_model": "h100", "busiest_core_pct": 10.0, "analytic_ring_ms": ms}


def test_reports_mark_a_flagged_row(tmp_path):
    path = tmp_path / "llama.csv"
    write_csv([_row("ring", "fwd", 5.0, 1.0), _row("charm", "fwd", 2.0, 1.25),
               _row("ring", "bwd", 10.0, 1.0), _row("charm", "bwd", 6.0, 1.02),
               _row("ring", "fwdbwd", 15.0, 1.0), _row("charm", "fwdbwd", 8.0, 1.3)],
              str(path))
    text = emulated.llama([path])
    assert f"| 2.0{OFF_MODEL_MARK} |" in text and "| 6.0 |" in text
    assert f"| 5.0{OFF_MODEL_MARK}" not in text
    assert text.rstrip().endswith(OFF_MODEL_NOTE)
    assert f"8.0{OFF_MODEL_MARK} (4.0)" in peers.make([path])
    assert OFF_MODEL_NOTE in peers.make([path])
    text = summary.make([str(path)], ["fwd"])
    assert f"| 2{OFF_MODEL_MARK} |" in text and OFF_MODEL_NOTE in text


def test_reports_without_a_flagged_row_have_no_note(tmp_path):
    path = tmp_path / "llama.csv"
    write_csv([_row("ring", "fwd", 5.0, 1.0), _row("charm", "fwd", 2.0, 1.05),
               _row("ring", "fwdbwd", 15.0, 1.0), _row("charm", "fwdbwd", 8.0, 0.95)],
              str(path))
    for text in (emulated.llama([path]), peers.make([path]), summary.make([str(path)], ["fwd"])):
        assert OFF_MODEL_MARK not in text


def test_the_virtual_clock_sizes_auto_dilation_on_a_tenth_of_the_step():
    # On the virtual clock a late host no longer reaches the measured time (the same device
    # times at D = 1500 and 3, docs/emulator.md), so auto stretches the unit to 0.05 s, not 0.5.
    from charm_megatron.lab.bench.gpu_emulation import (
        VIRTUAL_MIN_DILATION,
        VIRTUAL_STEP_WALL_S,
        setup_for,
    )

    algos = ["ring", "charm"]
    wall = setup_for("h100", (2, 4), [POINT], True, 2, algos=algos, device_clock="sync")
    virtual = setup_for("h100", (2, 4), [POINT], True, 2, algos=algos)
    assert wall.dilation == auto_dilation(H100, [POINT], GROUPS_2X4, True, 2, algos)
    assert virtual.dilation == auto_dilation(H100, [POINT], GROUPS_2X4, True, 2, algos,
                                             step_wall_s=VIRTUAL_STEP_WALL_S,
                                             floor=VIRTUAL_MIN_DILATION)
    assert VIRTUAL_MIN_DILATION < virtual.dilation
    assert abs(virtual.dilation * 10 / wall.dilation - 1) < 0.1, (virtual.dilation,
                                                                  wall.dilation)
