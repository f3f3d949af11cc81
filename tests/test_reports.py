"""``charm-megatron report``: the one typed reader of the bench CSV, and every docs table a
report makes is what the report prints now from the committed CSVs (byte for byte)."""

from __future__ import annotations

import csv
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from charm_megatron.cli import main as cli_main
from charm_megatron.lab.reports import bench_csv, docgen, peers, summary
from charm_megatron.lab.reports.bench_csv import COLUMNS, BenchRow, read_rows
from charm_megatron.lab.reports.cli import REPORTS

ROOT = Path(__file__).resolve().parents[1]
PERF = ROOT / "docs" / "performance"
#: The pages whose tables ``gen:report`` blocks make.
PAGES = ("docs/performance.md", "docs/performance/summary.md")


def _blocks(page: str) -> list[tuple[str, str]]:
    text = (ROOT / page).read_text(encoding="utf-8")
    return [(m.group("arg").strip(), m.group("body")) for m in docgen._BLOCK.finditer(text)
            if m.group("what") == "report"]


# ---- the reader --------------------------------------------------------------------------

def test_the_columns_live_in_the_reader() -> None:
    """The bench writes the reader's fields, in order ("pass" is the field ``pass_``)."""
    from charm_megatron.lab.bench import analysis, report

    assert analysis.COLUMNS is COLUMNS and report.COLUMNS is COLUMNS
    assert COLUMNS[:3] == ["point", "batch", "seq"] and "pass" in COLUMNS
    assert len(set(COLUMNS)) == len(COLUMNS)


def test_a_written_row_reads_back_typed(tmp_path: Path) -> None:
    from charm_megatron.lab.bench.report import write_csv

    row = {"point": 0, "batch": 2, "seq": 3072, "heads": 8, "kv_heads": 2, "head_dim": 64,
           "dtype": "fp32", "causal": True, "window": "4096,0", "world": 8, "topology": "2x4",
           "mode": "netns", "nic": "rank", "algo": "charm", "pass": "fwd", "status": "ok",
           "iters": 3, "median_ms": 250.5, "speedup_vs_ring": 1.8, "cores": 2,
           "cpu_limited": False, "wire_scale": "16x14", "bound_ms": float("nan"),
           "auto_pick": "", "note": "a note, with a comma"}
    path = tmp_path / "results.csv"
    write_csv([row], str(path))
    (r,) = read_rows(path)
    assert isinstance(r, BenchRow) and r.ok and r.pas == "fwd" and r.pass_ == "fwd"
    assert (r.point, r.seq, r.kv_heads, r.causal, r.window) == (0, 3072, 2, True, (4096, 0))
    assert (r.median_ms, r.cores, r.cpu_limited, r.wire_scale) == (250.5, 2, False, "16x14")
    assert r.bound_ms is None and r.auto_pick is None and r.vs_model is None
    assert r.note == "a note, with a comma"
    assert r.cells()["pass"] == "fwd" and list(r.cells()) == COLUMNS
    with pytest.raises(AttributeError):
        r.algo = "ring"  # type: ignore[misc]  (frozen)


def test_old_files_read_and_wrong_files_are_refused(tmp_path: Path) -> None:
    old = tmp_path / "old.csv"
    old.write_text("point,algo,pass,heads,median_ms\n0,ring,fwd,8,12.5\n")
    (r,) = read_rows(old)
    assert r.kv_heads == 8 and r.status is None and r.device_model is None  # missing: None
    other = tmp_path / "other.csv"
    other.write_text("a,b\n1,2\n")
    with pytest.raises(ValueError, match="not a charm-megatron bench results.csv"):
        read_rows(other)
    with pytest.raises(ValueError, match="does not exist"):
        read_rows(tmp_path / "missing.csv")
    bad = tmp_path / "bad.csv"
    bad.write_text("point,pass,median_ms\n0,fwd,1\n")
    with pytest.raises(ValueError, match="without algo"):
        read_rows(bad)


def test_every_committed_bench_csv_reads() -> None:
    files = sorted(PERF.rglob("*.csv"))
    assert len(files) > 100
    rows = [r for f in files for r in bench_csv.read_rows(f)]
    assert {r.pass_ for r in rows} == {"fwd", "bwd", "fwdbwd"}
    assert all(isinstance(r.seq, int) and isinstance(r.causal, bool) for r in rows)


