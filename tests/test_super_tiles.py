"""Super-tiles (issue 39 item 2, docs/algorithm.md *Super-tiles*): one kernel call over several
kv blocks held at once for the same q rows. The op's shape, the fusion, the validator, the
executor (against tile-by-tile and on the timed device), the model's price, the printout,
and real gloo runs of rmplus, charm (incl. head_parallel) and allgather against float64."""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch

import dist_cases
from charm_megatron.kernels.reference import ReferenceBackend
from charm_megatron.lab.emulate.device import TimedBackend
from charm_megatron.local_ranks import run_ranks
from charm_megatron.model import get_profile
from charm_megatron.model.sim import simulate
from charm_megatron.ops.executor import BlockShape, Executor
from charm_megatron.plan.core import (
    Half,
    Kind,
    Loc,
    Plan,
    Reset,
    SuperTile,
    Tile,
    TileBwd,
    TileSpec,
    format_op,
)
from charm_megatron.plan.cost import Problem
from charm_megatron.plan.fuse import fuse_ops, joint_kv, unfuse_ops
from charm_megatron.plan.memory import max_peak, peak
from charm_megatron.plan.registry import build_plan
from charm_megatron.plan.roles import RoleShape
from charm_megatron.plan.tile_rule import TileRule
from charm_megatron.plan.validate import PlanError, validate
from charm_megatron.topology import Topology

TOL = {"fp32": 1e-5, "bf16": 2e-2}
Q, KV = Loc.own(Kind.Q), Loc.own(Kind.KV)
RX = Loc("kv.rx")


def _supers(plan: Plan) -> int:
    return sum(type(op) is SuperTile for ops in plan.ops for op in ops)


def _fused(plan: Plan) -> Plan:
    return replace(plan, ops=[fuse_ops(ops) for ops in plan.ops])


# ------------------------------------------------------------------------------ the op
def test_a_super_tile_refuses_what_one_kernel_call_cannot_do() -> None:
    a = Tile(TileSpec(1, 2, Half.SECOND, Half.FULL, False), Q, RX.at(0), Plan.OUT)
    b = Tile(TileSpec(1, 3, Half.SECOND, Half.FULL, False), Q, RX.at(1), Plan.OUT)
    assert SuperTile((a, b)).members == (a, b)
    bad = {
        "two or more": (a,),
        "causal": (a, replace(b, spec=TileSpec(1, 1, Half.FULL, Half.FULL, True))),
        "share the q block": (a, replace(b, spec=replace(b.spec, q_half=Half.FULL))),
        "not fresh": (replace(a, fresh=True), replace(b, fresh=True)),
        "all Tile": (a, TileBwd(b.spec, Q, RX.at(1), Plan.DQ, Loc("acc.pdkv").at(0))),
    }
    for why, members in bad.items():
        with pytest.raises(ValueError, match=why):
            SuperTile(members)
    x = TileBwd(a.spec, Q, RX.at(0), Plan.DQ, Loc("acc.pdkv").at(0))
    with pytest.raises(ValueError, match="accumulator of its own"):
        SuperTile((x, replace(x, spec=b.spec, kv_loc=RX.at(1))))


def test_fusion_joins_adjacent_tiles_and_moves_nothing() -> None:
    for d in ("forward", "backward"):
        for causal in (True, False):
            plan = build_plan("allgather", d, [list(range(4))], causal)
            fused = _fused(plan)
            # causal: the later blocks' q.2nd tiles, then the earlier blocks' q.all tiles
            # (rank 0: three later blocks; rank 1: two later, one earlier, which stays a
            # tile; ...); full: one run of all three
            assert [sum(type(op) is SuperTile for op in ops) for ops in fused.ops] == [1] * 4
            assert [unfuse_ops(ops) for ops in fused.ops] == plan.ops
            assert validate(fused).tiles == validate(plan).tiles
    full = _fused(build_plan("allgather", "forward", [list(range(4))], False))
    assert all(len(op.members) == 3 for ops in full.ops for op in ops if type(op) is SuperTile)


