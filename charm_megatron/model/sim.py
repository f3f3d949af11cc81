"""Replay a plan on a described cluster: a discrete-event simulation of all ranks at once.

Semantics (the executor's, on NCCL):

* each rank runs its ops in order on one program clock: ``Tile`` / ``TileBwd`` / ``Merge``
  / ``SuperTile`` (one kernel call over several kv blocks) occupy the rank's compute (its
  device, or a worker of the shared core pool) for their cost;
  ``Comm`` posts a batch without blocking (``msg_cpu_us`` per message first, if set);
  ``Wait`` blocks until that batch has completed; ``Reset`` is free;
* a stream of a rank is serial (one NCCL communicator): its batches become *active* one after
  another, each when the previous one completed;
* a message flows once the sender's and the receiver's batches holding it are both active
  (grouped point-to-point, pair by pair, in posted order); a batch completes when all its
  sends and receives have arrived;
* a message waits ``latency_us``, then moves its bytes over its links, sharing each link
  max-min fairly with whatever else is in flight (:mod:`charm_megatron.model.fluid`).

Second-order effects (kernel rate against tile size and head dim, compute slowed while messages
move, links delivering less under concurrency) live in :mod:`charm_megatron.model.effects`,
called where a tile is priced and before each fair-share allocation. No protocol effects
(chunking, PCIe packet overheads), no memory-bandwidth contention beyond ``merge_gbps``.
docs/model.md lists what is in and out.
"""

from __future__ import annotations

import heapq
import math
from collections.abc import Callable, Hashable, Sequence
from dataclasses import dataclass, field

from charm_megatron.model import effects
from charm_megatron.model.cluster import Cluster
from charm_megatron.model.fluid import Job, allocate, allocate_in_order
from charm_megatron.model.links import Links
from charm_megatron.plan.batches import BatchMismatch, StreamQueues, messages_between
from charm_megatron.plan.core import (
    Comm,
    Merge,
    OpInterpreter,
    Plan,
    Reset,
    SuperTile,
    Tile,
    TileBwd,
    TileSpec,
    Wait,
    Xfer,
)
from charm_megatron.plan.cost import Problem, traffic
from charm_megatron.plan.fuse import joint_kv
from charm_megatron.plan.vocab import Kind


class ModelError(RuntimeError):
    """The simulation cannot finish (a plan that deadlocks, or mismatched batches)."""


@dataclass(frozen=True)
class RankStats:
    """One rank's time line in a simulation (seconds)."""

    finish_s: float  # when its last op completed
    busy_s: float  # wall time with a compute op (tile, merge, message overhead) running
    work_s: float  # compute work at full speed (differs from busy_s on a shared pool)


@dataclass(frozen=True)
class SimResult:
    """Predicted time of one plan on one cluster, with per-rank and per-link-class detail."""

    algo: str
    direction: str
    time_s: float  # makespan: the last rank's finish
    ranks: tuple[RankStats, ...]
    intra_bytes: float  # bytes sent inside hardware groups, all ranks
    cross_bytes: float  # bytes sent between hardware groups, all ranks
    max_rank_intra_bytes: float
    max_rank_cross_bytes: float
    messages: int

    @property
    def busy_fraction(self) -> float:
        """Mean over ranks of busy time / makespan (1.0: no rank ever waited)."""
        if not self.time_s:
            return 1.0
        return sum(r.busy_s for r in self.ranks) / (len(self.ranks) * self.time_s)

    def idle_s(self, rank: int) -> float:
        """Time ``rank`` spent without compute before the last rank finished."""
        return self.time_s - self.ranks[rank].busy_s


