"""``charm-megatron plan``: print a schedule and compare ring / rmplus / charm costs.

With ``--rank`` it also prints the role of each exchange of that rank (RM+ pair or cross
phase) and the bytes of both alternatives, so the byte rule of
:mod:`charm_megatron.plan.roles` can be checked by eye.
"""

from __future__ import annotations

import argparse
from collections import Counter
from dataclasses import replace

from charm_megatron.commands.flags import (
    add_problem_args,
    add_setting_args,
    problem_from_args,
    settings_from_args,
)
from charm_megatron.plan.core import Plan, SuperTile, Tile, TileBwd
from charm_megatron.plan.cost import Problem, traffic
from charm_megatron.plan.fuse import unfuse_ops
from charm_megatron.plan.head_stage import stage_plans
from charm_megatron.plan.memory import max_peak
from charm_megatron.plan.registry import (
    ALGORITHM_NAMES,
    CallTraits,
    Values,
    all_settings,
    build_plan,
    get,
    names,
    refusal,
    settings_values,
)
from charm_megatron.plan.roles import Decision, RoleShape
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
    add_setting_args(parser)
    add_problem_args(parser)


def _settings_note(values: Values) -> str:
    """`` split-visiting``, `` pass-order=joint``: the settings (other than ``roles``) that
    are not at their default, for the header (a switch turned on: its name alone)."""
    out = ""
    for name, s in all_settings().items():
        value = values[name]
        if name == "roles" or value is s.default or (s.switch and value.value == "off"):
            continue
        label = s.flag[2:]
        out += f" {label}" if s.switch and value.value == "on" else f" {label}={value.value}"
    return out


def _mb(x: float) -> str:
    return f"{x / 2**20:10.1f}"


def _decision_line(d: Decision, problem: Problem, n: int) -> str:
    """``pair with 3: kv   (kv 1.5 MiB, q 6.1 MiB)``: the bytes of one exchange's two
    alternatives for this problem (both directions of the exchange together)."""
    what = f"pair {d.peer:<3}" if d.where == "pair" else f"cross {d.peer:<2}"
    role = f"{d.role}" if d.where == "pair" else f"pass-{d.role}"
    ctx = f"  {d.context}" if d.context else ""
    if d.kv_bytes is None:
        return f"  {what} {role:7} (forced){ctx}"
    tokens = problem.b * problem.s / n
    return (f"  {what} {role:7} kv {d.kv_bytes * tokens / 2**20:7.2f}  "
            f"q {d.q_bytes * tokens / 2**20:7.2f}{ctx}")


def _role_summary(plan: Plan) -> str:
    """The roles a plan uses: its cross phases and the count of kv / q pairs (all ranks), and
    its super-tiles (all ranks)."""
    supers = sum(type(op) is SuperTile for ops in plan.ops for op in ops)
    fused = f" {supers} super-tiles" if supers else ""
    if not plan.decisions:
        return fused.strip() or "-"
    c = Counter((d.where, d.role.value) for ds in plan.decisions for d in ds)
    cross = "/".join(f"pass-{r}" for r in ("q", "kv") if c[("cross", r)])
    pairs = f"{c[('pair', 'kv')]}kv {c[('pair', 'q')]}q"
    lean = " lean" if plan.lean else " early-returns" if plan.early_returns else ""
    return (f"{cross} {pairs}" if cross else pairs) + lean + fused


