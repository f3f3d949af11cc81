"""From raw per-rank timings to the benchmark's table (no torch).

Definitions (docs/bench.md repeats them):

* **time of a call** in one round: the slowest rank's time (a CP call ends when its last rank
  ends). ``fwdbwd`` = forward + backward of the same round.
* **median / spread**: over the timed rounds; spread as min, quartiles, max.
* **speedup over ring**: the median over rounds of ``ring time / algorithm time``, both from the
  same round (the contenders alternate inside a round, so slow phases of the machine cancel).
* **CCR** (the paper's Eq. 7): ring's summed computation over its summed communication, each
  measured by running ring with the other switched off (``CPOptions.ablation``): ``median(ring
  compute-only) / median(ring comm-only)``.
* **lower bound** of an algorithm: ``max(total CPU work / cores, busiest cross link's bytes /
  its rate)``. Total CPU work = the CPU time (all threads) the ranks spend in the algorithm's
  compute-only run, summed over ranks: the work that must be done somewhere even with a free
  network. The link term: bytes the algorithm's plan moves over the most loaded direction of one
  cross-node link (the node's NIC with ``--nic node``, a rank's with ``--nic rank``), less the
  link's burst (a ``tbf`` bucket lets that much through at once), divided by the measured cross
  rate. On GPUs the compute term is the slowest rank's compute-only time
  (every rank has its own device). ``vs bound`` = median time / bound (1.0 = at the bound).
* **auto**: the contender ``auto`` runs ``cp_attention(algo="auto")``; its rows name its pick
  (``auto_pick``), take the pick's bound, and compare its median with the fastest median of
  ring / rmplus / charm in the same run (``vs_fastest``; ``auto_check`` is ``over`` above
  :data:`AUTO_SLACK`).
"""

from __future__ import annotations

import statistics
from collections import defaultdict
from collections.abc import Sequence
from dataclasses import dataclass, field

from charm_megatron.lab.bench.config import PASSES, BenchConfig, Point, element_size
from charm_megatron.lab.bench.gpu_emulation import CPU_LIMITED
from charm_megatron.lab.reports.bench_csv import (  # noqa: F401  (COLUMNS: the CSV's columns)
    COLUMNS,
    off_model,
)
from charm_megatron.model.te_contenders import TE_NAMES
from charm_megatron.model.te_contenders import get as te_get
from charm_megatron.plan.cost import Problem, call_parts
from charm_megatron.plan.registry import ALGORITHM_NAMES, build_plan, uses_topology
from charm_megatron.plan.roles import RoleShape

#: ``auto`` may be this much slower than the fastest contender (issue 12: 5 %).
AUTO_SLACK = 1.05
#: The contenders ``auto`` chooses among (and is compared with): every registered algorithm.
AUTO_FIELD = ALGORITHM_NAMES


@dataclass
class RunInfo:
    """Where and how the ranks ran (filled in by the launcher)."""

    mode: str  # local | netns | software | torchrun
    world: int
    device: str = "cpu"
    cores: int = 1  # cores the ranks share (the CPU bound's denominator)
    nic: str | None = None
    hw_groups: list[list[int]] | None = None  # emulated / real nodes; None: one machine
    cross_rate: float | None = None  # bytes/s used for the bound's link term
    cross_rate_source: str | None = None  # measured | configured
    cross_burst: int = 0  # bytes a link lets through at once (tc tbf bucket); 0: none
    rates: dict = field(default_factory=dict)  # what the launcher measured / configured
    notes: list[str] = field(default_factory=list)


def _q(values: Sequence[float]) -> tuple[float, float, float, float, float]:
    """min, q1, median, q3, max."""
    v = sorted(values)
    if len(v) == 1:
        return v[0], v[0], v[0], v[0], v[0]
    q1, med, q3 = statistics.quantiles(v, n=4, method="inclusive")
    return v[0], q1, med, q3, v[-1]


def _series(per_rank: Sequence[dict], pos: int, key: str, what: str, reduce) -> list[float]:
    """Per-round values of ``what`` for variant ``key`` at point position ``pos``, reduced over
    ranks (``max``: the slowest rank's wall time; ``sum``: the ranks' total CPU time)."""
    cols = [r["points"][pos]["times"][key][what] for r in per_rank]
    return [reduce(vals) for vals in zip(*cols)]


