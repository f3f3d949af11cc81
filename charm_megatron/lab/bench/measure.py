"""The per-rank timing loop: every rank of the CP group runs :func:`rank_main`.

For each grid point: random inputs (this rank's shard), the contenders, a few warm-up rounds,
then ``iters`` timed rounds. A round runs every *variant* once - each algorithm for real, and the
ablated runs (ring compute-only and comm-only for the CCR; every plan algorithm compute-only for
the lower bound) - in an order rotated by one each round, so that drifting machine noise hits all
variants alike (CPU-TESTBED.md: identical code moves +-5-10 % between runs).

One run of a variant: barrier, forward (timed), barrier, backward (timed). The barriers make
the forward and the backward separately measurable; each rank reports its own durations and the
analysis takes the slowest rank per round (a CP call is as slow as its slowest rank). CPU time
(``time.process_time``: all threads of the rank, including gloo's) is recorded beside wall time:
summed over ranks it is the total CPU work the lower bound needs. On an emulated GPU cluster
with ``--device-clock virtual`` a call's duration is read from the rank's virtual clock
(:class:`_CallClock`, lab/emulate/virtual_time.py) instead of the wall clock, so the host's
lateness on this machine is not in it.

Afterwards one untimed forward+backward per algorithm measures peak memory
(:mod:`charm_megatron.lab.bench.memory`).
"""

from __future__ import annotations

import contextlib
import gc
import os
import socket
import time
from dataclasses import dataclass, field
from typing import Any, NamedTuple

import torch
import torch.distributed as dist

from charm_megatron.lab.bench import links
from charm_megatron.lab.bench.config import BenchConfig, Point
from charm_megatron.lab.bench.contenders import DTYPES, AutoContender, Contender, Lineup, line_up
from charm_megatron.lab.bench.gpu_emulation import CoreMeter
from charm_megatron.lab.bench.memory import PeakMeter
from charm_megatron.lab.bench.packing import cumulative, doc_lengths
from charm_megatron.lab.bench.progress import Progress
from charm_megatron.model.te_contenders import TE_NAMES
from charm_megatron.ops.options import CPOptions
from charm_megatron.topology import resolve_topology


@dataclass
class Job:
    """What every rank runs (picklable)."""

    cfg: BenchConfig
    points: list[Point]
    topology: str  # CHARM+ topology string (GxM, group list, or a probe level)
    device: str = "cpu"  # "cpu" or "cuda"
    progress: bool = True
    env: dict[str, str] = field(default_factory=dict)


def variant_key(algo: str, mode: str) -> str:
    return f"{algo}/{mode}"


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


# bench mode -> CPOptions.ablation: "compute" runs without communication, "comm" without
# kernels.
ABLATION = {"full": "none", "compute": "compute_only", "comm": "comm_only"}


class Timing(NamedTuple):
    """Seconds of one call on this rank: wall and CPU time, forward and backward."""

    fwd: float
    bwd: float
    fwd_cpu: float
    bwd_cpu: float


@contextlib.contextmanager
def _gc_between_calls():
    """Python's cyclic garbage collector off for the timed calls, run between them (what
    Megatron-LM's ``--manual-gc`` does per iteration). A full collection of a process with
    torch loaded takes ~100 ms of one core here; landing inside a call, it stalls that rank
    and every rank waiting on it, for whichever contender happens to be running."""
    was_on = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if was_on:
            # Whatever collection the call's allocations made due runs at the next
            # allocation, before the next timed call's barrier.
            gc.enable()


class _CallClock:
    """What a timed call's duration is read from: the wall clock (``time.perf_counter``), or,
    on an emulated GPU cluster with ``--device-clock virtual``, the rank's virtual clock
    (lab/emulate/virtual_time.py): a call starts, on every rank alike, when the last rank
    reached it after the barrier, and ends at ``max(host_t, busy_until)`` once it synchronised
    with its device, so the host's lateness on this machine is not in it (the wall sleeps that
    keep the ranks causal still happen inside the call)."""

    def __init__(self, virtual: Any = None) -> None:
        self.virtual = virtual

    def start(self) -> float:
        """The call's start, after the barrier. Virtual: the latest rank's wall time here (a
        MAX all-reduce, itself a barrier), so that no rank's start holds how late its host
        left the barrier on this crowded machine (a GPU cluster's barrier skew is
        microseconds)."""
        if self.virtual is None:
            return time.perf_counter()
        # Leave the idle floor first (start-order links, lab/emulate/floors.py): the time
        # every rank then shares is no earlier than the one its floor took.
        self.virtual.begin()
        latest = torch.tensor([time.monotonic()], dtype=torch.float64)
        dist.all_reduce(latest, op=dist.ReduceOp.MAX)
        return self.virtual.begin(float(latest))

    def end(self) -> float:
        return self.virtual.now() if self.virtual is not None else time.perf_counter()


WALL_CLOCK = _CallClock()  # calls timed on the wall clock


