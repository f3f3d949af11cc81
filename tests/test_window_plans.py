"""Windowed plans (plan/tile_rule.py, plan/prune.py, the ring's bounded form): which tiles a
window needs, counted exactly; every algorithm's pruned plans proved by the validator on
every topology; the validator's windowed coverage (a tile outside the window, a missing or
a widened tile are rejected); and bytes that follow the window, not the sequence."""

import dataclasses
import itertools
import random

import pytest
import torch

from charm_megatron.kernels.window import Window
from charm_megatron.plan import registry
from charm_megatron.plan.core import Half, Tile, TileSpec, tile_spec
from charm_megatron.plan.cost import Problem, traffic
from charm_megatron.plan.head_stage import HeadStage
from charm_megatron.plan.tile_rule import WindowGeometry, full_rule, window_rule
from charm_megatron.plan.validate import PlanError, validate


def _groups(g, m):
    return tuple(tuple(range(i * m, (i + 1) * m)) for i in range(g))


def test_kept_pairs_are_counted_exactly():
    # Against the executor's own mask (kernels/window.py), pair by pair, odd rows included.
    rng = random.Random(0)
    for _ in range(200):
        n, causal = rng.choice([1, 2, 3, 5]), rng.random() < 0.6
        rows = 2 * rng.choice([1, 2, 3, 5]) + (0 if causal else rng.choice([0, 1]))
        left = rng.choice([-1, 0, 1, 2, 3, 5, 8, 13])
        right = rng.choice([-1, 0, 3]) if causal else rng.choice([-1, 0, 1, 4, 9])
        geo = WindowGeometry(left, right, n, rows, causal)
        mask = Window(left, right, n, rows, causal)
        for i, j in itertools.product(range(n), repeat=2):
            full = tile_spec(i, j, causal)
            for qh, kh in itertools.product(Half, Half):
                if full.q_half.covers(qh) and full.kv_half.covers(kh):
                    spec = TileSpec(i, j, qh, kh, full.causal)
                    want = int(mask.allowed(i, qh, j, kh, "cpu").sum())
                    assert geo.kept_pairs(spec) == want, (geo, spec)


def _flat_positions(r, n, rows, causal):
    """Global positions of rank ``r``'s rows (Megatron's layout), written out."""
    c = rows // 2
    if not causal:
        return list(range(r * rows, (r + 1) * rows))
    return list(range(r * c, (r + 1) * c)) + list(range((2 * n - 1 - r) * c, (2 * n - r) * c))


def test_a_lanes_window_follows_the_head_all_to_alls_row_placement():
    # After the head all-to-all a super-block's rows come from its members (HeadStage.pieces):
    # the lane geometry (WindowGeometry.group) must place them where those rows really are.
    for n, a, causal, rows in ((8, 4, True, 4), (8, 2, True, 6), (6, 3, False, 5),
                               (4, 4, True, 2), (4, 2, False, 3)):
        stage = HeadStage(n, a, causal)
        geo = Window(3, 0 if causal else 2, n, rows * a, causal, group=a)
        for r in range(n):
            placed = [None] * (rows * a)
            for j, member in enumerate(stage.members(r)):
                pos = _flat_positions(member, n, rows, causal)
                for local, sup in stage.pieces(j, rows):
                    placed[sup] = pos[local]
            assert geo.positions(r, Half.FULL).tolist() == placed, (n, a, causal, r)
        # Ranks of two lanes share no pair; the lane rule keeps only same-lane tiles.
        rule = window_rule(geo)
        assert all(w.q_owner % a == w.kv_owner % a for w in rule.pairs())
        assert geo.kept_pairs(TileSpec(0, 1, Half.FULL, Half.FULL, False)) == 0


def test_a_window_keeps_the_tiles_it_reaches_narrowed_to_their_halves():
    # 16 ranks, 4096 rows each (chunks of 2048), a 4096-row causal window: a rank's first
    # chunk reaches two chunks back, its second chunk the same, so 2 ranks each way.
    rule = window_rule(WindowGeometry(4096, 0, 16, 4096, True))
    assert rule.reach() == (2, 2)
    assert rule.want(5, 9) is None  # far apart: nothing
    assert rule.want(5, 4) == TileSpec(5, 4, Half.FIRST, Half.FIRST, False)  # chunk 5 vs 4
    assert rule.want(5, 6) == TileSpec(5, 6, Half.SECOND, Half.SECOND, False)  # 26 vs 25
    assert rule.want(15, 14).q_half is Half.FULL  # the middle: chunk 16 sees chunk 14 too
    assert full_rule(16, True).want(5, 9) == tile_spec(5, 9, True)
    # Rules compare by what they need: another window with the same tiles is the same rule.
    assert window_rule(WindowGeometry(4000, 0, 16, 4096, True)) == rule


