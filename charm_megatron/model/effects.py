"""Second-order effects of real hardware, kept apart from the event engine (:mod:`.sim`).

The engine calls three functions at three points:

* :func:`kernel_efficiency` when it prices a tile (kernel rate against tile size and head dim);
* :func:`link_capacity` before each fair-share allocation (a link's total delivered rate falls
  when several messages share it);
* :func:`compute_caps` before each allocation (compute of a rank slows while its messages move,
  more with each of its communicators moving data: :func:`contention`);
* :func:`burst_buckets` once per simulation and :func:`split_burst` when a message starts
  (token-bucket links: the first bytes of a call pass at once).

Each effect is off when its :class:`~charm_megatron.model.cluster.Cluster` field is at its
default, so a cluster without them predicts exactly what the plain model did. Sources for the
numbers the shipped profiles use are in docs/model.md ("Effects, and where their numbers come
from").
"""

from __future__ import annotations

from collections.abc import Hashable, Mapping, Sequence

from charm_megatron.model.cluster import Cluster
from charm_megatron.model.fluid import Job

# Resource kinds that are links (their capacity is bytes/s); "dev" and "pool" are compute.
LINK_KINDS = ("iout", "iin", "xout", "xin", "bus")


def head_dim_factor(cluster: Cluster, d: float) -> float:
    """The kernel-rate factor at head dim ``d``: linear between the profile's points."""
    pts = cluster.head_dim_factors
    if not pts:
        return 1.0
    if d <= pts[0][0]:
        return pts[0][1]
    for (d0, f0), (d1, f1) in zip(pts, pts[1:]):
        if d <= d1:
            return f0 + (f1 - f0) * (d - d0) / (d1 - d0)
    return pts[-1][1]


def kernel_efficiency(cluster: Cluster, sq: float, sk: float, d: float) -> float:
    """Fraction of ``cluster.tflops`` a tile of ``sq`` x ``sk`` rows at head dim ``d`` reaches.

    ``1 / (1 + q_rows / sq + k_rows / sk)``: a flash kernel pays a fixed cost per q row block
    (load q, write out and lse) and per kv row block (pipeline fill), so short tiles run below
    the long-tile rate. Times the head-dim factor.
    """
    eff = 1.0
    if cluster.kernel_q_rows and sq > 0:
        eff += cluster.kernel_q_rows / sq
    if cluster.kernel_k_rows and sk > 0:
        eff += cluster.kernel_k_rows / sk
    return head_dim_factor(cluster, d) / eff


def link_capacity(cluster: Cluster, capacity: Mapping[Hashable, float],
                  jobs: Sequence[Job]) -> Mapping[Hashable, float]:
    """Capacities for this allocation: a link with ``k > 1`` messages delivers
    ``1 / (1 + penalty * (k - 1))`` of its nominal capacity (returns ``capacity`` untouched
    when the penalty is 0)."""
    p = cluster.concurrency_penalty
    if not p:
        return capacity
    count: dict[Hashable, int] = {}
    for j in jobs:
        if j.tag and j.tag[0] == "msg":
            for res, _ in j.uses:
                if isinstance(res, tuple) and res[0] in LINK_KINDS:
                    count[res] = count.get(res, 0) + 1
    if not any(k > 1 for k in count.values()):
        return capacity
    out = dict(capacity)
    for res, k in count.items():
        if k > 1:
            out[res] = capacity[res] / (1.0 + p * (k - 1))
    return out


def contention(cluster: Cluster, streams: int) -> float:
    """How many times slower a rank computes while ``streams`` of its communicators move data:
    ``1 + comm_slowdown * k``, ``k`` the streams counted (at most ``comm_slowdown_streams``).

    Why per communicator: each NCCL communicator's kernel holds its own thread blocks (one per
    channel) on the SMs attention runs on, and the H200 proxy measured the slowdown growing
    with the blocks held, about 0.8 % per block (docs/gpu-check.md); ``comm_slowdown`` is one
    communicator's share (docs/model.md, "Effects")."""
    s = cluster.comm_slowdown
    if not s or streams <= 0:
        return 1.0
    cap = cluster.comm_slowdown_streams
    return 1.0 + s * (streams if cap is None else min(streams, cap))


def slowed_s(cluster: Cluster, work_s: float, remaining: Sequence[float]) -> float:
    """Seconds that ``work_s`` of compute at full speed takes from now when each of the rank's
    communicators in ``remaining`` still moves data for that many seconds: slowed by
    :func:`contention` of those still moving, which fall away one by one as each ends."""
    return slowed_over(cluster, work_s, 0.0, {i: [(0.0, end)] for i, end in enumerate(remaining)})


