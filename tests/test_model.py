"""The performance model (charm_megatron.model): hand-computable cases, link sharing, the
shared compute pool, monotonicity, CHARM+ vs ring, and the ``auto`` choice."""

from __future__ import annotations

import math

import pytest

from charm_megatron.model import (
    PROFILES,
    Cluster,
    ModelError,
    choose_algo,
    choose_algo_cached,
    default_cluster_for,
    get_profile,
    predict,
    predict_all,
    ring_ccr,
    simulate,
    tile_flops,
)
from charm_megatron.plan.core import Comm, Half, Plan, Wait, Xfer, tile_spec
from charm_megatron.plan.cost import Problem, traffic
from charm_megatron.plan.registry import build_plan

# One head of 64, bf16, s=2048 over 2 ranks: a kv block is 1024 rows * 2 * 64 * 2 B = 256 KiB.
P2 = Problem(b=1, s=2048, hq=1, hkv=1, d=64, elem=2)
KV2 = P2.block_bytes("kv", 2)
TILE2 = tile_flops(tile_spec(0, 1, False), P2, 2)  # 4 * 64 * 1024 * 1024 FLOPs


def _cluster(**kw: object) -> Cluster:
    base = {"intra_gbps": 1.0, "cross_gbps": 1.0, "tflops": 1.0}
    base.update(kw)
    return Cluster(**base)  # type: ignore[arg-type]


def test_block_and_tile_sizes() -> None:
    assert KV2 == 1024 * 2 * 64 * 2
    assert TILE2 == 4 * 64 * 1024 * 1024
    assert tile_flops(tile_spec(1, 1, True), P2, 2) == TILE2 / 2  # causal diagonal
    assert tile_flops(tile_spec(1, 0, True), P2, 2) == TILE2 / 2  # half the kv rows
    assert tile_flops(tile_spec(0, 1, True), P2, 2) == TILE2 / 2  # half the q rows


# ----------------------------------------------------------------------------- hand-computable
@pytest.mark.parametrize("groups", [[[0, 1]], [[0], [1]]])
def test_ring_two_ranks_comm_only(groups: list[list[int]]) -> None:
    """Ring forward, n=2, free compute: one kv exchange = latency + bytes / rate."""
    cl = _cluster(intra_gbps=2.0, cross_gbps=2.0, latency_us=5.0)
    plan = build_plan("ring", "forward", groups, causal=False)
    res = simulate(plan, P2, cl, groups, compute=False)
    assert res.time_s == pytest.approx(5e-6 + KV2 / 2e9, rel=1e-9)
    assert res.messages == 2


def test_ring_two_ranks_with_compute() -> None:
    """Own tile overlaps the exchange; the received tile follows it: max(tile, comm) + tile."""
    groups = [[0, 1]]
    plan = build_plan("ring", "forward", groups, causal=False)
    comm = 1e-6 + KV2 / 1e9
    for tflops in (1e-3, 1.0):  # compute dominating, then communication dominating
        tile = TILE2 / (tflops * 1e12)
        cl = _cluster(tflops=tflops, latency_us=1.0)
        res = simulate(plan, P2, cl, groups)
        assert res.time_s == pytest.approx(max(tile, comm) + tile, rel=1e-9)
        assert all(r.work_s == pytest.approx(2 * tile) for r in res.ranks)
        assert all(r.busy_s == pytest.approx(2 * tile) for r in res.ranks)


def test_overheads_add_up() -> None:
    """Per-op overhead and merge cost land on each tile; message CPU time before the post."""
    groups = [[0, 1]]
    plan = build_plan("ring", "forward", groups, causal=False)
    cl = _cluster(tflops=1e-3, op_overhead_us=100.0, merge_gbps=1.0, msg_cpu_us=50.0)
    tile = TILE2 / 1e9 + 100e-6 + P2.block_bytes("out", 2) / 1e9
    res = simulate(plan, P2, cl, groups)
    assert res.time_s == pytest.approx(2 * 50e-6 + 2 * tile, rel=1e-9)


