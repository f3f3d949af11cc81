"""The emulator's asynchronous timed device (issue 41, docs/emulator.md): ops are queued on the
device's timeline like a GPU stream's kernels, the host's own CPU work overlaps them, and the
host waits for the device only before a post and at the end of a call."""

from __future__ import annotations

import time

import async_device_cases
import pytest
import torch

from charm_megatron.devices import get_profile
from charm_megatron.lab.emulate.device import LinkClock, TimedBackend, WireScale
from charm_megatron.local_ranks import run_ranks

H200 = get_profile("h200").cluster
TILE_WALL_S = 0.3  # one tile's device time x D in the timing tests below
HOST_S = 0.2  # the host's CPU work between two tiles: shorter than a tile


def _tile(dev: TimedBackend) -> None:
    q = torch.zeros(64, 1, 4, 64, dtype=torch.bfloat16)
    dev.forward(q, q, q, False, 0.1)


def _device(synchronous: bool, **kw) -> TimedBackend:
    """A timed H200 dilated so that :func:`_tile` lasts :data:`TILE_WALL_S`."""
    probe = TimedBackend(H200, sm_contention=False)
    tile_s = probe.tile_seconds(64, 64, 1, 4, 4, 64, 2, False, False)
    return TimedBackend(H200, dilation=TILE_WALL_S / tile_s, sm_contention=False,
                        synchronous=synchronous, **kw)


@pytest.mark.parametrize("synchronous", [False, True])
def test_host_work_between_tiles_overlaps_only_the_asynchronous_device(synchronous):
    """Two tiles with :data:`HOST_S` of host work between them: the asynchronous device runs
    the second tile right after the first (the host's work hidden under the first), 2 tiles in
    all; the synchronous one adds the host's work."""
    dev = _device(synchronous)
    t0 = time.perf_counter()
    _tile(dev)
    issued = time.perf_counter() - t0
    time.sleep(HOST_S)  # the host's own CPU work (Python, torch on wire tensors, ...)
    _tile(dev)
    dev.synchronize()
    wall = time.perf_counter() - t0
    if synchronous:
        assert issued >= TILE_WALL_S
        assert wall >= 2 * TILE_WALL_S + HOST_S
    else:
        assert issued < TILE_WALL_S / 3  # queued, not waited for
        assert 2 * TILE_WALL_S <= wall < 2 * TILE_WALL_S + HOST_S / 2
    assert dev.clock.tiles == 2
    assert dev.clock.device_s * dev.dilation == pytest.approx(2 * TILE_WALL_S, rel=1e-9)
    # waited: wall time in sleeps / D; the asynchronous host slept only in synchronize: the
    # second tile and what the host's work left of the first (a little more if the sleeps
    # overshoot on a loaded machine)
    waited = dev.clock.waited_s * dev.dilation
    if synchronous:
        assert waited >= 2 * TILE_WALL_S
    else:
        assert TILE_WALL_S - 0.01 <= waited <= 2 * TILE_WALL_S - HOST_S + HOST_S / 2


def test_the_asynchronous_device_queues_each_op_at_the_synchronous_ones_price(monkeypatch):
    """On a frozen clock each op lengthens the queue by what the synchronous device sleeps
    for it (tile, merge, copy alike), starting where the queue ends; synchronize then sleeps
    the whole queue."""
    now = [100.0]
    monkeypatch.setattr("charm_megatron.lab.emulate.device.time.perf_counter", lambda: now[0])
    slept: list[float] = []
    scale = WireScale(batch=2, rows=8)
    sync = TimedBackend(H200, dilation=10.0, scale=scale, sleep=slept.append, synchronous=True)
    queued = TimedBackend(H200, dilation=10.0, scale=scale, sleep=slept.append)
    for dev in (sync, queued):
        _tile(dev)
        dev.merged(1_000_000)
        dev.copied(3_000_000)
    assert len(slept) == 3 and queued.busy_until == pytest.approx(100.0 + sum(slept))
    assert sync.busy_until == 0.0  # the synchronous device never queues
    queued.synchronize()
    assert slept[3:] == pytest.approx([sum(slept[:3])])
    assert queued.clock.device_s == pytest.approx(sync.clock.device_s, rel=1e-12)


