"""SM contention scales with the communicators in flight (issue 41, item 3).

A rank's compute runs ``1 + comm_slowdown * k`` times slower while messages of ``k`` of its
streams (communicators) move, ``k`` capped by ``comm_slowdown_streams`` (``1``: the flat
slowdown of before). Each case is computed three ways where it can be: by hand (written out
in the test), by the performance model on a hand-built plan (``model/sim.py``), and by the
emulator's timed device (``lab/emulate/device.py``) driven directly, without processes, on a
frozen clock.
"""

from __future__ import annotations

import pytest

from charm_megatron.devices import get_profile
from charm_megatron.lab.emulate.device import LinkClock, TimedBackend
from charm_megatron.model import Cluster, simulate, tile_flops
from charm_megatron.model.effects import contention, slowed_s
from charm_megatron.model.te_contenders import te_cluster
from charm_megatron.plan.core import Comm, Half, Plan, Tile, Wait, Xfer, tile_spec
from charm_megatron.plan.cost import Problem

S = 0.25  # comm_slowdown per communicator in these tests
N = 4  # ranks of the hand-built plans
P = Problem(b=1, s=2048, hq=1, hkv=1, d=64, elem=2)
BLOCK = P.block_bytes("kv", N)  # one message: one kv block of P over N ranks
WORK_S = 1.0  # one tile at full speed


def _cluster(intra_s: float, cross_s: float, streams: int | None = None) -> Cluster:
    """A device on which one tile takes ``WORK_S`` and a message takes ``intra_s`` inside a
    group and ``cross_s`` across (no latency, no overheads)."""
    tflops = tile_flops(tile_spec(0, 0, False), P, N) / WORK_S / 1e12
    return Cluster(intra_gbps=BLOCK / intra_s / 1e9, cross_gbps=BLOCK / cross_s / 1e9,
                   tflops=tflops, comm_slowdown=S, comm_slowdown_streams=streams)


def _send(handle: int, stream: str, peers: list[int]) -> Comm:
    return Comm(handle, stream, tuple(Xfer(p, "own.kv", "kv", 0, Half.FULL) for p in peers))


def _recv(handle: int, stream: str, src: int) -> Comm:
    return Comm(handle, stream, (), (Xfer(src, "kv.rx", "kv", src, Half.FULL),))


def _tile_busy_s(rank0: list[Comm], peers: dict[int, list[Comm]], cluster: Cluster,
                 groups: list[list[int]]) -> float:
    """Rank 0 posts ``rank0``, computes one tile, waits its batches; every peer posts its
    batches and waits them. Rank 0's busy time: its tile's wall time in the model."""
    plan = Plan("contention", "forward", N, (tuple(range(N)),), False)
    tile = Tile(tile_spec(0, 0, False), "own.q", "own.kv", "acc.out")
    plan.ops = [[*rank0, tile, *(Wait(c.handle) for c in rank0)]]
    plan.ops += [[*peers.get(r, []), *(Wait(c.handle) for c in peers.get(r, []))]
                 for r in range(1, N)]
    return simulate(plan, P, cluster, groups).ranks[0].busy_s


# Rank 0's batches while its tile runs (every message outlasts it), and the streams counted.
CASES = {
    "one stream": ([_send(0, "kv", [1])], 1),
    "two streams": ([_send(0, "kv", [1]), _send(1, "q", [2])], 2),
    "three streams": ([_send(0, "kv", [1]), _send(1, "q", [2]), _send(2, "cross", [3])], 3),
    # Two messages of one communicator are one stream, whatever their count...
    "two messages, one stream": ([_send(0, "kv", [1, 2])], 1),
    # ... and a stream counts whether the rank sends or receives on it.
    "a receive and a send": ([_recv(0, "kv", 1), _send(1, "q", [2])], 2),
}


def _peers(rank0: list[Comm]) -> dict[int, list[Comm]]:
    """Each peer's matching batch: a receive for rank 0's send, a send for its receive."""
    out: dict[int, list[Comm]] = {}
    for c in rank0:
        for x in c.sends:
            out.setdefault(x.peer, []).append(_recv(len(out.get(x.peer, [])), c.stream, 0))
        for x in c.recvs:
            out.setdefault(x.peer, []).append(_send(len(out.get(x.peer, [])), c.stream, [0]))
    return out


