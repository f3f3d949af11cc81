"""``charm-megatron report te``: our ``auto`` against TransformerEngine's CP types as shipped,
by the model, on the grid of docs/performance.md ("TransformerEngine as shipped").

For each point (topology, NIC model, shape): the fastest ``te-*`` contender TE runs there (on
TE's kernel curve, cuDNN's: ``assumed`` unless the profile measured it), then our ``auto``
(the fastest of ours, its settings decided on the profile as a call with it decides them) on
our measured kernel (``aten-flash``, FlashAttention-2) and on cuDNN's curve (what our ``cudnn``
backend runs: assumed, never run on a GPU), each with TE's time over ours (above 1: ours is
faster). Forward plus backward milliseconds.

``--emulated CSV...``: the emulated check instead: per bench CSV (one point, with ``te-*`` and
our contenders on the same emulated cluster), the fastest ``te-*``, ours, and the ratio; where
a ``te-*`` contender the emulator did not time (TE's all-gather: NCCL collectives) is faster
by the model on the CSV's device, that one, marked "model only".
"""

from __future__ import annotations

import argparse
import functools
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path

from charm_megatron.lab.bench.config import element_size
from charm_megatron.lab.reports.bench_csv import by_algo, read_rows
from charm_megatron.lab.reports.head_parallel import (
    Shape,
    bench_cell,
    grid_shapes,
    topology_groups,
)
from charm_megatron.model import get_profile
from charm_megatron.model.kernel_rates import cluster_on, kernels_of
from charm_megatron.model.predict import rank_algos
from charm_megatron.model.te_contenders import (
    TE_KERNEL,
    TE_NAMES,
    fastest_te,
    predict_te_all,
    te_cluster,
)
from charm_megatron.plan.cost import Problem

#: Our tiles' measured kernel curve (FlashAttention-2 through torch).
OURS_MEASURED = "aten-flash"


def te_shapes() -> Iterator[Shape]:
    """The head-parallel grid plus a 4k sliding window at 64k (Llama-8B-like GQA)."""
    yield from grid_shapes()
    yield Shape("8B 32/8 64k window 4k", Problem(1, 65536, 32, 8, 128, window=(4096, 0)), True)


def register(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--profile", default="h200",
                        help="the device profile (default h200: the costs measured on the H200)")
    parser.add_argument("--topologies", default="2x8,4x8", help="comma list (default 2x8,4x8)")
    parser.add_argument("--nics", default="rank,node",
                        help="NIC models: rank (one per GPU), node (one per node); comma list")
    parser.add_argument("--only", default=None, metavar="TEXT",
                        help="only the shapes whose label contains TEXT")
    parser.add_argument("--emulated", nargs="+", default=None, metavar="CSV",
                        help="emulated runs instead: one bench CSV per point")


def _ratio(te, ours_s: float) -> str:
    """TE's time over ours (``-`` where TE refuses the call)."""
    return "-" if te is None else f"{te.total_s / ours_s:.2f}x"


