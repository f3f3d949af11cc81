"""``charm-megatron model``: predicted ring / rmplus / charm times on a described cluster.

Describe the cluster with a profile (``--profile h100 [--topology 4x8]``) or by hand
(``--topology 2x8 --intra-gbps 300 --cross-gbps 40 --tflops 300 --nic rank``); any field given
on the command line overrides the profile's. Without ``--profile`` the profile named by
``CHARM_MODEL_PROFILE`` is used if set (as ``algo="auto"`` does); with neither, a generic
cluster is assumed
(:func:`~charm_megatron.model.cluster.default_cluster_for`). ``--profile`` also takes a profile
file, which ``--calibrate BENCH_CSV... -o FILE`` writes (:mod:`.calibrate`); ``--accuracy``
compares a profile with measurements (:mod:`.accuracy`).
"""

from __future__ import annotations

import argparse
import os
from dataclasses import replace

from charm_megatron.commands.flags import (
    add_problem_args,
    add_setting_args,
    problem_from_args,
    settings_from_args,
    values_from_args,
)
from charm_megatron.devices import DEVICES_ENV, PROFILES, builtin_profiles, get_profile
from charm_megatron.model.auto import ENV
from charm_megatron.model.cluster import (
    LINK_ORDERS,
    SLOWDOWN_LINKS,
    Cluster,
    default_cluster_for,
)
from charm_megatron.model.kernel_rates import KERNEL_FIELDS, cluster_on, kernels_of
from charm_megatron.model.predict import Prediction, predict, predict_all, ring_ccr, variants
from charm_megatron.model.te_contenders import TE_KERNEL, predict_te_all, te_cluster
from charm_megatron.plan.cost import Problem
from charm_megatron.plan.registry import ALGORITHM_NAMES as ALGOS
from charm_megatron.plan.roles import check_roles

# (flag, Cluster field, type, help)
_CLUSTER_FLAGS: tuple[tuple[str, str, type, str], ...] = (
    ("--intra-gbps", "intra_gbps", float, "intra-group link, GB/s per direction per message"),
    ("--intra-port-gbps", "intra_port_gbps", float,
     "aggregate of a rank's intra port (default: --intra-gbps)"),
    ("--cross-gbps", "cross_gbps", float, "cross-group link, GB/s per direction"),
    ("--tflops", "tflops", float, "sustained attention TFLOP/s per rank (per core with --cores)"),
    ("--latency-us", "latency_us", float, "latency per message, microseconds"),
    ("--bwd-factor", "bwd_factor", float, "backward tile time / forward tile time (2.5)"),
    ("--merge-gbps", "merge_gbps", float, "partials merged per second, GB/s (default: free)"),
    ("--op-overhead-us", "op_overhead_us", float, "fixed cost per compute op (launch, dispatch)"),
    ("--cores", "cores", int, "shared compute pool: at most this many ranks compute at once"),
    ("--msg-cpu-us", "msg_cpu_us", float, "compute time per message posted (CPU testbeds)"),
    ("--cpu-ns-per-byte", "cpu_ns_per_byte", float,
     "pool time per byte moved (CPU testbeds; needs --cores)"),
    ("--intra-bus-gbps", "intra_bus_gbps", float,
     "capacity shared by all intra messages of a group (PCIe root complex)"),
    ("--kernel-q-rows", "kernel_q_rows", float,
     "kernel rate vs tile size: rows of fixed cost per q side (rate / (1 + q/sq + k/sk))"),
    ("--kernel-k-rows", "kernel_k_rows", float, "same, per kv side"),
    ("--comm-slowdown", "comm_slowdown", float,
     "compute runs 1+X*k times slower while k of the rank's streams move messages "
     "(e.g. 0.19)"),
    ("--comm-slowdown-streams", "comm_slowdown_streams", int,
     "count at most N streams in --comm-slowdown (1: flat, one stream's slowdown whatever "
     "moves; default: the profile's)"),
    ("--concurrency-penalty", "concurrency_penalty", float,
     "a link with k messages delivers 1/(1+X(k-1)) of its capacity"),
    ("--cross-burst-kb", "cross_burst_kb", float, "token bucket per cross link, KiB per call"),
    ("--intra-burst-kb", "intra_burst_kb", float, "token bucket per intra link, KiB per call"),
)
_DEFAULT_GRID = (8192, 16384, 32768, 65536, 131072, 262144)


