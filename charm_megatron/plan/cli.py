"""``charm-megatron plan``: print a schedule and compare ring / rmplus / charm costs."""

from __future__ import annotations

import argparse

from charm_megatron.plan.cost import add_problem_args, problem_from_args, traffic
from charm_megatron.plan.registry import ALGORITHM_NAMES, build_plan, get, names
from charm_megatron.plan.validate import validate
from charm_megatron.topology import Topology


def register(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--cp", type=int, required=True, help="CP group size")
    parser.add_argument("--topology", default="flat", help="e.g. 2x8, 0-7,8-15, flat")
    parser.add_argument("--causal", action="store_true", help="causal mask (load-balanced)")
    parser.add_argument("--rank", type=int, default=None, help="print this rank's schedule")
    parser.add_argument("--algo", choices=ALGORITHM_NAMES, default="charm",
                        help="schedule to print: " + "; ".join(
                            f"{a}: {get(a).description}" for a in names()))
    parser.add_argument("--direction", choices=("forward", "backward"), default="forward")
    add_problem_args(parser)


def _mb(x: float) -> str:
    return f"{x / 2**20:10.1f}"


def run(args: argparse.Namespace) -> int:
    topo = Topology.parse(args.topology, cp_size=args.cp)
    topo.check_size(args.cp)
    groups = [list(g) for g in topo.groups]
    problem = problem_from_args(args)
    mask = "causal" if args.causal else "full"
    if args.rank is not None:
        if not 0 <= args.rank < args.cp:
            raise SystemExit(f"--rank must be in [0, {args.cp})")
        plan = build_plan(args.algo, args.direction, groups, args.causal)
        validate(plan)
        print(f"# {args.algo} {args.direction}, topology {topo}, {mask}, rank {args.rank}")
        print(plan.describe(args.rank))
        print()
    print(f"# cp={args.cp} topology={topo} mask={mask} b={args.batch} s={args.seq} "
          f"heads={args.heads}/{problem.hkv} dim={args.head_dim} {args.dtype}")
    print("# critical path: longest chain of data-dependent messages; MiB sent per rank")
    header = (f"{'algo':8} {'dir':8} {'crit.path':>9} {'msgs/rank':>9} {'intra max':>10} "
              f"{'cross max':>10} {'cross total':>11}")
    print(header)
    for direction in ("forward", "backward"):
        for algo in names():
            plan = build_plan(algo, direction, groups, args.causal)
            stats = validate(plan)
            t = traffic(plan, problem, groups)
            print(f"{algo:8} {direction:8} {stats.critical_path:9d} {max(stats.messages):9d} "
                  f"{_mb(max(t.intra))} {_mb(t.max_cross)} {_mb(t.total_cross):>11}")
    return 0