def _run_once(c: Contender, mode: str, inputs: tuple[torch.Tensor, ...], backward: bool,
              device: torch.device, clock: _CallClock = WALL_CLOCK) -> Timing:
    """One timed call of ``c`` in ``mode`` (``full``, ``compute`` or ``comm``), its duration
    read from ``clock``."""
    q, k, v, dout = inputs
    # Fresh leaves sharing the inputs' storage (detach() copies nothing).
    qa, ka, va = (t.detach().requires_grad_(backward) for t in (q, k, v))
    fwd = bwd = fcpu = bcpu = 0.0
    c = c.ablated(ABLATION[mode])
    with c.session(), torch.set_grad_enabled(backward), _gc_between_calls():
        dist.barrier()
        _sync(device)
        c0, t0 = time.process_time(), clock.start()
        out = c(qa, ka, va)
        _sync(device)
        fwd, fcpu = clock.end() - t0, time.process_time() - c0
        if backward:
            dist.barrier()
            _sync(device)
            c0, t0 = time.process_time(), clock.start()
            out.backward(dout)
            _sync(device)
            bwd, bcpu = clock.end() - t0, time.process_time() - c0
    return Timing(fwd, bwd, fcpu, bcpu)


def _memory(c: Contender, inputs: tuple[torch.Tensor, ...], backward: bool,
            device: torch.device) -> dict[str, int]:
    """Peak memory growth (bytes) of one untimed call: forward, and forward + backward."""
    q, k, v, dout = inputs
    qa, ka, va = (t.detach().requires_grad_(backward) for t in (q, k, v))
    meter = PeakMeter(device)
    with c.session(), torch.set_grad_enabled(backward):
        dist.barrier()
        with meter.phase("fwd"):
            out = c(qa, ka, va)
        if backward:
            dist.barrier()
            with meter.phase("fwdbwd"):
                out.backward(dout)
        del out, qa, ka, va
    peaks = meter.peaks
    return {"fwd": peaks["fwd"], "fwdbwd": peaks.get("fwdbwd", peaks["fwd"])}


def _packed(point: Point, cfg: BenchConfig, world: int, device: torch.device) -> dict | None:
    """Packed mode: the point's cu_seqlens (same on every rank: seeded by point, not rank)."""
    if not cfg.packed_mean:
        return None
    real, padded = doc_lengths(point.batch * point.seq, world, cfg.packed_mean,
                               cfg.seed * 1_000_003 + point.index)
    return {"cu_seqlens": cumulative(real, device), "cu_seqlens_padded": cumulative(padded, device)}


def _inputs(point: Point, cfg: BenchConfig, rank: int, world: int,
            device: torch.device) -> tuple[torch.Tensor, ...]:
    """This rank's q, k, v, dout: ``[S/n, B, H, D]`` (values do not matter for timing); in
    packed mode THD ``[B*S/n, H, D]``."""
    g = torch.Generator().manual_seed(cfg.seed * 1_000_003 + point.index * 1009 + rank)
    if cfg.packed_mean:
        t = point.batch * point.seq // world
        dt = DTYPES[cfg.dtype]
        return tuple(torch.randn(t, h, point.head_dim, generator=g).to(device=device, dtype=dt)
                     for h in (point.heads, point.kv_heads, point.kv_heads, point.heads))
    s, batch = point.seq // world, point.batch
    if cfg.device is not None:  # the wire copy of the problem the timed device times
        s, batch = s // cfg.device.rows_scale, batch // cfg.device.batch_scale
    dt = DTYPES[cfg.dtype]
    return tuple(torch.randn(s, batch, h, point.head_dim, generator=g)
                 .to(device=device, dtype=dt)
                 for h in (point.heads, point.kv_heads, point.kv_heads, point.heads))


