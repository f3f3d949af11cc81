"""``charm-megatron report memory``: peak memory of ring, RM+ and CHARM+ over a grid, on local
gloo ranks (no emulated network: memory does not depend on link speeds). One Markdown row per
point: ring's peaks, and RM+'s and CHARM+'s as multiples of them, forward and
forward+backward (max over ranks). A measurement, not a CSV report: it runs the ranks.

    charm-megatron report memory --topology 2x4 --seq 2048
"""

from __future__ import annotations

import argparse
import itertools
from collections.abc import Mapping, Sequence

PHASES = ("fwd", "fwdbwd")


def cases(topology: str, kv_heads: Sequence[int], roles: Sequence[str]) -> tuple[list, list]:
    """(points, cases): a point is ``(hkv, causal, roles)``; each runs ring, rmplus and charm."""
    points = list(itertools.product(kv_heads, (True, False), roles))
    out = []
    for hkv, causal, mix in points:
        out += [("ring", None, causal, hkv, mix), ("rmplus", None, causal, hkv, mix),
                ("charm", topology, causal, hkv, mix)]
    return points, out


def table(topology: str, heads: int, points: Sequence[tuple],
          worst: Mapping[tuple, Mapping[str, float]]) -> str:
    """The Markdown table from the peaks (bytes) per case and phase, max over ranks."""
    lines = [f"| {topology} | kv heads | mask | roles | ring fwd MB | ring fwd+bwd MB "
             "| RM+ fwd | RM+ fwd+bwd | CHARM+ fwd | CHARM+ fwd+bwd |",
             "|---|---|---|---|---|---|---|---|---|---|"]
    for hkv, causal, mix in points:
        ring = worst[("ring", None, causal, hkv, mix)]
        rm = worst[("rmplus", None, causal, hkv, mix)]
        ch = worst[("charm", topology, causal, hkv, mix)]
        cells = [f"{x[ph] / ring[ph]:.2f}×" for x in (rm, ch) for ph in PHASES]
        lines.append(f"| | {heads}/{hkv} | {'causal' if causal else 'full'} | {mix} "
                     f"| {ring['fwd'] / 1e6:.2f} | {ring['fwdbwd'] / 1e6:.2f} | "
                     + " | ".join(cells) + " |")
    return "\n".join(lines) + "\n"


def measure(topology: str = "2x2", seq: int = 1024, batch: int = 2, heads: int = 8,
            head_dim: int = 32, kv_heads: Sequence[int] = (8, 2),
            roles: Sequence[str] = ("bytes", "paper"), timeout_s: float = 1800) -> str:
    """Run the grid on ``G*M`` gloo ranks and return the table."""
    from charm_megatron.lab.bench.memory import call_peaks
    from charm_megatron.local_ranks import run_ranks

    g, m = map(int, topology.split("x"))
    points, grid = cases(topology, kv_heads, roles)
    per_rank = run_ranks(call_peaks, g * m, grid, seq, batch, heads, head_dim,
                         timeout_s=timeout_s)
    worst = {c: {ph: max(r[c][ph] for r in per_rank) for ph in PHASES} for c in grid}
    return table(topology, heads, points, worst)


def register(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--topology", default="2x2", help="GxM, e.g. 2x4")
    parser.add_argument("--seq", type=int, default=1024, help="global sequence length")
    parser.add_argument("--batch", type=int, default=2)
    parser.add_argument("--heads", type=int, default=8)
    parser.add_argument("--head-dim", type=int, default=32)
    parser.add_argument("--kv-heads", default="8,2", help="comma-separated")
    parser.add_argument("--roles", default="bytes,paper", help="comma-separated")


def run(args: argparse.Namespace) -> int:
    print(measure(args.topology, args.seq, args.batch, args.heads, args.head_dim,
                  [int(h) for h in args.kv_heads.split(",")], args.roles.split(",")), end="")
    return 0
