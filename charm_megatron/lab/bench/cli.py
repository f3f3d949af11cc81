"""``charm-megatron bench``: the paper's operator benchmark (see docs/bench.md).

Examples::

    charm-megatron bench --preset cpu-small --ranks 4 --out runs/bench-cpu
    charm-megatron bench --preset cpu-small --emulate 2x4 --cross-rate 1gbit \\
        --intra-rate 8gbit --nic rank --out runs/bench-2x4
    torchrun --nproc-per-node 8 -m charm_megatron.cli bench --preset paper --out runs/bench-gpu
"""

from __future__ import annotations

import argparse
import os
import platform
import sys
import time
from dataclasses import replace

from charm_megatron.commands.flags import add_setting_args, parse_window, values_from_args
from charm_megatron.devices import DEVICES_ENV, get_profile
from charm_megatron.lab.bench import runners
from charm_megatron.lab.bench.analysis import analyse
from charm_megatron.lab.bench.config import (
    ALGO_CHOICES,
    ALGOS,
    DTYPES,
    PRESETS,
    BenchConfig,
    HeadSpec,
    check_algos,
    element_size,
    parse_count,
    parse_grid_shape,
    parse_list,
    parse_settings,
)
from charm_megatron.lab.bench.emulator_checks import check_lines
from charm_megatron.lab.bench.gpu_emulation import (
    DEFAULT_WIRE_BYTES,
    DEVICE_CLOCKS,
    DeviceSetup,
    setup_for,
)
from charm_megatron.lab.bench.measure import Job
from charm_megatron.lab.bench.report import format_table, plot, write_csv, write_json
from charm_megatron.lab.emulate import LINK_MODELS, NIC_MODELS, available, parse_rate, parse_size
from charm_megatron.lab.emulate.rates import format_rate
from charm_megatron.model.te_contenders import TE_NAMES
from charm_megatron.plan.registry import ALGORITHM_NAMES
from charm_megatron.plan.vocab import Dtype

_DEFAULT_COMM_TIMEOUT_S = 300