def slowed_over(cluster: Cluster, work_s: float, start: float,
                spans: Mapping[Hashable, Sequence[tuple[float, float]]],
                scale: float = 1.0) -> float:
    """Seconds that ``work_s`` of compute at full speed takes from ``start`` while each
    communicator moves data during its ``spans`` (``(from, to)`` times, ``scale`` of them per
    second of compute: the emulator's dilation): :func:`contention` of the ``k`` moving at
    each moment, full speed where none is. With every span under way at ``start`` it is
    :func:`slowed_s`; the timed device (``lab/emulate/moving.py``) gives spans that start
    later too."""
    rel = {c: [((lo - start) / scale, (hi - start) / scale) for lo, hi in v if hi > start]
           for c, v in spans.items()}
    rel = {c: v for c, v in rel.items() if v}
    cuts = sorted({p for v in rel.values() for span in v for p in span if p > 0})
    t, left = 0.0, work_s
    for cut in cuts:
        k = sum(1 for v in rel.values() if any(lo <= t < hi for lo, hi in v))
        slow = contention(cluster, k)
        if left * slow <= cut - t:
            return t + left * slow
        left -= (cut - t) / slow
        t = cut
    return t + left  # nothing moves after the last cut


def compute_caps(cluster: Cluster, jobs: Sequence[Job]) -> None:
    """Cap each compute job at ``1 / contention(k)`` where ``k`` is the number of distinct
    streams (communicators) with a message of its rank moving (sent or received; with
    ``comm_slowdown_links="cross"`` only cross-group messages count), full speed when none
    moves. Mutates the jobs' ``cap``. (One pass over the jobs: the simulator calls this at
    every event.)"""
    if not cluster.comm_slowdown:
        return
    moving: dict[int, set[Hashable]] = {}
    computes: list[Job] = []
    cross_only = cluster.comm_slowdown_links == "cross"
    for j in jobs:
        tag = j.tag
        if not tag:
            continue
        if tag[0] == "compute":
            computes.append(j)
        elif tag[0] == "msg" and j.remaining > 0:
            if cross_only and not any(isinstance(res, tuple) and res[0] in ("xout", "xin")
                                      for res, _ in j.uses):
                continue
            _, src, dst, stream = tag
            if src in moving:
                moving[src].add(stream)
            else:
                moving[src] = {stream}
            if dst in moving:
                moving[dst].add(stream)
            else:
                moving[dst] = {stream}
    caps: dict[int, float] = {}  # by streams moving: the same contention for every rank
    for j in computes:
        k = len(moving.get(j.tag[1], ()))
        cap = caps.get(k)
        if cap is None:
            cap = caps[k] = 1.0 / contention(cluster, k)
        j.cap = cap


def burst_buckets(cluster: Cluster, capacity: Mapping[Hashable, float]) -> dict[Hashable, float]:
    """Bytes each bucketed link lets through before its rate applies (empty: no buckets)."""
    out: dict[Hashable, float] = {}
    intra_on = ("bus",) if cluster.intra_bus_gbps is not None else ("iout", "iin")
    for res in capacity:
        if not isinstance(res, tuple):
            continue
        if res[0] in ("xout", "xin") and cluster.cross_burst_kb:
            out[res] = cluster.cross_burst_kb * 1024.0
        elif res[0] in intra_on and cluster.intra_burst_kb:
            out[res] = cluster.intra_burst_kb * 1024.0
    return out


def split_burst(buckets: dict[Hashable, float], uses: tuple[tuple[Hashable, float], ...],
                nbytes: float) -> list[tuple[float, tuple[tuple[Hashable, float], ...]]]:
    """A message's phases ``[(bytes, uses), ...]``: first what the buckets of *all* its
    bucketed links still hold (those links not used), then the rest over every link. Takes the
    credit from the buckets."""
    held = [res for res, _ in uses if res in buckets]
    if not held:
        return [(nbytes, uses)]
    credit = min(min(buckets[res] for res in held), nbytes)
    if credit <= 0:
        return [(nbytes, uses)]
    for res in held:
        buckets[res] -= credit
    free = tuple((res, a) for res, a in uses if res not in buckets)
    phases = [(credit, free)]
    if nbytes - credit > 0:
        phases.append((nbytes - credit, uses))
    return phases
