"""CHARM+'s own causal diagonal tile as its three sub-tiles (``split_diagonal``,
docs/algorithm.md, *The own diagonal tile in three*): the sub-tiles, the plans and their
validator (a plan missing or repeating a sub-tile is rejected), the setting and its ``auto``
pick, and real gloo ranks against the float64 reference (GQA, a head-parallel degree, THD
with unequal documents, sliding windows; forward and backward)."""

from __future__ import annotations

import dataclasses

import pytest

import dist_cases
import packed_cases
import window_cases
from charm_megatron.algorithms.charm import entry
from charm_megatron.local_ranks import run_ranks
from charm_megatron.plan import registry
from charm_megatron.plan.core import Tile, TileBwd, TileSpec, diagonal_sub_tiles, tile_spec
from charm_megatron.plan.roles import RoleShape
from charm_megatron.plan.tile_rule import WindowGeometry
from charm_megatron.plan.validate import PlanError, validate
from charm_megatron.plan.vocab import Direction, Half

SHAPE = RoleShape(8, 2, 16, 4)  # GQA: every cross round passes kv under the byte rule
TOL = {"fp32": 1e-5, "fp64": 1e-9}


def _groups(g: int, m: int) -> list[list[int]]:
    return [list(range(i * m, (i + 1) * m)) for i in range(g)]


def _tiles(ops):
    return [op for op in ops if type(op) in (Tile, TileBwd)]


def _plan(direction: str, g: int = 2, m: int = 2, split_diagonal_value: str = "on", **kw):
    kw.setdefault("shape", SHAPE)
    return registry.build_plan("charm", direction, _groups(g, m), True,
                               split_diagonal=split_diagonal_value, **kw)


def _split_ranks(plan) -> list[int]:
    return [r for r, ops in enumerate(plan.ops)
            if any(op.spec.q_owner == op.spec.kv_owner and op.spec.q_half is not Half.FULL
                   for op in _tiles(ops))]


# ------------------------------------------------------------------- the sub-tiles
def test_the_three_sub_tiles_are_exactly_the_diagonals_pairs() -> None:
    first, between, second = diagonal_sub_tiles(tile_spec(3, 3, True))
    assert first == TileSpec(3, 3, Half.FIRST, Half.FIRST, True)
    assert between == TileSpec(3, 3, Half.SECOND, Half.FIRST, False)
    assert second == TileSpec(3, 3, Half.SECOND, Half.SECOND, True)
    # Pair by pair on the global positions of 4 ranks x 8 rows (Megatron's layout): the
    # union is the diagonal's causal pairs, each once.
    geo = WindowGeometry(-1, -1, 4, 8, True)
    assert geo.kept_pairs(tile_spec(3, 3, True)) == sum(
        geo.kept_pairs(t) for t in (first, between, second))
    assert diagonal_sub_tiles(tile_spec(2, 3, True)) is None  # not a diagonal
    assert diagonal_sub_tiles(tile_spec(3, 3, False)) is None  # no mask


# ------------------------------------------------------------------- plans, validator
@pytest.mark.parametrize("g,m,kw", [(2, 2, {}), (2, 4, {}), (3, 2, {}),
                                    (2, 4, {"head_parallel": 2}),
                                    (2, 4, {"super_tiles": "on"}),
                                    (2, 4, {"split_visiting": "quarters"}),
                                    (2, 2, {"pass_order": "joint"}),
                                    (2, 4, {"roles": "paper"})])
@pytest.mark.parametrize("direction", ["forward", "backward"])
def test_split_plans_validate_and_split_where_the_first_block_comes_whole(
        g, m, kw, direction) -> None:
    plan = _plan(direction, g, m, **kw)
    validate(plan)
    split = _split_ranks(plan)
    assert split  # the lower group's ranks (their first cross block arrives whole)
    assert 0 in split and (g * m - 1) not in split


@pytest.mark.parametrize("g,m,kw", [(2, 2, {}), (2, 4, {"head_parallel": 2}), (3, 2, {}),
                                    (2, 4, {"roles": "paper"})])
