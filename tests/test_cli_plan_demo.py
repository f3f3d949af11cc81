"""The `plan` and `demo` commands end to end (small sizes)."""

import re

from charm_megatron.cli import main


def _table(text):
    rows = {}
    for line in text.splitlines():
        m = re.match(r"(ring|rmplus|charm)\s+(forward|backward)\s+(\d+)\s+(\d+)\s+([\d.]+)\s+"
                     r"([\d.]+)\s+([\d.]+)", line)
        if m:
            rows[(m[1], m[2])] = [float(x) for x in m.groups()[2:]]
    return rows


def test_plan_2x8_charm_beats_ring_on_critical_path_and_cross_traffic(capsys):
    assert main(["plan", "--cp", "16", "--topology", "2x8", "--causal"]) == 0
    rows = _table(capsys.readouterr().out)
    for direction in ("forward", "backward"):
        ring, charm = rows[("ring", direction)], rows[("charm", direction)]
        assert charm[0] < ring[0]  # dependent steps on the critical path
        assert charm[3] < ring[3]  # most cross-group bytes any rank sends
        assert charm[4] < ring[4]  # total cross-group bytes


def test_plan_prints_a_rank_schedule(capsys):
    assert main(["plan", "--cp", "4", "--topology", "2x2", "--causal", "--rank", "1"]) == 0
    out = capsys.readouterr().out
    assert "post #0 on cross" in out and "tile q[1].all x kv[1].all causal" in out


def test_demo_small(capsys):
    assert main(["demo", "--operator", "--ranks", "4", "--seq", "128", "--heads", "4", "--kv-heads", "2",
                 "--head-dim", "16", "--iters", "1"]) == 0
    out = capsys.readouterr().out
    for algo in ("ring", "rmplus", "charm"):
        line = next(ln for ln in out.splitlines() if ln.startswith(algo + " "))
        errs = [float(x) for x in line.split("x   ")[1].split(", ")]
        assert max(errs) < 1e-4
