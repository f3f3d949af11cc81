"""Max-min fair sharing of resources among concurrent activities (progressive filling).

Every running activity (a message in flight, a compute op) is a *job* with a rate. A job uses
some resources (a link direction, a rank's device, the shared core pool) in proportion to its
rate; each resource has a capacity. Progressive filling raises all unfrozen jobs' *level* ``x``
together (a job's rate is ``weight * x``); when a resource saturates, the jobs using it freeze;
a job also freezes at its own cap. The result is the max-min fair allocation, which is how TCP
flows or NCCL channels sharing a link, and threads sharing cores, behave to first order.
"""

from __future__ import annotations

import math
from collections.abc import Hashable, Mapping, Sequence
from dataclasses import dataclass


@dataclass(eq=False)
class Job:
    """One activity: ``remaining`` work, its resource use per unit rate, its cap.

    ``rate = weight * level``; ``uses`` maps resource -> consumption per unit of *rate*;
    ``cap`` bounds the rate (``inf``: only resources bound it). ``tag`` says what the job is
    (``("compute", rank)`` or ``("msg", src, dst, stream)``) for
    :mod:`charm_megatron.model.effects`.
    """

    remaining: float
    uses: tuple[tuple[Hashable, float], ...]
    weight: float = 1.0
    cap: float = math.inf
    rate: float = 0.0
    tag: tuple = ()


def allocate_in_order(jobs: Sequence[Job], capacity: Mapping[Hashable, float]) -> None:
    """Set every job's ``rate`` first come, first served: in ``jobs`` order (the order they
    started), each takes all its resources have left, up to its cap. How one NCCL
    communicator runs the operations issued to it, and how the emulator's software links book
    transfers (lab/emulate/linkmodel.py); the same as :func:`allocate` for jobs that share
    nothing."""
    used: dict[Hashable, float] = {}
    for j in jobs:
        rate = j.cap
        for res, a in j.uses:
            if a > 0:
                rate = min(rate, max(capacity[res] - used.get(res, 0.0), 0.0) / a)
        if rate == math.inf:
            raise ValueError("a job is bounded by neither a resource nor a cap")
        j.rate = rate
        for res, a in j.uses:
            used[res] = used.get(res, 0.0) + a * rate


def allocate(jobs: Sequence[Job], capacity: Mapping[Hashable, float]) -> None:
    """Set every job's ``rate`` to the max-min fair share (weighted by ``weight``)."""
    # Which jobs share each resource: a job alone on all its resources is not contended.
    # (Plain loops, not generators: the simulator calls this at every event.)
    users: dict[Hashable, int] = {}
    for j in jobs:
        for res, _ in j.uses:
            users[res] = users.get(res, 0) + 1
    active = []
    for j in jobs:
        uses = j.uses
        for res, _ in uses:
            if users[res] != 1:
                j.rate = 0.0
                active.append(j)
                break
        else:
            bound = j.cap
            for res, a in uses:
                if a > 0 and capacity[res] / a < bound:
                    bound = capacity[res] / a
            if bound == math.inf:
                raise ValueError("a job is bounded by neither a resource nor a cap")
            j.rate = bound
    if active:
        _fill(active, capacity)


def _fill(active: list[Job], capacity: Mapping[Hashable, float]) -> None:
    """Progressive filling of the contended jobs (each sharing a resource with another)."""
    used: dict[Hashable, float] = {}
    level = 0.0
    while active:
        load: dict[Hashable, float] = {}
        for j in active:
            w = j.weight
            for res, a in j.uses:
                load[res] = load.get(res, 0.0) + a * w
        step = math.inf
        for res, lo in load.items():
            if lo > 0:
                s = (capacity[res] - used.get(res, 0.0)) / lo
                if s < step:
                    step = s
        for j in active:
            s = j.cap / j.weight - level
            if s < step:
                step = s
        if step == math.inf:
            raise ValueError("a job is bounded by neither a resource nor a cap")
        if step < 0:
            step = 0.0
        level += step
        full = set()
        for res, lo in load.items():
            u = used.get(res, 0.0) + lo * step
            used[res] = u
            if u >= capacity[res] * (1 - 1e-9):
                full.add(res)
        still = []
        for j in active:
            if j.cap / j.weight <= level * (1 + 1e-12) or any(res in full for res, _ in j.uses):
                j.rate = min(j.weight * level, j.cap)
            else:
                still.append(j)
        if len(still) == len(active):  # numerical corner: freeze everyone rather than loop
            for j in still:
                j.rate = min(j.weight * level, j.cap)
            break
        active = still
