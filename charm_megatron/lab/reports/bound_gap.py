"""``charm-megatron report bound-gap``: where CHARM+'s time above its lower bound goes, by the
model (docs/performance.md, *How close CHARM+ gets to the lower bound*).

For each row: the bound (the larger of the busiest rank's compute and the busiest cross link's
bytes at its rate), the model's CHARM+ time, and the share of the excess (time - bound, the
bound recomputed on each changed cluster) that goes when one cost is removed from the cluster:
the per-op overhead, the merges, the slowdown of compute under communication. (Infinitely fast
cross links are no such test: they move the bound itself from the links to compute.) The
shares do not add up exactly: the costs interact, and removing one can expose another.
"""

from __future__ import annotations

import argparse
from collections.abc import Iterator

from charm_megatron.lab.bench.analysis import busiest_link_bytes
from charm_megatron.lab.bench.config import Point
from charm_megatron.lab.calibration import paper
from charm_megatron.model import Cluster, get_profile, predict
from charm_megatron.plan.cost import Problem

# The Llama-3-like rows of docs/performance.md (32 q / 8 kv and 64 / 8 heads x 128, bf16, causal).
LLAMA = [(topo, hq, s) for topo in ("2x8", "4x8") for hq in (32, 64)
         for s in (16384, 32768, 65536, 131072)]
PASSES = (("fwd", "forward"), ("bwd", "backward"))


def register(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--profile", default="h100", help="the device profile (default h100)")
    parser.add_argument("--llama", action="store_true",
                        help="the Llama-3-like rows instead of the paper's Table 5 rows")
    parser.add_argument("--partials", choices=("input", "fp32"), default="fp32",
                        help="the dtype partial results travel in (default fp32, the paper's)")
    parser.add_argument("--nic", choices=("rank", "node"), default=None,
                        help="the NIC model (default: the profile's)")


def rows(llama: bool) -> Iterator[tuple[str, Problem, bool, str]]:
    """``(topology, problem, causal, label)`` of each row."""
    if llama:
        for topo, hq, s in LLAMA:
            yield topo, Problem(1, s, hq, 8, 128, 2), True, f"{hq}/8x128 S={s}"
        return
    for row in paper.TABLE5:
        yield (row.topology, Problem(row.b, row.s, paper.TABLE5_HEADS, paper.TABLE5_HEADS,
                                     paper.TABLE5_HEAD_DIM, paper.TABLE5_ELEM),
               paper.TABLE5_CAUSAL, f"B={row.b} S={row.s}")


class _Row:
    """One row's bound and model time per pass, on any variant of the cluster."""

    def __init__(self, topo: str, prob: Problem, causal: bool, cluster: Cluster) -> None:
        nodes, per = (int(x) for x in topo.split("x"))
        self.groups = [list(range(i * per, (i + 1) * per)) for i in range(nodes)]
        self.prob, self.causal = prob, causal
        point = Point(0, prob.b, prob.s, prob.hq, prob.hkv, prob.d)
        # the bytes of the plan the model times: its auto settings (head_parallel, splits)
        # decided on the cluster
        self.links = busiest_link_bytes("charm", self.groups, self.groups, causal, point,
                                        "bf16", cluster.nic, wide_partials=prob.wide_partials,
                                        cluster=cluster)

    def excess(self, cluster: Cluster, attr: str) -> tuple[float, float, float]:
        """``(time, bound, time - bound)`` of one direction (``forward`` / ``backward``)."""
        def run(**kw: object) -> float:
            pred = predict("charm", self.groups, self.prob, cluster, self.causal, tune=True,
                           **kw)
            return getattr(pred, attr).time_s

        t = run()
        link_s = self.links["fwd" if attr == "forward" else "bwd"] / (cluster.cross_gbps * 1e9)
        bound = max(run(compute_only=True), link_s)
        return t, bound, t - bound


def table(profile: str, llama: bool, partials: str, nic: str | None = None) -> list[str]:
    """The report's Markdown lines (``nic``: the NIC model, default the profile's)."""
    base = get_profile(profile).cluster
    if nic is not None:
        base = base.with_(nic=nic)
    wide = partials == "fp32"
    out = [f"# CHARM+ on {profile} ({base.describe()}); partials {partials}; ms; "
           "'less X': the share of the excess over the bound that goes when X is removed",
           "| GPUs | row | pass | bound | model | model / bound | less per-op cost | "
           "less merges | less compute slowdown |",
           "|---|---|---|---|---|---|---|---|---|"]
    variants = [base.with_(op_overhead_us=0.0), base.with_(merge_gbps=1e9),
                base.with_(comm_slowdown=0.0)]
    for topo, prob, causal, label in rows(llama):
        prob = Problem(prob.b, prob.s, prob.hq, prob.hkv, prob.d, prob.elem, wide_partials=wide)
        row = _Row(topo, prob, causal, base)
        for p, attr in PASSES:
            t, bound, over = row.excess(base, attr)
            shares = [f"{(over - row.excess(cl, attr)[2]) / over:.0%}" if over > 1e-9 else "-"
                      for cl in variants]
            out.append(f"| {topo} | {label} | {p} | {bound * 1e3:.1f} | {t * 1e3:.1f} | "
                       f"{t / bound:.2f}x | " + " | ".join(shares) + " |")
    return out


def run(args: argparse.Namespace) -> int:
    print("\n".join(table(args.profile, args.llama, args.partials, args.nic)))
    return 0