def register(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--profile", default=None, metavar="NAME|FILE",
                        help=f"named cluster ({', '.join(builtin_profiles())}, or a device "
                             f"added on {DEVICES_ENV}) or a profile file (.json, from "
                             "--calibrate)")
    parser.add_argument("--list-profiles", action="store_true", help="print the profiles")
    parser.add_argument("--topology", default=None,
                        help="hardware groups, e.g. 2x8, 4x8, 0-3,4-7 (default: the profile's)")
    parser.add_argument("--nic", choices=("rank", "node"), default=None,
                        help="rank: a cross link per rank; node: one shared per group")
    parser.add_argument("--link-order", choices=LINK_ORDERS, default=None,
                        help="how a link serves transfers at once: fair shares, or fifo (in "
                             "the order they started: one NCCL communicator, e.g. "
                             "TransformerEngine's ring; the emulator's software links); "
                             "default: the profile's")
    parser.add_argument("--comm-slowdown-links", choices=SLOWDOWN_LINKS, default=None,
                        help="which messages slow compute (--comm-slowdown): all, or only "
                             "cross-group ones; default: the profile's")
    parser.add_argument("--cross-via-intra", action=argparse.BooleanOptionalAction,
                        default=None,
                        help="cross messages also use the intra ports (one PCIe link per GPU)")
    for flag, _, typ, text in _CLUSTER_FLAGS:
        parser.add_argument(flag, type=typ, default=None, help=text)
    add_problem_args(parser)
    parser.add_argument("--causal", action="store_true", help="causal mask (load-balanced)")
    parser.add_argument("--grid", nargs="?", const="", default=None, metavar="SEQS",
                        help="sweep sequence lengths (comma list, k suffix allowed; "
                             "default 8k..256k) and print a table")
    parser.add_argument("--ranks", action="store_true", help="per-rank busy / idle detail")
    add_setting_args(parser, ("roles", "split_visiting", "split_counterpart_q", "split_diagonal",
                              "head_parallel", "super_tiles"))
    parser.add_argument("--kernel", default=None, metavar="NAME",
                        help="price our tiles on the profile's rate curve of this kernel (e.g. "
                             "cudnn, fa3; default: the profile's own, aten-flash on the GPU "
                             "profiles)")
    parser.add_argument("--te", action=argparse.BooleanOptionalAction, default=None,
                        help="also print TransformerEngine's CP types as shipped (te-p2p, "
                             "te-a2a, te-a2a+p2p, te-allgather) on TE's kernel curve (default: "
                             "on when the profile has one)")
    parser.add_argument("--tune", action="store_true",
                        help="decide the settings left to the model (auto: CHARM+'s splits, "
                             "head_parallel and super_tiles) on this cluster, as a call with this profile runs "
                             "them (default: off, as a call without a profile)")
    parser.add_argument("--compare-roles", default=None, metavar="MIX[,MIX]",
                        help="with --grid: also predict charm under these role mixes (e.g. "
                             "paper) and print their speed-ups next to --roles' columns")
    cal = parser.add_argument_group("calibration and accuracy")
    cal.add_argument("--calibrate", nargs="+", metavar="BENCH_CSV", default=None,
                     help="fit a profile to charm-megatron bench results.csv files (ring rows; "
                          "--cores, --intra-gbps, --cross-gbps, --*-burst-kb fill in what old "
                          "files lack) and write it with -o")
    cal.add_argument("-o", "--output", default=None, metavar="FILE",
                     help="profile file --calibrate writes (default: print it)")
    cal.add_argument("--name", default="calibrated", help="name of the calibrated profile")
    cal.add_argument("--fit-algos", default="ring",
                     help="algorithms whose rows the fit uses (comma list; default ring: "
                          "CHARM+ and RM+ rows stay unseen, so --accuracy can judge them)")
    cal.add_argument("--accuracy", nargs="*", metavar="BENCH_CSV", default=None,
                     help="compare --profile with measurements: bench CSVs, or none for the "
                          "paper's Table 5")