def _measure_point(job: Job, point: Point, lineup: Lineup, rank: int, world: int,
                   device: torch.device, progress: Progress,
                   clock: _CallClock = WALL_CLOCK) -> dict[str, Any]:
    """Warm-up and timed rounds of every variant at ``point`` (rotated order), then memory;
    each call timed on ``clock``."""
    cfg = job.cfg
    inputs = _inputs(point, cfg, rank, world, device)
    todo = [(a, m) for a, m in cfg.variants() if a in lineup.contenders
            and (m == "full" or lineup.contenders[a].ablatable)]
    times: dict[str, dict[str, list[float]]] = {
        variant_key(a, m): {name: [] for name in Timing._fields} for a, m in todo}
    rounds = cfg.warmup + cfg.iters
    # Emulated GPU cluster: the busiest core while calls are timed (a run above 70 % measures
    # this machine's cores, not the devices), and device time = wall time / dilation.
    meter = CoreMeter() if cfg.device is not None and rank == 0 else None
    dilation = cfg.device.dilation if cfg.device is not None else 1.0
    for it in range(rounds):
        shift = it % len(todo)
        for algo, mode in todo[shift:] + todo[:shift]:
            if meter is not None and it >= cfg.warmup:
                meter.start()
            # Warm-up calls are not timed on the virtual clock: the first resolves the call's
            # plans (the model times every variant of every degree: tens of seconds of host
            # work on a loaded 2-core machine), which a begun clock would count as the host
            # trailing its devices; an idle clock re-anchors at its first op or post instead.
            timing = _run_once(lineup.contenders[algo], mode, inputs, cfg.backward, device,
                               clock if it >= cfg.warmup else WALL_CLOCK)
            if meter is not None and it >= cfg.warmup:
                meter.stop()
            if dilation != 1.0:
                timing = timing._replace(fwd=timing.fwd / dilation, bwd=timing.bwd / dilation)
            if it >= cfg.warmup:
                for name, seconds in timing._asdict().items():
                    times[variant_key(algo, mode)][name].append(seconds)
        progress.update(1, f"{point.label}  round {it + 1}/{rounds}"
                        + (" (warm-up)" if it < cfg.warmup else ""))
    for algo, c in lineup.contenders.items():  # a measured auto decided in its warm-up
        if isinstance(c, AutoContender) and c.options.auto_tune is not None:
            lineup.picks[algo] = c.resolve_pick()
            margin = "all" if c.options.auto_tune == float("inf") else c.options.auto_tune
            lineup.notes[algo] = (f"auto (auto_tune {margin}) ran {lineup.picks[algo]}, the "
                                  f"model's pick {c.picked} (roles {c.picked_roles})")
    memory = ({algo: _memory(c, inputs, cfg.backward, device)
               for algo, c in lineup.contenders.items()} if cfg.memory else {})
    return {"point": point.index, "times": times, "memory": memory,
            "skipped": lineup.skipped, "notes": lineup.notes, "picks": lineup.picks,
            "busiest_core": meter.busiest() if meter is not None else None}


def _resolve_topology(job: Job, world: int) -> tuple[str, list[list[int]]]:
    """The CHARM+ topology every rank uses, and its groups (a probe is a collective)."""
    spec, source = CPOptions.from_env().topology_for("charm", job.topology)
    topo = resolve_topology(spec, None, world, source=source)
    return str(topo), [list(g) for g in topo.groups]


def rank_main(rank: int, world: int, job: Job) -> dict[str, Any]:
    """Run the whole grid on this rank; returns its raw measurements (picklable)."""
    os.environ.update(job.env)
    cfg = job.cfg
    if job.device == "cuda":
        device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", rank)))
        torch.cuda.set_device(device)
    else:
        device = torch.device("cpu")
        # Ablated runs compute on receive buffers that were never filled; denormal garbage
        # there must not make the kernels slower than real data would.
        torch.set_flush_denormal(True)
    topo_text, topo_groups = _resolve_topology(job, world)
    job.topology = topo_text
    progress = Progress(len(job.points) * (cfg.warmup + cfg.iters),
                        enabled=job.progress and rank == 0)
    torch_probe: dict = {}  # PyTorch CP's way of running, per head shape (a collective probe)
    # One timed device per rank for the whole run (an emulated GPU cluster), else the kernels;
    # with --device-clock virtual one virtual clock per rank, which its devices and its
    # software links share and its calls are timed on.
    virtual = cfg.device.virtual_time() if cfg.device is not None else None
    if not links.follow(virtual) and virtual is not None:
        raise RuntimeError("--device-clock virtual: this rank has no software links to take "
                           "its messages' arrivals from (use --device-clock async)")
    backend = cfg.device.backend(rank, virtual=virtual) if cfg.device is not None else None
    # TransformerEngine's contenders time their tiles on TE's kernel curve (the same device).
    te_backend = (cfg.device.backend(rank, te_kernel=True, virtual=virtual)
                  if cfg.device is not None and any(a in TE_NAMES for a in cfg.algos) else None)
    try:
        points_out = [
            _measure_point(job, point, line_up(cfg, job.topology, point, device, torch_probe,
                                               _packed(point, cfg, world, device),
                                               backend=backend, te_backend=te_backend),
                           rank, world, device, progress, _CallClock(virtual))
            for point in job.points]
    finally:
        progress.close()
    return {
        "rank": rank,
        "host": socket.gethostname(),
        "cores": _cores(),
        "threads": torch.get_num_threads(),
        "device": str(device),
        "topology": topo_text,
        "topology_groups": topo_groups,
        "memory_method": _memory_method(cfg, device),
        "points": points_out,
        "links_booked_cross_bytes": links.booked_cross_bytes(),
        "links_late_bookings": links.late_bookings(),
    }


def _memory_method(cfg: BenchConfig, device: torch.device) -> str:
    if not cfg.memory:
        return "not measured (--no-memory)"
    if device.type == "cuda":
        return ("peak growth of torch.cuda.max_memory_allocated over one call, per rank "
                "(max over ranks shown)")
    return ("peak growth of the bytes held by torch's CPU allocator over one call (profiler "
            "memory events), per rank (max over ranks shown)")


def _cores() -> int:
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # not Linux
        return os.cpu_count() or 1
