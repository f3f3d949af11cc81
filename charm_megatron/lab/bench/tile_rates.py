"""The CPU block kernel's time by tile length, one thread per process (one CP rank's share of a
2-core box): ring's tiles (a rank's 384 rows, 8 heads) against a head all-to-all's super-tiles
(``a`` times the rows, ``1/a`` of the heads), b=2, d=64, fp32 (docs/performance.md, CPU testbed
with the peers).

Each step doubles the rows and halves the heads, so the score pairs double; the ``per unit``
columns are the time per pair count of the first row's tile. ``--procs 8`` runs that many
processes at once (the testbed's 8 ranks on 2 cores) and reports the slowest's time.

    python -m charm_megatron.lab.bench.tile_rates [--procs 8]
"""

from __future__ import annotations

import argparse
import queue
import time
from collections.abc import Callable, Sequence

import torch
import torch.multiprocessing as mp

SHAPES = ((384, 8), (768, 4), (1536, 2), (3072, 1))
TIMEOUT_S = 600.0  # one worker's answer; a worker that died is named, never waited on forever


def _timed(fn: Callable[[], object], reps: int = 3) -> float:
    fn()
    start = time.perf_counter()
    for _ in range(reps):
        fn()
    return (time.perf_counter() - start) / reps


def one_tile(s: int, h: int, causal: bool) -> tuple[float, float]:
    """(forward, backward) seconds of one ``[2, h, s, 64]`` tile in this process, one thread."""
    fwd = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu
    bwd = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward
    torch.set_num_threads(1)
    q, k, v = (torch.randn(2, h, s, 64) for _ in range(3))
    out, lse = fwd(q, k, v, 0.0, causal)
    dout = torch.randn_like(out)
    return (_timed(lambda: fwd(q, k, v, 0.0, causal)),
            _timed(lambda: bwd(dout, q, k, v, out, lse, 0.0, causal)))


def _worker(s: int, h: int, causal: bool, results) -> None:  # noqa: ANN001
    results.put(one_tile(s, h, causal))


def measure(s: int, h: int, causal: bool, procs: int,
            timeout_s: float = TIMEOUT_S) -> tuple[float, float]:
    """The slowest of ``procs`` processes' (forward, backward) seconds, all running at once."""
    if procs == 1:
        return one_tile(s, h, causal)
    ctx = mp.get_context("fork")
    results = ctx.Queue()
    workers = [ctx.Process(target=_worker, args=(s, h, causal, results)) for _ in range(procs)]
    for w in workers:
        w.start()
    try:
        got = [results.get(timeout=timeout_s) for _ in workers]
    except queue.Empty:
        dead = [f"worker {i} (exit code {w.exitcode})" for i, w in enumerate(workers)
                if w.exitcode not in (None, 0)]
        raise RuntimeError(f"tile_rates: no answer within {timeout_s:g} s from every worker; "
                           f"{', '.join(dead) or 'none exited'}") from None
    finally:
        for w in workers:
            w.join(timeout=5)
            if w.is_alive():
                w.kill()
    return max(t[0] for t in got), max(t[1] for t in got)


def table(procs: int, shapes: Sequence[tuple[int, int]] = SHAPES) -> list[str]:
    """The report's lines: per mask and shape, ms forward / backward and per unit of pairs."""
    out = [f"{procs} process(es); the slowest's time",
           "causal  rows heads   fwd ms   bwd ms  bwd/fwd  fwd per unit  bwd per unit"]
    for causal in (True, False):
        for step, (s, h) in enumerate(shapes):
            tf, tb = measure(s, h, causal, procs)
            units = 2 ** step  # score pairs over the first row's
            out.append(f"{causal!s:6} {s:5d} {h:5d} {tf * 1e3:8.1f} {tb * 1e3:8.1f} "
                       f"{tb / tf:8.2f} {tf * 1e3 / units:13.2f} {tb * 1e3 / units:13.2f}")
    return out


def main(argv: Sequence[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--procs", type=int, default=1, help="processes running at once")
    args = ap.parse_args(argv)
    print("\n".join(table(args.procs)))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
