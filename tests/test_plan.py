"""Plans: pairing properties, the validator on every algorithm/topology, and broken plans."""

import dataclasses

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from charm_megatron.plan.core import Comm, Half, Stream, Tile, TileBwd, tile_spec
from charm_megatron.plan.pairing import group_rounds, rmplus_rounds
from charm_megatron.plan.registry import build_plan
from charm_megatron.plan.validate import PlanError, validate
from charm_megatron.plan.vocab import Role


def _groups(G, M):
    return [list(range(g * M, (g + 1) * M)) for g in range(G)]


def test_algorithm1_example_m4():
    # docs/algorithm.md, RM+: m = 4, level 2: 0 kv<->2, 0 q<->3, 1 q<->2, 1 kv<->3.
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


# 24 derandomized examples (the suite's profile has 60): the validator of plans up to 64
# ranks is the suite's slowest test, and the time budget of a CI stop is shared.
@settings(max_examples=24)
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


def _split_plan(direction="forward"):
    """2x4 causal pass-kv with split visiting kv: ranks 0-3 compute kv-half sub-tiles."""
    return build_plan("charm", direction, _groups(2, 4), True, roles="kv", split_visiting=True)


def _sub_tiles(ops):
    return [i for i, op in enumerate(ops) if isinstance(op, (Tile, TileBwd))
            and op.spec.q_half is Half.SECOND and op.spec.kv_half is not Half.FULL]


@pytest.mark.parametrize("direction", ["forward", "backward"])
def test_split_visiting_validates_and_splits_only_the_full_visiting_blocks(direction):
    plan = _split_plan(direction)
    stats = validate(plan)
    assert stats.tiles == [8] * 8  # work per rank, a sub-tile counting one half
    for r in range(8):
        subs = _sub_tiles(plan.ops[r])
        # the earlier group: 4 visiting tiles (q 2nd x kv all), each as 1st then 2nd half
        assert len(subs) == (8 if r < 4 else 0), r
        cross = [op for op in plan.comms(r) if op.stream is Stream.CROSS]
        kv_in = [x.half for op in cross for x in op.recvs if x.kind == "kv"]
        kv_out = [x.half for op in cross for x in op.sends if x.kind == "kv"]
        # earlier ranks receive the later kv in halves, send only their first half;
        # the later ranks receive the first half as before and send theirs in halves
        assert kv_in == ([Half.FIRST, Half.SECOND] if r < 4 else [Half.FIRST]), r
        assert kv_out == ([Half.FIRST] if r < 4 else [Half.FIRST, Half.SECOND]), r
        if direction == "backward":  # the visitors' dK, dV go home per half, in order
            dkv_out = [x.half for op in cross for x in op.sends if x.kind == "dkv"]
            dkv_in = [x.half for op in cross for x in op.recvs if x.kind == "dkv"]
            assert dkv_out == ([Half.FIRST, Half.SECOND] if r < 4 else [Half.FIRST]), r
            assert dkv_in == ([Half.FIRST] if r < 4 else [Half.FIRST, Half.SECOND]), r
    plain = build_plan("charm", direction, _groups(2, 4), True, roles="kv")
    assert not any(_sub_tiles(ops) for ops in plain.ops)  # the default sends whole blocks


def test_split_visiting_full_mask_splits_both_groups():
    plan = build_plan("charm", "forward", _groups(2, 2), False, roles="kv", split_visiting=True)
    validate(plan)
    for r in range(4):
        assert sum(1 for op in plan.ops[r] if isinstance(op, Tile)
                   and op.spec.kv_half is not Half.FULL) == 4  # 2 visiting tiles, 2 halves


def test_validator_rejects_a_lone_sub_tile():
    plan = _split_plan()
    idx = _sub_tiles(plan.ops[0])[-1]
    _mutate(plan, 0, lambda ops: ops[:idx] + ops[idx + 1:])
    with pytest.raises(PlanError, match="computed 1 times"):
        validate(plan)


# side -> (the role mix whose plan computes that side's tiles with rank 4 whole on rank 0, the
# spec field naming rank 4's block, the spec field holding that side's rows)
_SIDES = {"kv": ("kv", "kv_owner", "kv_half"), "q": ("q", "q_owner", "q_half")}