def _parse_mixes(text: str | None) -> list[str]:
    """The role mixes of ``--compare-roles`` (a clear error naming the option otherwise)."""
    if not text:
        return []
    mixes = [m.strip() for m in text.split(",") if m.strip()]
    for m in mixes:
        try:
            check_roles(m, "--compare-roles")
        except ValueError as exc:
            raise SystemExit(f"charm-megatron model: {exc}") from None
    return mixes


def _parse_seqs(text: str) -> list[int]:
    if not text:
        return list(_DEFAULT_GRID)
    out = []
    for part in text.split(","):
        part = part.strip().lower()
        mult = 1024 if part.endswith("k") else 1
        out.append(int(float(part.rstrip("k")) * mult))
    return out


def resolve(args: argparse.Namespace) -> tuple[str, list[list[int]], Cluster, str]:
    """(label, hardware groups, cluster, how the cluster was chosen) from the arguments."""
    topo, groups, cluster, how, _ = resolve_with_te(args)
    return topo, groups, cluster, how


def resolve_with_te(args: argparse.Namespace
                    ) -> tuple[str, list[list[int]], Cluster, str, Cluster | None]:
    """:func:`resolve`, and the cluster TransformerEngine's contenders run on (the same links
    and overheads on TE's kernel curve; ``None``: not asked for, or no profile has one)."""
    from charm_megatron.topology.core import Topology

    overrides: dict[str, object] = {field: getattr(args, flag[2:].replace("-", "_"))
                                    for flag, field, _, _ in _CLUSTER_FLAGS}
    overrides["nic"] = args.nic
    overrides["link_order"] = args.link_order
    overrides["comm_slowdown_links"] = args.comm_slowdown_links
    overrides["cross_via_intra"] = args.cross_via_intra
    name, origin, te = args.profile, "", None
    if not name and os.environ.get(ENV):
        name, origin = os.environ[ENV], f" (from {ENV})"
    if name:
        prof = get_profile(name)  # a name or a file; ValueError says which exist
        topo = Topology.parse(args.topology or prof.topology)
        kernel = getattr(args, "kernel", None)
        base = cluster_on(prof, kernel) if kernel else prof.cluster
        cluster = base.with_(**overrides)
        how = f"profile {prof.name}{origin}" + (f", our tiles on kernel {kernel}" if kernel
                                                 else "")
        want_te = getattr(args, "te", None)
        if want_te or (want_te is None and TE_KERNEL in kernels_of(prof)):
            links = {k: v for k, v in overrides.items() if k not in KERNEL_FIELDS}
            te = te_cluster(prof).with_(**links)
    else:
        if getattr(args, "kernel", None):
            raise SystemExit("charm-megatron model: --kernel names a rate curve of a profile; "
                             "give --profile")
        if not args.topology:
            raise SystemExit(f"charm-megatron model: give --profile or --topology (or set {ENV})")
        topo = Topology.parse(args.topology)
        groups = [list(g) for g in topo.groups]
        needed = ("intra_gbps", "cross_gbps", "tflops")
        if all(overrides[k] is None for k in needed):
            how = "generic cluster (default_cluster_for: no --profile, no rates given)"
        else:
            how = "described on the command line"
        base = default_cluster_for(groups)
        if topo.num_groups == 1 and overrides["intra_gbps"] is not None \
                and overrides["cross_gbps"] is None:
            overrides["cross_gbps"] = overrides["intra_gbps"]  # flat: no cross links used
        cluster = base.with_(**overrides)
    groups = [list(g) for g in topo.groups]
    return str(topo), groups, cluster, how, te