def test_nothing_but_the_reader_parses_the_bench_csv() -> None:
    """No module of the package and no script reads results.csv with csv.DictReader (the bench
    CSV's string keys live in bench_csv only)."""
    offenders = []
    for path in [*(ROOT / "charm_megatron").rglob("*.py"), *(ROOT / "scripts").glob("*.py")]:
        if path.name == "bench_csv.py" or "launch" in path.parts:  # compare.py: its own CSV
            continue
        if "DictReader" in path.read_text(encoding="utf-8"):
            offenders.append(str(path.relative_to(ROOT)))
    assert not offenders, offenders


# ---- the docs' tables --------------------------------------------------------------------

def _part(arg: str) -> str:
    """Which part of a page's report blocks ``arg`` is checked in: the table5 reports (which
    share their model predictions, ~10 s, in one process) or the others (llama's predictions
    are peers' too)."""
    return "table5" if arg.split()[0] == "table5" else "others"


@pytest.mark.parametrize("page,part", [(page, part) for page in PAGES
                                       for part in sorted({_part(a) for a, _ in _blocks(page)})])
def test_docs_report_blocks_are_what_the_reports_print(page: str, part: str) -> None:
    """Every ``<!-- gen:report ... -->`` block of the page, against a fresh run; in two parts
    where the page has table5 blocks (~30 s in one test), so the xdist workers share them."""
    blocks = [(arg, body) for arg, body in _blocks(page) if _part(arg) == part]
    assert blocks
    stale = [arg for arg, body in blocks if docgen._report(arg) != body]
    assert not stale, f"stale, run charm-megatron report docgen {page}: {stale}"


def test_the_performance_page_names_every_report_table() -> None:
    names = {arg.split()[0] for arg, _ in _blocks("docs/performance.md")}
    assert names == {"table5", "table4", "llama", "peers", "te", "head-parallel"}
    text = (ROOT / "docs" / "performance.md").read_text(encoding="utf-8")
    for arg, body in _blocks("docs/performance.md"):
        assert body.startswith(f"Made by `charm-megatron report {arg}`:\n\n| ")
    assert "scripts/peers_table.py" not in text and "scripts/llama_table.py" not in text


def _gqa_label(path: Path) -> str:
    """What a gqa run's results.json said: cluster, mode, NIC, link model, configured rate."""
    nic, model, rate = re.match(r"(node|rank)-(tbf|htb)-(\d+)mbit", path.stem).groups()
    return f"2x4 netns nic={nic}" + (" htb" if model == "htb" else "") + f" {rate} Mbit/s"


@pytest.mark.parametrize("grid", ["gqa-s20", "gqa-s21"])
def test_summary_reproduces_the_grid_summaries(grid: str) -> None:
    """The grid tables of docs/performance/gqa-s2*/summary.md, from the CSVs beside them with
    the labels their runs' results.json gave."""
    files = sorted(f for f in (PERF / grid).glob("*.csv") if re.match(r"(node|rank)-", f.name))
    text = summary.make([str(f) for f in files], ["fwd", "fwdbwd"],
                        [_gqa_label(f) for f in files])
    table = text.split("\n\n")[0] + "\n"
    assert len(table.splitlines()) == 2 + 2 * len(files)
    assert table in (PERF / grid / "summary.md").read_text(encoding="utf-8")


def test_summary_labels_a_copied_csv_by_its_name() -> None:
    label, rows = summary.load(str(PERF / "2x2-node.csv"))
    assert label == "2x2-node" and rows[0].topology == "2x2"
    with pytest.raises(ValueError, match="one per CSV"):
        summary.make([str(PERF / "2x2-node.csv")], labels=["a", "b"])


