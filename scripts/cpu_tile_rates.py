#!/usr/bin/env python3
"""The CPU block kernel's time by tile length, one thread per process (one CP rank's share of
a 2-core box): ring's tiles (a rank's 384 rows, 8 heads) against a head all-to-all's
super-tiles (``a`` times the rows, ``1/a`` of the heads), b=2, d=64, fp32 (docs/performance.md,
CPU testbed with the peers).

Each step doubles the rows and halves the heads, so the score pairs double; the ``per unit``
columns are the time per pair count of the first row's tile. ``--procs 8`` runs that many
processes at once (the testbed's 8 ranks on 2 cores) and reports the slowest's time.

    python scripts/cpu_tile_rates.py [--procs 8]
"""

from __future__ import annotations

import argparse
import time

import torch
import torch.multiprocessing as mp

FWD = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu
BWD = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward
SHAPES = ((384, 8), (768, 4), (1536, 2), (3072, 1))


def _timed(fn, reps: int = 3) -> float:
    fn()
    start = time.perf_counter()
    for _ in range(reps):
        fn()
    return (time.perf_counter() - start) / reps


def _one(s: int, h: int, causal: bool) -> tuple[float, float]:
    """(forward, backward) seconds of one tile in this process, one thread."""
    torch.set_num_threads(1)
    q, k, v = (torch.randn(2, h, s, 64) for _ in range(3))
    out, lse = FWD(q, k, v, 0.0, causal)
    dout = torch.randn_like(out)
    return (_timed(lambda: FWD(q, k, v, 0.0, causal)),
            _timed(lambda: BWD(dout, q, k, v, out, lse, 0.0, causal)))


def _worker(s: int, h: int, causal: bool, results) -> None:
    results.put(_one(s, h, causal))


def _measure(s: int, h: int, causal: bool, procs: int) -> tuple[float, float]:
    if procs == 1:
        return _one(s, h, causal)
    ctx = mp.get_context("fork")
    results = ctx.Queue()
    workers = [ctx.Process(target=_worker, args=(s, h, causal, results)) for _ in range(procs)]
    for w in workers:
        w.start()
    got = [results.get() for _ in workers]
    for w in workers:
        w.join()
    return max(t[0] for t in got), max(t[1] for t in got)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--procs", type=int, default=1, help="processes running at once")
    args = ap.parse_args()
    print(f"{args.procs} process(es); the slowest's time")
    print("causal  rows heads   fwd ms   bwd ms  bwd/fwd  fwd per unit  bwd per unit")
    for causal in (True, False):
        for step, (s, h) in enumerate(SHAPES):
            tf, tb = _measure(s, h, causal, args.procs)
            units = 2 ** step  # score pairs over the first row's
            print(f"{causal!s:6} {s:5d} {h:5d} {tf * 1e3:8.1f} {tb * 1e3:8.1f} {tb / tf:8.2f} "
                  f"{tf * 1e3 / units:13.2f} {tb * 1e3 / units:13.2f}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