def _problem(args: argparse.Namespace, seq: int) -> Problem:
    return problem_from_args(args, seq)


def _ms(x: float) -> str:
    return f"{x * 1e3:.2f}"


def _mib(x: float) -> str:
    return f"{x / 2**20:.1f}"


def _best(preds: dict[str, Prediction]) -> str:
    return min((p.total_s, i, a) for i, (a, p) in enumerate(preds.items()))[2]


def _print_profiles() -> None:
    try:
        profiles = list(PROFILES.values())  # a bad CHARM_DEVICES: say what, no traceback
    except ValueError as exc:
        raise SystemExit(f"charm-megatron model --list-profiles: {exc}") from None
    for prof in profiles:
        print(f"{prof.name:12} topology {prof.topology:5} {prof.cluster.describe()}")
        print(f"{'':12} {prof.source}")


def _calibrate(args: argparse.Namespace) -> int:
    from charm_megatron.devices import dumps, save_profile
    from charm_megatron.lab.calibration.calibrate import calibrate

    try:
        prof = calibrate(args.calibrate, name=args.name, cores=args.cores,
                         intra_gbps=args.intra_gbps, cross_gbps=args.cross_gbps,
                         cross_burst_kb=args.cross_burst_kb,
                         intra_burst_kb=args.intra_burst_kb or 0.0,
                         fit_algos=tuple(a.strip() for a in args.fit_algos.split(",")),
                         log=lambda m: print(f"# {m}"))
    except ValueError as exc:
        raise SystemExit(f"charm-megatron model --calibrate: {exc}") from None
    print(f"# {prof.cluster.describe()}")
    if args.output:
        save_profile(prof, args.output)
        print(f"# wrote {args.output}: use it with --profile {args.output}, or for "
              f"algo='auto' with CHARM_MODEL_PROFILE={args.output}")
    else:
        print(dumps(prof), end="")
    return 0


def _accuracy(args: argparse.Namespace) -> int:
    from charm_megatron.lab.calibration import accuracy
    from charm_megatron.lab.calibration.measured import load_points

    name = args.profile or ("cpu-testbed" if args.accuracy else "h100")
    try:
        prof = get_profile(name)
        if args.link_order:
            prof = replace(prof, cluster=prof.cluster.with_(link_order=args.link_order))
        if args.accuracy:
            settings = accuracy.bench_settings(load_points(args.accuracy), prof)
        else:
            settings = accuracy.table5_settings(prof)
    except ValueError as exc:
        raise SystemExit(f"charm-megatron model --accuracy: {exc}") from None
    groups: dict[str, list] = {}
    for st in settings:
        groups.setdefault(st.group, []).append(st)
    groups["all"] = settings
    print(f"# profile {prof.name}: {prof.cluster.describe()}")
    print("# median |error| / worst error (count); '*': a time the profile was fitted on")
    print(accuracy.summary_table(groups))
    print()
    print(accuracy.detail_table(settings))
    return 0