def register(parser: argparse.ArgumentParser) -> None:
    """The ``bench`` subcommand's arguments."""
    g = parser.add_argument_group("grid (lists are comma-separated; unset values come from "
                                  "--preset)")
    g.add_argument("--preset", choices=sorted(PRESETS),
                   help="paper: the paper's grid (GPU); cpu-small: a grid that runs in minutes "
                        "on a 2-core CPU machine; tiny: for tests. Default: paper with CUDA, "
                        "else cpu-small")
    g.add_argument("--batch", help="batch sizes, e.g. 1,2,4")
    g.add_argument("--seq", help="total sequence lengths over the CP group, e.g. 2k,4k,8k")
    g.add_argument("--heads", help="HEADSxDIM list, e.g. 12x128,20x128,12x192,20x192")
    g.add_argument("--kv-heads", type=int, help="kv heads (GQA/MQA); default: as many as q heads")
    g.add_argument("--dtype", choices=DTYPES)
    g.add_argument("--causal", dest="causal", action="store_true", default=True,
                   help="causal mask, Megatron's load-balanced layout (default)")
    g.add_argument("--no-causal", dest="causal", action="store_false", help="full attention")
    g.add_argument("--max-tokens", type=int, help="skip points with B*S above this (0: none)")
    g.add_argument("--window", type=parse_window, default=None, metavar="LEFT[,RIGHT]",
                   help="a sliding window on every call (flash-attn's window_size; RIGHT "
                        "defaults to 0, -1: unbounded), in the point's rows; PyTorch's CP "
                        "takes none and is left out")
    g.add_argument("--packed", metavar="MEAN", type=parse_count, default=0,
                   help="packed documents (THD): B*S tokens of documents whose lengths are "
                        "LogNormal(sigma=1) with mean MEAN tokens (seeded), each padded to a "
                        "multiple of 2*cp; torch is left out (it cannot pack)")

    a = parser.add_argument_group("what is timed")
    a.add_argument("--algos", default=",".join(ALGOS),
                   help=f"contenders, from {','.join(ALGO_CHOICES)} (torch: PyTorch's own CP "
                        "ring; auto: cp_attention's pick, reported)")
    add_setting_args(a, ("roles",))  # run once per mix to compare them
    a.add_argument("--partials", choices=[d.value for d in Dtype], default="input",
                   help="the dtype partial results (out, dq, dkv) travel in between ranks, "
                        "for every contender (CPOptions.partials): input (default) or fp32, "
                        "as ring-flash-attention and the paper's ring send gradient partials")
    a.add_argument("--auto-tune", metavar="MARGIN",
                   help="the auto contender measures the model's shortlist at the point's "
                        "first (warm-up) call and runs the measured fastest "
                        "(CPOptions.auto_tune): on (margin 1.5), a margin >= 1, or all; "
                        "default: CHARM_AUTO_TUNE, else the model's pick")
    a.add_argument("--setting", action="append", default=[], metavar="NAME=VALUE",
                   help="an algorithm setting for every contender that has it (repeatable; "
                        "any of charm_megatron.plan.registry.all_settings(), e.g. "
                        "split_visiting=on, pass_order=joint); over its CHARM_* variable")
    a.add_argument("--topology", help="CHARM+ topology (GxM, 0-3,4-7, auto); default: the "
                                      "--emulate shape, 'auto' under torchrun, else 2x(n/2)")
    a.add_argument("--warmup", type=int, help="warm-up rounds per point")
    a.add_argument("--iters", type=int, help="timed rounds per point")
    a.add_argument("--forward-only", action="store_true", help="no backward pass")
    a.add_argument("--no-ccr", action="store_true", help="skip ring's ablated runs (no CCR)")
    a.add_argument("--no-bound", action="store_true",
                   help="skip the compute-only runs of rmplus/charm (no lower bound for them)")
    a.add_argument("--no-memory", action="store_true", help="skip the peak-memory call")
    a.add_argument("--torch-rotate", choices=("alltoall", "allgather"), default="alltoall",
                   help="PyTorch CP's kv rotation (alltoall = a ring step per block; torch's "
                        "own default is allgather)")

    r = parser.add_argument_group("where the ranks run")
    r.add_argument("--ranks", type=int, default=4, help="local CPU ranks (without --emulate)")
    r.add_argument("--threads", type=int, default=1, help="intra-op threads per CPU rank")
    r.add_argument("--emulate", metavar="GxM",
                   help="emulated cluster of G nodes x M ranks on this machine")
    r.add_argument("--cross-rate", help="cross-node link rate (tc units: 1gbit, 400mbit, "
                                        "125mbps). With --emulate required; under torchrun used "
                                        "for the bound's link term")
    r.add_argument("--intra-rate", help="intra-node rate (default: unshaped loopback)")
    r.add_argument("--nic", choices=NIC_MODELS, default=None,
                   help="node: a node's ranks share one cross link; rank: one link per rank "
                        "(default: node; with --device-model the profile's)")
    r.add_argument("--link-model", choices=LINK_MODELS, default=None,
                   help="netns shaping: tbf (default: separate shaped veths for cross- and "
                        "intra-node traffic) or htb (--nic rank only: one veth per rank, htb "
                        "classes by the peer's node; docs/topology.md)")
    r.add_argument("--cross-burst", help="cross shaper bucket, e.g. 512kb (netns; default "
                                         "max(512kb, rate/250))")
    r.add_argument("--intra-burst", help="intra shaper bucket, e.g. 4mb (netns; default "
                                         "max(4mb, rate/250))")
    r.add_argument("--link-ingress", action=argparse.BooleanOptionalAction, default=None,
                   help="also shape traffic into each rank/node (netns; default: yes with tbf, "
                        "no with htb, which shapes egress only)")
    r.add_argument("--link-mtu", type=int, help="MTU of the emulated NICs (eth0 veths; netns; "
                                                "default 1500)")
    r.add_argument("--emulate-backend", choices=("auto", "netns", "software"), default="auto",
                   help="netns: namespaces + tc (root); software: the link model on gloo P2P; "
                        "auto: netns when available")
    r.add_argument("--launcher", choices=("auto", "local", "torchrun"), default="auto",
                   help="auto: torchrun when RANK/WORLD_SIZE/MASTER_ADDR are set")
    r.add_argument("--device", choices=("auto", "cpu", "cuda"), default="auto",
                   help="under torchrun: cuda when available (auto)")
    r.add_argument("--timeout-s", type=float, default=3600.0, help="bound on the whole run")
    r.add_argument("--comm-timeout-s", type=float, default=_DEFAULT_COMM_TIMEOUT_S,
                   help="bound on every communication wait and collective")

    d = parser.add_argument_group(
        "emulated GPU cluster (docs/emulator.md): every rank's device waits for its modelled "
        "time instead of computing, links carry real bytes at the real rates slowed down; "
        "every *_ms is then device time")
    d.add_argument("--device-model", metavar="PROFILE",
                   help="the device and its links: h100, h20, l20-pcie, a device added on "
                        "CHARM_DEVICES or a profile file (scripts/gpu_check.py, "
                        "charm-megatron model --calibrate); needs "
                        "--emulate GxM; --cross-rate / --intra-rate then give the real "
                        "(device-time) rates, e.g. 42.5GB/s, over the profile's")
    d.add_argument("--dilation", default="auto",
                   help="wall seconds per device second: the emulator's own per-message cost "
                        "shrinks by this factor in device time; auto (default): the shortest "
                        "dependent unit of the run's contenders stretched to 0.5 s, at least "
                        "50; on the virtual clock (the default) to 0.05 s, at least 10")
    d.add_argument("--wire-scale", metavar="BxR",
                   help="batch and rows-per-rank divisors of the problem on the wire (the device "
                        "times the full problem; links slow down by B*R); default: chosen so "
                        "the largest q block on the wire is about --wire-kib")
    d.add_argument("--wire-kib", type=int, default=DEFAULT_WIRE_BYTES // 1024,
                   help="target size of the largest q block on the wire (default %(default)s)")
    d.add_argument("--no-sm-contention", action="store_true",
                   help="leave out the profile's compute slowdown while a transfer is in "
                        "flight")
    d.add_argument("--device-clock", choices=DEVICE_CLOCKS,
                   help="virtual (default; netns: async): ops and posts on each rank's "
                        "virtual clock, the links serving in virtual start order; "
                        "virtual-post-order: the links in wall post order (an A/B); async: "
                        "ops queued on the wall clock; sync: every op sleeps at its call")
    d.add_argument("--sync-device", action="store_const", const="sync", dest="device_clock",
                   help="--device-clock sync (kept for older scripts)")

    o = parser.add_argument_group("output")
    o.add_argument("--out", help="directory for results.csv, results.json, speedup_vs_ccr.png "
                                 "(default runs/bench-<date>)")
    o.add_argument("--no-plot", action="store_true")
    o.add_argument("--quiet", action="store_true", help="no progress bar")


