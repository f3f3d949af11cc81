"""Every table in the docs says where it comes from.

A table (a run of consecutive lines starting with ``|``) in README.md or any Markdown file
under docs/ must be one of:

(a) inside a ``<!-- gen:... -->`` ... ``<!-- gen:end -->`` block, which
    ``charm-megatron report docgen`` rewrites and tests/test_reports.py and
    tests/test_model_docs.py check against fresh runs;
(b) measured or computed, with a provenance note: a line with ``Made by`` / ``made by`` and
    then a backtick (the command, script or file in backticks, e.g. "Made by
    `charm-megatron bench --emulate 2x4 ...`" or "Made by hand from `docs/.../x.csv`"), among
    the 8 non-blank lines above the table (not reaching past another table or a generated
    block) or the 3 lines below it;
(c) documentation, not numbers that were measured or computed (options, variables, file maps,
    feature comparisons), marked ``<!-- table: reference -->`` on the non-blank line directly
    above it.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path

import pytest

from charm_megatron.lab.reports.docgen import _BLOCK

ROOT = Path(__file__).resolve().parents[1]
REFERENCE = "<!-- table: reference -->"
MADE_BY = re.compile(r"\b[Mm]ade by\b.*`")
LOOK_BACK = 8  # non-blank lines above the table
LOOK_AHEAD = 3  # lines below it


@dataclass(frozen=True)
class Table:
    line: int  # 1-based, the header row
    rows: int
    kind: str  # "gen", "made-by", "reference" or "" (no provenance)
    header: str


def doc_files(root: Path = ROOT) -> list[Path]:
    return [root / "README.md", *sorted((root / "docs").rglob("*.md"))]


def _gen_lines(text: str) -> set[int]:
    """0-based indices of the lines inside generated blocks (markers included)."""
    inside: set[int] = set()
    for m in _BLOCK.finditer(text):
        first = text.count("\n", 0, m.start())
        inside.update(range(first, first + m.group(0).count("\n") + 1))
    return inside


def _is_table(line: str) -> bool:
    return line.startswith("|")


def _made_by_above(lines: list[str], start: int, gen: set[int]) -> bool:
    seen = 0
    for i in range(start - 1, -1, -1):
        if _is_table(lines[i]) or i in gen:
            return False
        if not lines[i].strip():
            continue
        if MADE_BY.search(lines[i]):
            return True
        seen += 1
        if seen == LOOK_BACK:
            return False
    return False


def _made_by_below(lines: list[str], end: int) -> bool:
    for line in lines[end:end + LOOK_AHEAD]:
        if _is_table(line):
            return False
        if MADE_BY.search(line):
            return True
    return False


def _reference(lines: list[str], start: int) -> bool:
    above = [line.strip() for line in lines[:start] if line.strip()]
    return bool(above) and above[-1] == REFERENCE


def tables(text: str) -> list[Table]:
    """Every table of a Markdown text, classified."""
    lines = text.split("\n")
    gen = _gen_lines(text)
    out, i = [], 0
    while i < len(lines):
        if not _is_table(lines[i]):
            i += 1
            continue
        end = i
        while end < len(lines) and _is_table(lines[end]):
            end += 1
        kind = ("gen" if i in gen else
                "reference" if _reference(lines, i) else
                "made-by" if _made_by_above(lines, i, gen) or _made_by_below(lines, end) else
                "")
        out.append(Table(i + 1, end - i, kind, lines[i]))
        i = end
    return out


def stray_markers(text: str) -> list[int]:
    """1-based lines of ``<!-- table: reference -->`` markers with no table right below."""
    lines = text.split("\n")
    bad = []
    for i, line in enumerate(lines):
        if line.strip() == REFERENCE:
            nxt = next((x for x in lines[i + 1:] if x.strip()), "")
            if not _is_table(nxt):
                bad.append(i + 1)
    return bad


def problems(root: Path = ROOT) -> list[str]:
    out = []
    for path in doc_files(root):
        if not path.exists():
            continue
        text = path.read_text(encoding="utf-8")
        rel = path.relative_to(root)
        for t in tables(text):
            if not t.kind:
                out.append(f"{rel}:{t.line}: table {t.header[:60]!r} ({t.rows} lines) says "
                           "not where it comes from")
        out += [f"{rel}:{n}: {REFERENCE} with no table below it" for n in stray_markers(text)]
    return out


# ---- the docs ------------------------------------------------------------------------------

def test_every_docs_table_says_where_it_comes_from() -> None:
    bad = problems()
    assert not bad, (
        "tables without provenance; add a line 'Made by `command`' (or 'Made by hand from "
        f"`file`') within {LOOK_BACK} non-blank lines above the table (or {LOOK_AHEAD} below), "
        f"or put {REFERENCE} directly above a table that documents rather than measures "
        "(or move it into a <!-- gen:... --> block):\n" + "\n".join(bad))


def test_the_docs_have_tables_of_each_kind() -> None:
    """The parser finds the docs' tables (a broken glob or pattern would pass the test above)."""
    found = [t for p in doc_files() if p.exists()
             for t in tables(p.read_text(encoding="utf-8"))]
    kinds = {k: sum(t.kind == k for t in found) for k in ("gen", "made-by", "reference")}
    assert len(found) > 60 and all(n >= 10 for n in kinds.values()), kinds


