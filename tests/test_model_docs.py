"""The shipped profiles and docs/model.md are what their sources give now (nothing hand-copied),
and the one-shot GPU script works on CPU."""

from __future__ import annotations

import math
import subprocess
import sys
from dataclasses import replace
from pathlib import Path

import pytest

from charm_megatron.lab.calibration.measured import file_digest
from charm_megatron.lab.calibration.paper import MEMORY_GBPS
from charm_megatron.lab.calibration.refit import (
    DOCS_BENCH,
    TABLE4_FIT_FIELDS,
    kernel_terms,
    table4_ring_error,
    table4_shapes,
    table5_ring_error,
)
from charm_megatron.lab.devices.h200 import MEASURED_FIELDS, measured_terms
from charm_megatron.lab.reports import docgen
from charm_megatron.model import get_profile, load_profile

ROOT = Path(__file__).resolve().parents[1]


#: The generated blocks this module checks: every one of docs/model.md but the slow ones (``--fast``),
#: and docs/performance.md's model predictions and headline (its report blocks, emulated
#: tables, are test_reports.py's: not run twice).
CHECKED = {"docs/model.md": (), "docs/performance.md": ("report",)}


def _checked_blocks() -> dict[tuple[str, str], list[tuple[str, str]]]:
    """(kind, argument) -> [(page, body)] of every checked block, read with the regex
    ``regenerate`` rewrites by; a block in both pages (the headline, the l20-pcie grid) is one
    key, generated once and compared with each copy."""
    blocks: dict[tuple[str, str], list[tuple[str, str]]] = {}
    for page, skip in CHECKED.items():
        text = (ROOT / page).read_text(encoding="utf-8")
        for m in docgen._BLOCK.finditer(text):
            what, arg = m.group("what"), m.group("arg").strip()
            if what in docgen.SLOW or what in skip:
                continue
            blocks.setdefault((what, arg), []).append((page, m.group("body")))
    return blocks


BLOCKS = _checked_blocks()


def test_the_checked_pages_have_their_generated_blocks() -> None:
    """Every generated block of the two pages is of a known kind (``regenerate`` raises on
    any other), and the checked ones below are those the pages are expected to have."""
    for page in CHECKED:
        kinds = [m.group("what") for m in docgen._BLOCK.finditer((ROOT / page).read_text(
            encoding="utf-8"))]
        assert kinds and set(kinds) <= set(docgen.GENERATORS), (page, kinds)
    perf = (ROOT / "docs" / "performance.md").read_text(encoding="utf-8")
    assert "--kv-heads 8 --causal --grid 16k,32k,64k,128k --compare-roles paper" in perf
    assert {w for w, _ in BLOCKS} == {"cmd", "headline", "accuracy-cpu", "accuracy-paper",
                                      "accuracy-table4", "report"}
    assert {p for copies in BLOCKS.values() for p, _ in copies} == set(CHECKED)


@pytest.mark.parametrize("what,arg", sorted(BLOCKS), ids=[f"{w} {a}".strip()
                                                          for w, a in sorted(BLOCKS)])
def test_docs_generated_block_is_regenerated(what: str, arg: str) -> None:
    """One generated block of docs/model.md (but the two slow ones) or of docs/performance.md
    (its model predictions and headline) matches a fresh run, byte for byte. One test per
    block, so that the two xdist workers share the ~2 minutes of model runs."""
    new = docgen.GENERATORS[what](arg)
    stale = [page for page, body in BLOCKS[(what, arg)] if body != new]
    assert not stale, (f"stale block {what} {arg} in {stale}, run python -m "
                       f"charm_megatron.lab.reports.docgen {' '.join(stale)}")


def test_cpu_testbed_profile_was_fitted_on_the_current_bench_files() -> None:
    prof = get_profile("cpu-testbed")
    files = sorted(ROOT.glob(DOCS_BENCH))
    assert files and prof.fit["inputs"] == file_digest(files), \
        "docs/performance/*.csv changed: rerun python -m charm_megatron.lab.calibration.refit"
    assert prof.fit["fit_algos"] == ["ring"]


