"""Fit a profile to measured bench runs: ``charm-megatron model --calibrate BENCH_CSV...``.

What is fitted, and on what (by default only the *ring's* rows, so every CHARM+ and RM+ row
stays a prediction the fit never saw; ``fit_algos`` widens that):

1. compute - long-tile kernel rate, tile-size rows (kernel rate against tile size), per-op
   cost, backward / forward factor and merge rate - on the compute-only times
   (``ring_compute_ms``: ``CPOptions(ablation="compute_only")``);
2. communication - per-message CPU cost, per-message latency, CPU cost per byte moved - on the
   communication-only times (``ring_comm_ms``), with the link rates the bench measured
   (``cross_rate_mbps``, ``intra_rate_mbps``) taken as given;
3. everything of 1 and 2 together on the compute-only, communication-only and full times.

The objective is the mean squared log error (every point weighs the same whatever its
length). The search is a deterministic coordinate descent in log space (no randomness: the
same files give the same profile on every machine). GPU runs (``cores`` absent or
``--no-cores``) fit the same terms with each rank on its own device.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, replace
from functools import lru_cache

from charm_megatron.lab.calibration.measured import Point, file_digest, load_points
from charm_megatron.lab.calibration.testbed import emulated_cluster
from charm_megatron.model.cluster import Cluster, Profile
from charm_megatron.model.predict import _plan
from charm_megatron.model.sim import simulate
from charm_megatron.plan.cost import Problem
from charm_megatron.plan.registry import uses_topology

# Parameters of each stage; all are >= 0 and searched in log space from these starts.
COMPUTE_PARAMS = ("tflops", "kernel_q_rows", "op_overhead_us", "bwd_factor", "merge_gbps")
COMM_PARAMS = ("msg_cpu_us", "latency_us", "cpu_ns_per_byte")
_FLOOR = {"kernel_q_rows": 1.0, "op_overhead_us": 1.0, "msg_cpu_us": 1.0, "latency_us": 1.0,
          "cpu_ns_per_byte": 0.01}


@lru_cache(maxsize=64)
def _groups(topology: str) -> tuple[tuple[int, ...], ...]:
    from charm_megatron.topology.core import Topology

    return tuple(tuple(g) for g in Topology.parse(topology).groups)


def _sim_ms(cluster: Cluster, topology: str, problem: Problem, causal: bool, algo: str,
            pas: str, *, compute: bool = True, comm: bool = True) -> float:
    groups = _groups(topology)
    flat = (tuple(range(sum(len(g) for g in groups))),)
    total = 0.0
    for direction in (("forward",) if pas == "fwd" else ("backward",) if pas == "bwd"
                      else ("forward", "backward")):
        plan = _plan(algo, direction, groups if uses_topology(algo) else flat, causal)
        total += simulate(plan, problem, cluster, groups, compute=compute, comm=comm).time_s
    return total * 1e3


def cluster_for(cluster: Cluster, pt: Point) -> Cluster:
    """``cluster`` as the point's run saw it: the emulator's layout for its NIC model on the
    netns testbed (:mod:`.testbed`), else just its NIC model."""
    if pt.mode == "netns":
        return emulated_cluster(cluster, pt.nic)
    return cluster if cluster.nic == pt.nic else replace(cluster, nic=pt.nic)


def predict_ms(cluster: Cluster, pt: Point, *, compute: bool = True, comm: bool = True) -> float:
    """The model's time for a measured point (:func:`cluster_for` the point)."""
    cl = cluster_for(cluster, pt)
    return _sim_ms(cl, pt.topology, pt.problem, pt.causal, pt.algo, pt.pas, compute=compute,
                   comm=comm)


@dataclass(frozen=True)
class Target:
    """One number to fit: which measurement of which point, and how to simulate it."""

    point: Point
    what: str  # full | compute | comm

    @property
    def measured_ms(self) -> float:
        if self.what == "compute":
            return self.point.ring_compute_ms if self.point.algo == "ring" \
                else self.point.compute_only_ms
        if self.what == "comm":
            return self.point.ring_comm_ms
        return self.point.median_ms

    def predicted_ms(self, cluster: Cluster) -> float:
        return predict_ms(cluster, self.point, compute=self.what != "comm",
                          comm=self.what != "compute")


def targets(points: Iterable[Point], fit_algos: Sequence[str] = ("ring",),
            passes: Sequence[str] = ("fwd", "bwd")) -> dict[str, list[Target]]:
    """The fit's targets by kind. ``fwdbwd`` rows are left out by default: they are the sum
    of the other two, and the model predicts them as that sum."""
    out: dict[str, list[Target]] = {"compute": [], "comm": [], "full": []}
    for pt in points:
        if pt.algo not in fit_algos or pt.pas not in passes:
            continue
        out["full"].append(Target(pt, "full"))
        if (pt.ring_compute_ms if pt.algo == "ring" else pt.compute_only_ms):
            out["compute"].append(Target(pt, "compute"))
        if pt.algo == "ring" and pt.ring_comm_ms:
            out["comm"].append(Target(pt, "comm"))
    return out