def _pass_series(per_rank: Sequence[dict], pos: int, key: str, cpu: bool = False
                 ) -> dict[str, list[float]]:
    suffix = "_cpu" if cpu else ""
    red = sum if cpu else max
    f = _series(per_rank, pos, key, "fwd" + suffix, red)
    b = _series(per_rank, pos, key, "bwd" + suffix, red)
    return {"fwd": f, "bwd": b, "fwdbwd": [x + y for x, y in zip(f, b)]}


def link_loads(algo: str, direction: str, plan_groups: Sequence[Sequence[int]],
               hw_groups: Sequence[Sequence[int]], causal: bool, point: Point, dtype: str,
               nic: str, roles: str = "bytes",
               window: tuple[int, int] | None = None,
               wide_partials: bool = False,
               cluster: object | None = None,
               settings: dict[str, object] | None = None) -> dict[tuple[str, int], float]:
    """Bytes per direction of every cross-node link for one call of ``algo``'s plan (with the
    role mix ``roles``, for this point's head shape; under ``window``, its windowed plan;
    with ``cluster``, the plan a call with that profile runs: its ``auto`` settings, e.g.
    CHARM+'s head-parallel degree, decided by the model on it; ``settings``: the run's
    algorithm settings by name, ``--setting`` included).

    Keys: ``("out", owner)`` / ``("in", owner)``, owner = node index (``nic="node"``: a node's
    ranks share its link) or rank (``nic="rank"``). Message sizes come from
    :meth:`charm_megatron.plan.cost.Problem.xfer_bytes`, counted as
    :func:`charm_megatron.plan.cost.traffic` counts the sender's side, plus the receiver's.
    """
    problem = Problem(point.batch, point.seq, point.heads, point.kv_heads, point.head_dim,
                      elem=element_size(dtype), window=window, wide_partials=wide_partials)
    shape = RoleShape(problem.hq, problem.hkv, problem.d, problem.elem, problem.dv,
                      problem.wide_partials)
    n = sum(len(g) for g in plan_groups)
    timer = None
    if cluster is not None:
        from charm_megatron.model import ClusterTimer

        timer = ClusterTimer(cluster, problem, tuple(tuple(g) for g in hw_groups))
    plan = build_plan(algo, direction, [list(g) for g in plan_groups], causal,
                      shape=shape, tiles=problem.tiles(n, causal), timer=timer,
                      **{**(settings or {}), "roles": roles})
    group_of = {r: gi for gi, g in enumerate(hw_groups) for r in g}

    def owner(r: int) -> int:
        return group_of[r] if nic == "node" else r

    loads: dict[tuple[str, int], float] = defaultdict(float)
    for part, prob in call_parts(plan, problem):  # a head all-to-all's messages too
        for r in range(part.n):
            for op in part.comms(r):
                for x, side in [(x, "out") for x in op.sends] + [(x, "in") for x in op.recvs]:
                    if group_of[x.peer] != group_of[r]:
                        loads[(side, owner(r))] += prob.xfer_bytes(x, part.n)
    return dict(loads)


def busiest_link_bytes(algo: str, plan_groups: Sequence[Sequence[int]],
                       hw_groups: Sequence[Sequence[int]], causal: bool, point: Point,
                       dtype: str, nic: str, roles: str = "bytes",
                       window: tuple[int, int] | None = None,
                       wide_partials: bool = False,
                       cluster: object | None = None,
                       settings: dict[str, object] | None = None) -> dict[str, float]:
    """Bytes over the most loaded cross-link direction, per pass (fwd, bwd, fwdbwd);
    ``cluster``, ``settings``: as :func:`link_loads`'."""
    fwd = link_loads(algo, "forward", plan_groups, hw_groups, causal, point, dtype, nic, roles,
                     window, wide_partials, cluster, settings)
    bwd = link_loads(algo, "backward", plan_groups, hw_groups, causal, point, dtype, nic, roles,
                     window, wide_partials, cluster, settings)
    both: dict[tuple[str, int], float] = defaultdict(float)
    for d in (fwd, bwd):
        for k, v in d.items():
            both[k] += v
    return {"fwd": max(fwd.values(), default=0.0), "bwd": max(bwd.values(), default=0.0),
            "fwdbwd": max(both.values(), default=0.0)}


