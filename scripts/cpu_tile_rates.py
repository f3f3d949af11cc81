#!/usr/bin/env python3
"""The CPU block kernel's time by tile length at a fixed head-dim and batch, one thread (one
CP rank's share of a 2-core box): ring's tiles (a rank's rows, all heads) against a head
all-to-all's super-tiles (a times the rows, 1/a of the heads). Each step doubles the rows and
halves the heads, so the score pairs double; the last column is the time per pair of the
first row's tile (docs/performance.md, CPU testbed with the peers).

    python scripts/cpu_tile_rates.py
"""

from __future__ import annotations

import time

import torch

FWD = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu
BWD = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward


def _timed(fn, reps: int = 3) -> float:
    fn()
    start = time.perf_counter()
    for _ in range(reps):
        fn()
    return (time.perf_counter() - start) / reps


def main() -> int:
    torch.set_num_threads(1)
    b, d = 2, 64
    print("causal  rows heads   fwd ms   bwd ms  bwd/fwd  fwd per unit  bwd per unit")
    for causal in (True, False):
        for step, (s, h) in enumerate(((384, 8), (768, 4), (1536, 2), (3072, 1))):
            q, k, v = (torch.randn(b, h, s, d) for _ in range(3))
            out, lse = FWD(q, k, v, 0.0, causal)
            dout = torch.randn_like(out)
            tf = _timed(lambda: FWD(q, k, v, 0.0, causal))  # noqa: B023
            tb = _timed(lambda: BWD(dout, q, k, v, out, lse, 0.0, causal))  # noqa: B023
            units = 2 ** step  # score pairs over the first row's
            print(f"{causal!s:6} {s:5d} {h:5d} {tf * 1e3:8.1f} {tb * 1e3:8.1f} {tb / tf:8.2f} "
                  f"{tf * 1e3 / units:13.2f} {tb * 1e3 / units:13.2f}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
