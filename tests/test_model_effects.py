"""The model's second-order effects (charm_megatron.model.effects), each against a hand-computed
time, and the emulated testbed layout."""

from __future__ import annotations

import pytest

from charm_megatron.lab.calibration.testbed import emulated_cluster
from charm_megatron.model import Cluster, simulate, tile_flops
from charm_megatron.model.effects import head_dim_factor, kernel_efficiency
from charm_megatron.model.predict import _plan as _cached_plan
from charm_megatron.plan.core import Comm, Half, Plan, Wait, Xfer, tile_spec
from charm_megatron.plan.cost import Problem

P2 = Problem(b=1, s=2048, hq=1, hkv=1, d=64, elem=2)
KV2 = P2.block_bytes("kv", 2)
TILE2 = tile_flops(tile_spec(0, 1, False), P2, 2)


def build_plan(algo: str, direction: str, groups: list[list[int]], causal: bool) -> Plan:
    # The model's own plan cache (the plan package's builder moved between modules).
    return _cached_plan(algo, direction, tuple(tuple(g) for g in groups), causal)


def _cluster(**kw: object) -> Cluster:
    base = {"intra_gbps": 1.0, "cross_gbps": 1.0, "tflops": 1.0}
    base.update(kw)
    return Cluster(**base)  # type: ignore[arg-type]


def _plan(n: int, ops: list[list]) -> Plan:
    plan = Plan("test", "forward", n, (tuple(range(n)),), False)
    plan.ops = ops
    return plan


def _xchg(handle: int, sends: list[int], recvs: list[int]) -> Comm:
    return Comm(handle, "kv",
                tuple(Xfer(p, "own.kv", "kv", 0, Half.FULL) for p in sends),
                tuple(Xfer(p, f"rx{p}", "kv", 0, Half.FULL) for p in recvs))


def test_kernel_efficiency_formula_and_head_dim() -> None:
    cl = _cluster(kernel_q_rows=50.0, kernel_k_rows=100.0,
                  head_dim_factors=((64.0, 0.5), (128.0, 1.0)))
    assert kernel_efficiency(cl, 100, 100, 128) == pytest.approx(1 / (1 + 0.5 + 1.0))
    assert head_dim_factor(cl, 96) == pytest.approx(0.75)  # linear between the points
    assert head_dim_factor(cl, 32) == 0.5 and head_dim_factor(cl, 256) == 1.0  # clamped
    assert kernel_efficiency(_cluster(), 7, 9, 64) == 1.0  # off by default
    with pytest.raises(ValueError, match="head_dim_factors"):
        _cluster(head_dim_factors=((128.0, 1.0), (64.0, 0.5)))


def test_small_tiles_run_slower_in_the_simulation() -> None:
    """Ring n=2, free communication: two 1024x1024 tiles at 1 / (1 + 2 * 256 / 1024)."""
    groups = [[0, 1]]
    plan = build_plan("ring", "forward", groups, causal=False)
    base = simulate(plan, P2, _cluster(), groups, comm=False).time_s
    slow = simulate(plan, P2, _cluster(kernel_q_rows=256.0, kernel_k_rows=256.0), groups,
                    comm=False).time_s
    assert base == pytest.approx(2 * TILE2 / 1e12)
    assert slow == pytest.approx(base * 1.5)


def test_compute_slows_while_its_messages_move() -> None:
    """Ring n=2: own tile (1 s) overlaps the exchange (0.5 s); at +100 % the tile runs at half
    speed while the message moves: 0.25 s of work in the first 0.5 s, 0.75 s after, then the
    received tile at full speed: 0.5 + 0.75 + 1 = 2.25 s (2 s without the effect)."""
    groups = [[0, 1]]
    plan = build_plan("ring", "forward", groups, causal=False)
    tflops = TILE2 / 1e12
    gbps = KV2 / 0.5e9
    plain = simulate(plan, P2, _cluster(tflops=tflops, intra_gbps=gbps), groups).time_s
    slowed = simulate(plan, P2, _cluster(tflops=tflops, intra_gbps=gbps, comm_slowdown=1.0),
                      groups).time_s
    assert plain == pytest.approx(2.0)
    assert slowed == pytest.approx(2.25)


def test_concurrency_penalty_shrinks_a_shared_port() -> None:
    """Rank 0 sends to 1 and 2 at once over its port: 2 one-message times without a penalty,
    x (1 + p) with one."""
    groups = [[0, 1, 2]]
    plan = _plan(3, [[_xchg(0, [1, 2], []), Wait(0)], [_xchg(0, [], [0]), Wait(0)],
                     [_xchg(0, [], [0]), Wait(0)]])
    one = P2.block_bytes("kv", 3) / 1e9
    assert simulate(plan, P2, _cluster(), groups).time_s == pytest.approx(2 * one)
    assert simulate(plan, P2, _cluster(concurrency_penalty=0.5), groups).time_s == \
        pytest.approx(3 * one)


def test_token_bucket_lets_the_first_bytes_through() -> None:
    """A cross bucket of half a message: the first half is free, the rest at the link rate;
    the bucket is per call, so a second message over the same link pays in full."""
    groups = [[0], [1]]
    kv = KV2
    burst_kb = kv / 2 / 1024
    plan = build_plan("ring", "forward", [[0, 1]], causal=False)
    plain = simulate(plan, P2, _cluster(), groups, compute=False).time_s
    bucket = simulate(plan, P2, _cluster(cross_burst_kb=burst_kb), groups, compute=False).time_s
    assert plain == pytest.approx(kv / 1e9)
    assert bucket == pytest.approx(kv / 2 / 1e9)
    two = _plan(2, [[_xchg(0, [1], []), Wait(0), _xchg(1, [1], []), Wait(1)],
                    [_xchg(0, [], [0]), Wait(0), _xchg(1, [], [0]), Wait(1)]])
    t = simulate(two, P2, _cluster(cross_burst_kb=burst_kb), groups, compute=False).time_s
    assert t == pytest.approx(1.5 * kv / 1e9)


def test_emulated_layout_moves_the_intra_rate() -> None:
    cl = _cluster(intra_gbps=0.1, nic="rank")
    node = emulated_cluster(cl, "node")
    assert node.intra_bus_gbps == 0.1 and node.intra_gbps > 10 and node.nic == "node"
    back = emulated_cluster(node, "rank")
    assert back.intra_gbps == 0.1 and back.intra_bus_gbps is None and back.nic == "rank"