@pytest.mark.parametrize("case", CASES)
@pytest.mark.parametrize("cap", [None, 1, 2])
def test_the_model_slows_compute_once_per_stream_in_flight(case, cap):
    """One tile of 1 s while every message moves for 30 s or more: it takes
    ``1 + S * min(k, cap)`` seconds, ``k`` the streams of rank 0 moving (cap 1: the flat
    slowdown, 1.25 s whatever is in flight)."""
    rank0, k = CASES[case]
    cluster = _cluster(intra_s=30.0, cross_s=30.0, streams=cap)
    counted = k if cap is None else min(k, cap)
    hand = WORK_S * (1 + S * counted)
    got = _tile_busy_s(rank0, _peers(rank0), cluster, [[r] for r in range(N)])
    assert got == pytest.approx(hand, rel=1e-9)
    assert contention(cluster, k) == pytest.approx(1 + S * counted)


def test_one_two_three_streams_cost_one_two_three_times_the_slowdown():
    cluster = _cluster(intra_s=30.0, cross_s=30.0)
    extra = [_tile_busy_s(CASES[c][0], _peers(CASES[c][0]), cluster,
                          [[r] for r in range(N)]) - WORK_S
             for c in ("one stream", "two streams", "three streams")]
    assert extra == pytest.approx([S, 2 * S, 3 * S], rel=1e-9)


# Rank 0 sends on stream kv inside its group (0.5 s) and on stream q across (1.0 s), each on
# links of its own, and computes one tile from the same instant.
INTRA_S, CROSS_S = 0.5, 1.0
GROUPS = [[0, 1], [2], [3]]


def _falling_hand(cap: int | None) -> float:
    """By hand: two streams until 0.5 s, one until 1.0 s, then full speed."""
    two = 1 + S * (2 if cap is None else min(2, cap))
    one = 1 + S
    done = INTRA_S / two + (CROSS_S - INTRA_S) / one  # work done by 1.0 s
    return CROSS_S + (WORK_S - done)


@pytest.mark.parametrize("cap", [None, 1])
def test_the_count_falls_as_each_stream_ends_alike_in_model_and_emulator(monkeypatch, cap):
    """Scaled (``cap=None``): 0.5 s at 1.5x (1/3 s of work), 0.5 s at 1.25x (0.4 s), the
    remaining 4/15 s at full speed: 1.2667 s. Flat (``cap=1``): 1 s at 1.25x, then 0.2 s:
    1.2 s. The model on a hand-built plan, the effects' ``slowed_s`` and the timed device
    (posts on streams kv and q, frozen clock) give the same."""
    hand = _falling_hand(cap)
    assert hand == pytest.approx(1.0 + 4 / 15 if cap is None else 1.2)
    cluster = _cluster(INTRA_S, CROSS_S, streams=cap)
    rank0 = [_send(0, "kv", [1]), _send(1, "q", [2])]
    assert _tile_busy_s(rank0, _peers(rank0), cluster, GROUPS) == pytest.approx(hand, rel=1e-9)
    assert slowed_s(cluster, WORK_S, [INTRA_S, CROSS_S]) == pytest.approx(hand, rel=1e-12)

    now = [100.0]
    monkeypatch.setattr("charm_megatron.lab.emulate.device.time.perf_counter", lambda: now[0])
    links = LinkClock(0, tuple(tuple(g) for g in GROUPS), intra_Bps=BLOCK / INTRA_S,
                      cross_Bps=BLOCK / CROSS_S)
    dev = TimedBackend(cluster, dilation=3.0, links=links, sleep=lambda s: None)
    dev.posted(0, [(1, BLOCK)], "kv")
    dev.posted(1, [(2, BLOCK)], "q")
    rows = P.s // N  # the model's tile: one block of q rows against one of kv rows
    tile = dev.tile_seconds(rows, rows, P.b, P.hq, P.hkv, P.d, P.elem, False, False)
    assert tile == pytest.approx(hand, rel=1e-9)