def test_gpu_profiles_come_from_their_sources() -> None:
    h100 = get_profile("h100")
    measured, _ = measured_terms()
    # The compute terms (kernel curve, head dims, backward factor, per-op host cost) are the
    # H200 measurement's (the same GH100 die and clocks), not a published or assumed number.
    for field in MEASURED_FIELDS:
        if field != "merge_gbps":
            assert getattr(h100.cluster, field) == measured[field], field
    assert h100.cluster.op_overhead_us == measured["op_overhead_us"]
    # The merge: the measured fused rate scaled to the H100's memory bandwidth.
    assert h100.cluster.merge_gbps == pytest.approx(
        measured["merge_gbps"] * MEMORY_GBPS["H100"] / MEMORY_GBPS["H200"], rel=1e-3)
    assert h100.fit["fitted"] == ["cross_gbps"]
    assert h100.fit["fit_algos"] == ["ring"] and h100.fit["passes"] == ["fwd"]
    # h20 and l20-pcie still take FA-2's published H100 curve's shape.
    k = kernel_terms()
    for name in ("h20", "l20-pcie"):
        assert get_profile(name).cluster.kernel_q_rows == k["kernel_q_rows"], name
    # The shipped cross rate is the optimum of the ring-forward fit (to its rounding).
    err = table5_ring_error(h100.cluster)
    assert math.sqrt(err) == pytest.approx(h100.fit["rms_log_error"], abs=2e-3)
    for f in (0.97, 1.03):
        assert table5_ring_error(replace(h100.cluster,
                                         cross_gbps=h100.cluster.cross_gbps * f)) > err
    assert get_profile("h20").cluster.cross_gbps == pytest.approx(
        42.6 * h100.fit["cross_fraction_of_table2"], rel=1e-3)


def test_h20_table4_profile_is_the_optimum_of_its_ring_fit() -> None:
    """h20-table4 was fitted on Table 4's ring column only, its shape is one of the paper's
    grid, and each fitted field is at the fit's optimum (to its rounding)."""
    prof = get_profile("h20-table4")
    assert prof.fit["fit_algos"] == ["ring"] and prof.fit["inputs"] == {"paper Table 4": "ring"}
    sh = prof.fit["shape"]
    shape = (sh["batch"], sh["heads"], sh["head_dim"])
    assert shape in table4_shapes()
    clusters = {"L20": get_profile("l20-pcie").cluster, "H20": prof.cluster}
    err = table4_ring_error(clusters, shape)
    assert math.sqrt(err / 10) == pytest.approx(prof.fit["rms_log_error"], abs=2e-3)
    for name in TABLE4_FIT_FIELDS:
        for f in (0.95, 1.05):
            moved = replace(prof.cluster, **{name: getattr(prof.cluster, name) * f})
            assert table4_ring_error({**clusters, "H20": moved}, shape) > err, (name, f)


def _run_on_cpu(script: str, out: Path) -> subprocess.CompletedProcess:
    """A device script's CPU smoke run (``--device cpu --tiny``), asserted to succeed."""
    proc = subprocess.run([sys.executable, str(ROOT / "scripts" / script), "--device", "cpu",
                           "--tiny", "--out", str(out)], capture_output=True, text=True,
                          timeout=300, cwd=ROOT)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    return proc


def test_gpu_check_script_runs_on_cpu(tmp_path: Path) -> None:
    out = tmp_path / "p.json"
    proc = _run_on_cpu("gpu_check.py", out)
    assert "FAIL" not in proc.stdout and "correctness:" in proc.stdout
    prof = load_profile(out)
    assert prof.fit["checks_ok"] is True and prof.fit["kernel_table"]
    assert prof.cluster.tflops > 0 and prof.cluster.op_overhead_us > 0
    # Every backend that passed its checks has a measured rate curve in the profile.
    measured = {k.name: k for k in prof.kernels if k.status == "measured"}
    assert set(measured) == set(prof.fit["kernel_rates_by_backend"]) and measured
    assert all(k.tflops > 0 and k.bwd_factor > 0 for k in measured.values())


def test_gpu_overheads_script_runs_on_cpu(tmp_path: Path) -> None:
    out = tmp_path / "o.json"
    _run_on_cpu("gpu_overheads.py", out)
    import json

    res = json.loads(out.read_text())
    assert "error" not in res["host"] and "error" not in res["executor"], res
    assert res["host"]["call_fwd_bwd_us[every_call]"] > 0
    assert res["executor"]["call_over_kernel"] > 0
    assert "cp_attention" in out.with_suffix(".prof.txt").read_text()


def test_gpu_check_reports_a_raising_path_as_failed() -> None:
    import torch
    from script_loader import load_script

    mod = load_script("gpu_check")
    gen = torch.Generator().manual_seed(0)
    bad = mod._guarded(mod.check_kernel, ("torch", torch.float32, 8, 16, 1, 2, 2, 8, True),
                       "cpu", gen)
    assert bad["ok"] is False and "equal q and kv" in bad["exception"]
    good = mod._guarded(mod.check_kernel, ("torch", torch.float32, 16, 16, 1, 2, 1, 8, True),
                        "cpu", gen)
    assert good["ok"] is True and set(good["errors"]) == {"out", "lse", "dq", "dk", "dv"}