# ----------------------------------------------------------------------------- link sharing
def _plan(n: int, ops: list[list]) -> Plan:
    plan = Plan("test", "forward", n, (tuple(range(n)),), False)
    plan.ops = ops
    return plan


def _xchg(handle: int, sends: list[int], recvs: list[int]) -> Comm:
    return Comm(handle, "kv",
                tuple(Xfer(p, "own.kv", "kv", 0, Half.FULL) for p in sends),
                tuple(Xfer(p, f"rx{p}", "kv", 0, Half.FULL) for p in recvs))


def _two_pairs() -> Plan:
    """Ranks 0 and 1 (group 0) send one kv block each to 2 and 3 (group 1), at once."""
    return _plan(4, [
        [_xchg(0, [2], []), Wait(0)],
        [_xchg(0, [3], []), Wait(0)],
        [_xchg(0, [], [0]), Wait(0)],
        [_xchg(0, [], [1]), Wait(0)],
    ])


def test_nic_node_shares_one_cross_link() -> None:
    groups = [[0, 1], [2, 3]]
    kv = P2.block_bytes("kv", 4)
    per_rank = simulate(_two_pairs(), P2, _cluster(nic="rank"), groups)
    per_node = simulate(_two_pairs(), P2, _cluster(nic="node"), groups)
    assert per_rank.time_s == pytest.approx(kv / 1e9)
    assert per_node.time_s == pytest.approx(2 * kv / 1e9)
    assert per_node.cross_bytes == 2 * kv and per_node.intra_bytes == 0


def test_one_port_shared_by_two_messages() -> None:
    """Rank 0 sends to 1 and 2 at once: its out-port is shared, each takes twice as long; with
    a port twice as wide as one message's cap, both finish in the single-message time."""
    groups = [[0, 1, 2]]
    plan = _plan(3, [
        [_xchg(0, [1, 2], []), Wait(0)],
        [_xchg(0, [], [0]), Wait(0)],
        [_xchg(0, [], [0]), Wait(0)],
    ])
    one = P2.block_bytes("kv", 3) / 1e9
    assert simulate(plan, P2, _cluster(), groups).time_s == pytest.approx(2 * one)
    wide = _cluster(intra_port_gbps=2.0)
    assert simulate(plan, P2, wide, groups).time_s == pytest.approx(one)


def test_unequal_flows_share_max_min() -> None:
    """A message that is done early frees its share: the other speeds up (fair re-share)."""
    groups = [[0, 1, 2]]
    plan = _plan(3, [
        [Comm(0, "kv", (Xfer(1, "own.kv", "kv", 0, Half.FULL),
                        Xfer(2, "own.kv", "kv", 0, Half.FIRST)), ()), Wait(0)],
        [_xchg(0, [], [0]), Wait(0)],
        [Comm(0, "kv", (), (Xfer(0, "rx", "kv", 0, Half.FIRST),)), Wait(0)],
    ])
    # Both at 0.5 GB/s until the half block is done (time kv/1e9), then the rest at 1 GB/s.
    kv = P2.block_bytes("kv", 3)
    assert simulate(plan, P2, _cluster(), groups).time_s == pytest.approx(1.5 * kv / 1e9)


