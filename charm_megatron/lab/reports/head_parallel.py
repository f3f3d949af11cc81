"""``charm-megatron report head-parallel``: CHARM+ with head parallelism on the grid of
docs/performance.md, *CHARM+ with head parallelism*, by the model.

For each point (topology, NIC model, shape): ring, our ``a2a+p2p`` (``-`` where the heads do
not divide by the group size), CHARM+ without a head all-to-all (``head_parallel=1``, the
paper's), CHARM+ with ``head_parallel=auto`` (the degree the model picks on the profile, as a
call with that profile runs it), the two ratios the issue asks for, and how far ``auto``'s
CHARM+ sits above its own lower bound per pass: the larger of its plans' compute alone and its
busiest cross link's bytes at the link's rate (as ``report bound-gap`` computes it).
Forward plus backward milliseconds.

``--emulated CSV...``: the emulated check instead. Each ``NAME.csv`` is a bench run with
CHARM+ at ``head_parallel=auto`` (beside ring, and ``a2a+p2p`` where it runs); its
``NAME-d1.csv`` the same point with CHARM+ alone at ``--setting head_parallel=1``. Device ms
per forward + backward, the contender's bound in brackets, CHARM+'s measured / model, and
TransformerEngine's fastest CP type as shipped there by the model beside the fastest of ours
(:func:`~charm_megatron.lab.reports.te_shipped.te_beside`).
"""

from __future__ import annotations

import argparse
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

from charm_megatron.lab.bench.analysis import busiest_link_bytes
from charm_megatron.lab.bench.config import Point
from charm_megatron.lab.reports.bench_csv import BenchRow, by_algo, read_rows
from charm_megatron.model import Cluster, get_profile, predict
from charm_megatron.model.predict import variants
from charm_megatron.plan import registry
from charm_megatron.plan.cost import Problem
from charm_megatron.plan.registry import CallTraits


@dataclass(frozen=True)
class Shape:
    """One row's model shape and mask."""

    label: str
    problem: Problem
    causal: bool


def grid_shapes() -> Iterator[Shape]:
    """The issue's grid: Llama-3-8B-like and 70B-like GQA at 16k, 32k, 128k; MHA at 64k; the
    paper's 12 x 192 full attention at B=16, S=26,880; Qwen-like 28 / 4 at 32k (causal but
    the paper's)."""
    for hq, name in ((32, "8B 32/8"), (64, "70B 64/8")):
        for s in (16384, 32768, 131072):
            yield Shape(f"{name} {s // 1024}k", Problem(1, s, hq, 8, 128), True)
    yield Shape("MHA 32/32 64k", Problem(1, 65536, 32, 32, 128), True)
    yield Shape("paper 12x192 B=16 26,880 full", Problem(16, 26880, 12, 12, 192), False)
    yield Shape("Qwen 28/4 32k", Problem(1, 32768, 28, 4, 128), True)


def register(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--profile", default="h200",
                        help="the device profile (default h200: the costs measured on the H200)")
    parser.add_argument("--topologies", default="2x8,4x8", help="comma list (default 2x8,4x8)")
    parser.add_argument("--nics", default="rank,node",
                        help="NIC models: rank (one per GPU), node (one per node, the same "
                             "rate); comma list")
    parser.add_argument("--only", default=None, metavar="TEXT",
                        help="only the shapes whose label contains TEXT")
    parser.add_argument("--emulated", nargs="+", default=None, metavar="CSV",
                        help="emulated runs instead: NAME.csv (charm auto) beside NAME-d1.csv "
                             "(charm head_parallel=1)")


def topology_groups(topo: str) -> list[list[int]]:
    """The hardware groups of ``GxM`` (``G`` groups of ``M`` consecutive ranks)."""
    nodes, per = (int(x) for x in topo.split("x"))
    return [list(range(i * per, (i + 1) * per)) for i in range(nodes)]


def _bound_ratio(groups: list[list[int]], shape: Shape, cluster: Cluster,
                 direction: str, time_s: float) -> float:
    """``time_s`` over CHARM+ auto's lower bound for ``direction`` (``fwd`` / ``bwd``)."""
    p = shape.problem
    comp = predict("charm", groups, p, cluster, shape.causal, tune=True, compute_only=True)
    comp_s = (comp.forward if direction == "fwd" else comp.backward).time_s
    point = Point(0, p.b, p.s, p.hq, p.hkv, p.d)
    links = busiest_link_bytes("charm", groups, groups, shape.causal, point, "bf16",
                               cluster.nic, cluster=cluster)
    return time_s / max(comp_s, links[direction] / (cluster.cross_gbps * 1e9))