def test_contention_counts_from_the_ops_start_on_the_device(monkeypatch):
    """A tile queued behind 1 s of device work while a transfer moves for 1.5 s more is
    slowed only for the 0.5 s of the transfer left when it starts, not for all of it."""
    now = [100.0]
    monkeypatch.setattr("charm_megatron.lab.emulate.device.time.perf_counter", lambda: now[0])
    links = LinkClock(0, ((0,), (1,)), intra_Bps=1e12, cross_Bps=1e9)
    dev = TimedBackend(H200, links=links, sleep=lambda s: None)
    dev.posted(3, [(1, 1_500_000_000)])  # posted on an idle device: moves until 101.5
    dev._wait(1.0, tile=False)  # the device is busy until 101.0
    slow = 1.0 + H200.comm_slowdown
    assert dev._slowed(1.0) == pytest.approx(0.5 + (1.0 - 0.5 / slow))  # not 1.0 * slow
    now[0] = 101.0  # the host catches up with the device: the same start, the same price
    assert dev._slowed(1.0) == pytest.approx(0.5 + (1.0 - 0.5 / slow))


class _Booked:
    """A link handle whose arrival the software links have booked (``None``: not yet)."""

    def __init__(self, deadline):
        self.deadline = deadline


def test_contention_lasts_until_the_links_booked_arrival(monkeypatch):
    """A transfer that queues behind others on a shared link moves longer than alone: once
    the links have booked its arrival the slowdown lasts until then (the model counts a
    queued message as moving), and until they have, the alone-time estimate holds."""
    now = [100.0]
    monkeypatch.setattr("charm_megatron.lab.emulate.device.time.perf_counter", lambda: now[0])
    links = LinkClock(0, ((0,), (1,)), intra_Bps=1e12, cross_Bps=1e9)
    slow = 1.0 + H200.comm_slowdown
    dev = TimedBackend(H200, links=links, sleep=lambda s: None)
    late, unknown = _Booked(102.0), _Booked(None)
    dev.posted(3, [(1, 500_000_000)], works=[(1, late)])  # alone 0.5 s, booked 2 s
    assert dev._slowed(1.0) == pytest.approx(slow)  # slowed all through, not 0.5 s of it
    dev.waited(3)
    dev.posted(4, [(1, 500_000_000)], works=[(1, unknown)])  # not booked: 0.5 s alone
    assert dev._slowed(1.0) == pytest.approx(0.5 + (1.0 - 0.5 / slow))
    unknown.deadline = 100.25  # booked sooner than alone would take: its own arrival
    assert dev._slowed(1.0) == pytest.approx(0.25 + (1.0 - 0.25 / slow))


def test_a_ranks_posts_wait_for_its_device_and_a_call_for_its_device_work():
    """Two gloo ranks, ring forward and backward on the asynchronous timed device: no batch
    with sends is posted before the device has run the ops queued before it (the backward's
    partials leave right after their tile), each call returns only when its device work is
    done, and its wall time holds all of it."""
    per_rank = run_ranks(async_device_cases.timed_ring_call, 2, 0.15, False, timeout_s=240,
                         pg_timeout_s=60)
    for rank, got in enumerate(per_rank):
        early = [(t, busy) for t, busy in got["posts"] if t < busy]
        assert not early, (rank, early)
        assert any(busy > 0 for _, busy in got["posts"]), rank  # posts after device ops
        for direction in ("fwd", "bwd"):
            assert got[f"{direction}_left_s"] == 0.0, (rank, direction)
            assert got[direction] >= got[f"{direction}_device_wall_s"] > 0.1, (rank, got)
        assert got["waited_s"] > 0.1, rank