# ---- the checker ---------------------------------------------------------------------------

TABLE = "| a | b |\n|---|---|\n| 1 | 2 |\n"


def _kinds(text: str) -> list[str]:
    return [t.kind for t in tables(text)]


def test_a_table_without_a_note_is_flagged(tmp_path: Path) -> None:
    text = "# Page\n\nSome numbers:\n\n" + TABLE + "\nMore text.\n"
    assert _kinds(text) == [""]
    (tmp_path / "docs").mkdir()
    (tmp_path / "README.md").write_text("no tables\n")
    (tmp_path / "docs" / "page.md").write_text(text)
    (bad,) = problems(tmp_path)
    assert bad.startswith("docs/page.md:5: table '| a | b |'")


@pytest.mark.parametrize("text", [
    "Made by `charm-megatron bench --emulate 2x4`:\n\n" + TABLE,
    "Numbers, made by `scripts/bench_gqa.sh` on a quiet\nmachine, 2 cores:\n\n" + TABLE,
    "Made by hand from `docs/performance/2x2-node.csv`.\n" + "line\n" * 7 + "\n" + TABLE,
    TABLE + "\nMade by `python scripts/gpu_check.py`.\n",
])
def test_a_made_by_note_above_or_below_is_accepted(text: str) -> None:
    assert _kinds(text) == ["made-by"]


def test_a_reference_marker_directly_above_is_accepted() -> None:
    assert _kinds("Options:\n\n" + REFERENCE + "\n" + TABLE) == ["reference"]
    assert _kinds(REFERENCE + "\n\n" + TABLE) == ["reference"]
    assert _kinds(REFERENCE + "\nSome text.\n\n" + TABLE) == [""]  # not directly above
    assert stray_markers(REFERENCE + "\nSome text.\n\n" + TABLE) == [1]
    assert stray_markers(REFERENCE + "\n" + TABLE) == []


def test_a_generated_block_is_accepted() -> None:
    text = ("x\n<!-- gen:report table4 docs/performance/emulated-t4 -->\n" + TABLE
            + "<!-- gen:end -->\n")
    assert _kinds(text) == ["gen"]
    assert _kinds("<!-- gen:end -->\n" + TABLE) == [""]  # a marker alone is no block


@pytest.mark.parametrize("text", [
    "Made by `x`.\n" + "line\n" * 8 + TABLE,  # 9 non-blank lines up: too far
    "Made by hand from the CSVs.\n\n" + TABLE,  # no command or file in backticks
    "From `charm-megatron plan`:\n\n" + TABLE,  # says where, but not as a note
    TABLE + "\n\n\nMade by `x`.\n",  # 4 lines below: too far
])
def test_a_note_too_far_or_without_a_command_is_not_enough(text: str) -> None:
    assert _kinds(text) == [""]


def test_one_note_does_not_cover_a_table_past_another() -> None:
    text = "Made by `a`:\n\n" + TABLE + "\nText.\n\n" + TABLE
    assert _kinds(text) == ["made-by", ""]
    gen = "Made by `a`:\n<!-- gen:headline -->\nx\n<!-- gen:end -->\n\n" + TABLE
    assert _kinds(gen) == [""]