def test_cross_via_intra_and_bus() -> None:
    groups = [[0, 1], [2, 3]]
    plan = _plan(4, [
        [_xchg(0, [2, 1], []), Wait(0)],
        [_xchg(0, [], [0]), Wait(0)],
        [_xchg(0, [], [0]), Wait(0)],
        [],
    ])
    one = P2.block_bytes("kv", 4) / 1e9
    # Separate ports: the cross and the intra message do not meet.
    assert simulate(plan, P2, _cluster(), groups).time_s == pytest.approx(one)
    # One PCIe link per GPU carries both.
    assert simulate(plan, P2, _cluster(cross_via_intra=True), groups).time_s == \
        pytest.approx(2 * one)
    # A group-wide intra bus: 0->1 and 2->3 meet on it although their ports differ.
    flat = [[0, 1, 2, 3]]
    pairs = _plan(4, [
        [_xchg(0, [1], []), Wait(0)],
        [_xchg(0, [], [0]), Wait(0)],
        [_xchg(0, [3], []), Wait(0)],
        [_xchg(0, [], [2]), Wait(0)],
    ])
    assert simulate(pairs, P2, _cluster(), flat).time_s == pytest.approx(one)
    assert simulate(pairs, P2, _cluster(intra_bus_gbps=1.0), flat).time_s == \
        pytest.approx(2 * one)


def test_shared_core_pool() -> None:
    """Two ranks, free communication: 4 tiles on 1 shared core take 4 tiles' time."""
    groups = [[0, 1]]
    plan = build_plan("ring", "forward", groups, causal=False)
    tile = TILE2 / 1e12
    own = simulate(plan, P2, _cluster(), groups, comm=False)
    one_core = simulate(plan, P2, _cluster(cores=1), groups, comm=False)
    two_cores = simulate(plan, P2, _cluster(cores=2), groups, comm=False)
    assert own.time_s == pytest.approx(2 * tile)
    assert two_cores.time_s == pytest.approx(2 * tile)
    assert one_core.time_s == pytest.approx(4 * tile)
    assert one_core.ranks[0].busy_s == pytest.approx(4 * tile)  # stretched, not more work
    assert one_core.ranks[0].work_s == pytest.approx(2 * tile)


def test_head_all_to_all_copies_are_compute() -> None:
    """Ulysses on 2 ranks, free communication: one super-tile each, plus the stage's local
    copies at the merge rate (ours: 1 + 1/2 passes each way over q and kv, then out; TE's
    all-to-all 2 + 1/2), and those copies stretched by n / cores on a shared pool (every rank
    copies at once)."""
    groups = [[0, 1]]
    prob = Problem(b=1, s=2048, hq=2, hkv=2, d=64, elem=2)
    plan = build_plan("a2a", "forward", groups, causal=False)
    tile = tile_flops(tile_spec(0, 0, False), prob.for_plan(plan), 2) / 1e12
    moved = 1.5 * (prob.block_bytes("q", 2) + prob.block_bytes("kv", 2)
                   + prob.block_bytes("out", 2))
    cl = _cluster(merge_gbps=1.0)
    fold = prob.for_plan(plan).block_bytes("out", 2) / 1e9  # the tile's fold into its acc
    assert simulate(plan, prob, cl, groups, comm=False).time_s == \
        pytest.approx(tile + fold + moved / 1e9)
    pooled = simulate(plan, prob, cl.with_(cores=1), groups, comm=False)
    assert pooled.time_s == pytest.approx(2 * (tile + fold) + 2 * moved / 1e9)
    assert pooled.ranks[0].work_s == pytest.approx(tile + fold + moved / 1e9)
    te = simulate(plan, prob, cl.with_(head_copies="te"), groups, comm=False)
    assert te.time_s == pytest.approx(tile + fold + moved / 1.5 * 2.5 / 1e9)
    # Without compute the copies are free too (the CCR's communication part).
    assert simulate(plan, prob, cl, groups, compute=False).time_s < moved / 1e9


def test_cpu_cost_per_byte_caps_a_transfer() -> None:
    """On a CPU testbed a transfer is one thread: at 1 ns/B it moves at most 1 GB/s."""
    groups = [[0, 1]]
    plan = build_plan("ring", "forward", groups, causal=False)
    cl = _cluster(intra_gbps=100.0, cores=2, cpu_ns_per_byte=1.0)
    res = simulate(plan, P2, cl, groups, compute=False)
    assert res.time_s == pytest.approx(KV2 / 1e9)
    # With one core the two ranks' transfers share it.
    assert simulate(plan, P2, cl.with_(cores=1), groups, compute=False).time_s == \
        pytest.approx(2 * KV2 / 1e9)


