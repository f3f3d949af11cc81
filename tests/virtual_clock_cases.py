"""The rank function of the virtual clock's gloo test (module level so the forkserver can
pickle it): tests/test_virtual_clock.py."""

from __future__ import annotations

import datetime
import time

import torch
import torch.distributed as dist

from charm_megatron.devices import get_profile
from charm_megatron.lab.emulate import SoftwareLinks
from charm_megatron.lab.emulate.device import TimedBackend
from charm_megatron.lab.emulate.virtual_time import VirtualTime
from charm_megatron.ops.transport import P2P

TIMEOUT = datetime.timedelta(seconds=60)


def tile(dev: TimedBackend) -> None:
    """One small forward tile on ``dev`` (64 rows, 4 heads of 64, bf16)."""
    q = torch.zeros(64, 1, 4, 64, dtype=torch.bfloat16)
    dev.forward(q, q, q, False, 0.1)


def timed_device(tile_wall_s: float, virtual: VirtualTime | None) -> TimedBackend:
    """A timed H200, dilated so that :func:`tile` lasts ``tile_wall_s``, no SM contention."""
    cluster = get_profile("h200").cluster
    tile_s = TimedBackend(cluster).tile_seconds(64, 64, 1, 4, 4, 64, 2, False, False)
    return TimedBackend(cluster, dilation=tile_wall_s / tile_s, sm_contention=False,
                        virtual=virtual)


def late_receiver(rank: int, world: int, spec: SoftwareLinks, nbytes: int, tile_wall_s: float,
                  late_s: float) -> dict:
    """Rank 0 sends rank 1 a message and receives its answer; rank 1 receives, its host wakes
    ``late_s`` late, runs one tile and answers. Every post and wait through the software
    links on the rank's virtual clock, timed as the bench times a call."""
    virtual = VirtualTime()
    dev = timed_device(tile_wall_s, virtual)
    links = spec.for_rank(rank)
    transport = links.transport(clock=virtual)
    out_buf, in_buf = torch.zeros(nbytes // 4), torch.zeros(nbytes // 4)
    dist.barrier()
    start = virtual.begin()
    got: dict = {"start": start}
    if rank == 0:
        dev.before_post()
        for w in transport.post([P2P(True, out_buf, 1), P2P(False, in_buf, 1)]):
            w.wait(TIMEOUT)
    else:
        dev.before_post()
        (recv,) = transport.post([P2P(False, in_buf, 0)])
        recv.wait(TIMEOUT)
        got["first_arrival"] = recv.deadline
        time.sleep(late_s)  # the host wakes late after the message (a crowded machine)
        tile(dev)
        dev.before_post()
        got["answer_wall_post"] = time.monotonic()
        (send,) = transport.post([P2P(True, out_buf, 0)])
        send.wait(TIMEOUT)
        got["egress_busy_until"] = links.cross_out.busy_until
    dev.synchronize()
    got["end"] = virtual.now()
    return got


def call_start(rank: int, world: int, late_s: float) -> tuple[float, float]:
    """The bench's virtual start of a timed call on this rank, rank 1 reaching it ``late_s``
    after the barrier; (that start, this rank's wall time when it reached it)."""
    from charm_megatron.lab.bench.measure import _CallClock

    dist.barrier()
    if rank == 1:
        time.sleep(late_s)
    reached = time.monotonic()
    return _CallClock(VirtualTime()).start(), reached