def test_printout() -> None:
    fused = _fused(build_plan("allgather", "backward", [list(range(4))], True))
    lines = [format_op(op) for op in fused.ops[1] if type(op) is SuperTile]
    assert lines == ["super-tile-bwd q[1].2nd x (kv[2].all + kv[3].all) dq -> acc.dq, "
                     "dkv => ag.dkv2, => ag.dkv3"]
    fwd = _fused(build_plan("allgather", "forward", [list(range(4))], False))
    assert format_op(next(op for op in fwd.ops[0] if type(op) is SuperTile)) == \
        "super-tile q[0].all x (kv[1].all + kv[2].all + kv[3].all) -> acc.out"


# ------------------------------------------------------------------------------ validator
def _break(plan: Plan, rank: int, edit) -> Plan:
    ops = list(plan.ops[rank])
    i = next(i for i, op in enumerate(ops) if type(op) is SuperTile)
    ops[i] = edit(ops[i])
    out = [list(o) for o in plan.ops]
    out[rank] = ops
    return replace(plan, ops=out)


def _forced(members) -> SuperTile:
    """A super-tile made without its constructor's check (a plan edited after it was built)."""
    op = object.__new__(SuperTile)
    object.__setattr__(op, "members", tuple(members))
    return op


@pytest.mark.parametrize("d", ["forward", "backward"])
def test_the_validator_catches_a_broken_super_tile(d: str) -> None:
    plan = build_plan("charm", d, [list(range(4)), list(range(4, 8))], True, super_tiles="on",
                      shape=RoleShape(8, 2, 16, 4))
    assert _supers(plan) > 0
    validate(plan)
    twice = _break(plan, 0, lambda op: _forced((op.members[0], *op.members)))
    with pytest.raises(PlanError, match="twice|computed 2 times|afresh"):
        validate(twice)
    missing = _break(plan, 0, lambda op: _forced(op.members[1:]) if len(op.members) > 2
                     else op.members[0])
    with pytest.raises(PlanError, match="missing|holds None"):
        validate(missing)
    first = plan.ops[0][next(i for i, op in enumerate(plan.ops[0]) if type(op) is SuperTile)]
    other_acc = Loc("acc.else")
    wrong = _break(plan, 0, lambda op: _forced((
        op.members[0], *(replace(m, **({"acc": other_acc} if d == "forward"
                                       else {"dq_acc": other_acc})) for m in op.members[1:]))))
    with pytest.raises(PlanError, match="is not a super-tile"):
        validate(wrong)
    swapped = _break(plan, 0, lambda op: _forced((replace(
        op.members[0], kv_loc=op.members[1].kv_loc), *op.members[1:])))
    with pytest.raises(PlanError, match="expects kv"):
        validate(swapped)
    assert type(first) is SuperTile


def test_the_validator_rejects_a_super_tile_under_a_window() -> None:
    plan = _fused(build_plan("allgather", "forward", [list(range(4))], False))
    rule = TileRule(4, False, wants=tuple(tuple(TileSpec(i, j, Half.FULL, Half.FULL, False)
                                                for j in range(4)) for i in range(4)))
    with pytest.raises(PlanError, match="windowed plan"):
        validate(replace(plan, tiles=rule))


# ------------------------------------------------------------------------------ model, memory
def test_the_model_prices_a_super_tile_below_its_members() -> None:
    cluster = get_profile("h200").cluster
    assert cluster.op_overhead_us > 0
    groups = [list(range(8))]
    problem = Problem(1, 32768, 32, 8, 128, 2)
    for d in ("forward", "backward"):
        plan = build_plan("allgather", d, groups, False)
        fused = _fused(plan)
        t = [simulate(p, problem, cluster, groups, comm=False).time_s for p in (plan, fused)]
        # 7 tiles -> one call: 6 overheads and 6 merges of the q rows' partial fewer, a
        # longer tile's efficiency, against one copy of the 7 blocks' kv
        assert t[1] < t[0] - 6 * cluster.op_overhead_us * 1e-6, (d, t)
    # Without overhead, tile-size effect, merges or copies, a super-tile costs its FLOPs: the
    # sum of its members'.
    flat = replace(cluster, op_overhead_us=0.0, kernel_q_rows=0.0, kernel_k_rows=0.0,
                   merge_gbps=None, comm_slowdown=0.0, head_dim_factors=())
    plan = build_plan("allgather", "forward", groups, False)
    t = [simulate(p, problem, flat, groups, comm=False).time_s for p in (plan, _fused(plan))]
    assert t[1] == pytest.approx(t[0], rel=1e-9)


