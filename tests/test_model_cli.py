"""``charm-megatron model``: the command line of the performance model."""

from __future__ import annotations

import pytest

from charm_megatron.cli import main
from charm_megatron.plan.registry import names


def _run(capsys: pytest.CaptureFixture[str], *args: str) -> str:
    assert main(["model", *args]) == 0
    return capsys.readouterr().out


def test_profile_prints_every_algorithm(capsys: pytest.CaptureFixture[str]) -> None:
    out = _run(capsys, "--profile", "h100", "--topology", "4x8", "--seq", "65536", "--causal",
               "--ranks")
    assert "topology 4x8 (32 ranks, 4 groups, nic=rank)" in out
    assert "ring CCR" in out
    rows = {line.split()[0]: line.split() for line in out.splitlines()
            if line.split() and line.split()[0] in names()}
    assert set(rows) == set(names()) >= {"ring", "rmplus", "charm", "allgather"}
    assert rows["ring"][4:7] == ["1.00", "1.00", "1.00"]  # speedups of ring over itself
    assert float(rows["charm"][6]) > 1.0
    # The fastest is the row with the least fwd+bwd (at this MHA shape on 4x8: a2a, whose
    # all-to-all moves fewer bytes than any exchange; docs/performance.md).
    fastest = min(rows, key=lambda a: float(rows[a][3]))
    assert f"# fastest (fwd+bwd): {fastest}" in out
    assert float(rows["charm"][3]) < min(float(rows[a][3]) for a in ("ring", "rmplus",
                                                                      "allgather"))
    assert out.count("busy per rank") == 2 * len(names())  # each algorithm, each direction


def test_hand_described_cluster_and_overrides(capsys: pytest.CaptureFixture[str]) -> None:
    out = _run(capsys, "--topology", "2x4", "--intra-gbps", "24", "--cross-gbps", "14.7",
               "--tflops", "60", "--nic", "node", "--latency-us", "10", "--seq", "16384")
    assert "described on the command line" in out
    assert "cross 14.7 GB/s per group" in out
    out = _run(capsys, "--profile", "l20-pcie", "--tflops", "30", "--seq", "16384")
    assert "profile l20-pcie" in out and "attention 30 TFLOP/s" in out
    out = _run(capsys, "--topology", "2x2", "--seq", "16384", "--cores", "2",
               "--cpu-ns-per-byte", "0.5")
    assert "generic cluster" in out and "2 shared cores" in out


def test_grid(capsys: pytest.CaptureFixture[str]) -> None:
    out = _run(capsys, "--profile", "h20", "--causal", "--grid", "8k,32k")
    lines = [line for line in out.splitlines() if line and line[0] != "#"]
    assert lines[0].split()[0] == "seq"
    assert [line.split()[0] for line in lines[1:]] == ["8192", "32768"]
    assert all(line.split()[-1] in names() for line in lines[1:])


def test_list_profiles_and_errors(capsys: pytest.CaptureFixture[str]) -> None:
    out = _run(capsys, "--list-profiles")
    for name in ("l20-pcie", "h20", "h100", "cpu-testbed"):
        assert name in out
    with pytest.raises(SystemExit):
        main(["model", "--seq", "1024"])  # neither a profile nor a topology


def _grid_rows(out: str) -> dict[str, list[str]]:
    return {line.split()[0]: line.split() for line in out.splitlines()
            if line and line[0] != "#" and line.split()[0] != "seq"}


def test_roles_and_compare_roles(capsys: pytest.CaptureFixture[str]) -> None:
    """``--compare-roles paper`` adds charm's speed-ups under the paper's roles, the same numbers
    a ``--roles paper`` run prints; with GQA at a short sequence the byte rule is faster."""
    base = ("--profile", "h100", "--heads", "32", "--kv-heads", "8", "--causal", "--grid", "16k")
    both = _run(capsys, *base, "--compare-roles", "paper")
    paper = _run(capsys, *base, "--roles", "paper")
    assert "roles bytes" in both and "roles paper" in paper and "charm/paper x fwd" in both
    row, prow = _grid_rows(both)["16384"], _grid_rows(paper)["16384"]
    assert row[10:13] == prow[7:10]  # paper's charm fwd / bwd / total speed-ups
    assert row[:4] == prow[:4]  # seq, CCRs and ring ms do not depend on the roles
    assert float(row[9]) > float(row[12])  # bytes beats paper for 32 q / 8 kv heads at 16k
    with pytest.raises(SystemExit, match="--compare-roles 'papr'"):
        main(["model", *base, "--compare-roles", "papr"])
    with pytest.raises(SystemExit, match="needs --grid"):
        main(["model", "--profile", "h100", "--compare-roles", "paper"])