@pytest.mark.parametrize("direction", ["forward", "backward"])
def test_all_splits_the_diagonal_on_every_rank(g, m, kw, direction) -> None:
    """``split_diagonal=all``: the upper group's ranks split too (their first cross block
    arrives in halves), and the plans still compute every pair once."""
    plan = _plan(direction, g, m, split_diagonal_value="all", **kw)
    validate(plan)
    assert _split_ranks(plan) == list(range(g * m))
    lower = _plan(direction, g, m, **kw)
    assert set(_split_ranks(lower)) < set(_split_ranks(plan))


def test_on_is_a_no_op_without_a_mask_or_a_second_group() -> None:
    for causal, groups in ((False, _groups(2, 2)), (True, _groups(1, 4))):
        on = registry.build_plan("charm", "backward", groups, causal, shape=SHAPE,
                                 split_diagonal="on")
        off = registry.build_plan("charm", "backward", groups, causal, shape=SHAPE)
        assert on.ops == off.ops


def _edit(plan, rank: int, edit):
    ops = [list(o) for o in plan.ops]
    ops[rank] = edit(ops[rank])
    return dataclasses.replace(plan, ops=ops)


@pytest.mark.parametrize("direction", ["forward", "backward"])
def test_the_validator_rejects_a_missing_or_a_repeated_sub_tile(direction) -> None:
    plan = _plan(direction)
    rank = _split_ranks(plan)[0]
    for spec in diagonal_sub_tiles(tile_spec(rank, rank, True)):
        i = next(i for i, op in enumerate(plan.ops[rank])
                 if type(op) in (Tile, TileBwd) and op.spec == spec)
        with pytest.raises(PlanError, match="missing|computed"):
            validate(_edit(plan, rank, lambda ops, i=i: ops[:i] + ops[i + 1:]))
        with pytest.raises(PlanError, match="twice|computed"):
            validate(_edit(plan, rank, lambda ops, i=i: ops[:i + 1] + [ops[i]] + ops[i + 1:]))
    # The whole diagonal tile next to its sub-tiles: two partitions of one tile.
    whole = dataclasses.replace(next(op for op in _tiles(plan.ops[rank])
                                     if op.spec.q_owner == op.spec.kv_owner),
                                spec=tile_spec(rank, rank, True))
    with pytest.raises(PlanError):
        validate(_edit(plan, rank, lambda ops: [*ops, whole]))


# ------------------------------------------------------------------- settings, model
def test_the_setting_parses_and_auto_times_both_plans() -> None:
    with pytest.raises(ValueError, match=r"split_diagonal='halves'.*auto, off, on, all"):
        registry.variants("charm", _groups(2, 2), True, split_diagonal="halves")
    fwd, bwd = registry.variants("charm", _groups(2, 2), True, split_diagonal="on")
    assert fwd.split_diagonal and bwd.split_diagonal
    assert not fwd.split_diagonal_all and not bwd.split_diagonal_all
    fwd, bwd = registry.variants("charm", _groups(2, 2), True, split_diagonal="all")
    assert fwd.split_diagonal_all and bwd.split_diagonal_all
    # The default, auto, is off where nothing times the plans.
    assert not any(registry.variants("charm", _groups(2, 2), True)[i].split_diagonal
                   for i in (0, 1))


class _Timer:
    """A plan timer that prices a split plan as ``factor`` x the other (the auto rule's
    input, independent of the cluster model's numbers)."""

    def __init__(self, factor: float) -> None:
        self.factor = factor

    def seconds(self, plan) -> float:
        return self.factor if _split_ranks(plan) else 1.0


@pytest.mark.parametrize("factor,picked", [(0.9, True), (0.97, False), (1.1, False)])
def test_auto_picks_the_split_only_beyond_the_margin(factor, picked) -> None:
    """``auto`` keeps the split plan where the timer says it wins by more than
    SPLIT_MARGIN (the rule of every split), per direction."""
    values = registry.settings_values(split_diagonal="auto", split_visiting="off",
                                      split_counterpart_q="off")
    ctx = entry.VariantContext(tuple(map(tuple, _groups(2, 2))), True, SHAPE, _Timer(factor))
    fwd, bwd = entry.charm_variants(values.only(s.name for s in entry.SETTINGS_WITH_HEADS),
                                    ctx)
    assert (fwd.split_diagonal, bwd.split_diagonal) == (picked, picked)
    plan = entry._plan(Direction.BACKWARD, ctx, bwd)
    assert bool(_split_ranks(plan)) == picked