def table(profile: str, topologies: list[str], nics: list[str], only: str | None = None
          ) -> list[str]:
    """The model's grid as Markdown lines."""
    prof = get_profile(profile)
    known = kernels_of(prof)
    status = {k: known[k].status if k in known else "absent" for k in (OURS_MEASURED, TE_KERNEL)}
    ours_k = OURS_MEASURED if OURS_MEASURED in known else None
    head = (f"| GPUs | NIC | shape | fastest TE ({TE_KERNEL}, {status[TE_KERNEL]}) | ours, auto "
            f"(FA-2, {status[OURS_MEASURED]}) | TE / ours | ours on {TE_KERNEL} "
            f"({status[TE_KERNEL]}) | TE / ours on {TE_KERNEL} |")
    out = [head, "|---|---|---|---|---|---|---|---|"]
    for topo in topologies:
        groups = topology_groups(topo)
        for nic in nics:
            ours_cl = (cluster_on(prof, ours_k) if ours_k else prof.cluster).with_(nic=nic)
            fast_cl = (cluster_on(prof, TE_KERNEL) if TE_KERNEL in known
                       else prof.cluster).with_(nic=nic)
            te_cl = te_cluster(prof).with_(nic=nic)
            for shape in te_shapes():
                if only and only not in shape.label:
                    continue
                p, causal = shape.problem, shape.causal
                te = fastest_te(groups, p, te_cl, causal)
                ours = rank_algos(groups, p, ours_cl, causal=causal, tune=True)[0]
                fast = rank_algos(groups, p, fast_cl, causal=causal, tune=True)[0]
                te_cell = "refused" if te is None else f"{te.algo} {te.total_s * 1e3:.1f}"
                out.append(f"| {topo} | {nic} | {shape.label} | {te_cell} | "
                           f"{ours[1]} {ours[0] * 1e3:.1f} | {_ratio(te, ours[0])} | "
                           f"{fast[1]} {fast[0] * 1e3:.1f} | {_ratio(te, fast[0])} |")
    return out


def emulated(paths: list[str]) -> list[str]:
    """One row per bench CSV: the fastest ``te-*`` row, the fastest of ours (``auto``'s pick
    where it ran), TE's time over ours, our ``a2a+p2p`` where it ran and ``auto``'s speed over
    it (issue 39), ours over the model, and every timed row of the run (any contender, any
    pass) more than 10 % off the model (issue 41); device ms per forward + backward, the bound
    in brackets, † where the row is more than 10 % off the model."""
    out = ["| point | GPUs / NIC | fastest TE | ours (auto) | TE / ours | our a2a+p2p | "
           "auto vs a2a+p2p | ours measured / model | rows off the model |",
           "|---|---|---|---|---|---|---|---|---|"]
    for path in sorted(paths):
        every = read_rows(path)
        rows = by_algo(every, "fwdbwd", ok_only=True)
        tes = {a: r for a, r in rows.items() if a in TE_NAMES and r.median_ms}
        ours = {a: r for a, r in rows.items() if a not in TE_NAMES and r.median_ms}
        if not ours:
            continue
        first = next(iter(rows.values()))
        mine_name = "auto" if "auto" in ours else min(ours, key=lambda a: ours[a].median_ms)
        mine = ours[mine_name]
        te_name = min(tes, key=lambda a: tes[a].median_ms) if tes else None

        # TE's contenders the emulator did not time (its all-gather) at the model's price.
        model_only = {n: p.total_s * 1e3 for n, p in _model_te(_point(every[0])).items()
                      if n not in tes}
        best_model = min(model_only, key=model_only.get, default=None)
        if best_model is not None and (te_name is None
                                       or model_only[best_model] < tes[te_name].median_ms):
            te_cell = f"{best_model} {model_only[best_model]:.2f} (model only)"
            ratio = f"{model_only[best_model] / mine.median_ms:.2f}x"
        elif te_name is not None:
            te_cell = f"{te_name} {bench_cell(tes[te_name])}"
            ratio = f"{tes[te_name].median_ms / mine.median_ms:.2f}x"
        else:
            te_cell, ratio = "refused", "-"
        hier = ours.get("a2a+p2p")
        vs_hier = "-" if hier is None or mine_name == "a2a+p2p" else \
            f"{hier.median_ms / mine.median_ms:.2f}x"
        vs = "-" if mine.vs_model is None else f"{mine.vs_model:.2f}"
        label = Path(path).parent.name if Path(path).stem == "results" else Path(path).stem
        out.append(f"| {label} ({first.device_model}) | {first.topology} / {first.nic} | "
                   f"{te_cell} | {mine_name} {bench_cell(mine)} | {ratio} | "
                   f"{bench_cell(hier)} | {vs_hier} | {vs} | {_off_model_rows(every)} |")
    out.append("")
    out.append("† more than 10 % off the model: not a headline")
    return out