def test_the_timed_device_counts_streams_not_batches(monkeypatch):
    """Two batches of one stream are one communicator; a third stream adds one more; once a
    stream's batches are waited it no longer counts."""
    now = [100.0]
    monkeypatch.setattr("charm_megatron.lab.emulate.device.time.perf_counter", lambda: now[0])
    cluster = _cluster(30.0, 30.0)
    links = LinkClock(0, tuple((r,) for r in range(N)), intra_Bps=BLOCK / 30.0,
                      cross_Bps=BLOCK / 30.0)
    dev = TimedBackend(cluster, links=links, sleep=lambda s: None)
    assert dev._slowed(WORK_S) == WORK_S  # nothing posted
    dev.posted(0, [(1, BLOCK)], "kv")
    dev.posted(1, [(2, BLOCK)], "kv")
    assert dev._slowed(WORK_S) == pytest.approx(1 + S)
    dev.posted(2, [(3, BLOCK)], "cross")
    assert dev._slowed(WORK_S) == pytest.approx(1 + 2 * S)
    dev.posted(3, [(3, BLOCK)])  # no stream named: one more (unnamed) communicator
    assert dev._slowed(WORK_S) == pytest.approx(1 + 3 * S)
    for h in (0, 1, 3):
        dev.waited(h)
    assert dev._slowed(WORK_S) == pytest.approx(1 + S)  # cross only
    now[0] += 31.0  # every transfer has arrived by the links' clock
    assert dev._slowed(WORK_S) == WORK_S
    flat = TimedBackend(cluster.with_(comm_slowdown_streams=1), links=links,
                        sleep=lambda s: None)
    for h, stream in enumerate(("kv", "q", "cross")):
        flat.posted(h, [(h + 1, BLOCK)], stream)
    assert flat._slowed(WORK_S) == pytest.approx(1 + S)


def test_the_cap_is_a_whole_number_and_described():
    for bad in (0, -1, True, 1.5):
        with pytest.raises(ValueError, match="comm_slowdown_streams"):
            _cluster(1.0, 1.0, streams=bad)
    assert "+25% per stream under comm" in _cluster(1.0, 1.0).describe()
    assert "+25% under comm" in _cluster(1.0, 1.0, streams=1).describe()
    assert "per stream (at most 2)" in _cluster(1.0, 1.0, streams=2).describe()
    assert contention(_cluster(1.0, 1.0).with_(comm_slowdown=0.0), 3) == 1.0


def test_shipped_gpu_profiles_scale_and_te_counts_one_communicator():
    """The GPU profiles count every stream (Lee et al.'s 0.189 per communicator); the CPU
    testbed has no SM contention; TransformerEngine's contenders run their ring on one
    communicator, so they count one."""
    for name in ("h100", "h200", "h20", "l20-pcie", "h100-paper", "h100-paper-measured"):
        prof = get_profile(name)
        assert prof.cluster.comm_slowdown == pytest.approx(0.189), name
        assert prof.cluster.comm_slowdown_streams is None, name
        assert te_cluster(prof).comm_slowdown_streams == 1, name
    assert get_profile("cpu-testbed").cluster.comm_slowdown == 0.0


def test_cross_only_slowdown_counts_only_cross_transfers_alike_in_model_and_emulator(
        monkeypatch):
    """``comm_slowdown_links="cross"`` (the paper's implementation, h100-paper-appendix):
    rank 0 sends on stream kv inside its group for 1.0 s and on stream q across for 0.5 s. By
    hand only q counts: 0.5 s at 1.25x (0.4 s of work), then 0.6 s at full speed: 1.1 s
    (counting both: 1.2667 s). The model and the timed device agree."""
    from dataclasses import replace

    hand = 0.5 + (WORK_S - 0.5 / (1 + S))
    assert hand == pytest.approx(1.1)
    cluster = replace(_cluster(intra_s=1.0, cross_s=0.5), comm_slowdown_links="cross")
    rank0 = [_send(0, "kv", [1]), _send(1, "q", [2])]
    assert _tile_busy_s(rank0, _peers(rank0), cluster, GROUPS) == pytest.approx(hand, rel=1e-9)
    both = _tile_busy_s(rank0, _peers(rank0), replace(cluster, comm_slowdown_links="all"),
                        GROUPS)
    assert both > hand + 0.1

    now = [100.0]
    monkeypatch.setattr("charm_megatron.lab.emulate.device.time.perf_counter", lambda: now[0])
    links = LinkClock(0, tuple(tuple(g) for g in GROUPS), intra_Bps=BLOCK / 1.0,
                      cross_Bps=BLOCK / 0.5)
    dev = TimedBackend(cluster, dilation=3.0, links=links, sleep=lambda s: None)
    dev.posted(0, [(1, BLOCK)], "kv")
    dev.posted(1, [(2, BLOCK)], "q")
    rows = P.s // N
    tile = dev.tile_seconds(rows, rows, P.b, P.hq, P.hkv, P.d, P.elem, False, False)
    assert tile == pytest.approx(hand, rel=1e-9)