def analyse(cfg: BenchConfig, points: Sequence[Point], per_rank: Sequence[dict],
            info: RunInfo) -> tuple[list[dict], dict]:
    """The rows of the result table (one per point x algorithm x pass) and the raw series
    (per point and variant: the slowest rank's time and the ranks' summed CPU time, per round)."""
    rows: list[dict] = []
    raw: dict = {}
    passes = PASSES if cfg.backward else ("fwd",)
    r0 = per_rank[0]
    topology = r0["topology"]
    charm_groups = r0["topology_groups"]
    world = info.world
    flat = [list(range(world))]
    for pos, point in enumerate(points):
        rec0 = r0["points"][pos]
        keys = list(rec0["times"])
        wall = {k: _pass_series(per_rank, pos, k) for k in keys}
        cpu = {k: _pass_series(per_rank, pos, k, cpu=True) for k in keys}
        raw[str(point.index)] = {
            k: {"fwd_ms": [x * 1e3 for x in wall[k]["fwd"]],
                "bwd_ms": [x * 1e3 for x in wall[k]["bwd"]],
                "fwd_cpu_ms_sum": [x * 1e3 for x in cpu[k]["fwd"]],
                "bwd_cpu_ms_sum": [x * 1e3 for x in cpu[k]["bwd"]]} for k in keys}
        base = {"point": point.index, "batch": point.batch, "seq": point.seq,
                "heads": point.heads, "kv_heads": point.kv_heads, "head_dim": point.head_dim,
                "dtype": cfg.dtype, "causal": cfg.causal,
                "window": "" if cfg.window is None else f"{cfg.window[0]},{cfg.window[1]}",
                "world": world, "topology": topology,
                "mode": info.mode, "nic": info.nic or "", "partials": cfg.partials,
                "auto_tune": cfg.auto_tune or "",
                **_link_columns(info)}
        ccr: dict[str, tuple[float, float, float]] = {}
        if "ring/compute" in wall and "ring/comm" in wall:
            for p in passes:
                comp = statistics.median(wall["ring/compute"][p])
                comm = statistics.median(wall["ring/comm"][p])
                ccr[p] = (comp / comm if comm > 0 else float("inf"), comp, comm)
        picks = rec0.get("picks", {})
        if cfg.device is not None:
            base.update(_device_columns(cfg, per_rank, pos))
        for algo in cfg.algos:
            if algo in rec0["skipped"]:
                for p in passes:
                    rows.append({**base, "algo": algo, "pass": p, "status": "skipped",
                                 "note": rec0["skipped"][algo]})
                continue
            key = f"{algo}/full"
            # auto runs its pick's plans: its bytes and its bound are the pick's; a te-*
            # contender runs the plan that moves its blocks, with its wire dtype, on TE's
            # kernel curve.
            plan_algo = picks.get(algo, algo)
            run = _as_run(cfg, algo)
            if algo in TE_NAMES:
                plan_algo = te_get(algo).algo
            bytes_by_pass = None
            if algo != "torch" and info.hw_groups and len(info.hw_groups) > 1:
                plan_groups = charm_groups if uses_topology(plan_algo) else flat
                # On the emulated cluster the ranks decide auto settings on the device's
                # model, so the bytes are those of the plan they ran.
                bytes_by_pass = busiest_link_bytes(plan_algo, plan_groups, info.hw_groups,
                                                   cfg.causal, point, cfg.dtype, info.nic or "node",
                                                   cfg.roles, cfg.problem_window(),
                                                   run.wide_partials, run.cluster,
                                                   run.settings)
            for p in passes:
                row = {**base, "algo": algo, "pass": p, "status": "ok",
                       "note": rec0["notes"].get(algo, "")}
                row.update(_timing(wall, cpu, key, p))
                row.update(_speedup(wall, key, p))
                if p in ccr:
                    row.update(ring_ccr=ccr[p][0], ring_compute_ms=ccr[p][1] * 1e3,
                               ring_comm_ms=ccr[p][2] * 1e3)
                if cfg.device is not None and algo != "torch":
                    row.update(_model_columns(cfg, point, plan_algo, p, charm_groups, info,
                                              row["median_ms"], run))
                row.update(_bound(wall, cpu, plan_algo, p, info, bytes_by_pass,
                                  row["median_ms"], row.get("compute_only_ms")))
                if algo in picks:
                    row.update(_versus_fastest(wall, key, p, picks[algo]))
                mem = [r["points"][pos]["memory"].get(algo) for r in per_rank]
                if mem and all(m is not None for m in mem):
                    which = "fwd" if p == "fwd" else "fwdbwd"
                    row["peak_mem_mb"] = max(m[which] for m in mem) / 2**20
                rows.append(row)
    return rows, raw


