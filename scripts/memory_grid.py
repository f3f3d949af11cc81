"""Peak memory of ring, RM+ and CHARM+ over a grid, on local gloo ranks (no emulated network:
memory does not depend on link speeds). Prints one markdown row per point: ring's peaks and
RM+'s and CHARM+'s as multiples of them, forward and forward+backward (max over ranks).

    PYTHONPATH=$PWD python scripts/memory_grid.py --topology 2x4 --seq 2048
"""

from __future__ import annotations

import argparse
import itertools

from charm_megatron.bench.memory import call_peaks
from charm_megatron.local_ranks import run_ranks


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--topology", default="2x2", help="GxM, e.g. 2x4")
    ap.add_argument("--seq", type=int, default=1024, help="global sequence length")
    ap.add_argument("--batch", type=int, default=2)
    ap.add_argument("--heads", type=int, default=8)
    ap.add_argument("--head-dim", type=int, default=32)
    ap.add_argument("--kv-heads", default="8,2", help="comma-separated")
    ap.add_argument("--roles", default="bytes,paper", help="comma-separated")
    args = ap.parse_args()
    g, m = map(int, args.topology.split("x"))
    world = g * m
    points = list(itertools.product([int(h) for h in args.kv_heads.split(",")], (True, False),
                                    args.roles.split(",")))
    cases = []
    for hkv, causal, roles in points:
        cases += [("ring", None, causal, hkv, roles), ("rmplus", None, causal, hkv, roles),
                  ("charm", args.topology, causal, hkv, roles)]
    per_rank = run_ranks(call_peaks, world, cases, args.seq, args.batch, args.heads,
                         args.head_dim, timeout_s=1800)
    worst = {c: {ph: max(r[c][ph] for r in per_rank) for ph in ("fwd", "fwdbwd")}
             for c in cases}
    print(f"| {args.topology} | kv heads | mask | roles | ring fwd MB | ring fwd+bwd MB "
          "| RM+ fwd | RM+ fwd+bwd | CHARM+ fwd | CHARM+ fwd+bwd |")
    print("|---|---|---|---|---|---|---|---|---|---|")
    for hkv, causal, roles in points:
        ring = worst[("ring", None, causal, hkv, roles)]
        rm = worst[("rmplus", None, causal, hkv, roles)]
        ch = worst[("charm", args.topology, causal, hkv, roles)]
        cells = [f"{x[ph] / ring[ph]:.2f}×" for x in (rm, ch) for ph in ("fwd", "fwdbwd")]
        print(f"| | {args.heads}/{hkv} | {'causal' if causal else 'full'} | {roles} "
              f"| {ring['fwd'] / 1e6:.2f} | {ring['fwdbwd'] / 1e6:.2f} | " + " | ".join(cells)
              + " |")


if __name__ == "__main__":
    main()