def test_deadlock_is_reported() -> None:
    plan = _plan(2, [[_xchg(0, [1], []), Wait(0)], []])
    with pytest.raises(ModelError, match="deadlock"):
        simulate(plan, P2, _cluster(), [[0, 1]])
    plan = _plan(2, [[_xchg(0, [1], [])], []])  # posted, never waited, never received
    with pytest.raises(ModelError, match="never matched"):
        simulate(plan, P2, _cluster(), [[0, 1]])


def test_bytes_match_plan_costs() -> None:
    groups = [list(range(4)), list(range(4, 8))]
    prob = Problem(1, 8192, 4, 2, 64)
    for algo in ("ring", "rmplus", "charm"):
        plan = build_plan(algo, "backward", groups, causal=True)
        res = simulate(plan, prob, default_cluster_for(groups), groups)
        t = traffic(plan, prob, groups)
        assert res.intra_bytes == pytest.approx(sum(t.intra))
        assert res.cross_bytes == pytest.approx(sum(t.cross))


def test_cluster_rejects_nonsense() -> None:
    with pytest.raises(ValueError, match="nic"):
        _cluster(nic="switch")
    with pytest.raises(ValueError, match="cross_gbps"):
        _cluster(cross_gbps=0.0)
    with pytest.raises(ValueError, match="cores"):
        _cluster(cpu_ns_per_byte=1.0)
    with pytest.raises(ValueError, match="unknown profile"):
        get_profile("tpu")


# ----------------------------------------------------------------------------- whole algorithms
G2x4 = [list(range(4)), list(range(4, 8))]
G2x8 = [list(range(8)), list(range(8, 16))]


def test_slower_cross_never_speeds_ring_up() -> None:
    prob = Problem(1, 16384, 8, 8, 64)
    base = Cluster(intra_gbps=100.0, cross_gbps=100.0, tflops=100.0, latency_us=5.0)
    for nic in ("rank", "node"):
        for causal in (False, True):
            last = {"forward": 0.0, "backward": 0.0}
            for cross in (100.0, 50.0, 25.0, 12.5, 5.0, 1.0):
                p = predict("ring", G2x4, prob, base.with_(cross_gbps=cross, nic=nic), causal)
                for res in (p.forward, p.backward):
                    assert res.time_s >= last[res.direction] * (1 - 1e-12)
                    last[res.direction] = res.time_s


def test_charm_beats_ring_on_2x8_with_slow_cross() -> None:
    """Cross links 1/8 of intra, ring CCR moderate (0.3 .. 1): CHARM+ is predicted faster."""
    cl = default_cluster_for(G2x8)
    assert cl.cross_gbps * 8 == cl.intra_gbps
    prob = Problem(1, 131072, 32, 32, 128)
    ccr = ring_ccr(G2x8, prob, cl, causal=True).ratio
    assert 0.3 < ccr < 1.0
    preds = predict_all(G2x8, prob, cl, causal=True)
    assert preds["charm"].forward.time_s < preds["ring"].forward.time_s
    assert preds["charm"].backward.time_s < preds["ring"].backward.time_s
    assert preds["charm"].forward.max_rank_cross_bytes < preds["ring"].forward.max_rank_cross_bytes
    # CHARM+ keeps the devices busier than the ring does.
    assert preds["charm"].forward.busy_fraction > preds["ring"].forward.busy_fraction


def test_flat_charm_is_rmplus() -> None:
    flat = [list(range(4))]
    cl = default_cluster_for(flat)
    assert cl.cross_gbps == cl.intra_gbps
    preds = predict_all(flat, Problem(1, 8192, 8, 8, 64), cl, causal=True)
    assert preds["charm"].total_s == preds["rmplus"].total_s