def _versus_fastest(wall: dict, key: str, p: str, pick: str) -> dict:
    """auto's row: its pick, the fastest of :data:`AUTO_FIELD` timed here (by median) and
    auto's median over that one's (``auto_check`` ``over`` beyond :data:`AUTO_SLACK`)."""
    out: dict = {"auto_pick": pick}
    medians = {a: statistics.median(wall[f"{a}/full"][p]) for a in AUTO_FIELD
               if f"{a}/full" in wall}
    if not medians:
        return out
    order = list(AUTO_FIELD)
    fastest = min(medians, key=lambda a: (medians[a], order.index(a)))
    ratio = statistics.median(wall[key][p]) / medians[fastest] if medians[fastest] > 0 else None
    out.update(fastest=fastest, vs_fastest=ratio)
    if pick in medians and medians[fastest] > 0:
        # The same plans timed as their own contender: above 1.05 the choice was wrong;
        # vs_fastest far above this one is noise or overhead of the auto call itself.
        out["pick_vs_fastest"] = medians[pick] / medians[fastest]
    if ratio is not None:
        out["auto_check"] = "ok" if ratio <= AUTO_SLACK else "over"
    return out


def _device_columns(cfg: BenchConfig, per_rank: Sequence[dict], pos: int) -> dict:
    dev = cfg.device
    busiest = per_rank[0]["points"][pos].get("busiest_core")
    return {"device_model": dev.profile, "dilation": dev.dilation,
            "wire_scale": f"{dev.batch_scale}x{dev.rows_scale}",
            "device_clock": dev.device_clock,
            "busiest_core_pct": busiest * 100 if busiest is not None else "",
            "cpu_limited": (busiest > CPU_LIMITED) if busiest is not None else ""}


@dataclass(frozen=True)
class _Run:
    """How a contender's plan ran: the partials' wire dtype, the device (``None``: not
    emulated) and the settings given to it."""

    wide_partials: bool
    cluster: object
    settings: dict
    te: bool = False


def _as_run(cfg: BenchConfig, algo: str) -> _Run:
    """Ours run with the bench's ``--partials`` and ``--setting`` values on the device; a
    ``te-*`` contender with TE's wire dtype, no settings, on the device on TE's kernel."""
    device = cfg.device
    if algo in TE_NAMES:
        return _Run(te_get(algo).partials == "fp32",
                    None if device is None else device.with_links(device.te_cluster()), {},
                    te=True)
    return _Run(cfg.wide_partials, None if device is None else device.model_cluster,
                dict(cfg.settings))


def _model_columns(cfg: BenchConfig, point: Point, algo: str, p: str,
                   charm_groups: list[list[int]], info: RunInfo, median_ms: float,
                   run: _Run | None = None) -> dict:
    """The model's prediction of ``algo`` at ``point`` on the run's device (the same profile,
    the same links, the hardware groups; ``run``: how the contender ran it, ours by default)
    and, for ring, the textbook ring (issue 23's checks: within 10 %, or the difference
    explained)."""
    from charm_megatron.model import predict

    run = run if run is not None else _as_run(cfg, algo)
    cluster = run.cluster
    hw = info.hw_groups or [list(range(info.world))]
    problem = Problem(point.batch, point.seq, point.heads, point.kv_heads, point.head_dim,
                      elem=element_size(cfg.dtype), window=cfg.problem_window(),
                      wide_partials=run.wide_partials)
    settings = {**run.settings, "roles": cfg.roles}
    own = {k: v for k, v in settings.items() if k in _settings_of(algo)}
    pred = predict(algo, hw, problem, cluster, cfg.causal, tune=True, **own)
    model_s = {"fwd": pred.forward.time_s, "bwd": pred.backward.time_s,
               "fwdbwd": pred.total_s}[p]
    vs_model = (median_ms / 1e3) / model_s if model_s > 0 else None
    flag = off_model(vs_model)
    out = {"model_ms": model_s * 1e3, "vs_model": "" if vs_model is None else vs_model,
           "off_model": "" if flag is None else flag}
    # The device's compute is the model's by construction (the timed device prices tiles with
    # its formulas), so an emulated run takes its compute-only time, and ring's CCR, from the
    # model instead of timing ablated runs: the bound = max(the busiest rank's device
    # compute, the busiest cross link's bytes at its real rate).
    compute = predict(algo, hw, problem, cluster, cfg.causal, tune=True, compute_only=True,
                      **own)
    comp_s = {"fwd": compute.forward.time_s, "bwd": compute.backward.time_s,
              "fwdbwd": compute.total_s}[p]
    out["compute_only_ms"] = comp_s * 1e3
    if p != "fwdbwd":
        from charm_megatron.model import ring_ccr

        ccr = ring_ccr(hw, problem, cluster, cfg.causal,
                       "forward" if p == "fwd" else "backward")
        out.update(ring_ccr=ccr.ratio, ring_compute_ms=ccr.compute_s * 1e3,
                   ring_comm_ms=ccr.comm_s * 1e3)
    if algo == "ring" and problem.window is None and not run.te:  # the textbook ring
        from charm_megatron.lab.bench.emulator_checks import analytic_ring

        n = info.world
        f = analytic_ring(cluster, problem, n, cfg.causal, "forward", hw)
        b = analytic_ring(cluster, problem, n, cfg.causal, "backward", hw)
        out["analytic_ring_ms"] = {"fwd": f, "bwd": b, "fwdbwd": f + b}[p] * 1e3
    return out