@pytest.mark.parametrize("side", sorted(_SIDES))
def test_validator_rejects_a_sub_tile_on_top_of_its_whole_tile(side):
    roles, owner, half = _SIDES[side]
    plan = build_plan("charm", "forward", _groups(2, 4), True, roles=roles)  # whole blocks
    idx = next(i for i, op in enumerate(plan.ops[0]) if isinstance(op, Tile)
               and getattr(op.spec, owner) == 4)
    op = plan.ops[0][idx]
    sub = dataclasses.replace(op, spec=dataclasses.replace(op.spec, **{half: Half.FIRST}))
    _mutate(plan, 0, lambda ops: ops[:idx + 1] + [sub] + ops[idx + 1:])
    with pytest.raises(PlanError, match="twice"):
        validate(plan)


# The diagonal tile (causal) and a tile already a half on that side have no halves there:
# (rank whose ring plan is searched, the other half-tile's half on that side, the bad half).
_NO_HALVES = {"kv": (3, Half.FIRST, Half.SECOND), "q": (0, Half.SECOND, Half.FIRST)}


@pytest.mark.parametrize("side", sorted(_SIDES))
def test_validator_rejects_sub_tiles_of_a_masked_or_half_tile(side):
    _, _, half = _SIDES[side]
    r, already, bad_half = _NO_HALVES[side]
    for pick in (lambda op: op.spec.causal, lambda op: getattr(op.spec, half) is already):
        p = build_plan("ring", "forward", _groups(1, 4), True)
        idx = next(i for i, op in enumerate(p.ops[r]) if isinstance(op, Tile) and pick(op))
        op = p.ops[r][idx]
        bad = dataclasses.replace(op, spec=dataclasses.replace(op.spec, **{half: bad_half}))
        p.ops[r] = p.ops[r][:idx] + [bad] + p.ops[r][idx + 1:]
        with pytest.raises(PlanError, match="should be"):
            validate(p)


def _q_split_plan(direction="forward", causal=True, g=(2, 4)):
    """2x4 pass-q (forced) with split counterpart q: ranks 0-3 compute q-half sub-tiles."""
    return build_plan("charm", direction, _groups(*g), causal, roles="q",
                      split_counterpart_q=True)


def _q_sub_tiles(ops, causal=True):
    return [i for i, op in enumerate(ops) if isinstance(op, (Tile, TileBwd))
            and op.spec.q_half is not Half.FULL
            and tile_spec(op.spec.q_owner, op.spec.kv_owner, causal).q_half is Half.FULL]


@pytest.mark.parametrize("direction", ["forward", "backward"])
def test_split_counterpart_q_validates_and_splits_only_the_full_counterpart_blocks(direction):
    plan = _q_split_plan(direction)
    stats = validate(plan)
    assert stats.tiles == [8] * 8  # work per rank, a sub-tile counting one half
    partial = "dq" if direction == "backward" else "out"
    query = "qgrad" if direction == "backward" else "q"
    for r in range(8):
        subs = _q_sub_tiles(plan.ops[r])
        # the earlier group: 4 counterpart tiles (q all x kv 1st), each as q 1st then 2nd
        assert len(subs) == (8 if r < 4 else 0), r
        halves = [plan.ops[r][i].spec.q_half for i in subs]
        assert halves == ([Half.FIRST] * 4 + [Half.SECOND] * 4 if r < 4 else []), r
        cross = [op for op in plan.comms(r) if op.stream is Stream.CROSS]
        q_in = [x.half for op in cross for x in op.recvs if x.kind == query]
        q_out = [x.half for op in cross for x in op.sends if x.kind == query]
        # earlier ranks receive the later q in halves and send their 2nd half as before;
        # the later ranks receive the 2nd half as before and send theirs in halves
        assert q_in == ([Half.FIRST, Half.SECOND] if r < 4 else [Half.SECOND]), r
        assert q_out == ([Half.SECOND] if r < 4 else [Half.FIRST, Half.SECOND]), r
        # the partials go home per half, in order
        p_out = [x.half for op in cross for x in op.sends if x.kind == partial]
        p_in = [x.half for op in cross for x in op.recvs if x.kind == partial]
        assert p_out == ([Half.FIRST, Half.SECOND] if r < 4 else [Half.SECOND]), r
        assert p_in == ([Half.SECOND] if r < 4 else [Half.FIRST, Half.SECOND]), r
        if r < 4:  # the first half's partial is posted before the second sub-pass's tiles
            ops = plan.ops[r]
            first_home = next(i for i, op in enumerate(ops) if isinstance(op, Comm)
                              and any(x.kind == partial and x.half is Half.FIRST
                                      for x in op.sends))
            assert first_home < subs[4], r
        assert not any(x.kind == "dkv" for op in cross for x in op.sends)  # dK, dV stay
    plain = build_plan("charm", direction, _groups(2, 4), True, roles="q")
    assert not any(_q_sub_tiles(ops) for ops in plain.ops)  # the default sends whole blocks