def _config(args: argparse.Namespace, cuda: bool) -> BenchConfig:
    preset = PRESETS[args.preset or ("paper" if cuda else "cpu-small")]

    def pick(name: str):
        v = getattr(args, name)
        return preset[name] if v is None else v

    return BenchConfig(
        batches=parse_list(str(pick("batch")), parse_count),
        seqs=parse_list(str(pick("seq")), parse_count),
        heads=parse_list(str(pick("heads")), HeadSpec.parse),
        kv_heads=args.kv_heads,
        dtype=pick("dtype"),
        causal=args.causal,
        algos=check_algos([a.strip() for a in args.algos.split(",") if a.strip()]),
        warmup=int(pick("warmup")),
        iters=int(pick("iters")),
        backward=not args.forward_only,
        ccr=not args.no_ccr,
        bound=not args.no_bound,
        memory=not args.no_memory,
        max_tokens=int(pick("max_tokens")),
        threads=args.threads,
        torch_rotate=args.torch_rotate,
        packed_mean=args.packed,
        roles=values_from_args(args)["roles"].value,
        partials=args.partials,
        auto_tune=_auto_tune(args.auto_tune),
        settings=parse_settings(args.setting),
        window=args.window,
    )


def _cuda_available() -> bool:
    import torch

    return torch.cuda.is_available()