def test_peers_marks_absent_refused_and_slow_auto(tmp_path: Path) -> None:
    src = PERF / "peers" / "cpu-2x4-rank-100mbit-kv8-peers.csv"
    text = peers.make([src])
    assert text.rstrip().endswith("| charm | a2a | **1.168** |")  # auto 1.17x the fastest
    assert "busiest core" not in text  # CPU runs measure none
    # a2a and a2a+p2p dropped from a GQA point: not run, and refused by the registry
    gqa = tmp_path / "gqa.csv"
    with open(PERF / "peers" / "cpu-2x4-node-100mbit-kv2.csv", newline="") as f:
        rows = [r for r in csv.DictReader(f) if r["algo"] != "allgather"]
    with open(gqa, "w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=list(rows[0]))
        w.writeheader()
        w.writerows(rows)
    line = peers.make([gqa], algos=["ring", "allgather", "a2a"]).splitlines()[2]
    assert line.split(" | ")[2:4] == ["-", "refused (not run)"]
    with pytest.raises(ValueError, match="one per CSV"):
        peers.make([src], labels=["a", "b"])


def test_the_report_command_and_the_old_names(tmp_path: Path, capsys) -> None:
    with pytest.raises(SystemExit):
        cli_main(["report", "--help"])
    out = capsys.readouterr().out
    assert all(name in out for name in REPORTS)
    # One row's CSV (the docs block test runs the whole directory, ~10 s, through the same
    # command line).
    t5 = tmp_path / "t5"
    t5.mkdir()
    shutil.copy(PERF / "emulated-t5" / "2x8-b128-s3360.csv", t5)
    assert cli_main(["report", "table5", str(t5)]) == 0
    new = capsys.readouterr().out
    assert new.startswith("| GPUs | B | S | pass |")
    rows = [line.split(" | ")[:4] for line in new.splitlines()[2:] if line.startswith("|")]
    assert rows == [["| 2x8", "128", "3,360", p] for p in ("fwd", "bwd")]


def test_docgen_checks_and_rewrites_a_report_block(tmp_path: Path, capsys) -> None:
    page = tmp_path / "page.md"
    page.write_text("x\n<!-- gen:report table4 docs/performance/emulated-t4 -->\nold\n"
                    "<!-- gen:end -->\n")
    assert cli_main(["report", "docgen", str(page), "--check"]) == 1
    assert "stale generated blocks" in capsys.readouterr().out
    assert cli_main(["report", "docgen", str(page)]) == 0
    assert cli_main(["report", "docgen", str(page), "--check"]) == 0
    assert "| 2x8 H20 | 7168 |" in page.read_text()


def test_memory_report_measures_on_gloo_ranks() -> None:
    """A tiny grid end to end (4 gloo ranks), through the command line."""
    proc = subprocess.run([sys.executable, "-m", "charm_megatron.cli", "report", "memory",
                           "--topology", "2x2", "--seq", "64", "--batch", "1", "--heads", "2",
                           "--head-dim", "8", "--kv-heads", "2", "--roles", "bytes"],
                          capture_output=True, text=True, timeout=300, cwd=ROOT)
    assert proc.returncode == 0, proc.stderr
    lines = proc.stdout.splitlines()
    assert lines[0].startswith("| 2x2 | kv heads | mask | roles |") and len(lines) == 4
    assert lines[2].startswith("| | 2/2 | causal | bytes |") and lines[2].endswith("× |")


def test_memory_table_from_peaks() -> None:
    from charm_megatron.lab.reports.memory import cases, table

    points, grid = cases("2x4", [2], ["paper"])
    worst = {c: {"fwd": 2e6 * (2 if c[0] == "charm" else 1), "fwdbwd": 4e6} for c in grid}
    text = table("2x4", 8, points, worst)
    assert text.splitlines()[2] == ("| | 8/2 | causal | paper | 2.00 | 4.00 | 1.00× | 1.00× "
                                    "| 2.00× | 1.00× |")


def test_the_runtime_imports_no_lab_code() -> None:
    """``charm_megatron.lab`` holds what the runtime never imports (``auto`` imports the model
    package; the model reads bench CSVs only when asked to)."""
    code = ("import sys, charm_megatron, charm_megatron.model, charm_megatron.ops; "
            "print(sorted(m for m in sys.modules if m.startswith('charm_megatron.lab')))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         timeout=120, cwd=ROOT, check=True).stdout
    assert out.strip() == "[]"