def table(profile: str, topologies: list[str], nics: list[str],
          only: str | None = None) -> list[str]:
    """The report's Markdown lines."""
    base = get_profile(profile).cluster
    out = [f"# profile {profile} ({base.describe()}); model, fwd+bwd ms; charm d=1: "
           "head_parallel=1 (the paper's CHARM+); charm auto: head_parallel=auto (its degree "
           "d); /bound: charm auto over its lower bound, fwd / bwd",
           "| GPUs | NIC | shape | ring | a2a+p2p | charm d=1 | charm auto (d) | "
           "auto vs a2a+p2p | auto vs d=1 | /bound fwd | /bound bwd |",
           "|---|---|---|---|---|---|---|---|---|---|---|"]
    for topo in topologies:
        groups = topology_groups(topo)
        traits_groups = tuple(tuple(g) for g in groups)
        for nic in nics:
            cl = base.with_(nic=nic)
            for shape in grid_shapes():
                if only and only not in shape.label:
                    continue
                p, causal = shape.problem, shape.causal
                ring = predict("ring", groups, p, cl, causal).total_s
                a2a = None
                if not registry.refuses("a2a+p2p", CallTraits(traits_groups, p.hq, p.hkv)):
                    a2a = predict("a2a+p2p", groups, p, cl, causal).total_s
                one = predict("charm", groups, p, cl, causal, tune=True, head_parallel=1)
                auto = predict("charm", groups, p, cl, causal, tune=True)
                d = variants("charm", groups, p, cl, causal=causal)[0].head_parallel
                vs_a2a = "-" if a2a is None else f"{a2a / auto.total_s:.2f}x"
                out.append(
                    f"| {topo} | {nic} | {shape.label} | {ring * 1e3:.1f} | "
                    f"{'-' if a2a is None else f'{a2a * 1e3:.1f}'} | {one.total_s * 1e3:.1f} | "
                    f"{auto.total_s * 1e3:.1f} ({d}) | {vs_a2a} | "
                    f"{one.total_s / auto.total_s:.2f}x | "
                    f"{_bound_ratio(groups, shape, cl, 'fwd', auto.forward.time_s):.2f}x | "
                    f"{_bound_ratio(groups, shape, cl, 'bwd', auto.backward.time_s):.2f}x |")
    return out


def bench_cell(row: BenchRow | None) -> str:
    """A bench row's device ms, † when more than 10 % off the model, its bound in brackets."""
    if row is None or row.median_ms is None:
        return "-"
    mark = "†" if row.off_model else ""
    bound = "" if row.bound_ms is None else f" ({row.bound_ms:.2f})"
    return f"{row.median_ms:.2f}{mark}{bound}"


def emulated(paths: list[str], te: bool = True) -> list[str]:
    """The emulated check's Markdown lines: one row per ``NAME.csv`` with a ``NAME-d1.csv``;
    ``te=False`` leaves TransformerEngine's column (the model's prices of it) empty."""
    # te_shipped imports this module's topology_groups: imported here, not at the top
    from charm_megatron.lab.reports.te_shipped import te_beside

    out = ["| point | GPUs / NIC | ring | a2a+p2p | charm d=1 | charm auto | auto vs a2a+p2p | "
           "auto vs d=1 | charm auto measured / model | fastest TE, model (TE / ours, model) |",
           "|---|---|---|---|---|---|---|---|---|---|"]
    by_name = {Path(p).stem: p for p in paths}
    for name, path in sorted(by_name.items()):
        if name.endswith("-d1") or f"{name}-d1" not in by_name:
            continue
        rows = by_algo(read_rows(path), "fwdbwd", ok_only=True)
        one = by_algo(read_rows(by_name[f"{name}-d1"]), "fwdbwd", ok_only=True).get("charm")
        ring, a2a, auto = rows.get("ring"), rows.get("a2a+p2p"), rows.get("charm")
        first = next(iter(rows.values()))

        def ratio(a: BenchRow | None, b: BenchRow | None) -> str:
            if a is None or b is None or not a.median_ms or not b.median_ms:
                return "-"
            return f"{a.median_ms / b.median_ms:.2f}x"

        vs_model = "-" if auto is None or auto.vs_model is None else f"{auto.vs_model:.2f}"
        out.append(f"| {name} ({first.device_model}) | {first.topology} / {first.nic} | "
                   f"{bench_cell(ring)} | {bench_cell(a2a)} | {bench_cell(one)} | "
                   f"{bench_cell(auto)} | "
                   f"{ratio(a2a, auto)} | {ratio(one, auto)} | {vs_model} | "
                   f"{te_beside(first, rows) if te else '-'} |")
    out.append("")
    out.append("† more than 10 % off the model: not a headline")
    return out


def run(args: argparse.Namespace) -> int:
    if args.emulated:
        print("\n".join(emulated(args.emulated)))
        return 0
    print("\n".join(table(args.profile, args.topologies.split(","), args.nics.split(","),
                          args.only)))
    return 0