def test_memory_counts_the_concatenation_unless_received_jointly() -> None:
    problem = Problem(1, 4096, 8, 2, 64, 2)
    kv_block = problem.block_bytes(Kind.KV, 4)
    # Full attention: the three gathered blocks arrive into one buffer (no copy) and the
    # super-tile's one output replaces the tiles' one at a time: the same peak.
    plan = build_plan("allgather", "forward", [list(range(4))], False)
    fused = _fused(plan)
    assert all(len(joint_kv(ops)) == 1 for ops in fused.ops)
    assert max_peak(fused, problem) == max_peak(plan, problem)
    # Causal, rank 3: whole blocks gathered, first halves read: concatenated, a copy of the
    # three halves while the call runs.
    plan = build_plan("allgather", "forward", [list(range(4))], True)
    ops = fuse_ops(plan.ops[3])
    assert _supers(replace(plan, ops=[ops])) == 1 and joint_kv(ops) == {}
    assert peak(ops, problem, 4).bytes == pytest.approx(peak(plan.ops[3], problem, 4).bytes
                                                        + 1.5 * kv_block)
    # RM+ / CHARM+ steps receive each block at the rows its tile reads: all joint.
    charm = build_plan("charm", "backward", [list(range(4)), list(range(4, 8))], True,
                       super_tiles="on", shape=RoleShape(8, 2, 16, 4))
    assert sum(len(joint_kv(ops)) for ops in charm.ops) == _supers(charm) > 0


# ------------------------------------------------------------------------------ executor
def _single(backend, dtype=torch.float64) -> Executor:
    return Executor(None, backend, BlockShape(8, 2, 4, 2, 8, dtype, torch.device("cpu")), 0.3)


def _blocks(seed: int):
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(8, 2, 4, 8, generator=g, dtype=torch.float64)
    kvs = [tuple(torch.randn(8, 2, 2, 8, generator=g, dtype=torch.float64) for _ in range(2))
           for _ in range(3)]
    dout = torch.randn(8, 2, 4, 8, generator=g, dtype=torch.float64)
    return q, kvs, dout


# q[0].2nd against kv[1].all, kv[2].1st and kv[3].all: members of different kv rows.
SPECS = [TileSpec(0, 1, Half.SECOND, Half.FULL, False),
         TileSpec(0, 2, Half.SECOND, Half.FIRST, False),
         TileSpec(0, 3, Half.SECOND, Half.FULL, False)]


def _forward(backend, seed: int, fuse: bool):
    """One rank's executor on ``backend`` after the forward tiles of :data:`SPECS` over
    ``seed``'s blocks, as one super-tile (``fuse``) or tile by tile."""
    q, kvs, _ = _blocks(seed)
    ex = _single(backend)
    ex.set_own(Q, Kind.Q, q)
    for j, (k, v) in enumerate(kvs):
        ex.set_own(RX.at(j), Kind.KV, k, v)
    ex.interpret(Reset(Plan.OUT, Kind.OUT, 0))
    tiles = [Tile(s, Q, RX.at(j), Plan.OUT) for j, s in enumerate(SPECS)]
    for op in ([SuperTile(tuple(tiles))] if fuse else tiles):
        ex.interpret(op)
    return ex