def _off_model_rows(rows) -> str:
    """The timed rows of a run (each contender's forward and backward) more than 10 % off the
    model, as ``algo pass measured/model``; ``none`` when every one is within."""
    off = [f"{r.algo} {r.pass_} {r.vs_model:.2f}" for r in rows
           if r.ok and r.pass_ in ("fwd", "bwd") and r.off_model]
    return ", ".join(off) if off else "none"


_PASS_SECONDS = {"fwd": lambda p: p.forward.time_s, "bwd": lambda p: p.backward.time_s,
                 "fwdbwd": lambda p: p.total_s}


def te_beside(row, ours: Iterable[str], pass_: str = "fwdbwd") -> str:
    """The cell an emulated table puts beside ours: the fastest ``te-*`` contender at a bench
    row's point *by the model* on the shipped profile of the row's device (TE's curve,
    :func:`_model_te`), its ms for ``pass_`` and, in brackets, its time over the fastest of
    ``ours`` (our algorithms the run timed, each at its defaults with the model deciding its
    ``auto`` settings) by the same model on the same profile: above 1, ours is faster. Both
    sides are priced now, so the ratio holds on the profile as shipped even where the run's
    own times predate a change to it. ``refused`` where TE runs none of its types; ``-`` for
    a CPU-testbed row (no device profile)."""
    if not row.device_model or None in (row.batch, row.seq, row.heads, row.kv_heads,
                                         row.head_dim, row.dtype, row.topology):
        return "-"  # a CPU-testbed row, or a file too old to say its problem
    point = _point(row)
    secs = {n: _PASS_SECONDS[pass_](p) for n, p in _model_te(point).items()}
    if not secs:
        return "refused"
    name = min(secs, key=secs.get)
    mine = [_PASS_SECONDS[pass_](p) for p in _model_ours(point, tuple(sorted(set(ours))))]
    ratio = f" ({secs[name] / min(mine):.2f}x)" if mine else ""
    return f"{name} {secs[name] * 1e3:.1f}{ratio}"


@dataclass(frozen=True)
class _Point:
    """What the model needs of a bench row's point (hashable: the tables ask per pass and
    per table, the model answers once)."""

    device: str
    nic: str | None
    topology: str
    problem: Problem
    causal: bool


def _point(row) -> _Point:
    problem = Problem(row.batch, row.seq, row.heads, row.kv_heads, row.head_dim,
                      element_size(row.dtype), window=row.window)
    return _Point(row.device_model, row.nic or None, row.topology, problem, bool(row.causal))


@functools.lru_cache(maxsize=256)
def _model_ours(point: _Point, algos: tuple[str, ...]) -> list:
    """The model's predictions of ``algos`` (those it can run) at a point, on its device's
    shipped profile and NIC model."""
    from charm_megatron.model.predict import predict
    from charm_megatron.plan.registry import find

    cluster = get_profile(point.device).cluster.with_(nic=point.nic)
    groups = topology_groups(point.topology)
    out = []
    for algo in algos:
        if algo in TE_NAMES or algo == "auto" or find(algo) is None:
            continue
        try:
            out.append(predict(algo, groups, point.problem, cluster, point.causal, tune=True))
        except ValueError:  # refused at this shape (heads that do not divide, ...)
            continue
    return out


@functools.lru_cache(maxsize=256)
def _model_te(point: _Point) -> dict:
    """The model's TE contenders that run at a point, on its device profile's TE curve and
    NIC model, by name."""
    cl = te_cluster(get_profile(point.device)).with_(nic=point.nic)
    return predict_te_all(topology_groups(point.topology), point.problem, cl, point.causal)


def run(args: argparse.Namespace) -> int:
    if args.emulated:
        print("\n".join(emulated(args.emulated)))
        return 0
    print("\n".join(table(args.profile, args.topologies.split(","), args.nics.split(","),
                          args.only)))
    return 0
