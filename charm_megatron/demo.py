"""``charm-megatron demo`` (what ``make demo`` runs), two demos behind one command.

* Default - the training demo (:mod:`charm_megatron.train_demo`, ``docs/demo.md``): trains the
  ``gpt-tiny-cpu`` config with megatron-core's GPTModel on 4 CPU ranks (gloo), CP 4 over an
  emulated ``2x2`` cluster whose cross-node link is slowed with ``tc``, once with ``ring`` and
  once with ``charm``; writes Megatron-LM logs, runs ``compare`` on them and checks that the two
  loss curves agree.
* ``--operator`` - the operator demo: causal context-parallel attention forward+backward with
  ring, RM+ and CHARM+ on the same inputs (alternating, so machine noise hits all alike); prints
  the median time per call and the largest error of out, dq, dk, dv against a float64
  single-process reference over the full sequence. All links are loopback there, so it shows
  correctness and overheads, not the cross-node speed-up.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time

import torch

from charm_megatron.kernels.reference import ReferenceBackend
from charm_megatron.layout import shard, unshard
from charm_megatron.local_ranks import run_ranks
from charm_megatron.ops.attention import cp_attention
from charm_megatron.plan.registry import ALGORITHM_NAMES as ALGOS
from charm_megatron.plan.registry import CallTraits, refusal, uses_topology
from charm_megatron.topology import Topology
from charm_megatron.train_demo.runner import add_arguments
from charm_megatron.train_demo.runner import main as train_demo_main

#: The operator demo's sizes when not given.
OPERATOR_DEFAULTS: dict[str, object] = {"ranks": 4, "topology": "2x2", "seq": 2048, "batch": 1,
                                        "heads": 8, "kv_heads": 4, "head_dim": 64, "iters": 5}


def register(parser: argparse.ArgumentParser) -> None:
    """Add the options of both demos (the operator demo's apply with ``--operator``)."""
    parser.add_argument("--operator", action="store_true",
                        help="run the operator demo (ring vs RM+ vs CHARM+ attention calls, "
                        "errors against float64) instead of the training demo")
    add_arguments(parser)
    # --iters, --seq and --topology serve both demos; the rest are the operator demo's.
    parser.add_argument("--iters", type=int, default=None,
                        help="training iterations (default: the run's train_iters); with "
                        f"--operator: timed calls (default {OPERATOR_DEFAULTS['iters']})")
    parser.add_argument("--seq", type=int, default=None,
                        help="global sequence length (default: the run's seq_length; with "
                        f"--operator {OPERATOR_DEFAULTS['seq']})")
    parser.add_argument("--topology", default=None,
                        help="CHARM+ topology GxM (default: the config's charm_topology; with "
                        f"--operator {OPERATOR_DEFAULTS['topology']})")
    g = parser.add_argument_group("operator demo only (--operator)")
    for name in ("ranks", "batch", "heads", "kv_heads", "head_dim"):
        g.add_argument("--" + name.replace("_", "-"), type=int, default=None,
                       help=f"default {OPERATOR_DEFAULTS[name]}")


def run(args: argparse.Namespace) -> int:
    """The training demo, or with ``--operator`` the operator demo; the exit status."""
    if args.operator:
        for key, value in OPERATOR_DEFAULTS.items():
            if getattr(args, key) is None:
                setattr(args, key, value)
        return run_operator(args)
    given = [f"--{k.replace('_', '-')}" for k in ("ranks", "batch", "heads", "kv_heads",
                                                   "head_dim") if getattr(args, k) is not None]
    if given:
        print(f"charm-megatron demo: {', '.join(given)} belong to the operator demo (add "
              "--operator); the training demo takes its model from the config (--set KEY=VALUE)",
              file=sys.stderr)
        return 2
    for option, key in (("iters", "train_iters"), ("seq", "seq_length"),
                        ("topology", "charm_topology")):
        if getattr(args, option) is not None:
            args.overrides.append(f"{key}={getattr(args, option)}")

    return train_demo_main(args)


def _runnable(cfg: dict, world: int) -> dict[str, str | None]:
    """Per algorithm, why it cannot run the demo's shape (``None``: it can): the head
    all-to-alls need the heads to divide by their group size."""
    groups = Topology.parse(cfg["topology"], world).groups
    traits = CallTraits(tuple(map(tuple, groups)), cfg["heads"], cfg["kv_heads"])
    return {algo: refusal(algo, traits) for algo in ALGOS}


def _rank_main(rank: int, world: int, cfg: dict) -> dict:
    g = torch.Generator().manual_seed(0)
    s, b, hq, hkv, d = cfg["seq"], cfg["batch"], cfg["heads"], cfg["kv_heads"], cfg["head_dim"]
    q, k, v, dout = (torch.randn(s, b, h, d, generator=g) for h in (hq, hkv, hkv, hq))
    ql, kl, vl, dl = (shard(t, rank, world) for t in (q, k, v, dout))
    algos = [a for a, why in _runnable(cfg, world).items() if why is None]
    times: dict[str, list[float]] = {a: [] for a in algos}
    results = {}
    for it in range(cfg["iters"] + 1):  # iteration 0 warms up (process groups, plans)
        for algo in algos:
            qa, ka, va = (t.clone().requires_grad_() for t in (ql, kl, vl))
            topo = cfg["topology"] if uses_topology(algo) else None
            torch.distributed.barrier()
            t0 = time.perf_counter()
            out = cp_attention(qa, ka, va, algo=algo, topology=topo, causal=True)
            out.backward(dl)
            elapsed = time.perf_counter() - t0
            if it > 0:
                times[algo].append(elapsed)
            results[algo] = [out.detach(), qa.grad, ka.grad, va.grad]
        if rank == 0:
            print(f"  iteration {it}/{cfg['iters']}" + (" (warm-up)" if it == 0 else ""),
                  flush=True)
    return {"times": times, "results": results}


def run_operator(args: argparse.Namespace) -> int:
    """The operator demo (``charm-megatron demo --operator``)."""
    cfg = {"seq": args.seq, "batch": args.batch, "heads": args.heads,
           "kv_heads": args.kv_heads, "head_dim": args.head_dim, "iters": args.iters,
           "topology": args.topology}
    print(f"charm-megatron demo --operator: {args.ranks} CPU ranks (gloo), causal attention, "
          f"S={args.seq} b={args.batch} heads={args.heads}/{args.kv_heads} dim={args.head_dim} "
          f"fp32, forward+backward; CHARM+ topology {args.topology}")
    t0 = time.perf_counter()
    per_rank = run_ranks(_rank_main, args.ranks, cfg, timeout_s=1800)
    print(f"  ranks finished in {time.perf_counter() - t0:.1f} s; computing the float64 reference")

    g = torch.Generator().manual_seed(0)
    s, b, d = args.seq, args.batch, args.head_dim
    q, k, v, dout = (torch.randn(s, b, h, d, generator=g).double()
                     for h in (args.heads, args.kv_heads, args.kv_heads, args.heads))
    ref = ReferenceBackend(torch.float64)
    r_out, r_lse = ref.forward(q, k, v, True, d ** -0.5)
    want = [r_out, *ref.backward(dout, q, k, v, r_out, r_lse, True, d ** -0.5)]

    print()
    print(f"{'algo':8} {'median ms/call':>15} {'vs ring':>8}   max |err| out, dq, dk, dv")
    ring_ms = None
    for algo, why in _runnable(cfg, args.ranks).items():
        if why is not None:
            print(f"{algo:8} {'-':>15} {'-':>8}   not run: {why}")
            continue
        # A call's time is its slowest rank's time.
        per_iter = [max(r["times"][algo][i] for r in per_rank) for i in range(args.iters)]
        ms = statistics.median(per_iter) * 1e3
        ring_ms = ring_ms or ms
        errs = []
        for i, w in enumerate(want):
            full = unshard([r["results"][algo][i] for r in per_rank]).double()
            errs.append((full - w).abs().max().item())
        print(f"{algo:8} {ms:15.1f} {ring_ms / ms:7.2f}x   " +
              ", ".join(f"{e:.1e}" for e in errs))
    print("\n(vs ring > 1 means faster than ring; all links here are loopback, so this shows "
          "overheads, not the cross-node win; `charm-megatron demo` without --operator trains "
          "over an emulated slow link)")
    return 0