def log_error(cluster: Cluster, tgts: Sequence[Target]) -> float:
    """Mean squared log ratio predicted / measured over ``tgts``."""
    if not tgts:
        return 0.0
    return sum(math.log(t.predicted_ms(cluster) / t.measured_ms) ** 2 for t in tgts) / len(tgts)


def _with(cluster: Cluster, name: str, value: float) -> Cluster:
    if name == "kernel_q_rows":  # one tile-size term for both dims (the bench's tiles are square)
        return replace(cluster, kernel_q_rows=value, kernel_k_rows=value)
    return replace(cluster, **{name: value})


def coordinate_descent(cluster: Cluster, params: Sequence[str],
                       loss: Callable[[Cluster], float], *, step: float = 2.0,
                       min_step: float = 1.03, max_evals: int = 400) -> tuple[Cluster, float]:
    """Minimise ``loss`` over ``params`` (each multiplied up or down by ``step``, the step
    shrinking to its square root whenever a sweep improves nothing). Deterministic."""
    best = loss(cluster)
    evals = 1
    while step > min_step and evals < max_evals:
        improved = False
        for name in params:
            cur = getattr(cluster, name) or _FLOOR.get(name, 1e-3)
            for factor in (step, 1.0 / step):
                cand = _with(cluster, name, cur * factor)
                val = loss(cand)
                evals += 1
                if val < best * (1 - 1e-9):
                    cluster, best, improved = cand, val, True
                    break
        if not improved:
            step = math.sqrt(step)
    return cluster, best


def plan_volume(pt: Point) -> tuple[float, int]:
    """(bytes sent by all ranks, messages posted by all ranks) of a point's plans."""
    from charm_megatron.plan.core import Comm
    from charm_megatron.plan.cost import traffic

    groups = _groups(pt.topology)
    flat = (tuple(range(sum(len(g) for g in groups))),)
    nbytes, msgs = 0.0, 0
    for direction in (("forward",) if pt.pas == "fwd" else ("backward",) if pt.pas == "bwd"
                      else ("forward", "backward")):
        plan = _plan(pt.algo, direction, groups if uses_topology(pt.algo) else flat, pt.causal)
        t = traffic(plan, pt.problem, groups)
        nbytes += sum(t.intra) + sum(t.cross)
        msgs += sum(len(op.sends) + len(op.recvs) for ops in plan.ops for op in ops
                    if isinstance(op, Comm))
    return nbytes, msgs


def fit_cpu_costs(points: Sequence[Point]) -> tuple[float, float]:
    """(ns per byte, us per message) of CPU that communication costs, by least squares on
    ``run_cpu_ms - cpu_work_ms`` (the bench's CPU of a real run minus that of the same run
    without communication, all ranks) against the plans' bytes and messages. Both >= 0."""
    rows = []
    for pt in points:
        nbytes, msgs = plan_volume(pt)
        rows.append((nbytes, float(msgs), max(0.0, (pt.run_cpu_ms - pt.cpu_work_ms) * 1e-3)))
    sbb = sum(b * b for b, _, _ in rows)
    smm = sum(m * m for _, m, _ in rows)
    sbm = sum(b * m for b, m, _ in rows)
    sby = sum(b * y for b, _, y in rows)
    smy = sum(m * y for _, m, y in rows)
    det = sbb * smm - sbm * sbm
    a = (sby * smm - smy * sbm) / det if det else 0.0
    c = (smy * sbb - sby * sbm) / det if det else 0.0
    if a < 0 or c < 0:  # the unconstrained optimum is outside: best one-term fit
        a_only = sby / sbb if sbb else 0.0
        c_only = smy / smm if smm else 0.0
        err_a = sum((y - a_only * b) ** 2 for b, _, y in rows)
        err_c = sum((y - c_only * m) ** 2 for _, m, y in rows)
        a, c = (a_only, 0.0) if err_a <= err_c else (0.0, c_only)
    return a * 1e9, c * 1e6