def test_slowdown_links_must_be_all_or_cross():
    with pytest.raises(ValueError, match="comm_slowdown_links must be one of"):
        _cluster(1.0, 1.0).with_(comm_slowdown_links="intra")


# A tile's whole price is slowed, not only its FLOPs: WORK_S of FLOPs, FOLD_S to fold its
# result (out and lse) into the accumulators, OVER_S per op.
FOLD_S, OVER_S = 0.5, 0.25


def _priced(cluster: Cluster) -> Cluster:
    return cluster.with_(merge_gbps=P.local_bytes("out", N) / FOLD_S / 1e9,
                         op_overhead_us=OVER_S * 1e6)


def _frozen_device(monkeypatch, cluster: Cluster, intra_s: float, cross_s: float,
                   groups) -> TimedBackend:
    monkeypatch.setattr("charm_megatron.lab.emulate.device.time.perf_counter", lambda: 100.0)
    links = LinkClock(0, tuple(tuple(g) for g in groups), intra_Bps=BLOCK / intra_s,
                      cross_Bps=BLOCK / cross_s)
    return TimedBackend(cluster, dilation=3.0, links=links, sleep=lambda s: None)


def test_a_tiles_fold_and_overhead_are_slowed_too_alike_in_model_and_emulator(monkeypatch):
    """The model's compute op is one job at its whole cost (FLOPs, fold, per-op overhead),
    capped at ``1 / contention`` while bytes move; the timed device slows the same whole
    (until 2026-12-06 it slowed the FLOPs alone: 1.25 + 0.5 + 0.25 = 2.0 s here, where the
    model says 1.75 x 1.25 = 2.1875 s; on the h100 ring's short backward steps that put the
    emulator 7 % under the model). One stream moving for 30 s, longer than the tile."""
    cluster = _priced(_cluster(intra_s=30.0, cross_s=30.0))
    hand = (WORK_S + FOLD_S + OVER_S) * (1 + S)
    rank0 = [_send(0, "kv", [1])]
    groups = [[r] for r in range(N)]
    assert _tile_busy_s(rank0, _peers(rank0), cluster, groups) == pytest.approx(hand, rel=1e-9)
    dev = _frozen_device(monkeypatch, cluster, 30.0, 30.0, groups)
    dev.posted(0, [(1, BLOCK)], "kv")
    rows = P.s // N
    tile = dev.tile_seconds(rows, rows, P.b, P.hq, P.hkv, P.d, P.elem, False, False)
    assert tile == pytest.approx(hand, rel=1e-9)


def test_a_merge_is_slowed_while_bytes_move_alike_in_model_and_emulator(monkeypatch):
    """Rank 0 sends a kv block on stream kv inside its group (30 s) and receives one on
    stream q across (0.5 s), then merges it: the merge (the block at the merge rate, plus
    OVER_S) runs while the kv stream moves, ``1 + S`` times slower in the model and on the
    timed device (which did not slow merges before 2026-12-06)."""
    from charm_megatron.plan.core import Merge

    cluster = _priced(_cluster(intra_s=30.0, cross_s=0.5))
    groups = [[0, 1], [2], [3]]
    hand = (BLOCK / (cluster.merge_gbps * 1e9) + OVER_S) * (1 + S)
    send, recv = _send(0, "kv", [1]), _recv(1, "q", 2)
    plan = Plan("contention", "backward", N, (tuple(range(N)),), False)
    plan.ops = [[send, recv, Wait(1), Merge("acc.dkv", "kv.rx"), Wait(0)],
                [_recv(0, "kv", 0), Wait(0)], [_send(0, "q", [0]), Wait(0)], []]
    assert simulate(plan, P, cluster, groups).ranks[0].busy_s == pytest.approx(hand, rel=1e-9)
    dev = _frozen_device(monkeypatch, cluster, 30.0, 0.5, groups)
    dev.posted(0, [(1, BLOCK)], "kv")
    dev.merged(BLOCK)
    assert dev.clock.device_s == pytest.approx(hand, rel=1e-9)