def run(args: argparse.Namespace) -> int:
    """Run the benchmark; 0 on success, 2 on a usage error."""
    torchrun = args.launcher == "torchrun" or (args.launcher == "auto" and runners.in_torchrun()
                                               and not args.emulate)
    cuda = torchrun and args.device != "cpu" and _cuda_available()
    try:
        if args.nic is None:
            args.nic = (get_profile(args.device_model).cluster.nic if args.device_model
                        else "node")
        if args.link_model is None:
            args.link_model = "tbf"
        cfg = _config(args, cuda)
        emulate = parse_grid_shape(args.emulate) if args.emulate else None
        if args.iters is not None and args.iters < 1:
            raise ValueError("--iters must be at least 1")
        if args.device_model and not emulate:
            raise ValueError("--device-model emulates a GPU cluster: add --emulate GxM")
        if emulate and not args.cross_rate and not args.device_model:
            raise ValueError("--emulate needs --cross-rate (e.g. 1gbit)")
        if emulate and torchrun:
            raise ValueError("--emulate starts its own ranks; do not run it under torchrun")
        _check_link_options(args, emulate)
    except ValueError as exc:
        print(f"charm-megatron bench: {exc}", file=sys.stderr)
        return 2
    if torchrun:
        return _run_torchrun(args, cfg, cuda)
    world = emulate[0] * emulate[1] if emulate else args.ranks
    return _run_here(args, cfg, world, emulate)


def _check_link_options(args: argparse.Namespace, emulate) -> None:
    """The netns shaping options: only with --emulate, and htb only with --nic rank."""
    given = [f"--{n.replace('_', '-')}" for n in ("cross_burst", "intra_burst")
             if getattr(args, n) is not None]
    if args.link_ingress is not None:
        given.append("--link-ingress")
    if args.link_mtu is not None:
        given.append("--link-mtu")
    if args.link_model != "tbf":
        given.append(f"--link-model {args.link_model}")
    if given and not emulate:
        raise ValueError(f"{', '.join(given)}: shaping options of the emulated links; use them "
                         "with --emulate GxM")
    if given and args.emulate_backend == "software":
        raise ValueError(f"{', '.join(given)}: need --emulate-backend netns (the software link "
                         "model has no shapers)")
    if args.link_model == "htb" and args.nic != "rank":
        raise ValueError("--link-model htb models one NIC per rank that carries intra- and "
                         f"cross-node traffic: add --nic rank (got --nic {args.nic})")
    for n in ("cross_burst", "intra_burst"):
        if getattr(args, n) is not None:
            parse_size(getattr(args, n))


def _link_kw(args: argparse.Namespace) -> dict:
    """EmulatedCluster's shaping arguments from the bench options."""
    return {"link_model": args.link_model, "ingress": args.link_ingress,
            "cross_burst": args.cross_burst, "intra_burst": args.intra_burst,
            "mtu": args.link_mtu}


def _topology(args: argparse.Namespace, world: int, emulate) -> str:
    if args.topology:
        return args.topology
    if emulate:
        return f"{emulate[0]}x{emulate[1]}"
    if world >= 4 and world % 2 == 0:
        return f"2x{world // 2}"
    return "flat"


def _job(args, cfg: BenchConfig, world: int, topology: str, device: str, progress: bool):
    points, dropped = cfg.points(world)
    from charm_megatron.ops.options import ENV_VARS

    # The caller's CHARM_* settings travel with the job: a rank started by a process server
    # that predates them (a pool started earlier in the same process) would not see them.
    env = {var: os.environ[var] for var in ENV_VARS if var in os.environ}
    env["CHARM_COMM_TIMEOUT_S"] = str(args.comm_timeout_s)
    # The devices --device-model and CHARM_MODEL_PROFILE may name (empty: the built-in ones
    # only, also in a pooled rank that saw another value before).
    env[DEVICES_ENV] = os.environ.get(DEVICES_ENV, "")
    return Job(cfg, points, topology, device, progress, env), dropped


def _header(cfg: BenchConfig, world: int, topology: str, where: str, points, dropped,
            log) -> None:
    log(f"charm-megatron bench: {len(points)} point(s) x {len(cfg.algos)} algorithm(s) "
        f"({','.join(cfg.algos)}), {world} ranks {where}, {cfg.dtype}, "
        f"{'causal' if cfg.causal else 'full attention'}, "
        f"{'forward + backward' if cfg.backward else 'forward only'}, CHARM+ topology {topology}, "
        f"roles {cfg.roles}; "
        + (f"partials {cfg.partials}; " if cfg.partials != "input" else "")
        + (f"auto measured (auto_tune {cfg.auto_tune}); " if cfg.auto_tune else "")
        + (f"window {cfg.window[0]},{cfg.window[1]}; " if cfg.window else "") +
        f"{cfg.warmup} warm-up + {cfg.iters} timed rounds per point")
    if cfg.packed_mean:
        from charm_megatron.lab.bench.packing import describe

        log(f"  {describe(cfg.packed_mean)}")
    for d in dropped:
        log(f"  left out: {d}")


