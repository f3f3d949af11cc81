"""a2a (Ulysses) and a2a+p2p (hierarchical CP): the head all-to-all, its lifted plans, their
checks, their model, and real gloo ranks against the float64 full-sequence reference."""

import pytest

import dist_cases
from charm_megatron.local_ranks import run_ranks
from charm_megatron.model import auto_cluster, choose_algo, predict
from charm_megatron.plan import registry
from charm_megatron.plan.core import Plan, Tile, TileSpec
from charm_megatron.plan.cost import Problem, traffic
from charm_megatron.plan.head_stage import HeadStage, stage_plans
from charm_megatron.plan.registry import CallTraits, check_call
from charm_megatron.plan.validate import PlanError, validate
from charm_megatron.plan.vocab import Direction, Kind

TOL = {"fp32": 1e-5, "bf16": 2e-2}


def _groups(g: int, m: int) -> tuple[tuple[int, ...], ...]:
    return tuple(tuple(range(i * m, (i + 1) * m)) for i in range(g))


# ------------------------------------------------------------------------------ plans
@pytest.mark.parametrize("g,m", [(1, 1), (1, 2), (2, 1), (1, 4), (2, 2), (4, 1), (2, 3), (3, 2),
                                 (2, 4), (4, 2), (2, 8), (4, 4)])
@pytest.mark.parametrize("causal", [True, False])
def test_lifted_plans_validate(g: int, m: int, causal: bool) -> None:
    groups = _groups(g, m)
    n = g * m
    for algo, a in (("a2a", n), ("a2a+p2p", m)):
        fwd, bwd = registry.plans(algo, groups, causal)
        for plan in (fwd, bwd):
            assert plan.head_group == a
            validate(plan)
            # Every tile pairs ranks of one lane.
            for ops in plan.ops:
                for op in ops:
                    if hasattr(op, "spec"):
                        assert op.spec.q_owner % a == op.spec.kv_owner % a


def test_validator_rejects_tiles_across_lanes() -> None:
    """A plan that claims a head all-to-all but pairs ranks of two lanes is refused."""
    fwd, _ = registry.plans("ring", (tuple(range(4)),), True)
    lifted = Plan(fwd.algo, fwd.direction, fwd.n, fwd.groups, fwd.causal, fwd.ops,
                  head_group=2)
    with pytest.raises(PlanError, match="needs none of its pairs"):
        validate(lifted)
    # And a lifted plan with one tile's halves changed is refused too.
    a2a, _ = registry.plans("a2a+p2p", _groups(2, 2), True)
    ops = [list(o) for o in a2a.ops]
    i = next(i for i, op in enumerate(ops[2]) if isinstance(op, Tile)
             and op.spec.q_owner != op.spec.kv_owner)
    s = ops[2][i].spec
    ops[2][i] = Tile(TileSpec(s.q_owner, s.kv_owner, s.q_half, s.q_half, s.causal),
                     ops[2][i].q_loc, ops[2][i].kv_loc, ops[2][i].acc)
    bad = Plan(a2a.algo, a2a.direction, a2a.n, a2a.groups, a2a.causal, ops, head_group=2)
    with pytest.raises(PlanError):
        validate(bad)