def test_choose_algo_is_deterministic() -> None:
    prob = Problem(1, 131072, 32, 32, 128)
    cl = default_cluster_for(G2x8)
    # Among the paper's algorithms CHARM+ wins; with every peer, a head all-to-all does
    # (MHA: a2a moves fewer bytes here; docs/performance.md), TE's or CHARM+'s own
    # (head_parallel). Either way, deterministically.
    assert choose_algo(G2x8, prob, cl, algos=("ring", "rmplus", "charm")) == "charm"
    first = choose_algo(G2x8, prob, cl)
    assert first in ("a2a", "a2a+p2p", "charm")
    assert choose_algo(G2x8, prob, cl, head_parallel=1) in ("a2a", "a2a+p2p")
    assert choose_algo(G2x8, prob, cl) == first
    assert choose_algo_cached(G2x8, prob, cl) == first
    assert choose_algo_cached(tuple(map(tuple, G2x8)), prob, None) == choose_algo(G2x8, prob)
    # Flat: charm ties rmplus exactly; the tie goes to the earlier name, never to charm.
    assert choose_algo([list(range(4))], Problem(1, 65536, 8, 8, 64)) in ("ring", "rmplus")
    # A single candidate is returned as is.
    assert choose_algo(G2x8, prob, cl, algos=("ring",)) == "ring"


def test_profiles_run() -> None:
    prob = Problem(1, 32768, 16, 16, 128)
    for name, prof in PROFILES.items():
        from charm_megatron.topology.core import Topology

        groups = [list(g) for g in Topology.parse(prof.topology).groups]
        p = predict("charm", groups, prob, prof.cluster, causal=True)
        assert math.isfinite(p.total_s) and p.total_s > 0, name


def test_prediction_identical_across_processes() -> None:
    """Every rank must compute the same choice: the arithmetic may not depend on hash seeds
    (set iteration order) or anything else that differs between processes."""
    import subprocess
    import sys

    code = ("from charm_megatron.model import predict_all, default_cluster_for\n"
            "from charm_megatron.plan.cost import Problem\n"
            "g = [list(range(4)), list(range(4, 8)), list(range(8, 12))]\n"
            "cl = default_cluster_for(g).with_(nic='node', cross_via_intra=True)\n"
            "p = predict_all(g, Problem(1, 24576, 8, 2, 64), cl, causal=True)\n"
            "print([x.total_s.hex() for x in p.values()])\n")
    outs = {subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                           check=True, env={"PYTHONHASHSEED": seed, "PATH": ""}).stdout
            for seed in ("1", "2", "3")}
    assert len(outs) == 1, outs


def test_fp32_partials_make_ring_backward_move_three_kv_blocks_per_step() -> None:
    """bf16, link-bound ring of n: backward moves kv n-1 hops and dkv n (its last hop takes
    it home); with fp32 partials dkv is twice kv's bytes, so the communication takes
    (n-1 + 2n) / (n-1 + n) as long (3x kv per step, the paper's ring); forward moves no
    partial."""
    groups = [[0, 1, 2, 3]]
    narrow = Problem(b=1, s=4096, hq=4, hkv=4, d=64, elem=2)
    wide = Problem(b=1, s=4096, hq=4, hkv=4, d=64, elem=2, wide_partials=True)
    assert wide.block_bytes("dkv", 4) == 2 * narrow.block_bytes("dkv", 4)
    assert wide.block_bytes("kv", 4) == narrow.block_bytes("kv", 4)
    assert wide.local_bytes("dkv", 4) == narrow.block_bytes("dkv", 4)
    cl = _cluster()
    for direction, ratio in (("forward", 1.0), ("backward", (3 + 8) / (3 + 4))):
        plan = build_plan("ring", direction, groups, causal=False)
        t = [simulate(plan, p, cl, groups, compute=False).time_s for p in (narrow, wide)]
        assert t[1] / t[0] == pytest.approx(ratio, rel=0.02), (direction, t)