def run(args: argparse.Namespace) -> int:
    if args.list_profiles:
        _print_profiles()
        return 0
    if args.calibrate:
        return _calibrate(args)
    if args.accuracy is not None:
        return _accuracy(args)
    try:
        topo, groups, cluster, how, te = resolve_with_te(args)
    except ValueError as exc:  # a bad topology or cluster field: say which, no traceback
        raise SystemExit(f"charm-megatron model: {exc}") from None
    compare = _parse_mixes(args.compare_roles)
    if compare and args.grid is None:
        raise SystemExit("charm-megatron model: --compare-roles needs --grid (it adds columns "
                         "to the grid table)")
    n = sum(len(g) for g in groups)
    mask = "causal" if args.causal else "full"
    print(f"# cluster: {how}; topology {topo} ({n} ranks, {len(groups)} groups, nic={cluster.nic})")
    print(f"#   {cluster.describe()}")
    if args.grid is not None:
        return _grid(args, groups, cluster, mask, compare)
    problem = _problem(args, args.seq)
    print(f"# problem: b={problem.b} s={problem.s} heads={problem.hq}/{problem.hkv} "
          f"dim={problem.d}{f'/{problem.dv}' if problem.dv else ''} {args.dtype} {mask}, "
          f"roles {values_from_args(args)['roles'].value}")
    ccr_f = ring_ccr(groups, problem, cluster, args.causal, "forward")
    ccr_b = ring_ccr(groups, problem, cluster, args.causal, "backward")
    print(f"# ring CCR (compute time / communication time, each alone): forward "
          f"{ccr_f.ratio:.2f} ({_ms(ccr_f.compute_s)} / {_ms(ccr_f.comm_s)} ms), backward "
          f"{ccr_b.ratio:.2f} ({_ms(ccr_b.compute_s)} / {_ms(ccr_b.comm_s)} ms)")
    preds = predict_all(groups, problem, cluster, args.causal, tune=args.tune,
                        **settings_from_args(args))
    ring = preds["ring"]
    if args.tune and "charm" in preds:
        fwd, bwd = variants("charm", groups, problem, cluster, causal=args.causal,
                            **settings_from_args(args))
        print(f"# charm as a call with this profile runs it: head_parallel={fwd.head_parallel}, "
              f"split_visiting {fwd.visiting_split}/{bwd.visiting_split}, split_counterpart_q "
              f"{fwd.split_counterpart_q}/{bwd.split_counterpart_q}, split_diagonal "
              f"{fwd.split_diagonal}/{bwd.split_diagonal}, super_tiles "
              f"{fwd.super_tiles}/{bwd.super_tiles} (fwd/bwd)")
    print(f"{'':12} {'time ms':^29}   {'speedup over ring':^17}   {'busy':^9}   "
          f"{'MiB sent per rank (max)':^27}")
    print(f"{'algo':12} {'fwd':>9} {'bwd':>9} {'fwd+bwd':>9}   {'fwd':>5} {'bwd':>5} {'total':>5}   "
          f"{'fwd':>4} {'bwd':>4}   {'intra fwd':>9} {'bwd':>6} {'cross fwd':>9} {'bwd':>6}")
    for algo, p in preds.items():
        print(_row(algo, p, ring))
    print(f"# fastest (fwd+bwd): {_best(preds)}")
    if te is not None:
        _te_rows(args, groups, problem, te, ring, preds)
    if args.ranks:
        for algo, p in preds.items():
            for res in (p.forward, p.backward):
                cells = " ".join(f"{r.busy_s / res.time_s:4.0%}" if res.time_s else "  - "
                                 for r in res.ranks)
                print(f"# {algo:6} {res.direction:8} busy per rank (rest idle): {cells}")
    return 0


def _row(name: str, p: Prediction, ring: Prediction) -> str:
    """One line of the single-point table: times, speed-ups over ``ring``, busy, bytes."""
    f, b = p.forward, p.backward
    return (f"{name:12} {_ms(f.time_s):>9} {_ms(b.time_s):>9} {_ms(p.total_s):>9}   "
            f"{ring.forward.time_s / f.time_s:5.2f} {ring.backward.time_s / b.time_s:5.2f} "
            f"{ring.total_s / p.total_s:5.2f}   {f.busy_fraction:4.0%} {b.busy_fraction:4.0%}"
            f"   {_mib(f.max_rank_intra_bytes):>9} {_mib(b.max_rank_intra_bytes):>6}"
            f" {_mib(f.max_rank_cross_bytes):>9} {_mib(b.max_rank_cross_bytes):>6}")