def nelder_mead(cluster: Cluster, params: Sequence[str], loss: Callable[[Cluster], float], *,
                max_evals: int = 400, spread: float = 1.0) -> tuple[Cluster, float]:
    """Minimise ``loss`` over ``params`` in log space with the Nelder-Mead simplex (handles
    the correlated valleys of rate vs fixed cost that defeat coordinate descent).
    Deterministic: the simplex starts at ``x0`` and ``x0 + spread`` along each axis."""
    x0 = [math.log(getattr(cluster, n) or _FLOOR.get(n, 1e-3)) for n in params]

    def make(x: Sequence[float]) -> Cluster:
        c = cluster
        for n, v in zip(params, x):
            c = _with(c, n, math.exp(v))
        return c

    def f(x: Sequence[float]) -> float:
        return loss(make(x))

    simplex = [list(x0)] + [[v + (spread if i == j else 0.0) for j, v in enumerate(x0)]
                            for i in range(len(x0))]
    vals = [f(x) for x in simplex]
    evals = len(vals)
    while evals < max_evals:
        order = sorted(range(len(simplex)), key=lambda i: vals[i])
        simplex, vals = [simplex[i] for i in order], [vals[i] for i in order]
        if vals[-1] - vals[0] <= 1e-10 * max(1.0, abs(vals[0])):
            break
        n = len(x0)
        cent = [sum(x[j] for x in simplex[:-1]) / n for j in range(n)]
        worst = simplex[-1]
        refl = [c + (c - w) for c, w in zip(cent, worst)]
        fr = f(refl)
        evals += 1
        if fr < vals[0]:
            exp_ = [c + 2 * (c - w) for c, w in zip(cent, worst)]
            fe = f(exp_)
            evals += 1
            simplex[-1], vals[-1] = (exp_, fe) if fe < fr else (refl, fr)
        elif fr < vals[-2]:
            simplex[-1], vals[-1] = refl, fr
        else:
            con = [c + 0.5 * (w - c) for c, w in zip(cent, worst)]
            fc = f(con)
            evals += 1
            if fc < vals[-1]:
                simplex[-1], vals[-1] = con, fc
            else:  # shrink towards the best
                best = simplex[0]
                simplex = [best] + [[b + 0.5 * (v - b) for b, v in zip(best, x)]
                                    for x in simplex[1:]]
                vals = [vals[0]] + [f(x) for x in simplex[1:]]
                evals += n
    i = min(range(len(vals)), key=lambda k: vals[k])
    return make(simplex[i]), vals[i]