def _device_setup(args, cfg: BenchConfig, points) -> DeviceSetup:
    """The emulated GPU cluster of ``--device-model`` with this run's options."""
    if args.dilation == "auto":
        dilation = None
    else:
        try:
            dilation = float(args.dilation)
        except ValueError:
            raise ValueError(f"--dilation {args.dilation!r}: a number or auto") from None
    return setup_for(args.device_model, parse_grid_shape(args.emulate), points, cfg.causal,
                     element_size(cfg.dtype),
                     wire_scale=parse_grid_shape(args.wire_scale) if args.wire_scale else None,
                     wire_bytes=args.wire_kib * 1024, dilation=dilation,
                     cross_Bps=parse_rate(args.cross_rate) if args.cross_rate else None,
                     intra_Bps=parse_rate(args.intra_rate) if args.intra_rate else None,
                     sm_contention=not args.no_sm_contention, nic=args.nic,
                     divides=[w for w in (cfg.window or ()) if w > 0],
                     # The software link model books each transfer when it is posted: first
                     # come, first served, which the model is told (docs/emulator.md).
                     link_order="fifo" if args.emulate_backend in ("auto", "software") else None,
                     # auto sizes the dilation on the shortest dependent unit of the contenders
                     algos=[a for a in cfg.algos if a in ALGORITHM_NAMES or a in TE_NAMES],
                     device_clock=_device_clock(args))


def _device_clock(args) -> str:
    """``--device-clock``, by default ``virtual``; ``async`` on netns, whose TCP gives no
    modelled arrivals for the virtual clock to take its host time from."""
    netns = args.emulate_backend == "netns"
    clock = args.device_clock or ("async" if netns else "virtual")
    if clock.startswith("virtual") and netns:
        raise ValueError("--device-clock virtual needs the software links (the default "
                         "--emulate-backend): with netns use --device-clock async or sync")
    return clock


def _run_here(args, cfg: BenchConfig, world: int, emulate) -> int:
    topology = _topology(args, world, emulate)
    job, dropped = _job(args, cfg, world, topology, "cpu", not args.quiet)
    if not job.points:
        print("charm-megatron bench: no grid point fits (see 'left out' above)", file=sys.stderr)
        for d in dropped:
            print(f"  left out: {d}", file=sys.stderr)
        return 2
    if args.device_model:
        try:
            device = _device_setup(args, cfg, job.points)
        except ValueError as exc:
            print(f"charm-megatron bench: {exc}", file=sys.stderr)
            return 2
        # Memory means nothing on a timed device; its compute-only times and ring's CCR are
        # the model's (analysis._model_columns), so no ablated runs either.
        job.cfg = cfg = replace(cfg, device=device, memory=False, ccr=False, bound=False)
        try:
            cfg.wire_window()  # a window the wire copy cannot scale: refused before any rank
        except ValueError as exc:
            print(f"charm-megatron bench: {exc}", file=sys.stderr)
            return 2
        return _run_emulated_gpu(args, cfg, job, dropped, emulate)
    mode = "local"
    if emulate:
        mode = args.emulate_backend
        if mode == "auto":
            ok, why = available()
            mode = "netns" if ok else "software"
            if not ok and any(v not in (None, "tbf") for v in _link_kw(args).values()):
                print(f"charm-megatron bench: network namespaces unavailable ({why}); "
                      "--link-model / --cross-burst / --intra-burst / --link-ingress / --link-mtu "
                      "need them",
                      file=sys.stderr)
                return 2
            if not ok:
                print(f"\n*** network namespaces unavailable ({why}): falling back to the "
                      "SOFTWARE LINK MODEL on gloo P2P (see docs/bench.md for what it does not "
                      "model) ***\n", flush=True)
    where = {"local": "on this machine (loopback)",
             "netns": f"in an emulated {args.emulate} cluster (namespaces + tc "
                      f"{args.link_model}, nic={args.nic})",
             "software": f"on a {args.emulate} software link model (nic={args.nic})"}[mode]
    _header(cfg, world, topology, where, job.points, dropped, print)
    t0 = time.monotonic()
    kw = {"timeout_s": args.timeout_s, "pg_timeout_s": args.comm_timeout_s}
    if mode == "local":
        results, info = runners.run_local(job, world, **kw)
    elif mode == "netns":
        results, info = runners.run_netns(job, emulate[0], emulate[1], args.cross_rate,
                                         args.intra_rate, args.nic, **kw, **_link_kw(args))
    else:
        results, info = runners.run_software(job, emulate[0], emulate[1], args.cross_rate,
                                            args.intra_rate, args.nic, **kw)
    return _finish(args, cfg, job, dropped, results, info, time.monotonic() - t0)