WINDOWS = [(True, 3, 0), (True, 9, -1), (True, 40, 0), (True, 0, 0),
           (False, 3, 5), (False, -1, 2), (False, 20, 20)]
TOPOLOGIES = [("ring", (1, 5), {}), ("ring", (1, 8), {}), ("rmplus", (1, 6), {}),
              ("rmplus", (1, 8), {}), ("charm", (2, 2), {}), ("charm", (2, 4), {}),
              ("charm", (4, 2), {}), ("charm", (2, 4), {"roles": "kv", "pass_order": "joint"}),
              ("charm", (2, 4), {"split_visiting": True}),
              ("charm", (2, 4), {"split_visiting": "quarters"}), ("allgather", (1, 6), {}),
              ("a2a", (1, 4), {}), ("a2a", (1, 6), {}), ("a2a+p2p", (2, 4), {}),
              ("a2a+p2p", (4, 2), {}), ("a2a+p2p", (3, 2), {})]


@pytest.mark.parametrize("algo,topo,settings", TOPOLOGIES,
                         ids=[f"{a}-{g}x{m}-{len(s)}" for a, (g, m), s in TOPOLOGIES])
def test_every_algorithm_prunes_to_a_valid_windowed_plan(algo, topo, settings):
    g, m = topo
    n = g * m
    for causal, left, right in WINDOWS:
        rule = window_rule(WindowGeometry(left, right, n, 8, causal))
        fwd, bwd = registry.plans(algo, _groups(g, m), causal, tiles=rule, **settings)
        for plan in (fwd, bwd):
            stats = validate(plan)  # coverage: every needed pair once, none outside
            # After a head all-to-all: the window's rule on the lanes' super-blocks.
            assert plan.tiles is rule.for_lanes(plan.head_group)
            assert sum(stats.tiles) <= len(rule.pairs())


def test_full_attention_plans_are_untouched():
    g = _groups(2, 4)
    for algo in ("ring", "rmplus", "charm", "allgather"):
        assert registry.plans(algo, g, True, tiles=full_rule(8, True)) == \
            registry.plans(algo, g, True)


def _windowed(algo="charm", causal=True, left=3):
    rule = window_rule(WindowGeometry(left, 0, 8, 8, causal))
    return registry.plans(algo, _groups(2, 4), causal, tiles=rule)[0], rule


def _replace_tile(plan, rank, pick, new_spec):
    ops = list(plan.ops[rank])
    i = next(i for i, op in enumerate(ops) if type(op) is Tile and pick(op.spec))
    ops[i] = dataclasses.replace(ops[i], spec=new_spec(ops[i].spec))
    return dataclasses.replace(plan, ops=[ops if r == rank else o
                                          for r, o in enumerate(plan.ops)])


def test_validator_rejects_a_tile_the_window_does_not_reach():
    plan, rule = _windowed()
    far = next(j for j in range(8) if rule.want(0, j) is None)
    bad = _replace_tile(plan, 0, lambda s: s.kv_owner == 0,
                        lambda s: tile_spec(0, far, True))
    with pytest.raises(PlanError, match="needs none of its pairs"):
        validate(bad)


def test_validator_rejects_a_tile_wider_than_the_window_needs():
    plan, rule = _windowed()
    narrow = next(w for w in rule.pairs() if w.q_owner == 3 and w.kv_owner == 2)
    assert narrow.q_half is Half.FIRST  # chunk 3 sees chunk 2; chunk 12 does not
    bad = _replace_tile(plan, 3, lambda s: s.kv_owner == 2,
                        lambda s: dataclasses.replace(s, q_half=Half.FULL))
    with pytest.raises(PlanError):
        validate(bad)


def test_validator_rejects_a_windowed_plan_that_misses_a_needed_tile():
    plan, rule = _windowed()
    ops = [op for op in plan.ops[3] if not (type(op) is Tile and op.spec.kv_owner == 2)]
    bad = dataclasses.replace(plan, ops=[ops if r == 3 else o for r, o in enumerate(plan.ops)])
    with pytest.raises(PlanError, match="missing tiles"):
        validate(bad)
    # ... and the full attention's plan is not a windowed one.
    full = registry.plans("charm", _groups(2, 4), True)[0]
    with pytest.raises(PlanError):
        validate(dataclasses.replace(full, tiles=rule))