def _settings_of(algo: str) -> set[str]:
    from charm_megatron.plan.registry import get

    return {s.name for s in get(algo).settings}


def _link_columns(info: RunInfo) -> dict:
    """Cores the ranks shared, the intra rate (measured one pair, else configured) and the
    cross links' token bucket: the calibration's inputs (docs/model.md)."""
    intra = info.rates.get("intra_one_pair") or info.rates.get("configured_intra")
    return {"cores": info.cores if info.device != "cuda" else "",
            "intra_rate_mbps": intra / 1e6 if intra else "",
            "cross_burst_kb": info.cross_burst / 1024 if info.cross_burst else ""}


def _timing(wall: dict, cpu: dict, key: str, p: str) -> dict:
    t = wall[key][p]
    mn, q1, med, q3, mx = _q(t)
    return {"iters": len(t), "median_ms": med * 1e3, "min_ms": mn * 1e3, "q1_ms": q1 * 1e3,
            "q3_ms": q3 * 1e3, "max_ms": mx * 1e3,
            "run_cpu_ms": statistics.median(cpu[key][p]) * 1e3}


def _speedup(wall: dict, key: str, p: str) -> dict:
    if "ring/full" not in wall:
        return {}
    ratios = [a / b for a, b in zip(wall["ring/full"][p], wall[key][p]) if b > 0]
    if not ratios:
        return {}
    return {"speedup_vs_ring": statistics.median(ratios), "speedup_min": min(ratios),
            "speedup_max": max(ratios)}


def _bound(wall: dict, cpu: dict, algo: str, p: str, info: RunInfo,
           bytes_by_pass: dict[str, float] | None, median_ms: float,
           modelled_compute_ms: float | None = None) -> dict:
    out: dict = {}
    compute_term = None
    comp_key = f"{algo}/compute"
    if modelled_compute_ms is not None:  # an emulated device: its compute is the model's
        compute_term = modelled_compute_ms / 1e3
    elif comp_key in wall:
        comp_wall = statistics.median(wall[comp_key][p])
        work = statistics.median(cpu[comp_key][p])
        out.update(compute_only_ms=comp_wall * 1e3, cpu_work_ms=work * 1e3)
        # On devices (real or emulated) compute is the compute-only run's time; on the CPU
        # testbed the ranks share the cores, so it is their CPU work over the cores.
        on_device = info.device in ("cuda", "emulated")
        compute_term = comp_wall if on_device else work / max(1, info.cores)
    link_term = None
    if bytes_by_pass is not None:
        out["cross_link_mb"] = bytes_by_pass[p] / 1e6
        if info.cross_rate:
            out["cross_rate_mbps"] = info.cross_rate / 1e6
            # A tbf link starts a call with up to a full bucket: B bytes need at least
            # (B - burst) / rate, whatever the schedule.
            link_term = max(0.0, bytes_by_pass[p] - info.cross_burst) / info.cross_rate
    if compute_term is None:
        return out
    bound, by = compute_term, ("compute" if info.device in ("cuda", "emulated") else "cpu")
    if link_term is not None and link_term > compute_term:
        bound, by = link_term, "link"
    out.update(bound_ms=bound * 1e3, bound_by=by,
               vs_bound=(median_ms / 1e3) / bound if bound > 0 else None)
    return out