@pytest.mark.parametrize("causal", [True, False])
@pytest.mark.parametrize("a,rows", [(1, 4), (2, 4), (3, 6), (4, 8)])
def test_super_block_rows_are_a_partition_in_sequence_order(causal: bool, a: int,
                                                            rows: int) -> None:
    """Member ``j``'s rows land where the load-balanced layout of ``n/a`` ranks puts them:
    every super row exactly once, and global positions in order within each half."""
    n = 2 * a
    stage = HeadStage(n, a, causal)
    for g in range(n // a):
        seen: dict[int, int] = {}
        for j, rank in enumerate(stage.members(g * a)):
            for local, sup in stage.pieces(j, rows):
                for lr, sr in zip(range(*local.indices(rows)), range(*sup.indices(a * rows))):
                    seen[sr] = _position(rank, lr, n, rows, causal)
        assert sorted(seen) == list(range(a * rows))
        # The super-block's rows are those of super rank g in the n/a-rank layout.
        want = [_position(g, r, n // a, a * rows, causal) for r in range(a * rows)]
        assert [seen[r] for r in range(a * rows)] == want


def _position(rank: int, row: int, n: int, rows: int, causal: bool) -> int:
    if not causal:
        return rank * rows + row
    c = rows // 2
    return rank * c + row if row < c else (2 * n - 1 - rank) * c + row - c


def test_stage_bytes_are_the_all_to_all() -> None:
    """Per rank, each all-to-all sends (a-1)/a of the moved blocks' bytes; the plan in between
    moves a ring's bytes over n/a super-blocks."""
    p = Problem(2, 4096, 16, 4, 64)
    n, a = 8, 4
    groups = _groups(2, 4)
    into, back = stage_plans(n, a, Direction.FORWARD, True)
    sent = traffic(into, p, groups)
    per_rank = (p.block_bytes(Kind.Q, n) + p.block_bytes(Kind.KV, n)) * (a - 1) / a
    assert sent.intra == [pytest.approx(per_rank)] * n and sent.cross == [0.0] * n
    bdin, bdout = stage_plans(n, a, Direction.BACKWARD, True)
    back_bytes = (p.block_bytes(Kind.DQ, n) + p.block_bytes(Kind.DKV, n)) * (a - 1) / a
    assert traffic(bdout, p, groups).intra == [pytest.approx(back_bytes)] * n
    # a2a+p2p on 2x4: the ring across the two groups sends one super kv block per rank.
    fwd, _ = registry.plans("a2a+p2p", groups, True)
    t = traffic(fwd, p, groups)
    kv = p.block_bytes(Kind.KV, n)  # a super-block holds as many bytes as a block
    assert t.cross == [pytest.approx(kv)] * n
    out = p.block_bytes(Kind.OUT, n) * (a - 1) / a
    assert t.intra == [pytest.approx(per_rank + out)] * n


def test_checks_name_the_heads_the_groups_and_the_alternatives() -> None:
    flat8 = (tuple(range(8)),)
    with pytest.raises(ValueError, match="kv heads 4 does not divide by 8.*a2a\\+p2p, ring"):
        check_call("a2a", CallTraits(flat8, 16, 4))
    with pytest.raises(ValueError, match="q heads 6 and kv heads 6 do not divide by 4"):
        check_call("a2a+p2p", CallTraits(_groups(2, 4), 6, 6))
    with pytest.raises(ValueError, match="consecutive groups of equal size"):
        check_call("a2a+p2p", CallTraits(((0, 2), (1, 3)), 8, 8))
    check_call("a2a", CallTraits(flat8, 8, 8, windowed=True))  # windows: the lanes' tiles
    check_call("a2a", CallTraits(flat8, 8, 8, packed=True))  # THD: the lanes' documents
    check_call("a2a", CallTraits(flat8, 8, 8, offset=True))  # sinks: on each lane's heads
    check_call("a2a+p2p", CallTraits(_groups(2, 4), 12, 4))  # 12 and 4 divide by 4
    check_call("a2a", CallTraits(flat8, None, None))  # shape-free: groups only


def test_model_never_picks_an_algorithm_that_refuses_the_problem() -> None:
    cl = auto_cluster("h100")
    g = _groups(2, 8)
    mha = Problem(1, 131072, 32, 32, 128)
    # the model's pick here: a head all-to-all, TE's or inside CHARM+ (head_parallel)
    assert choose_algo(g, mha, cl) in ("a2a", "a2a+p2p", "charm")
    assert choose_algo(g, mha, cl, head_parallel=1) in ("a2a", "a2a+p2p")
    odd = Problem(1, 131072, 20, 20, 128)  # 20 heads: not a multiple of 16 or 8
    assert choose_algo(g, odd, cl) not in ("a2a", "a2a+p2p")
    with pytest.raises(ValueError, match="does not divide|do not divide"):
        predict("a2a", g, odd, cl, True)
    # The all-to-alls add to the lifted plan's time (nothing overlaps them).
    pred = predict("a2a", g, mha, cl, True)
    inner = pred.forward
    assert inner.time_s > 0 and inner.ranks[0].finish_s == pytest.approx(inner.time_s, rel=0.2)


# -------------------------------------------------------------------- real ranks, float64
def _assert_within(cases, per_rank) -> None:
    failures = []
    for case in cases:
        for rank, res in enumerate(per_rank):
            for name, err in res[case].items():
                if not err < TOL[case[3]]:
                    failures.append(f"{case} rank {rank}: {name} rel err {err:.3g}")
    assert not failures, "\n".join(failures)


# world -> (algo, topology, q heads, kv-head counts to try); ring first (the vs-ring column)
SETUPS = {
    4: (8, [("ring", None, (8, 2)), ("a2a", None, (8, 4)), ("a2a+p2p", "2x2", (8, 4, 2)),
            ("a2a+p2p", "1x4", (4,)), ("a2a+p2p", "4x1", (1,))]),
    6: (12, [("ring", None, (6,)), ("a2a", None, (12, 6)), ("a2a+p2p", "3x2", (6, 2)),
             ("a2a+p2p", "2x3", (3,))]),
    8: (8, [("ring", None, (8,)), ("a2a", None, (8,)), ("a2a+p2p", "2x4", (4,)),
            ("a2a+p2p", "4x2", (2,))]),
}


@pytest.mark.parametrize("world", sorted(SETUPS))
def test_against_float64_reference(world: int) -> None:
    heads, setups = SETUPS[world]
    cases = [(algo, topo, causal, dtype, hkv)
             for algo, topo, hkvs in setups for causal in (True, False)
             for dtype in ("fp32", "bf16") for hkv in hkvs
             if dtype == "fp32" or hkv == hkvs[0]]
    _assert_within(cases, run_ranks(dist_cases.run_matrix, world, cases, 8, 16, heads,
                                    timeout_s=600))