def _bytes(algo, seq, window, direction=0):
    n = 16
    rule = None if window is None else window_rule(
        WindowGeometry(window, 0, n, seq // n, True))
    plan = registry.plans(algo, _groups(2, 8), True, tiles=rule)[direction]
    t = traffic(plan, Problem(1, seq, 32, 8, 128), _groups(2, 8))
    return max(i + c for i, c in zip(t.intra, t.cross))


@pytest.mark.parametrize("algo", ["ring", "rmplus", "charm"])
def test_a_windows_bytes_follow_the_window_not_the_sequence(algo):
    # Window 4k on 16 ranks: doubling the sequence doubles full attention's bytes per rank
    # and leaves the window's (fewer, larger blocks) about where they were.
    for direction in (0, 1):
        w64, w128 = _bytes(algo, 65536, 4096, direction), _bytes(algo, 131072, 4096, direction)
        f64, f128 = _bytes(algo, 65536, None, direction), _bytes(algo, 131072, None, direction)
        assert f128 == pytest.approx(2 * f64)
        assert w128 <= 1.05 * w64
        assert w64 <= 0.5 * f64
    # The ring's window is two neighbour walks of two steps: 4 half blocks of kv a rank.
    assert _bytes("ring", 65536, 4096) == pytest.approx(
        4 * Problem(1, 65536, 32, 8, 128).block_bytes("kv", 16) / 2)


def test_allgather_keeps_gathering_everything_under_a_window():
    # TE's all-gather moves all of k and v whatever the window; only its tiles are pruned.
    assert _bytes("allgather", 65536, 4096) == _bytes("allgather", 65536, None)


def test_a_tile_the_window_keeps_whole_runs_unmasked():
    w = Window(100, 0, 4, 8, True)
    assert not w.needs_mask(tile_spec(2, 1, True))  # all within 100 positions
    assert Window(5, 0, 4, 8, True).needs_mask(tile_spec(2, 1, True))
    assert w.fraction(tile_spec(2, 2, True)) == 1.0
    frac = Window(5, 0, 4, 8, True).fraction(tile_spec(2, 1, True))
    allowed = Window(5, 0, 4, 8, True).allowed(2, Half.FULL, 1, Half.FIRST, "cpu")
    assert frac == pytest.approx(float(allowed.to(torch.float64).mean()))


def test_the_model_times_a_window_and_auto_picks_from_it():
    from charm_megatron.model import auto_cluster, choose_algo, predict

    cluster = auto_cluster("h100")
    groups = _groups(2, 8)
    full = Problem(1, 65536, 32, 8, 128)
    windowed = dataclasses.replace(full, window=(4096, 0))
    times = {}
    for algo in ("ring", "charm", "allgather"):
        t_full = predict(algo, groups, full, cluster, True).total_s
        t_win = predict(algo, groups, windowed, cluster, True).total_s
        times[algo] = t_win
        assert t_win < t_full
    # Ring and CHARM+ send only what the window needs: far below their full attention.
    assert times["ring"] < 0.3 * predict("ring", groups, full, cluster, True).total_s
    # All-gather still moves every k and v: the window leaves it the slowest.
    assert times["allgather"] > max(times["ring"], times["charm"])
    # auto weighs each algorithm with its settings decided on the cluster (tune=True: CHARM+'s
    # head_parallel and splits), so its pick is within 5 % of the fastest so tuned.
    pick = choose_algo(groups, windowed, cluster, causal=True)
    tuned = {a: predict(a, groups, windowed, cluster, True, tune=True).total_s for a in times}
    assert tuned.get(pick, predict(pick, groups, windowed, cluster, True, tune=True).total_s) \
        <= 1.05 * min(tuned.values())


def test_a_window_prunes_the_lanes_ring_of_hierarchical_cp():
    # a2a+p2p on 2x8 (heads 32/8 divide by 8): its ring crosses the two groups with super kv
    # blocks; a 4k window at 128k reaches only the neighbouring super-block, so the second
    # group's first ranks need nothing of the first's beyond the boundary. Its all-to-alls
    # move everything (TE's do), so the saving is the ring's cross bytes only.
    win, full = _bytes("a2a+p2p", 131072, 4096), _bytes("a2a+p2p", 131072, None)
    assert win < full
    fwd = registry.plans("a2a+p2p", _groups(2, 8), True, tiles=window_rule(
        WindowGeometry(4096, 0, 16, 8192, True)))[0]
    t = traffic(fwd, Problem(1, 131072, 32, 8, 128), _groups(2, 8))
    t_full = traffic(registry.plans("a2a+p2p", _groups(2, 8), True)[0],
                     Problem(1, 131072, 32, 8, 128), _groups(2, 8))
    assert sum(t.intra) == pytest.approx(sum(t_full.intra))  # the all-to-alls: unchanged
    assert sum(t.cross) < sum(t_full.cross)
    # Ulysses has no ring: a window leaves its bytes as they are (MHA: 32 kv heads divide).
    mha = Problem(1, 65536, 32, 32, 128)
    rule = window_rule(WindowGeometry(4096, 0, 16, 4096, True))
    win, full = (traffic(registry.plans("a2a", _groups(2, 8), True, tiles=t)[0], mha,
                         _groups(2, 8)) for t in (rule, None))
    assert win.intra == full.intra and win.cross == full.cross and sum(full.cross) > 0