def test_executor_forward_super_tile_is_its_tiles() -> None:
    results = [_forward(ReferenceBackend(), 0, fuse).result(Plan.OUT) for fuse in (False, True)]
    for a, b in zip(*results):
        torch.testing.assert_close(a, b, rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("fresh_dkv", [False, True])
def test_executor_backward_super_tile_splits_dk_dv_back(fresh_dkv: bool) -> None:
    q, kvs, dout = _blocks(1)
    ref = ReferenceBackend()
    rows = slice(4, 8)
    k_all = torch.cat([kvs[0][0], kvs[1][0][:4], kvs[2][0]])
    v_all = torch.cat([kvs[0][1], kvs[1][1][:4], kvs[2][1]])
    out, lse = ref.forward(q[rows], k_all, v_all, False, 0.3)
    stats = torch.zeros(8, 2, 4, 2, dtype=torch.float64)
    stats[rows, ..., 0] = lse.permute(2, 0, 1)
    full_out = torch.zeros_like(q)
    full_out[rows] = out
    dkvs = [Loc("acc.pdkv").at(j) for j in range(3)]
    results = []
    for fuse in (False, True):
        ex = _single(ref)
        ex.set_own(Loc.own(Kind.QGRAD), Kind.QGRAD, q, dout, stats)
        ex.set_own_output(Loc.own(Kind.QGRAD), full_out)
        for j, (k, v) in enumerate(kvs):
            ex.set_own(RX.at(j), Kind.KV, k, v)
        ex.interpret(Reset(Plan.DQ, Kind.DQ, 0))
        if not fresh_dkv:
            for j, loc in enumerate(dkvs):
                ex.interpret(Reset(loc, Kind.DKV, j + 1))
        tiles = [TileBwd(s, Loc.own(Kind.QGRAD), RX.at(j), Plan.DQ, dkvs[j],
                         fresh_dkv=fresh_dkv) for j, s in enumerate(SPECS)]
        for op in ([SuperTile(tuple(tiles))] if fuse else tiles):
            ex.interpret(op)
        got = [ex.result(Plan.DQ)[0]]
        for j, loc in enumerate(dkvs):
            t = ex.result(loc)
            got += [t[0][: (4 if j == 1 else 8)], t[1][: (4 if j == 1 else 8)]]
        results.append(got)
    for a, b in zip(*results):
        torch.testing.assert_close(a.double(), b.double(), rtol=1e-12, atol=1e-12)


def test_the_timed_device_prices_a_super_tile_as_one_call() -> None:
    cluster = get_profile("h200").cluster
    clocks = []
    for fuse in (False, True):
        dev = TimedBackend(cluster, sleep=lambda s: None, sm_contention=False)
        _forward(dev, 2, fuse)
        clocks.append(dev.clock)
    assert (clocks[0].tiles, clocks[1].tiles) == (3, 1)
    # at 8 rows the per-call overhead dominates: one call, not three
    assert clocks[1].device_s < clocks[0].device_s - 1.5 * cluster.op_overhead_us * 1e-6


# ------------------------------------------------------------------------------ gloo ranks
def _groups(world: int, topology: str | None) -> list[list[int]]:
    if topology is None:
        return [list(range(world))]
    return [list(g) for g in Topology.parse(topology, cp_size=world).groups]


# (algo, topology, extra settings); super_tiles on everywhere. charm on 1x8 with
# head_parallel 2: RM+ over four super-blocks per lane (the 2x4 groups would hold two, one
# round: nothing to fuse).
SETUPS = {
    4: [("rmplus", None, ()), ("allgather", None, ())],
    8: [("charm", "2x4", ()), ("rmplus", None, ()), ("allgather", None, ()),
        ("charm", "1x8", (("head_parallel", 2),))],
}


def _cases(world: int) -> list[tuple]:
    out = []
    for algo, topo, extra in SETUPS[world]:
        settings = (("super_tiles", "on"), *extra)
        hkvs = (4, 2) if extra else (2, 1)
        for causal in (True, False):
            for dtype in ("fp32", "bf16"):
                for hkv in hkvs:
                    out.append((algo, topo, causal, dtype, hkv, settings))
        if algo == "rmplus":  # forced kv pairs at 4 kv heads
            out += [(algo, topo, causal, "fp32", 4, (*settings, ("roles", "kv")))
                    for causal in (True, False)]
    return out


@pytest.mark.parametrize("world", sorted(SETUPS))
def test_super_tiles_against_float64_reference(world: int) -> None:
    cases = _cases(world)
    fused = {"forward": 0, "backward": 0}
    for algo, topo, causal, dtype, hkv, settings in cases:  # the plans run do fuse
        counts = {d: _supers(build_plan(algo, d, _groups(world, topo), causal,
                                        shape=RoleShape(8, hkv, 16, 4 if dtype == "fp32" else 2),
                                        **dict(settings)))
                  for d in ("forward", "backward")}
        assert sum(counts.values()) > 0, (algo, topo, causal, hkv, settings)
        for d, c in counts.items():
            fused[d] += c > 0
    assert fused["forward"] >= len(cases) // 2 and fused["backward"] >= len(cases) // 2, fused
    per_rank = run_ranks(dist_cases.run_matrix, world, cases, timeout_s=600)
    failures = [f"{case} rank {r}: {name} {err:.3g}"
                for case in cases for r, res in enumerate(per_rank)
                for name, err in res[case].items() if not err < TOL[case[3]]]
    assert not failures, "\n".join(failures)


def test_packed_and_windowed_calls_with_super_tiles_on() -> None:
    """Packed (THD) calls run a super-tile member by member (their tiles are cut by
    document); windowed plans are pruned tile by tile (a super-tile split back into its
    members), and a window that keeps every tile whole leaves them fused. All against
    float64, on the plans that fuse without a window (rmplus on 8 ranks, charm 2x4)."""
    import packed_cases
    import window_cases

    env = {"CHARM_SUPER_TILES": "on"}
    setups = (("rmplus", None), ("charm", "2x4"))
    packed = [(algo, topo, causal, "fp32", 2, docs) for algo, topo in setups
              for causal in (True, False) for docs in ("unequal", "nopad")]
    per_rank = run_ranks(packed_cases.run_packed_matrix, 8, packed, [], timeout_s=600, env=env)
    for case in packed:
        for res in per_rank:
            errs, zero = res[case]
            assert zero and max(errs.values()) < TOL["fp32"], (case, errs)
    # 8 rows per rank: (5, 0) prunes, (1000, 1000) keeps every tile whole
    windowed = [(algo, topo, causal, "fp32", 2, left, right) for algo, topo in setups
                for causal in (True, False) for left, right in ((5, 0), (1000, 1000))]
    # the wide window's plans are the plans without one: fused (but where the bound makes
    # them lean)
    assert all(_supers(build_plan(algo, d, _groups(8, topo), causal, super_tiles="on",
                                  shape=RoleShape(4, 2, 16, 4))) > 0
               for algo, topo, causal, *_ in windowed if algo == "rmplus"
               for d in ("forward", "backward"))
    res = run_ranks(window_cases.run_sbhd, 8, windowed, timeout_s=600, env=env)
    bad = [f"{c} rank {r}: {n} {e:.3g}" for r, per in enumerate(res) for c, errs in per.items()
           for n, e in errs.items() if not e < window_cases.TOL[c[3]]]
    assert not bad, "\n".join(bad)


def test_auto_is_the_models_pick_per_direction_and_off_without_a_profile() -> None:
    from charm_megatron.model.predict import variants
    from charm_megatron.plan.registry import variants as plain_variants

    cluster = get_profile("h200").cluster
    groups = [list(range(8)), list(range(8, 16))]
    short = Problem(1, 16384, 32, 8, 128, 2)  # the model: 1.39x forward, 1.13x backward
    fwd, bwd = variants("charm", groups, short, cluster, causal=True, super_tiles="auto",
                        head_parallel=1)
    assert fwd.super_tiles and bwd.super_tiles
    long = Problem(1, 131072, 32, 8, 128, 2)  # 1.06x forward, 0.97x backward
    fwd, bwd = variants("charm", groups, long, cluster, causal=True, super_tiles="auto",
                        head_parallel=1)
    assert fwd.super_tiles and not bwd.super_tiles
    fwd, bwd = plain_variants("charm", groups, True, shape=RoleShape(32, 8, 128, 2),
                              super_tiles="auto")
    assert not fwd.super_tiles and not bwd.super_tiles
    assert plain_variants("allgather", [list(range(4))], True, super_tiles="auto") == \
        (False, False)
    assert plain_variants("allgather", [list(range(4))], True, super_tiles="on") == (True, True)


def test_a_super_tile_plan_the_validator_rejects_falls_back(monkeypatch) -> None:
    """Ranks group their units into steps each by its own tiles, so the posting order is
    not the plain plan's: a plan with super-tiles is kept only where the validator proves
    it, else the plan without them."""
    from charm_megatron.algorithms.charm import entry
    from charm_megatron.plan.registry import _plans, _variants

    groups = [list(range(4)), list(range(4, 8))]
    shape = RoleShape(8, 2, 16, 4)
    assert _supers(build_plan("charm", "forward", groups, True, super_tiles="on",
                              shape=shape)) > 0

    def reject(plan):
        raise PlanError("as if it deadlocked")

    monkeypatch.setattr(entry, "validate", reject)
    _plans.cache_clear()
    _variants.cache_clear()
    try:
        plan = build_plan("charm", "forward", groups, True, super_tiles="on", shape=shape)
        assert _supers(plan) == 0
        assert plan.ops == build_plan("charm", "forward", groups, True, shape=shape).ops
    finally:
        _plans.cache_clear()
        _variants.cache_clear()