def _run_emulated_gpu(args, cfg: BenchConfig, job, dropped, emulate) -> int:
    """Ranks with timed devices in an emulated cluster whose links are the device profile's
    (or the given real rates) slowed by the wire scale and the dilation."""
    device = cfg.device
    assert device is not None
    world = emulate[0] * emulate[1]
    wire = device.wire_links()  # the model's description of the links, on the wire
    cross, intra = wire.cross.message_Bps, wire.intra.message_Bps
    # No token bucket on a GPU's links: the smallest one a shaper keeps its rate with (two
    # packets of the path's MTU, or one timer tick's worth of bytes). The tbf model's intra
    # veths carry 64 KiB packets; htb's single veth per rank 1500-byte ones.
    intra_packet = 1514 if args.link_model == "htb" else 65549
    burst = {"cross_burst": max(2 * 1514, int(cross / 250)),
             "intra_burst": max(2 * intra_packet, int(intra / 250))}
    kw_links = {**_link_kw(args), **{k: v for k, v in burst.items() if _link_kw(args)[k] is None}}
    # The software link model by default: TCP through tbf shapers at these scaled-down rates
    # loses packets and stalls on retransmission timeouts when many flows cross at once, and
    # the kernel's packet path saturates the 2 cores first when the rates are raised; both
    # measured and described in docs/emulator.md. --emulate-backend netns keeps TCP.
    mode = "software" if args.emulate_backend == "auto" else args.emulate_backend
    where = (f"in an emulated {args.emulate} GPU cluster ({mode} links, nic={args.nic}): "
             f"{device.describe()}; links {format_rate(device.device_cross_Bps)} cross, "
             f"{format_rate(device.device_intra_Bps)} intra in device time")
    _header(cfg, world, job.topology, where, job.points, dropped, print)
    t0 = time.monotonic()
    kw = {"timeout_s": args.timeout_s, "pg_timeout_s": args.comm_timeout_s}
    if mode == "netns":
        results, info = runners.run_netns(job, emulate[0], emulate[1], cross, intra, args.nic,
                                         **kw, **kw_links)
    else:
        # The software links are built from the model's own description (model/links.py):
        # per-message rates, port aggregates (a port wider than one message carries several
        # at once, in start order), the profile's latency dilated like all device time.
        results, info = runners.run_software(job, emulate[0], emulate[1], cross, intra,
                                            args.nic, **kw, links=wire)
    info.device = "emulated"
    info.cross_rate, info.cross_rate_source = device.device_cross_Bps, f"device model {device.profile}"
    info.cross_burst = int(info.cross_burst * device.bytes_scale)  # in real bytes
    return _finish(args, cfg, job, dropped, results, info, time.monotonic() - t0)


def _run_torchrun(args, cfg: BenchConfig, cuda: bool) -> int:
    import torch.distributed  # noqa: F401 - fail early if torch lacks distributed

    world = int(os.environ["WORLD_SIZE"])
    rank = int(os.environ["RANK"])
    topology = args.topology or "auto"
    job, dropped = _job(args, cfg, world, topology, "cuda" if cuda else "cpu",
                        not args.quiet and rank == 0)
    if not job.points:
        if rank == 0:
            print("charm-megatron bench: no grid point fits", file=sys.stderr)
        return 2
    if rank == 0:
        _header(cfg, world, topology, f"under torchrun ({'NCCL' if cuda else 'gloo'})",
                job.points, dropped, print)
    t0 = time.monotonic()
    results, info = runners.run_torchrun(
        job, pg_timeout_s=args.comm_timeout_s, nic=args.nic,
        cross_rate=parse_rate(args.cross_rate) if args.cross_rate else None)
    if results is None or info is None:
        return 0
    return _finish(args, cfg, job, dropped, results, info, time.monotonic() - t0)


