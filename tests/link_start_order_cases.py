"""The rank functions of the start-order links' gloo tests (module level so the forkserver can
pickle them): tests/test_link_start_order.py."""

from __future__ import annotations

import datetime
import random
import time

import torch
import torch.distributed as dist
import virtual_clock_cases as cases

from charm_megatron.lab.emulate import SoftwareLinks
from charm_megatron.lab.emulate.virtual_time import VirtualTime
from charm_megatron.ops.transport import P2P

TIMEOUT = datetime.timedelta(seconds=60)


def _common_start(virtual: VirtualTime) -> float:
    """Every rank's call starts at one time, as the bench's (``_CallClock.start``)."""
    from charm_megatron.lab.bench.measure import _CallClock

    dist.barrier()
    return _CallClock(virtual).start()


def late_early_sender(rank: int, world: int, spec: SoftwareLinks, nbytes: int,
                      tile_wall_s: float, late_s: float) -> dict:
    """2 nodes of 2 ranks on one NIC each: rank 0 sends to rank 2 at the call's start, but its
    host sleeps ``late_s`` before posting; rank 1 runs a tile, then sends to rank 3, posting
    before rank 0 on the wall and later in virtual time. Ranks 2 and 3 receive at once. Each
    rank's start, its message's arrival and its call's virtual end."""
    virtual = VirtualTime()
    dev = cases.timed_device(tile_wall_s, virtual)
    transport = spec.for_rank(rank).transport(clock=virtual)
    buf = torch.zeros(nbytes // 4)
    start = _common_start(virtual)
    if rank == 0:
        time.sleep(late_s)  # a host that runs late on the crowded machine
        dev.before_post()
        op = P2P(True, buf, 2)
    elif rank == 1:
        cases.tile(dev)
        dev.before_post()
        op = P2P(True, buf, 3)
    else:
        dev.before_post()
        op = P2P(False, buf, rank - 2)
    (work,) = transport.post([op])
    work.wait(TIMEOUT)
    dev.posts_done()
    dev.synchronize()
    return {"start": start, "arrival": work.deadline, "end": virtual.now(),
            "late": spec.start_queue().late if spec.start_order else 0}


def all_to_all(rank: int, world: int, spec: SoftwareLinks, nbytes: int, seeds: list) -> list:
    """One all-to-all per entry of ``seeds``, each a call of its own: every rank sends
    ``nbytes`` to every other and receives from each (its sends, then its receives, one post
    each), all at the call's start in virtual time, the hosts posting on the wall in an order
    that ``seed`` shuffles across the ranks and their posts (``None``: rank 0's posts first,
    then rank 1's, ...). Each call's arrivals, from its start, by (src, dst)."""
    virtual = VirtualTime()
    transport = spec.for_rank(rank).transport(clock=virtual)
    peers = [p for p in range(world) if p != rank]
    ops = [(True, p) for p in peers] + [(False, p) for p in peers]
    out = []
    for seed in seeds:
        if seed is None:
            delay = [0.05 * rank] + [0.0] * (len(ops) - 1)
        else:
            rng = random.Random(seed * 1000 + rank)
            delay = [rng.uniform(0.0, 0.03) for _ in ops]
        start = _common_start(virtual)
        works = []
        for (send, peer), pause in zip(ops, delay):
            time.sleep(pause)
            buf = torch.zeros(nbytes // 4)
            (w,) = transport.post([P2P(send, buf, peer)])
            works.append(((rank, peer) if send else (peer, rank), w))
        for _, w in works:
            w.wait(TIMEOUT)
        virtual.posts_done()
        virtual.end_call()
        out.append({key: w.deadline - start for key, w in works})
    return out


def stuck_rank(rank: int, world: int, spec: SoftwareLinks, nbytes: int, stuck_s: float,
               wait_s: float) -> str:
    """Rank 0 sends to rank 1; rank 2 starts the call with them and never posts (its host
    stuck for ``stuck_s``). Ranks 0 and 1: the error their wait raised (``wait_s``), and how
    long it took."""
    virtual = VirtualTime()
    transport = spec.for_rank(rank).transport(clock=virtual)
    _common_start(virtual)
    if rank == 2:
        time.sleep(stuck_s)
        return ""
    t0 = time.monotonic()
    (work,) = transport.post([P2P(rank == 0, torch.zeros(nbytes // 4), 1 - rank)])
    try:
        work.wait(datetime.timedelta(seconds=wait_s))
    except TimeoutError as exc:
        return f"{time.monotonic() - t0:.3f} {exc}"
    return "served"


def two_batches_on_one_stream(rank: int, world: int, spec: SoftwareLinks, nbytes: int,
                              tile_wall_s: float) -> dict:
    """2 nodes of 2 ranks on one NIC each: ranks 0 and 1 each post two batches of one send
    (to rank 2, to rank 3) on one communicator back to back, rank 1 a tile after the call's
    start; ranks 2 and 3 post their two receives so at the start. The call's start and the
    two messages' arrivals of each rank."""
    virtual = VirtualTime()
    dev = cases.timed_device(tile_wall_s, virtual)
    transport = spec.for_rank(rank).transport(clock=virtual)
    start = _common_start(virtual)
    if rank == 1:
        cases.tile(dev)
    dev.before_post()
    peer = rank + 2 if rank < 2 else rank - 2
    works = [transport.post([P2P(rank < 2, torch.zeros(nbytes // 4), peer)])[0]
             for _ in range(2)]
    for w in works:
        w.wait(TIMEOUT)
    dev.posts_done()
    dev.synchronize()
    return {"start": start, "arrivals": [w.deadline for w in works]}