def run(args: argparse.Namespace) -> int:
    topo = Topology.parse(args.topology, cp_size=args.cp)
    topo.check_size(args.cp)
    groups = [list(g) for g in topo.groups]
    problem = problem_from_args(args)
    shape = RoleShape(problem.hq, problem.hkv, problem.d, problem.elem, problem.dv,
                      problem.wide_partials)
    mask = "causal" if args.causal else "full"
    settings = settings_from_args(args)
    values = settings_values(**settings)
    roles = values["roles"].value
    tiles = problem.tiles(args.cp, args.causal)
    if args.rank is not None:
        if not 0 <= args.rank < args.cp:
            raise SystemExit(f"--rank must be in [0, {args.cp})")
        why = _refusals(groups, problem).get(args.algo)
        if why is not None:
            raise SystemExit(f"charm-megatron plan: {why}")
        plan = build_plan(args.algo, args.direction, groups, args.causal, shape=shape,
                          tiles=tiles, **settings)
        validate(plan)
        print(f"# {args.algo} {args.direction}, topology {topo}, {mask}, rank {args.rank}, "
              f"roles {roles}")
        stage = (stage_plans(plan.n, plan.head_group, plan.direction, plan.causal)
                 if plan.head_group > 1 else None)
        if stage is not None:
            print(f"# head all-to-all before, in groups of {plan.head_group} "
                  "(plan/head_stage.py):")
            print(stage[0].describe(args.rank))
            print("# then, on the super-blocks (owners are CP ranks of this lane):")
        print(plan.describe(args.rank))
        if stage is not None:
            print("# head all-to-all after:")
            print(stage[1].describe(args.rank))
        if plan.decisions and plan.decisions[args.rank]:
            print(f"# rank {args.rank}'s exchanges in plan order: peer, role, MiB that the kv "
                  "and q alternatives move (both ways), blocks held (ours | peer's)")
            for d in plan.decisions[args.rank]:
                print(_decision_line(d, problem, args.cp))
        print()
    print(f"# cp={args.cp} topology={topo} mask={mask} b={args.batch} s={args.seq} "
          f"heads={args.heads}/{problem.hkv} dim={_dims(problem)} {args.dtype} "
          f"roles={roles}{_settings_note(values)}")
    print("# critical path: longest chain of data-dependent messages (a head all-to-all "
          "counts one step, and its messages per peer and kind); MiB sent per rank; "
          "peak MiB of buffers and tile outputs per rank (plan/memory.py); roles: cross phase "
          "and RM+ pairs (all ranks); early-returns / lean: built so to stay within 1.1x ring's "
          "peak")
    w = max(8, *(len(a) for a in names()))  # the algorithm column fits every name
    header = (f"{'algo':{w}} {'dir':8} {'crit.path':>9} {'msgs/rank':>9} {'intra max':>10} "
              f"{'cross max':>10} {'cross total':>11} {'peak mem':>10}  roles")
    print(header)
    refused = _refusals(groups, problem)
    for direction in ("forward", "backward"):
        for algo in names():
            if algo in refused:
                continue
            plan = build_plan(algo, direction, groups, args.causal, shape=shape, tiles=tiles,
                              **settings)
            stats = validate(plan)
            t = traffic(plan, problem, groups)
            depth, msgs = stats.critical_path, max(stats.messages)
            if plan.head_group > 1:  # the two all-to-alls around the lifted plan
                for part in stage_plans(plan.n, plan.head_group, plan.direction, plan.causal):
                    depth += 1
                    msgs += max(len(op.sends) for r in range(part.n) for op in part.comms(r))
            print(f"{algo:{w}} {direction:8} {depth:9d} {msgs:9d} "
                  f"{_mb(max(t.intra))} {_mb(t.max_cross)} {_mb(t.total_cross):>11} "
                  f"{_mb(max_peak(plan, problem))}  {_role_summary(plan)}")
    for algo, why in refused.items():
        print(f"# {algo}: not run here: {why}")
    if tiles is not None:
        _window_savings(args, groups, problem, shape, settings, tiles, w, refused)
    return 0


def _refusals(groups, problem: Problem) -> dict[str, str]:
    """Why each algorithm that refuses this problem does (its entry's check)."""
    traits = CallTraits(tuple(map(tuple, groups)), problem.hq, problem.hkv,
                        windowed=problem.window is not None)
    why = {algo: refusal(algo, traits) for algo in names()}
    return {algo: text for algo, text in why.items() if text is not None}


def _window_savings(args, groups, problem, shape, settings, tiles, w: int,
                    refused: dict[str, str]) -> None:
    """What the window saves: per algorithm that runs the problem (not ``refused``) and
    direction, the busiest rank's MiB sent and tiles, windowed against the same algorithm's
    full attention."""
    left, right = problem.window
    print()
    print(f"# window {left},{right}: {len(tiles.pairs())} of {args.cp ** 2} tiles needed; "
          "the busiest rank's MiB sent, tiles and compute (score pairs the window keeps, in "
          "rank-block squares), windowed and full attention, and their ratio")
    print(f"{'algo':{w}} {'dir':8} {'MiB window':>10} {'MiB full':>10} {'ratio':>6} "
          f"{'tiles':>6} {'full':>5} {'compute':>8} {'full':>6} {'ratio':>6}")
    rows = problem.s // args.cp
    for direction in ("forward", "backward"):
        for algo in names():
            if algo in refused:
                continue
            cut = build_plan(algo, direction, groups, args.causal, shape=shape, tiles=tiles,
                             **settings)
            full = build_plan(algo, direction, groups, args.causal, shape=shape, **settings)
            sent = [_sent(p, problem, groups) for p in (cut, full)]
            counts = [max(validate(p).tiles) for p in (cut, full)]
            # After a head all-to-all a tile pairs super-blocks (a times the rows) on 1/a of
            # the heads: its pairs count 1/a of a rank-block square's.
            a = cut.head_group
            window = problem.for_plan(cut).geometry(args.cp, args.causal, a)
            geometries = (window, replace(window, left=-1, right=-1))
            work = [max(sum(g.kept_pairs(op.spec) for op in unfuse_ops(ops)
                            if type(op) in (Tile, TileBwd))
                        for ops in p.ops) / rows ** 2 / a
                    for p, g in zip((cut, full), geometries)]
            print(f"{algo:{w}} {direction:8} {_mb(sent[0])} {_mb(sent[1])} "
                  f"{_ratio(sent):6.2f} {counts[0]:6g} {counts[1]:5g} {work[0]:8.2f} "
                  f"{work[1]:6.2f} {_ratio(work):6.2f}")


def _ratio(pair: list[float]) -> float:
    return pair[0] / pair[1] if pair[1] else 1.0


def _sent(plan: Plan, problem, groups) -> float:
    t = traffic(plan, problem, groups)
    return max(i + c for i, c in zip(t.intra, t.cross))


def _dims(problem) -> str:
    """The head dim, or ``q/k dim / v dim`` where v has its own (MLA)."""
    return f"{problem.d}" if not problem.dv else f"{problem.d}/{problem.dv}"