def _median(xs: Sequence[float]) -> float:
    s = sorted(xs)
    return s[len(s) // 2] if len(s) % 2 else 0.5 * (s[len(s) // 2 - 1] + s[len(s) // 2])


def initial_cluster(points: Sequence[Point], *, cores: int | None, intra_gbps: float | None,
                    cross_gbps: float | None, cross_burst_kb: float | None = None,
                    intra_burst_kb: float = 0.0) -> Cluster:
    """The starting point: link rates and buckets as measured (or given), a shared pool of
    ``cores``; on the netns testbed, the emulator's layout of the first point's NIC model."""
    cross = cross_gbps or (_median([p.cross_mbps for p in points if p.cross_mbps]) / 1e3
                           if any(p.cross_mbps for p in points) else None)
    intra = intra_gbps or (_median([p.intra_mbps for p in points if p.intra_mbps]) / 1e3
                           if any(p.intra_mbps for p in points) else None)
    if cores and cross is None:
        raise ValueError("the bench output has no cross_rate_mbps: give --cross-gbps")
    if cores and intra is None:
        raise ValueError("the bench output has no intra_rate_mbps (written by bench since "
                         "this version; older files lack it): give --intra-gbps")
    # GPU runs (no shared pool): a rate neither measured nor given is fitted (calibrate).
    cross = cross or 10.0
    intra = intra or 8.0 * cross
    if cross_burst_kb is None:
        found = [p.cross_burst_kb for p in points if p.cross_burst_kb is not None]
        cross_burst_kb = _median(found) if found else 0.0
    nic = points[0].nic
    if cores:  # a CPU testbed: start from ~50 GFLOP/s per core, costs of a Python executor
        cl = Cluster(intra_gbps=intra, cross_gbps=cross, tflops=0.05, nic=nic,
                     latency_us=50.0, cores=cores, cpu_ns_per_byte=1.0, msg_cpu_us=100.0,
                     merge_gbps=2.0, op_overhead_us=200.0, kernel_q_rows=32.0,
                     kernel_k_rows=32.0, bwd_factor=2.0, cross_burst_kb=cross_burst_kb,
                     intra_burst_kb=intra_burst_kb)
    else:
        cl = Cluster(intra_gbps=intra, cross_gbps=cross, tflops=200.0, nic=nic,
                     latency_us=10.0, merge_gbps=500.0, op_overhead_us=10.0,
                     kernel_q_rows=64.0, kernel_k_rows=64.0, cross_burst_kb=cross_burst_kb,
                     intra_burst_kb=intra_burst_kb)
    return emulated_cluster(cl, nic) if points[0].mode == "netns" else cl


def calibrate(paths: Sequence[str], *, name: str = "calibrated", cores: int | None = None,
              intra_gbps: float | None = None, cross_gbps: float | None = None,
              cross_burst_kb: float | None = None, intra_burst_kb: float = 0.0,
              fit_algos: Sequence[str] = ("ring",), max_evals: int = 400,
              log: Callable[[str], None] | None = None) -> Profile:
    """Fit a :class:`Profile` to the bench CSVs at ``paths`` (module docstring: what and how).

    ``cores``: ranks share this many cores (a CPU testbed); ``None`` takes the files' ``cores``
    column, and without one each rank has its own device (GPU runs).
    """
    points = load_points(paths)
    if cores is None:
        found = {p.cores for p in points if p.cores}
        cores = max(found) if found else None
    cl = initial_cluster(points, cores=cores, intra_gbps=intra_gbps, cross_gbps=cross_gbps,
                         cross_burst_kb=cross_burst_kb, intra_burst_kb=intra_burst_kb)
    unmeasured = tuple(name for name, given, col in (("cross_gbps", cross_gbps, "cross_mbps"),
                                                     ("intra_gbps", intra_gbps, "intra_mbps"))
                       if not given and not any(getattr(p, col) for p in points))
    if not cores:
        cl = replace(cl, cpu_ns_per_byte=0.0)
    comm_params = COMM_PARAMS if cores else ("latency_us",)
    tg = targets(points, fit_algos)
    if not tg["full"]:
        raise ValueError(f"no {'/'.join(fit_algos)} fwd or bwd rows to fit on in "
                         f"{', '.join(paths)}")
    say = log or (lambda _msg: None)
    if tg["compute"]:
        cl, e = nelder_mead(cl, COMPUTE_PARAMS, lambda c: log_error(c, tg["compute"]),
                            max_evals=max_evals)
        cl, e = coordinate_descent(cl, COMPUTE_PARAMS, lambda c: log_error(c, tg["compute"]),
                                   step=1.1, max_evals=max_evals // 2)
        say(f"compute fit on {len(tg['compute'])} compute-only times: rms log error "
            f"{math.sqrt(e):.3f}")
    cpu_rows = [t.point for t in tg["full"] if t.point.run_cpu_ms and t.point.cpu_work_ms]
    rest: tuple[str, ...] = ("latency_us",) + unmeasured
    if unmeasured:
        say(f"no measured {' / '.join(unmeasured)}: fitted on the ring's times (only a link "
            "the ring waits on is determined; give --cross-gbps / --intra-gbps from "
            "charm-megatron topo or a point-to-point test if you have them)")
    if cores and cpu_rows:
        ns, us = fit_cpu_costs(cpu_rows)
        cl = replace(cl, cpu_ns_per_byte=ns, msg_cpu_us=us)
        say(f"CPU cost of communication from {len(cpu_rows)} runs (run CPU - compute-only "
            f"CPU): {ns:.3g} ns per byte, {us:.4g} us per message")
    elif cores:
        rest = comm_params
    tune = tg["comm"] + tg["full"]
    cl, e = coordinate_descent(cl, rest, lambda c: log_error(c, tune), max_evals=max_evals)
    say(f"{', '.join(rest)} on {len(tune)} communication-only and full times: rms log error "
        f"{math.sqrt(e):.3f}")
    every = tg["compute"] + tg["comm"] + tg["full"]
    cl = _rounded(cl)
    fit = {"method": "charm_megatron.lab.calibration.calibrate (Nelder-Mead + coordinate descent, log "
                     "error)",
           "inputs": file_digest(paths), "fit_algos": list(fit_algos),
           "fitted_link_rates": list(unmeasured),
           "passes": ["fwd", "bwd"], "targets": {k: len(v) for k, v in tg.items()},
           "rms_log_error": round(math.sqrt(log_error(cl, every)), 4)}
    topo = points[0].topology
    src = (f"calibrated by charm-megatron model --calibrate on {', '.join(sorted(fit['inputs']))}"
           f" ({'/'.join(fit_algos)} rows only; link rates "
           + (f"{', '.join(unmeasured)} fitted, the rest " if unmeasured else "")
           + "as the bench measured or the command line gave them)")
    return Profile(name, cl, topo, src, fit)


def _rounded(cl: Cluster) -> Cluster:
    """Four significant digits: a profile file that reads well and diffs small."""
    def r(x: float) -> float:
        return float(f"{x:.4g}")

    changes = {}
    for name in ("intra_gbps", "cross_gbps", "tflops", "latency_us", "bwd_factor", "merge_gbps",
                 "op_overhead_us", "msg_cpu_us", "cpu_ns_per_byte", "kernel_q_rows",
                 "kernel_k_rows", "comm_slowdown", "concurrency_penalty"):
        v = getattr(cl, name)
        if v:
            changes[name] = r(v)
    return replace(cl, **changes)
