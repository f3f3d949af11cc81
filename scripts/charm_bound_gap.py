#!/usr/bin/env python3
"""Where CHARM+'s time above its lower bound goes, by the model (docs/performance.md, *How
close CHARM+ gets to the lower bound*): for each row, the bound (max of the busiest rank's
compute and the busiest cross link's bytes at its rate), the model's CHARM+ time, and how much
of the excess (time - bound, the bound recomputed on each changed cluster) disappears when one
cost is removed from the cluster: the per-op overhead, the
merges and the slowdown of compute under communication. (Infinitely fast cross links are no
such test: they move the bound itself from the links to compute.)

    python scripts/charm_bound_gap.py                     # Table 5 rows, h100, fp32 partials
    python scripts/charm_bound_gap.py --llama             # the Llama-3-like rows
    python scripts/charm_bound_gap.py --profile h200

The shares do not add up exactly (the costs interact: removing one can expose another).
"""

from __future__ import annotations

import argparse
import sys

from charm_megatron.lab.bench.analysis import busiest_link_bytes
from charm_megatron.lab.bench.config import Point
from charm_megatron.lab.calibration import paper
from charm_megatron.model import get_profile, predict
from charm_megatron.plan.cost import Problem

# Llama-3-like rows of docs/performance.md (32 q / 8 kv and 64 / 8 heads x 128, bf16, causal).
LLAMA = [(topo, hq, s) for topo in ("2x8", "4x8") for hq in (32, 64)
         for s in (16384, 32768, 65536, 131072)]


def _rows(llama: bool):
    if llama:
        for topo, hq, s in LLAMA:
            yield topo, Problem(1, s, hq, 8, 128, 2), True, f"{hq}/8x128 S={s}"
    else:
        for row in paper.TABLE5:
            yield (row.topology, Problem(row.b, row.s, paper.TABLE5_HEADS, paper.TABLE5_HEADS,
                                         paper.TABLE5_HEAD_DIM, paper.TABLE5_ELEM),
                   paper.TABLE5_CAUSAL, f"B={row.b} S={row.s}")


def main(argv: list[str]) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--profile", default="h100")
    ap.add_argument("--llama", action="store_true")
    ap.add_argument("--partials", choices=("input", "fp32"), default="fp32")
    args = ap.parse_args(argv)
    base = get_profile(args.profile).cluster
    wide = args.partials == "fp32"
    print(f"# CHARM+ on {args.profile} ({base.describe()}); partials {args.partials}; ms; "
          "'less X': the share of the excess over the bound that goes when X is removed")
    print("| GPUs | row | pass | bound | model | model / bound | less per-op cost | "
          "less merges | less compute slowdown |")
    print("|---|---|---|---|---|---|---|---|---|")
    for topo, prob, causal, label in _rows(args.llama):
        prob = Problem(prob.b, prob.s, prob.hq, prob.hkv, prob.d, prob.elem,
                       wide_partials=wide)
        nodes, per = (int(x) for x in topo.split("x"))
        groups = [list(range(i * per, (i + 1) * per)) for i in range(nodes)]
        point = Point(0, prob.b, prob.s, prob.hq, prob.hkv, prob.d)
        links = busiest_link_bytes("charm", groups, groups, causal, point, "bf16", base.nic,
                                   wide_partials=wide)

        def excess(cl, attr, groups=groups, prob=prob, causal=causal, links=links):
            """(time, bound, time - bound) of one direction (``forward`` / ``backward``)."""
            def run(**kw):
                return getattr(predict("charm", groups, prob, cl, causal, tune=True, **kw),
                               attr).time_s

            t = run()
            link_s = links["fwd" if attr == "forward" else "bwd"] / (cl.cross_gbps * 1e9)
            bound = max(run(compute_only=True), link_s)
            return t, bound, t - bound

        variants = [base.with_(op_overhead_us=0.0), base.with_(merge_gbps=1e9),
                    base.with_(comm_slowdown=0.0)]
        for p, attr in (("fwd", "forward"), ("bwd", "backward")):
            t, bound, over = excess(base, attr)
            shares = []
            for cl in variants:
                left = excess(cl, attr)[2]
                shares.append(f"{(over - left) / over:.0%}" if over > 1e-9 else "-")
            print(f"| {topo} | {label} | {p} | {bound * 1e3:.1f} | {t * 1e3:.1f} | "
                  f"{t / bound:.2f}x | " + " | ".join(shares) + " |")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
