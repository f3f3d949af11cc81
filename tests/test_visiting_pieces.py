"""CHARM+'s visiting kv in four row pieces (``split_visiting="quarters"``, docs/algorithm.md,
*Visiting kv in pieces*): the quarters of the plan vocabulary, the plans and their validator
(a broken quarter plan is rejected), the home streams, the model's ``auto`` pick, the refusal
for the counterpart q, and real gloo ranks against the float64 reference (both layouts, GQA,
MHA under forced pass-kv, a head-parallel degree, odd quarter sizes)."""

from __future__ import annotations

import dataclasses

import pytest

import dist_cases
import packed_cases
import visiting_pieces_cases
import window_cases
from charm_megatron.local_ranks import run_ranks
from charm_megatron.model import get_profile
from charm_megatron.model.predict import variants
from charm_megatron.plan import registry
from charm_megatron.plan.core import Comm, Tile, TileBwd
from charm_megatron.plan.cost import Problem
from charm_megatron.plan.roles import RoleShape
from charm_megatron.plan.validate import PlanError, validate
from charm_megatron.plan.vocab import Half, Stream

QUARTERS = Half.pieces(4)
HOME = (Stream.HOME_UP, Stream.HOME_DOWN)


def _groups(g: int, m: int) -> list[list[int]]:
    return [list(range(i * m, (i + 1) * m)) for i in range(g)]