def tile_flops(spec: TileSpec, problem: Problem, n: int) -> float:
    """Forward FLOPs of one tile: two matmuls, ``QK^T`` (``2·b·hq·d·sq·sk``) and ``PV``
    (``2·b·hq·dv·sq·sk``; MLA's v is narrower), halved for a causal diagonal tile (the mask
    keeps half the scores)."""
    rows = problem.s / n
    sq = rows * spec.q_half.fraction
    sk = rows * spec.kv_half.fraction
    flops = 2.0 * problem.b * problem.hq * (problem.d + problem.v_dim) * sq * sk
    return flops / 2 if spec.causal else flops


@dataclass(eq=False)
class _Batch:
    rank: int
    op: Comm
    pending: int
    active: bool = False
    done: bool = False
    matched: set[int] = field(default_factory=set)
    waiter: bool = False


class _Engine(OpInterpreter[None]):
    def __init__(self, plan: Plan, problem: Problem, cluster: Cluster,
                 groups: Sequence[Sequence[int]], compute: bool, comm: bool) -> None:
        self.plan, self.problem, self.cl = plan, problem, cluster
        self.n = plan.n
        self.compute, self.comm = compute, comm
        self.group_of = {r: gi for gi, g in enumerate(groups) for r in g}
        if sorted(self.group_of) != list(range(self.n)):
            raise ValueError(f"groups {groups} do not cover the plan's {self.n} ranks exactly")
        self.t = 0.0
        self.pc = [0] * self.n
        self.r = 0  # the rank whose op is being interpreted
        self.blocked = [False] * self.n
        self.paid = [False] * self.n  # the current Comm's message overhead is done
        self.finish: list[float | None] = [None] * self.n
        self.busy = [0.0] * self.n
        self.work = [0.0] * self.n
        self.batches: dict[tuple[int, int], _Batch] = {}
        self.queues: StreamQueues[_Batch] = StreamQueues()
        self.loc_bytes: list[dict[str, float]] = [{} for _ in range(self.n)]
        self.jobs: list[tuple[Job, float, Callable[[], None]]] = []  # (job, total, on_done)
        self.timers: list[tuple[float, int, Callable[[], None]]] = []
        self._seq = 0
        self.ready: set[int] = set(range(self.n))
        self.links = Links.of(cluster)  # the emulator's links are built from the same object
        self.capacity = self._capacities()
        self.buckets = effects.burst_buckets(cluster, self.capacity)
        # A transfer on a CPU testbed is one thread: its level is in cores (see fluid.Job).
        c = cluster.cpu_ns_per_byte * 1e-9
        self.flow_weight = 1.0 / c if c else 1.0
        self.flow_cap = 1.0 / c if c else math.inf
        # A sliding window: a tile costs the share of its pairs the window keeps (a windowed
        # kernel skips the blocks outside it; plan/tile_rule.py counts the pairs exactly).
        self.window = problem.geometry(self.n, plan.causal, plan.head_group)
        self.joint: dict[int, dict] = {}  # rank -> plan/fuse.py joint_kv, when first asked

    # ---------------------------------------------------------------- resources
    def _capacities(self) -> dict[Hashable, float]:
        cl, intra, cross = self.cl, self.links.intra, self.links.cross
        cap: dict[Hashable, float] = {}
        for r in range(self.n):
            cap[("iout", r)] = cap[("iin", r)] = intra.port_Bps
            cap[("dev", r)] = 1.0
            if cross.shared_by == "rank":
                cap[("xout", r)] = cap[("xin", r)] = cross.port_Bps
        for g in set(self.group_of.values()):
            if cross.shared_by == "node":
                cap[("xout", g)] = cap[("xin", g)] = cross.port_Bps
            if cl.intra_bus_gbps is not None:
                cap[("bus", g)] = cl.intra_bus_gbps * 1e9
        cap["pool"] = float(cl.cores or 0)
        return cap

    def _flow(self, src: int, dst: int) -> tuple[tuple[tuple[Hashable, float], ...], float]:
        """The resources a message from ``src`` to ``dst`` uses, and its own rate cap."""
        cl = self.cl
        gs, gd = self.group_of[src], self.group_of[dst]
        uses: list[tuple[Hashable, float]] = []
        cap = self.flow_cap
        if gs == gd:
            uses += [(("iout", src), 1.0), (("iin", dst), 1.0)]
            cap = min(cap, self.links.intra.message_Bps)
            if cl.intra_bus_gbps is not None:
                uses.append((("bus", gs), 1.0))
        else:  # one message can fill a cross port (Links.of): no cap of its own
            a, b = (src, dst) if cl.nic == "rank" else (gs, gd)
            uses += [(("xout", a), 1.0), (("xin", b), 1.0)]
            if self.links.cross_via_intra:  # the emulator's links read the same field
                uses += [(("iout", src), 1.0), (("iin", dst), 1.0)]
        if cl.cpu_ns_per_byte:
            uses.append(("pool", cl.cpu_ns_per_byte * 1e-9))
        return tuple(uses), cap

    # ---------------------------------------------------------------- costs
    def _merge_s(self, nbytes: float) -> float:
        return nbytes / (self.cl.merge_gbps * 1e9) if self.cl.merge_gbps else 0.0

    def _op_cost(self, r: int, op: Tile | TileBwd | Merge | SuperTile) -> float:
        """Seconds of compute at full speed for one op (0 when compute is switched off)."""
        if not self.compute:
            return 0.0
        over = self.cl.op_overhead_us * 1e-6
        if isinstance(op, Merge):
            return self._merge_s(self.loc_bytes[r].get(op.src, 0.0)) + over
        if not isinstance(op, SuperTile):
            return self._kernel_s((op,), False) + over
        copy = self.pc[r] not in self._joint(r)  # kv not received into one buffer
        return self._kernel_s(op.members, copy) + over

    def _joint(self, r: int) -> dict:
        """Rank ``r``'s super-tiles whose kv is received into one buffer (no copy)."""
        if r not in self.joint:
            self.joint[r] = joint_kv(self.plan.ops[r])
        return self.joint[r]

    def _kernel_s(self, members: Sequence[Tile] | Sequence[TileBwd], copy: bool) -> float:
        """One kernel call over ``members`` (one tile, or a super-tile's: their q rows, their
        kv rows concatenated): the FLOPs of all at the efficiency of the call's size, the fold
        of its result into the accumulators (forward: one partial of the q rows; backward: dq
        once and each member's dk, dv), and with ``copy`` the copy that concatenates the
        members' kv rows (at the merge rate, like the stage's copies; none where they were
        received into one buffer, plan/fuse.py ``joint_kv``)."""
        p, n, cl = self.problem, self.n, self.cl
        bwd = isinstance(members[0], TileBwd)
        flops = 0.0
        for m in members:
            f = tile_flops(m.spec, p, n)
            flops += f * self.window.fraction(m.spec) if self.window is not None else f
        if bwd:
            flops *= cl.bwd_factor
        rows = p.s / n
        q_frac = members[0].spec.q_half.fraction
        kv_frac = sum(m.spec.kv_half.fraction for m in members)
        eff = effects.kernel_efficiency(cl, rows * q_frac, rows * kv_frac, p.d)
        # The executor folds each call's result into its accumulators: that is a merge too.
        if bwd:
            folded = p.local_bytes("dq", n) * q_frac + p.local_bytes("dkv", n) * kv_frac
        else:
            folded = p.local_bytes("out", n) * q_frac
        if copy:
            folded += p.local_bytes("kv", n) * kv_frac
        return flops / (cl.tflops * 1e12 * eff) + self._merge_s(folded)

    # ---------------------------------------------------------------- jobs and timers
    def _start_compute(self, r: int, seconds: float, is_work: bool = True) -> None:
        """Block rank ``r`` for ``seconds`` of compute (stretched if the pool is shared);
        ``is_work=False`` for message overheads, which are busy time but not attention work."""
        self.blocked[r] = True
        t0 = self.t

        def done() -> None:
            self.blocked[r] = False
            self.busy[r] += self.t - t0
            self.ready.add(r)

        if is_work:
            self.work[r] += seconds
        if seconds <= 0:
            done()
            return
        res: Hashable = "pool" if self.cl.cores else ("dev", r)
        self.jobs.append((Job(seconds, ((res, 1.0),), 1.0, 1.0, tag=("compute", r)), seconds,
                          done))

    def _at(self, when: float, fn: Callable[[], None]) -> None:
        self._seq += 1
        heapq.heappush(self.timers, (when, self._seq, fn))

    # ---------------------------------------------------------------- batches
    def _post(self, r: int, op: Comm) -> None:
        for x in op.recvs:
            self.loc_bytes[r][x.loc] = self._bytes(x)
        b = _Batch(r, op, len(op.sends) + len(op.recvs))
        self.batches[(r, op.handle)] = b
        if self.queues.post(r, op.stream, b):
            self._activate(b)

    def _bytes(self, x: Xfer) -> float:
        return self.problem.xfer_bytes(x, self.n)

    def _activate(self, b: _Batch) -> None:
        """``b`` reached the head of its stream: its messages with every peer whose head batch
        on that stream is active too start to flow (plan.batches: pair by pair)."""
        b.active = True
        if b.pending == 0:
            self._complete(b)
            return
        for peer in b.op.peers:
            other = self.queues.head(peer, b.op.stream)
            if other is not None and other.active and b.rank in other.op.peers:
                self._match(b, other)

    def _match(self, a: _Batch, c: _Batch) -> None:
        r, p = a.rank, c.rank
        if p in a.matched or r in c.matched:
            return
        a.matched.add(p)
        c.matched.add(r)
        for src, dst in ((a, c), (c, a)):
            try:
                pairs = messages_between(src.rank, src.op, dst.rank, dst.op)
            except BatchMismatch as e:
                raise ModelError(f"{self.plan.algo} {self.plan.direction}: {e}") from None
            for x, _ in pairs:
                self._message(src, dst, x)

    def _message(self, sb: _Batch, rb: _Batch, x: Xfer) -> None:
        def arrived() -> None:
            for b in (sb, rb):
                b.pending -= 1
                if b.pending == 0:
                    self._complete(b)

        if not self.comm:
            self._at(self.t, arrived)
            return
        nbytes = self._bytes(x)
        uses, cap = self._flow(sb.rank, x.peer)

        # The stream names the communicator: SM contention counts communicators in flight.
        tag = ("msg", sb.rank, x.peer, sb.op.stream)

        def start() -> None:
            if nbytes <= 0:
                arrived()
                return
            self._move(effects.split_burst(self.buckets, uses, nbytes), cap, tag, arrived)

        same = self.group_of[sb.rank] == self.group_of[x.peer]
        self._at(self.t + (self.links.intra if same else self.links.cross).latency_s, start)

    def _move(self, phases: list, cap: float, tag: tuple, arrived: Callable[[], None]) -> None:
        """Move a message's phases one after another (see effects.split_burst)."""
        nbytes, uses = phases[0]
        rest = phases[1:]

        def done() -> None:
            if rest:
                self._move(rest, cap, tag, arrived)
            else:
                arrived()

        if not uses and cap == math.inf:
            done()  # nothing limits it (all links bucketed, no CPU cost): instant
            return
        self.jobs.append((Job(nbytes, uses, self.flow_weight, cap, tag=tag), nbytes, done))

    def _complete(self, b: _Batch) -> None:
        b.done = True
        if self.queues.head(b.rank, b.op.stream) is not b:
            raise ModelError("internal: a batch completed out of its stream's order")
        nxt = self.queues.pop(b.rank, b.op.stream)
        if b.waiter:
            self.blocked[b.rank] = False
            self.ready.add(b.rank)
        if nxt is not None:
            self._activate(nxt)

    # ---------------------------------------------------------------- rank programs
    def _advance(self, r: int) -> None:
        ops = self.plan.ops[r]
        self.r = r
        while not self.blocked[r] and self.pc[r] < len(ops):
            self.interpret(ops[self.pc[r]])
        if not self.blocked[r] and self.pc[r] == len(ops) and self.finish[r] is None:
            self.finish[r] = self.t

    # One op of rank ``self.r``: each moves its program counter on, except a Comm whose message
    # overhead must be paid first (it is interpreted again once that compute is done).
    def on_comm(self, op: Comm) -> None:
        r = self.r
        nmsg = len(op.sends) + len(op.recvs)
        if self.comm and self.cl.msg_cpu_us and not self.paid[r]:
            self.paid[r] = True
            self._start_compute(r, nmsg * self.cl.msg_cpu_us * 1e-6, is_work=False)
            return
        self.paid[r] = False
        self.pc[r] += 1
        self._post(r, op)

    def on_wait(self, op: Wait) -> None:
        r = self.r
        b = self.batches.get((r, op.handle))
        if b is None:
            raise ModelError(f"{self.plan.algo} {self.plan.direction}: rank {r} waits "
                             f"for batch #{op.handle}, never posted")
        if not b.done:
            b.waiter = True
            self.blocked[r] = True
        self.pc[r] += 1  # (blocked: resumes after the wait)

    def on_reset(self, op: Reset) -> None:
        self.pc[self.r] += 1

    def _compute_op(self, op: Tile | TileBwd | Merge | SuperTile) -> None:
        cost = self._op_cost(self.r, op)  # at the op's index (a super-tile's joint kv)
        self.pc[self.r] += 1
        self._start_compute(self.r, cost)

    on_tile = on_tile_bwd = on_merge = on_super_tile = _compute_op

    # ---------------------------------------------------------------- main loop
    def run(self) -> float:
        while True:
            while self.ready:
                for r in sorted(self.ready):
                    self.ready.discard(r)
                    self._advance(r)
            if not self.jobs and not self.timers:
                break
            dt = math.inf
            if self.jobs:
                jobs = [j for j, _, _ in self.jobs]
                effects.compute_caps(self.cl, jobs)
                share = allocate_in_order if self.cl.link_order == "fifo" else allocate
                share(jobs, effects.link_capacity(self.cl, self.capacity, jobs))
                for j in jobs:  # the earliest finish (plain loops: this runs at every event)
                    rate = j.rate
                    if rate > 0:
                        left = j.remaining / rate
                        if left < dt:
                            dt = left
            if self.timers:
                dt = min(dt, self.timers[0][0] - self.t)
            if dt == math.inf:
                raise ModelError(f"{self.plan.algo} {self.plan.direction}: stalled at "
                                 f"{self.t:.6g} s with jobs that cannot progress")
            dt = max(dt, 0.0)
            self.t += dt
            finished, running = [], []
            for entry in self.jobs:
                j, total, _ = entry
                j.remaining -= j.rate * dt
                if j.remaining <= total * 1e-9:
                    finished.append(entry)
                else:
                    running.append(entry)
            self.jobs = running
            for _, _, done in finished:
                done()
            while self.timers and self.timers[0][0] <= self.t * (1 + 1e-12) + 1e-18:
                _, _, fn = heapq.heappop(self.timers)
                fn()
        unfinished = [r for r in range(self.n) if self.finish[r] is None]
        if unfinished:
            # A rank can only be stuck in a Wait, the op before its program counter.
            stuck = {r: str(self.plan.ops[r][max(self.pc[r] - 1, 0)]) for r in unfinished}
            raise ModelError(f"{self.plan.algo} {self.plan.direction}: deadlock at "
                             f"{self.t:.6g} s; blocked ranks {stuck}")
        unmatched = sorted(f"{r}/{stream}" for r, stream in self.queues.pending())
        if unmatched:
            raise ModelError(f"{self.plan.algo} {self.plan.direction}: batches never matched "
                             f"on rank/stream {unmatched}")
        return max(f for f in self.finish if f is not None)