def _finish(args, cfg: BenchConfig, job, dropped, results, info, elapsed: float) -> int:
    rows, raw = analyse(cfg, job.points, results, info)
    out = args.out or os.path.join("runs", time.strftime("bench-%Y%m%d-%H%M%S"))
    os.makedirs(out, exist_ok=True)
    r0 = results[0]
    meta = {
        "command": "charm-megatron bench " + " ".join(sys.argv[2:] if len(sys.argv) > 2 else []),
        "date": time.strftime("%Y-%m-%d %H:%M:%S"),
        "host": platform.node(),
        "python": platform.python_version(),
        "torch": _torch_version(),
        "config": cfg.to_dict(),
        "world": info.world,
        "mode": info.mode,
        "device": info.device,
        "cores": info.cores,
        "nic": info.nic,
        "hw_groups": info.hw_groups,
        "cross_rate_Bps": info.cross_rate,
        "cross_rate_source": info.cross_rate_source,
        "cross_burst_bytes": info.cross_burst,
        "link_model": args.link_model if info.mode == "netns" else None,
        "link_ingress": args.link_ingress if info.mode == "netns" else None,
        "link_mtu": args.link_mtu if info.mode == "netns" else None,
        "rates_Bps": info.rates,
        "topology": r0["topology"],
        "memory_method": r0["memory_method"],
        "notes": info.notes,
        "elapsed_s": elapsed,
        "points": [vars(p) for p in job.points],
        "dropped_points": dropped,
    }
    csv_path = os.path.join(out, "results.csv")
    json_path = os.path.join(out, "results.json")
    write_csv(rows, csv_path)
    write_json({"meta": meta, "rows": rows, "raw": raw}, json_path)
    print()
    print(format_table(rows))
    _print_bound_summary(rows, info)
    if cfg.device is not None and (checks := check_lines(rows)):
        print("\n" + "\n".join(checks))
    for n in info.notes:
        print(f"note: {n}")
    print(f"memory: {r0['memory_method']}")
    written = [csv_path, json_path]
    if not args.no_plot:
        title = (f"{info.world} ranks, {info.mode}"
                 + (f" nic={info.nic}" if info.nic else "") + f", {cfg.dtype}, "
                 + ("causal" if cfg.causal else "full"))
        png = plot(rows, os.path.join(out, "speedup_vs_ccr.png"), title)
        if png:
            written.append(png)
    print(f"wrote {', '.join(written)}  ({elapsed:.0f} s)")
    return 0


def _print_bound_summary(rows, info) -> None:
    """One line per algorithm and pass: how close the measured time is to the bound."""
    if info.device == "cuda":
        what = "compute term = slowest rank's compute-only time"
    elif info.device == "emulated":
        what = "compute term = the busiest rank's device compute (the model's, which the timed " \
               "device waits for)"
    else:
        what = f"total CPU work of the compute-only run / {info.cores} cores"
    if info.cross_rate:
        burst = f" - {info.cross_burst / 1024:.0f} KiB burst" if info.cross_burst else ""
        what += (f"; link term = (busiest cross link's bytes{burst}) / "
                 f"{info.cross_rate / 1e6:.1f} MB/s ({info.cross_rate_source})")
    print(f"lower bound = max({what})")
    by: dict[tuple[str, str], list[float]] = {}
    for r in rows:
        if r.get("vs_bound") is not None:
            by.setdefault((r["algo"], r["pass"]), []).append(r["vs_bound"])
    for (algo, p), v in sorted(by.items()):
        print(f"  {algo:7} {p:6} measured / bound: median {sorted(v)[len(v) // 2]:.2f} "
              f"(range {min(v):.2f} - {max(v):.2f} over {len(v)} point(s))")
    print()


def _torch_version() -> str:
    try:
        import torch

        return torch.__version__
    except ImportError:  # pragma: no cover
        return "?"


def main(argv: list[str] | None = None) -> int:
    """``python -m charm_megatron.lab.bench.cli`` (same as ``charm-megatron bench``)."""
    parser = argparse.ArgumentParser(prog="charm-megatron bench", description=__doc__.splitlines()[0])
    register(parser)
    return run(parser.parse_args(argv))


if __name__ == "__main__":
    sys.exit(main())


def _auto_tune(value: str | None) -> str | None:
    """``--auto-tune`` checked now (ValueError naming it), kept as given for the ranks."""
    if value is None:
        return None
    from charm_megatron.ops.options import CPOptions

    try:
        CPOptions(auto_tune=value)
    except ValueError as exc:
        raise ValueError(f"--auto-tune {value!r}: {exc}") from None
    return value