@pytest.mark.parametrize("direction", ["forward", "backward"])
@pytest.mark.parametrize("g,causal", [((2, 4), True), ((2, 2), False), ((3, 2), True)])
def test_split_counterpart_q_home_sends_every_partial_on_the_home_streams(direction, g,
                                                                          causal):
    """``split_counterpart_q="home"``: the same halves, but every pass-q partial (the split
    ones and the whole ones of the later group) goes home on the home streams, none on the
    cross stream, which then carries only q blocks; ours come back on a receive posted
    before the pass that serves the counterpart."""
    plan = build_plan("charm", direction, _groups(*g), causal, roles="q",
                      split_counterpart_q="home")
    validate(plan)
    on = build_plan("charm", direction, _groups(*g), causal, roles="q",
                    split_counterpart_q="on")
    partial = "dq" if direction == "backward" else "out"
    for r in range(plan.n):
        cross = [op for op in plan.comms(r) if op.stream is Stream.CROSS]
        assert not any(x.kind == partial for op in cross for x in (*op.sends, *op.recvs)), r
        home = [op for op in plan.comms(r) if op.stream not in (Stream.CROSS, Stream.KV,
                                                                Stream.Q)]
        sent = [x.half for op in home for x in op.sends if x.kind == partial]
        got = [x.half for op in home for x in op.recvs if x.kind == partial]
        want = [op for op in on.comms(r) if op.stream is Stream.CROSS]
        assert sent == [x.half for op in want for x in op.sends if x.kind == partial], r
        assert sorted(got, key=str) == sorted((x.half for op in want for x in op.recvs
                                               if x.kind == partial), key=str), r
        assert sent, r
        # the same tiles, in the same order, as the halves on the cross stream
        tiles = [[op for op in p.ops[r] if isinstance(op, (Tile, TileBwd))] for p in (plan, on)]
        assert tiles[0] == tiles[1], r


def test_split_counterpart_q_full_mask_splits_both_groups():
    plan = _q_split_plan(causal=False, g=(2, 2))
    validate(plan)
    for r in range(4):
        # 2 counterpart tiles, 2 halves each
        assert len(_q_sub_tiles(plan.ops[r], causal=False)) == 4


def test_split_counterpart_q_leaves_joint_first_pass_whole():
    # the joint order's first pass holds the own q with the counterpart's: no sub-passes
    plan = build_plan("charm", "forward", _groups(2, 2), True, pass_order="joint", roles="q",
                      split_counterpart_q=True)
    validate(plan)
    assert plan.ops == build_plan("charm", "forward", _groups(2, 2), True, pass_order="joint",
                                  roles="q").ops


def test_validator_rejects_a_lone_q_sub_tile():
    plan = _q_split_plan()
    # the last one accumulated here (not a served partial, whose send would fail first)
    idx = [i for i in _q_sub_tiles(plan.ops[0]) if not plan.ops[0][i].fresh][-1]
    _mutate(plan, 0, lambda ops: ops[:idx] + ops[idx + 1:])
    with pytest.raises(PlanError, match="computed 1 times"):
        validate(plan)


def test_sub_tiles_of_two_sides_do_not_make_a_tile():
    # a q-half and a kv-half sub-tile cover 3/4 of the tile's pairs at most, with one
    # quarter twice: neither counts as the tile, and they are rivals
    from charm_megatron.plan.validate import _rivals, check_tiles_once, covered

    want = tile_spec(2, 0, False)
    q1 = dataclasses.replace(want, q_half=Half.FIRST)
    kv2 = dataclasses.replace(want, kv_half=Half.SECOND)
    assert covered({q1, kv2}, False) == {q1, kv2}
    assert kv2 in _rivals(q1, want) and want in _rivals(q1, want)
    plan = build_plan("ring", "forward", _groups(1, 4), False)
    with pytest.raises(PlanError, match="computed 2 times"):
        check_tiles_once(plan, {(2, 0): [q1, kv2]})
    q2 = dataclasses.replace(want, q_half=Half.SECOND)
    check_tiles_once(plan, {(2, 0): [q2, q1]})  # the two q halves, in any order
    assert covered({q1, q2}, False) == {want}


def test_tile_spec_causal_halves():
    assert tile_spec(2, 2, True).causal
    assert (tile_spec(3, 1, True).q_half, tile_spec(3, 1, True).kv_half) == (Half.FULL, Half.FIRST)
    assert (tile_spec(1, 3, True).q_half, tile_spec(1, 3, True).kv_half) == (Half.SECOND, Half.FULL)
    assert not tile_spec(1, 3, False).causal