class _EveryTimer:
    """Prices a plan by how many ranks split their diagonal: ``each`` less per rank."""

    def __init__(self, each: float) -> None:
        self.each = each

    def seconds(self, plan) -> float:
        return 1.0 - self.each * len(_split_ranks(plan))


@pytest.mark.parametrize("each,picked", [(0.1, (True, True)), (0.01, (False, False)),
                                         (-0.01, (False, False))])
def test_auto_picks_the_faster_of_the_two_splits(each, picked) -> None:
    """``auto`` times both splits (the lower group's ranks, every rank) and keeps the faster
    where it beats the whole tile by more than SPLIT_MARGIN: with 4 ranks, every rank at
    0.1 each (0.6) beats the lower group (0.8) and whole (1.0); at 0.01 each neither passes
    the margin; at a cost, neither."""
    values = registry.settings_values(split_diagonal="auto", split_visiting="off",
                                      split_counterpart_q="off")
    ctx = entry.VariantContext(tuple(map(tuple, _groups(2, 2))), True, SHAPE,
                               _EveryTimer(each))
    fwd, bwd = entry.charm_variants(values.only(s.name for s in entry.SETTINGS_WITH_HEADS),
                                    ctx)
    assert (fwd.split_diagonal_all, bwd.split_diagonal_all) == picked
    assert (fwd.split_diagonal, bwd.split_diagonal) == picked


# ------------------------------------------------------------------- real ranks
_ON = (("split_diagonal", "on"),)
_ALL = (("split_diagonal", "all"),)


def test_split_diagonal_matches_float64_on_gloo_ranks() -> None:
    """2x2, GQA under the byte rule (pass-kv), with visiting quarters and a head-parallel
    degree of 2, MHA with the paper's roles (pass-q); the lower group's ranks split (on) or
    every rank (all); out, lse, dq, dk, dv against float64."""
    cases = [("charm", "2x2", True, "fp32", 2, _ON),
             ("charm", "2x2", True, "fp32", 2, (*_ON, ("split_visiting", "quarters"))),
             ("charm", "2x2", True, "fp32", 2, (*_ON, ("head_parallel", 2))),
             ("charm", "2x2", True, "fp32", 8, (*_ON, ("roles", "paper"))),
             # every rank splits (split_diagonal=all): pass-kv, pass-q, head-parallel
             ("charm", "2x2", True, "fp32", 2, _ALL),
             ("charm", "2x2", True, "fp32", 8, (*_ALL, ("roles", "paper"))),
             ("charm", "2x2", True, "fp32", 2, (*_ALL, ("head_parallel", 2)))]
    per_rank = run_ranks(dist_cases.run_matrix, 4, cases, 6, 16, 8, timeout_s=300)
    bad = dist_cases.over_tolerance(per_rank, lambda case, name: TOL[case[3]])
    assert not bad, bad


def test_packed_split_diagonal_matches_float64_on_gloo_ranks() -> None:
    """THD with documents of unequal lengths: each sub-tile is cut by document (its causal
    squares inside each document's chunk, the block between them its two chunks)."""
    cases = [("charm", "2x2", True, "fp32", 2, docs, "bytes", 8) for docs in ("unequal",)]
    per_rank = run_ranks(packed_cases.run_packed_matrix, 4, cases, [], timeout_s=300,
                         env={"CHARM_SPLIT_DIAGONAL": "on"})
    bad = [f"{c} rank {r}: {errs}" for r, res in enumerate(per_rank)
           for c, (errs, zero) in res.items() if not zero or max(errs.values()) >= TOL["fp32"]]
    assert not bad, bad


def test_windowed_split_diagonal_matches_float64_on_gloo_ranks() -> None:
    """Sliding windows: each sub-tile masked by its own rows' positions. 8 rows per rank
    (chunks of 4): left 20 keeps part of rank 1's block between its chunks (1 and 6) and none
    of rank 0's (chunks 0 and 7), 26 part of both, 3 none (an empty sub-tile)."""
    cases = [("charm", "2x2", True, "fp64", 2, left, 0) for left in (20, 26, 3)]
    per_rank = run_ranks(window_cases.run_sbhd, 4, cases, timeout_s=300,
                         env={"CHARM_SPLIT_DIAGONAL": "on"})
    bad = dist_cases.over_tolerance(per_rank, lambda case, name: window_cases.TOL[case[3]])
    assert not bad, bad
