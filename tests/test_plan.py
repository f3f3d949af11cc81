"""Plans: pairing properties, the validator on every algorithm/topology, and broken plans."""

import dataclasses

import pytest
from hypothesis import given
from hypothesis import strategies as st

from charm_megatron.plan.core import Comm, Half, Stream, Tile, TileBwd, tile_spec
from charm_megatron.plan.pairing import group_rounds, rmplus_rounds
from charm_megatron.plan.registry import build_plan
from charm_megatron.plan.validate import PlanError, validate
from charm_megatron.plan.vocab import Role


def _groups(G, M):
    return [list(range(g * M, (g + 1) * M)) for g in range(G)]


def test_algorithm1_example_m4():
    # ALGORITHM.md §3: m = 4, level 2: 0 kv<->2, 0 q<->3, 1 q<->2, 1 kv<->3.
    rounds = rmplus_rounds(4)
    roles = {}
    for rd in rounds:
        for a, b in rd.partner.items():
            roles[(a, b)] = rd.role
    assert roles[(0, 1)] is Role.KV
    assert roles[(0, 2)] is Role.KV and roles[(0, 3)] is Role.Q
    assert roles[(1, 2)] is Role.Q and roles[(1, 3)] is Role.KV


@given(st.integers(min_value=1, max_value=64))
def test_rounds_meet_every_pair_once_and_split_roles(m):
    rounds = rmplus_rounds(m)
    seen = {}
    per_rank = {x: {Role.KV: 0, Role.Q: 0} for x in range(m)}
    for rd in rounds:
        for a, b in rd.partner.items():
            assert rd.partner[b] == a  # a matching
            if a < b:
                assert (a, b) not in seen
                seen[(a, b)] = rd.role
            per_rank[a][rd.role] += 1
    assert len(seen) == m * (m - 1) // 2
    assert len(rounds) <= m  # m - 1 rounds (m odd: m rounds with one idle rank each)
    if m >= 4:  # (m = 3: the rank that idles in the only q round has kv pairs only)
        for counts in per_rank.values():
            # Both streams carry work; the split is as even as the round structure allows.
            assert counts[Role.Q] >= 1 and counts[Role.KV] >= counts[Role.Q]
            assert counts[Role.KV] - counts[Role.Q] <= max(2, (m - 1) // 2)


def test_group_rounds_cover_all_group_pairs():
    for G in range(1, 9):
        pairs = {(min(a, b), max(a, b)) for rd in group_rounds(G) for a, b in rd.items()}
        assert len(pairs) == G * (G - 1) // 2


def _divisor_groupings(n):
    return [(G, n // G) for G in range(1, n + 1) if n % G == 0]


@given(st.integers(min_value=1, max_value=64).flatmap(
    lambda n: st.tuples(st.just(n), st.sampled_from(_divisor_groupings(n)))),
    st.booleans(), st.sampled_from(["forward", "backward"]))
def test_every_plan_validates(n_and_grouping, causal, direction):
    n, (G, M) = n_and_grouping
    for algo in ("ring", "rmplus", "charm"):
        if algo == "ring" and n > 32:
            continue  # ring plans are simple; large n only slows the property test
        stats = validate(build_plan(algo, direction, _groups(G, M), causal))
        assert sum(stats.tiles) == n * n
        assert all(t == n for t in stats.tiles)  # compute stays balanced


def test_strided_groups_validate():
    groups = [[0, 2, 4, 6], [1, 3, 5, 7]]
    for d in ("forward", "backward"):
        for causal in (True, False):
            validate(build_plan("charm", d, groups, causal))


def test_critical_path_and_cross_traffic_beat_ring_on_2x8():
    g = _groups(2, 8)
    ring = validate(build_plan("ring", "forward", g, True))
    charm = validate(build_plan("charm", "forward", g, True))
    assert ring.critical_path == 15
    assert charm.critical_path < ring.critical_path


def _mutate(plan, rank, fn):
    plan.ops[rank] = fn(list(plan.ops[rank]))
    return plan


def test_validator_rejects_missing_tile():
    plan = build_plan("charm", "forward", _groups(2, 2), True)
    idx = next(i for i, op in enumerate(plan.ops[1]) if isinstance(op, Tile))
    _mutate(plan, 1, lambda ops: ops[:idx] + ops[idx + 1:])
    with pytest.raises(PlanError, match="missing tiles"):
        validate(plan)


def test_validator_rejects_duplicated_tile():
    plan = build_plan("rmplus", "backward", _groups(1, 4), True)
    idx = next(i for i, op in enumerate(plan.ops[2]) if isinstance(op, TileBwd))
    _mutate(plan, 2, lambda ops: ops[:idx + 1] + [ops[idx]] + ops[idx + 1:])
    with pytest.raises(PlanError, match="twice"):
        validate(plan)


def test_validator_rejects_wrong_causal_half():
    plan = build_plan("ring", "forward", _groups(1, 4), True)
    idx = next(i for i, op in enumerate(plan.ops[3]) if isinstance(op, Tile)
               and op.spec.kv_owner != 3)
    op = plan.ops[3][idx]
    bad = dataclasses.replace(op, spec=dataclasses.replace(op.spec, kv_half=Half.FULL))
    _mutate(plan, 3, lambda ops: ops[:idx] + [bad] + ops[idx + 1:])
    with pytest.raises(PlanError, match="should be"):
        validate(plan)


def test_validator_rejects_mismatched_send_order():
    plan = build_plan("charm", "forward", _groups(2, 2), True)
    # Swap two consecutive batches on one stream of rank 0: its peers now wait in another order.
    ops = plan.ops[0]
    comms = [i for i, op in enumerate(ops) if isinstance(op, Comm) and op.stream is Stream.CROSS]
    assert len(comms) >= 2
    i, j = comms[0], comms[1]

    def swap(ops):
        a, b = ops[i], ops[j]
        ops[i] = dataclasses.replace(b, handle=a.handle)
        ops[j] = dataclasses.replace(a, handle=b.handle)
        return ops
    _mutate(plan, 0, swap)
    with pytest.raises(PlanError):
        validate(plan)


def test_validator_rejects_mismatched_message():
    plan = build_plan("rmplus", "forward", _groups(1, 2), True)
    idx = next(i for i, op in enumerate(plan.ops[0]) if isinstance(op, Comm))
    op = plan.ops[0][idx]
    x = op.sends[0]
    bad = dataclasses.replace(op, sends=(dataclasses.replace(x, half=Half.SECOND),))
    _mutate(plan, 0, lambda ops: ops[:idx] + [bad] + ops[idx + 1:])
    with pytest.raises(PlanError):
        validate(plan)


def test_tile_spec_causal_halves():
    assert tile_spec(2, 2, True).causal
    assert (tile_spec(3, 1, True).q_half, tile_spec(3, 1, True).kv_half) == (Half.FULL, Half.FIRST)
    assert (tile_spec(1, 3, True).q_half, tile_spec(1, 3, True).kv_half) == (Half.SECOND, Half.FULL)
    assert not tile_spec(1, 3, False).causal
