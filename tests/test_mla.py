"""Different head dims for q / k and v (multi-latent attention: q, k 192 and v 128 in
DeepSeek-style MLA) on real gloo ranks against a float64 reference: out, lse, dq, dk, dv for
every algorithm, sbhd and packed THD, v narrower and wider than q / k; and the plans' bytes
count v at its own width."""

import pytest

import mla_cases
from charm_megatron.local_ranks import run_ranks
from charm_megatron.plan.cost import Problem
from charm_megatron.plan.roles import RoleShape, row_bytes
from charm_megatron.plan.vocab import Kind

ALGOS = (("ring", None), ("rmplus", None), ("charm", "2x2"), ("allgather", None))


def _failures(per_rank: list[dict]) -> list[str]:
    return [f"{case} rank {r}: {name} {err:.3g}"
            for r, res in enumerate(per_rank) for case, errs in res.items()
            for name, err in errs.items() if not err < mla_cases.TOL[case[3]]]


def test_sbhd_matches_float64_reference():
    cases = [(algo, topo, causal, dtype, hkv, d, dv)
             for algo, topo in ALGOS for causal in (True, False)
             for dtype, hkv, d, dv in (("fp64", 2, 24, 16), ("fp32", 4, 16, 24),
                                       ("bf16", 2, 24, 16))]
    assert not _failures(run_ranks(mla_cases.run_sbhd, 4, cases, timeout_s=300))


def test_packed_matches_float64_reference():
    cases = [(algo, topo, causal, dtype, docs, 24, 16)
             for algo, topo in (("ring", None), ("charm", "2x2")) for causal in (True, False)
             for dtype, docs in (("fp64", "unequal"), ("bf16", "short"))]
    assert not _failures(run_ranks(mla_cases.run_packed, 4, cases, timeout_s=300))


def test_bytes_count_v_at_its_own_width():
    mha = Problem(1, 4096, 16, 16, 192, 2)
    mla = Problem(1, 4096, 16, 16, 192, 2, dv=128)
    assert mla.block_bytes(Kind.KV, 4) == pytest.approx(mha.block_bytes(Kind.KV, 4) * 320 / 384)
    assert mla.block_bytes(Kind.OUT, 4) < mha.block_bytes(Kind.OUT, 4)
    assert mla.block_bytes(Kind.Q, 4) == mha.block_bytes(Kind.Q, 4)
    # The byte rule reads the narrower v in every block that holds v or the output.
    wide, narrow = RoleShape(16, 16, 192), RoleShape(16, 16, 192, dv=128)
    for kind in (Kind.KV, Kind.OUT, Kind.QGRAD, Kind.DKV):
        assert row_bytes(kind, narrow) < row_bytes(kind, wide), kind
    for kind in (Kind.Q, Kind.DQ):
        assert row_bytes(kind, narrow) == row_bytes(kind, wide), kind


def test_plan_and_model_clis_take_the_v_head_dim(capsys):
    from charm_megatron.cli import main

    def ring_forward_mib(*extra: str) -> float:
        assert main(["plan", "--cp", "16", "--topology", "2x8", "--causal", "--seq", "131072",
                     "--heads", "16", "--head-dim", "192", *extra]) == 0
        out = capsys.readouterr().out
        assert ("dim=192/128" in out) == bool(extra), out.splitlines()[0]
        (row,) = [line for line in out.splitlines() if line.startswith("ring ") and "forward" in line]
        return float(row.split()[4])  # intra max MiB

    # kv blocks of 192 + 128 instead of 192 + 192 columns: 5/6 of ring's bytes.
    assert ring_forward_mib("--v-head-dim", "128") == pytest.approx(ring_forward_mib() * 5 / 6)
    assert main(["model", "--profile", "h100", "--seq", "65536", "--causal", "--heads", "16",
                 "--head-dim", "192", "--v-head-dim", "128"]) == 0
    assert "dim=192/128" in capsys.readouterr().out