# ------------------------------------------------------------------- the vocabulary
@pytest.mark.parametrize("s", [1, 2, 5, 6, 7, 8, 13, 64])
def test_quarters_nest_in_the_halves_as_the_executor_cuts_rows(s: int) -> None:
    first, second = Half.FIRST.span(s), Half.SECOND.span(s)
    assert first == (0, s // 2) and second == (s // 2, s)  # the executor's halves
    q = [h.span(s) for h in QUARTERS]
    assert q[0][0] == 0 and q[1][1] == first[1] and q[2][0] == second[0] and q[3][1] == s
    assert all(a[1] == b[0] for a, b in zip(q, q[1:]))  # contiguous, in row order
    assert all(h.parent.span(s)[0] <= h.span(s)[0] <= h.span(s)[1] <= h.parent.span(s)[1]
               for h in QUARTERS)


def test_quarters_cover_union_fraction_cut_and_print() -> None:
    q1, q2, q3, q4 = QUARTERS
    assert Half.FIRST.covers(q2) and not q2.covers(Half.FIRST) and not Half.FIRST.covers(q3)
    assert Half.FULL.covers(q4) and q1.covers(q1)
    assert q1.union(q2) is Half.FIRST and q3.union(q4) is Half.SECOND
    assert q2.union(q3) is Half.FULL and q1.union(Half.FIRST) is Half.FIRST
    assert [h.fraction for h in QUARTERS] == [0.25] * 4
    assert Half.FULL.cut(4) == QUARTERS and Half.SECOND.cut(4) == (q3, q4)
    assert Half.FIRST.cut(2) == (Half.FIRST,) and Half.FULL.cut(2) == Half.pieces(2)
    assert [str(h) for h in QUARTERS] == ["1/4", "2/4", "3/4", "4/4"]
    with pytest.raises(ValueError, match="1, 2 or 4 pieces"):
        Half.pieces(3)


# ------------------------------------------------------------------- plans, validator
def _quarter_plan(direction: str, g: int = 2, m: int = 2, causal: bool = True, **kw):
    return registry.build_plan("charm", direction, _groups(g, m), causal, roles="kv",
                               split_visiting="quarters", **kw)


def _tiles(ops):
    return [op for op in ops if type(op) in (Tile, TileBwd)]


@pytest.mark.parametrize("g,m", [(2, 2), (2, 4), (3, 2)])
@pytest.mark.parametrize("causal", [True, False])
@pytest.mark.parametrize("direction", ["forward", "backward"])
def test_quarter_plans_validate_and_split_the_visiting_kv(g, m, causal, direction) -> None:
    plan = _quarter_plan(direction, g, m, causal)
    validate(plan)
    specs = [op.spec for ops in plan.ops for op in _tiles(ops)]
    assert any(s.kv_half in QUARTERS for s in specs)
    streams = {op.stream for ops in plan.ops for op in ops if type(op) is Comm}
    # Backward, the dK, dV pieces go home on the home streams; forward nothing comes home.
    assert (set(HOME) <= streams) == (direction == "backward")


def test_quarter_plans_validate_with_a_head_parallel_degree_and_super_tiles() -> None:
    for direction in ("forward", "backward"):
        validate(_quarter_plan(direction, 2, 4, head_parallel=2))
        validate(_quarter_plan(direction, 2, 4, super_tiles="on"))


def test_the_two_halves_plans_keep_the_cross_stream() -> None:
    plan = registry.build_plan("charm", "backward", _groups(2, 4), True, roles="kv",
                               split_visiting="on")
    assert {op.stream for ops in plan.ops for op in ops if type(op) is Comm} == \
        {Stream.KV, Stream.Q, Stream.CROSS}


def _edit(plan, rank: int, edit):
    ops = [list(o) for o in plan.ops]
    ops[rank] = edit(ops[rank])
    return dataclasses.replace(plan, ops=ops)


def test_the_validator_rejects_a_missing_or_a_repeated_quarter() -> None:
    plan = _quarter_plan("forward")
    rank = next(r for r, ops in enumerate(plan.ops)
                if any(op.spec.kv_half is Half.Q3 for op in _tiles(ops)))
    i = next(i for i, op in enumerate(plan.ops[rank])
             if type(op) is Tile and op.spec.kv_half is Half.Q3)
    missing = _edit(plan, rank, lambda ops: ops[:i] + ops[i + 1:])
    with pytest.raises(PlanError, match="missing|computed"):
        validate(missing)
    twice = _edit(plan, rank, lambda ops: ops[:i + 1] + [ops[i]] + ops[i + 1:])
    with pytest.raises(PlanError, match="twice|computed"):
        validate(twice)
    # A quarter's tile replaced by its half's: pieces of two partitions of one side.
    half = dataclasses.replace(plan.ops[rank][i],
                               spec=dataclasses.replace(plan.ops[rank][i].spec,
                                                        kv_half=Half.SECOND))
    with pytest.raises(PlanError):
        validate(_edit(plan, rank, lambda ops: ops[:i] + [half] + ops[i + 1:]))


# ------------------------------------------------------------------- settings, model
def test_split_counterpart_q_refuses_quarters_naming_the_setting() -> None:
    with pytest.raises(ValueError, match=r"split_counterpart_q='quarters'.*auto, off, on, home"):
        registry.variants("charm", _groups(2, 2), True, split_counterpart_q="quarters")


def test_auto_picks_quarters_where_the_model_predicts_them_faster() -> None:
    """h200, 2x8 with one NIC per node, Llama-8B-like 16k at head-parallel degree 8: the
    backward's dK, dV pieces go home while the later pieces still cross (docs/algorithm.md);
    the model predicts quarters more than SPLIT_MARGIN faster than halves there."""
    cl = get_profile("h200").cluster.with_(nic="node")
    p = Problem(1, 16384, 32, 8, 128, 2)
    _, bwd = variants("charm", _groups(2, 8), p, cl, causal=True, head_parallel=8)
    assert (bwd.split_visiting, bwd.visiting_pieces, bwd.home_stream) == (True, 4, True)
    # Without a profile nothing is timed: whole blocks.
    whole = registry.variants("charm", _groups(2, 8), True, shape=RoleShape(32, 8, 128, 2),
                              head_parallel=8)
    assert not whole[1].split_visiting


# ------------------------------------------------------------------- real ranks
TOL = {"fp32": 1e-5, "bf16": 2e-2}
_Q = (("split_visiting", "quarters"),)


def test_quarters_match_float64_on_gloo_ranks() -> None:
    """2x2, 6 rows per rank (odd halves: quarters of 1 and 2 rows): GQA under the byte rule
    (pass-kv), MHA under forced pass-kv, bf16, and a head-parallel degree of 2; causal and
    full; and the halves with their dK, dV on the home streams (``home``); out, lse, dq, dk,
    dv against float64."""
    cases = [("charm", "2x2", causal, "fp32", 2, _Q) for causal in (True, False)]
    cases += [("charm", "2x2", causal, "fp32", 8, (*_Q, ("roles", "kv")))
              for causal in (True, False)]
    cases += [("charm", "2x2", True, "bf16", 2, _Q),
              ("charm", "2x2", True, "fp32", 2, (*_Q, ("head_parallel", 2)))]
    for causal, hkv, settings in ((c[2], c[4], dict(c[5])) for c in cases):
        shape = RoleShape(8, hkv, 16, 4)
        plan = registry.build_plan("charm", "backward", _groups(2, 2), causal, shape=shape,
                                   **settings)
        assert any(op.spec.kv_half in QUARTERS for ops in plan.ops for op in _tiles(ops))
    # split_visiting="home": the halves, their dK, dV home on the home streams
    home = [("charm", "2x2", causal, "fp32", 2, (("split_visiting", "home"),))
            for causal in (True, False)]
    for causal in (True, False):
        plan = registry.build_plan("charm", "backward", _groups(2, 2), causal,
                                   shape=RoleShape(8, 2, 16, 4), split_visiting="home")
        assert any(op.stream not in (Stream.CROSS, Stream.KV, Stream.Q)
                   for r in range(plan.n) for op in plan.comms(r))
    per_rank = run_ranks(dist_cases.run_matrix, 4, cases + home, 6, 16, 8, timeout_s=300)
    bad = dist_cases.over_tolerance(per_rank, lambda case, name: TOL[case[3]])
    assert not bad, bad


def test_packed_quarters_match_float64_on_gloo_ranks() -> None:
    """THD: a quarter cuts its half's internal rows across documents; GQA's pass-kv on 2x2,
    causal and full, documents of unequal lengths; padding rows stay zero."""
    cases = [("charm", "2x2", causal, "fp32", 2, docs, "bytes", 8)
             for causal in (True, False) for docs in ("unequal", "short")]
    per_rank = run_ranks(packed_cases.run_packed_matrix, 4, cases, [], timeout_s=300,
                         env={"CHARM_SPLIT_VISITING": "quarters"})
    bad = [f"{c} rank {r}: {errs}" for r, res in enumerate(per_rank)
           for c, (errs, zero) in res.items() if not zero or max(errs.values()) >= TOL["fp32"]]
    assert not bad, bad


def test_windowed_quarters_match_float64_on_gloo_ranks() -> None:
    """Sliding windows: each quarter sub-tile is masked by its own rows' positions
    (kernels/window.py), or pruned where the window keeps none of its pairs."""
    cases = [("charm", "2x2", causal, "fp64", 2, left, right)
             for causal, left, right in ((True, 9, 0), (True, 3, 0), (False, 3, 5))]
    per_rank = run_ranks(window_cases.run_sbhd, 4, cases, timeout_s=300,
                         env={"CHARM_SPLIT_VISITING": "quarters"})
    bad = dist_cases.over_tolerance(per_rank, lambda case, name: window_cases.TOL[case[3]])
    assert not bad, bad


def test_the_home_streams_are_made_by_the_first_plan_that_posts_on_them() -> None:
    for before, after in run_ranks(visiting_pieces_cases.home_streams_made, 4, timeout_s=120):
        assert before == ["cross", "kv", "q"]
        assert after == ["cross", "home_down", "home_up", "kv", "q"]
