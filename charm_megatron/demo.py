"""``charm-megatron demo`` (what ``make demo`` runs): ring vs CHARM+ on CPU ranks.

Starts ``--ranks`` gloo processes on this machine, runs causal context-parallel attention
forward+backward with each algorithm on the same inputs (alternating, so machine noise hits
both alike), and prints the median time per call and the largest error of out, dq, dk, dv
against a float64 single-process reference over the full sequence.

On one CPU machine every link is loopback, so this shows correctness and overheads, not the
cross-node speed-up; ``docs/performance.md`` covers emulated slow links.
"""

from __future__ import annotations

import argparse
import statistics
import time

ALGOS = ("ring", "rmplus", "charm")


def register(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--ranks", type=int, default=4)
    parser.add_argument("--topology", default="2x2", help="CHARM+ topology (GxM)")
    parser.add_argument("--seq", type=int, default=2048, help="global sequence length")
    parser.add_argument("--batch", type=int, default=1)
    parser.add_argument("--heads", type=int, default=8)
    parser.add_argument("--kv-heads", type=int, default=4)
    parser.add_argument("--head-dim", type=int, default=64)
    parser.add_argument("--iters", type=int, default=5)


def _rank_main(rank: int, world: int, cfg: dict) -> dict:
    import torch

    from charm_megatron import cp_attention
    from charm_megatron.layout import shard

    g = torch.Generator().manual_seed(0)
    s, b, hq, hkv, d = cfg["seq"], cfg["batch"], cfg["heads"], cfg["kv_heads"], cfg["head_dim"]
    q, k, v, dout = (torch.randn(s, b, h, d, generator=g) for h in (hq, hkv, hkv, hq))
    ql, kl, vl, dl = (shard(t, rank, world) for t in (q, k, v, dout))
    times: dict[str, list[float]] = {a: [] for a in ALGOS}
    results = {}
    for it in range(cfg["iters"] + 1):  # iteration 0 warms up (process groups, plans)
        for algo in ALGOS:
            qa, ka, va = (t.clone().requires_grad_() for t in (ql, kl, vl))
            topo = cfg["topology"] if algo == "charm" else None
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


def run(args: argparse.Namespace) -> int:
    import torch

    from charm_megatron.kernels.reference import ReferenceBackend
    from charm_megatron.layout import unshard
    from charm_megatron.testing import run_ranks

    cfg = {"seq": args.seq, "batch": args.batch, "heads": args.heads,
           "kv_heads": args.kv_heads, "head_dim": args.head_dim, "iters": args.iters,
           "topology": args.topology}
    print(f"charm-megatron demo: {args.ranks} CPU ranks (gloo), causal attention, "
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
    for algo in ALGOS:
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
          "overheads, not the cross-node win — see docs/performance.md)")
    return 0