def _te_rows(args: argparse.Namespace, groups: list[list[int]], problem: Problem,
             te: Cluster, ring: Prediction, ours: dict[str, Prediction]) -> None:
    """TransformerEngine's contenders as shipped, in the table's columns (speed-ups over our
    ring), and the fastest of ours against the fastest of theirs."""
    prof = get_profile(args.profile or os.environ[ENV])
    curve = kernels_of(prof).get(TE_KERNEL)
    status = curve.status if curve is not None else "the profile's own kernel"
    preds = predict_te_all(groups, problem, te, args.causal)
    print(f"# TransformerEngine as shipped: its CP types on its kernel ({TE_KERNEL}, {status}; "
          "docs/performance.md, \"TransformerEngine as shipped\")")
    for name, p in preds.items():
        print(_row(name, p, ring))
    if not preds:
        print("# TransformerEngine refuses this call with every CP type")
        return
    best_te, best = _best(preds), _best(ours)
    print(f"# fastest TransformerEngine: {best_te} ({_ms(preds[best_te].total_s)} ms); the "
          f"fastest of ours, {best} ({_ms(ours[best].total_s)} ms), runs "
          f"{preds[best_te].total_s / ours[best].total_s:.2f}x its speed (fwd+bwd)")


def _grid(args: argparse.Namespace, groups: list[list[int]], cluster: Cluster,
          mask: str, compare: list[str]) -> int:
    print(f"# problem: b={args.batch} heads={args.heads}/{args.kv_heads or args.heads} "
          f"dim={args.head_dim} {args.dtype} {mask}, roles {values_from_args(args)['roles'].value}; times are fwd+bwd, "
          "speedups over ring")
    if compare:
        print(f"# charm/MIX: charm with role mix MIX ({', '.join(compare)})")
    print("# best: the fastest of every registered algorithm that can run the problem (the "
          "peers allgather, a2a, a2a+p2p included), and its fwd+bwd ms")
    extra = "".join(f"  {f'charm/{m} x fwd':>{len(m) + 12}} {'bwd':>5} {'total':>5}"
                    for m in compare)
    print(f"{'seq':>8} {'CCR fwd':>7} {'bwd':>5}  {'ring ms':>9} {'rmplus ms':>9} "
          f"{'charm ms':>9}  {'rmplus x':>8}  {'charm x fwd':>11} {'bwd':>5} {'total':>5}"
          f"{extra}  {'best ms':>9}  best")
    settings = settings_from_args(args)
    for seq in _parse_seqs(args.grid):
        problem = _problem(args, seq)
        cf = ring_ccr(groups, problem, cluster, args.causal, "forward").ratio
        cb = ring_ccr(groups, problem, cluster, args.causal, "backward").ratio
        preds = predict_all(groups, problem, cluster, args.causal, ALGOS, tune=args.tune,
                            **settings)
        ring, rmp, ch = preds["ring"], preds["rmplus"], preds["charm"]
        cells = ""
        for m in compare:
            other = predict("charm", groups, problem, cluster, args.causal, tune=args.tune,
                            **{**settings, "roles": m})
            cells += (f"  {ring.forward.time_s / other.forward.time_s:>{len(m) + 12}.2f}"
                      f" {ring.backward.time_s / other.backward.time_s:5.2f}"
                      f" {ring.total_s / other.total_s:5.2f}")
        print(f"{seq:>8} {cf:7.2f} {cb:5.2f}  {_ms(ring.total_s):>9} {_ms(rmp.total_s):>9} "
              f"{_ms(ch.total_s):>9}  {ring.total_s / rmp.total_s:8.2f}  "
              f"{ring.forward.time_s / ch.forward.time_s:11.2f} "
              f"{ring.backward.time_s / ch.backward.time_s:5.2f} "
              f"{ring.total_s / ch.total_s:5.2f}{cells}  "
              f"{_ms(preds[_best(preds)].total_s):>9}  {_best(preds)}")
    return 0