def stage_copy_s(problem: Problem, cluster: Cluster, n: int, kinds: Sequence[Kind],
                 passes: float) -> float:
    """Wall seconds of a head all-to-all's local copies on every rank at once.

    ``passes`` over a rank's blocks of ``kinds`` (plan/head_stage.py, ``copy_passes``: the
    executor packs what it sends and places what it receives). That is memory-bound work at
    the merge rate (the timed device charges it the same way); on a shared core pool
    all ``n`` ranks copy at once, so it takes ``n / cores`` times as long when there are
    fewer cores than ranks. Nothing overlaps it (the stage is a barrier in the plan).
    """
    if not cluster.merge_gbps:
        return 0.0
    nbytes = passes * sum(problem.local_bytes(k, n) for k in kinds)
    one = nbytes / (cluster.merge_gbps * 1e9)
    return one * max(1.0, n / cluster.cores) if cluster.cores else one


def _copy_work_s(copy_s: float, cluster: Cluster, n: int) -> float:
    """A rank's share of the copy phase at full speed (its wall time on a shared pool is longer)."""
    return copy_s / max(1.0, n / cluster.cores) if cluster.cores else copy_s


def simulate(plan: Plan, problem: Problem, cluster: Cluster,
             groups: Sequence[Sequence[int]], *, compute: bool = True,
             comm: bool = True) -> SimResult:
    """Predict how long ``plan`` takes for ``problem`` on ``cluster``.

    ``groups`` are the *hardware* groups (which ranks share fast links), whatever groups the
    plan's algorithm used (ring and RM+ plans are built flat). ``compute=False`` makes compute
    free and ``comm=False`` makes messages instantaneous (per-message CPU overhead counts as
    communication), like ``CPOptions.ablation`` in the executor: the two give the CCR's parts.

    A plan after a head all-to-all (``plan.head_group > 1``) runs on its super-blocks
    (:meth:`Problem.for_plan`) between the two all-to-alls, each simulated as a plan of its
    own (plan/head_stage.py) and added: nothing overlaps them, as in TE.
    """
    parts = [(plan, problem.for_plan(plan), 0.0)]
    if plan.head_group > 1:
        from charm_megatron.plan.head_stage import copy_passes, stage_kinds, stage_plans

        into, back = stage_plans(plan.n, plan.head_group, plan.direction, plan.causal)
        kinds_in, kinds_back = stage_kinds(plan.direction)
        passes = copy_passes(plan.head_group, cluster.head_copies)
        copies = (stage_copy_s(problem, cluster, plan.n, kinds_in, passes[0]),
                  stage_copy_s(problem, cluster, plan.n, kinds_back, passes[1]))
        if not compute:
            copies = (0.0, 0.0)
        parts = [(into, problem, copies[0]), *parts, (back, problem, copies[1])]
    time_s, ranks = 0.0, [RankStats(0.0, 0.0, 0.0)] * plan.n
    messages = 0
    for part, prob, copy_s in parts:
        eng = _Engine(part, prob, cluster, groups, compute, comm)
        t = eng.run() + copy_s
        ranks = [RankStats(time_s + (eng.finish[r] or 0.0) + copy_s,
                           was.busy_s + eng.busy[r] + copy_s,
                           was.work_s + eng.work[r] + _copy_work_s(copy_s, cluster, plan.n))
                 for r, was in enumerate(ranks)]
        time_s += t
        messages += sum(len(op.sends) for r in range(part.n) for op in part.comms(r))
    t = traffic(plan, problem, groups)
    return SimResult(plan.algo, plan.direction, time_s, tuple(ranks), sum(t.intra),
                     sum(t.cross), max(t.intra), max(t.cross), messages)
