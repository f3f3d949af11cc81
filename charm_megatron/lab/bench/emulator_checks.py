"""The checks of a run on the emulated GPU cluster (issue 23, docs/emulator.md): the busiest
core (above :data:`~charm_megatron.lab.bench.gpu_emulation.CPU_LIMITED` the run measures this
machine, not the devices), ring against the textbook ring (:func:`analytic_ring`), and every
contender against the performance model (within 10 %, or a difference to explain)."""

from __future__ import annotations

from collections.abc import Sequence

from charm_megatron.lab.bench.gpu_emulation import CPU_LIMITED
from charm_megatron.lab.reports.bench_csv import MODEL_TOLERANCE
from charm_megatron.model.cluster import Cluster


def analytic_ring(cluster: Cluster, problem, n: int, causal: bool, direction: str,
                  groups: Sequence[Sequence[int]]) -> float:
    """Ring attention's seconds by the textbook formula: the first ``n - 1`` steps each take
    max(its tile, the step's transfer over the ring's slowest link), the last step its tile
    alone. Forward moves one kv block per step. Backward's dk, dv partial follows its kv block
    one step behind, on the same link: step 0 moves kv alone, steps 1 .. n-2 move kv and dkv,
    and after the last tile each dkv takes one more hop home, which nothing overlaps. Tiles are
    priced as the model prices them (rate, tile efficiency, the fold of the result, the per-op
    overhead, slowed by ``comm_slowdown`` per stream moving); one link latency per transfer."""
    from charm_megatron.model import effects

    rows = problem.s / n
    backward = direction == "backward"
    merge = (lambda nbytes: nbytes / (cluster.merge_gbps * 1e9)) if cluster.merge_gbps \
        else (lambda nbytes: 0.0)

    def tile_s(sq: float, sk: float, masked: bool) -> float:
        flops = 4.0 * problem.b * problem.hq * problem.d * sq * sk * (0.5 if masked else 1.0)
        flops *= cluster.bwd_factor if backward else 1.0
        eff = effects.kernel_efficiency(cluster, sq, sk, problem.d)
        if backward:
            folded = (problem.local_bytes("dq", n) * sq / rows
                      + problem.local_bytes("dkv", n) * sk / rows)
        else:
            folded = problem.local_bytes("out", n) * sq / rows
        return (flops / (cluster.tflops * 1e12 * eff) + merge(folded)
                + cluster.op_overhead_us * 1e-6)

    # Under the load-balanced causal layout every off-diagonal tile is half a block.
    step = tile_s(rows, rows / 2, False) if causal else tile_s(rows, rows, False)
    first = tile_s(rows, rows, True) if causal else step
    if n == 1:
        return first
    rate = (cluster.cross_gbps if len(groups) > 1 else cluster.intra_gbps) * 1e9

    def xfer_s(nbytes: float) -> float:
        return nbytes / rate + cluster.latency_us * 1e-6

    kv_b, dkv_b = problem.block_bytes("kv", n), problem.block_bytes("dkv", n)
    kv_x = xfer_s(kv_b)
    both_x = xfer_s(kv_b + dkv_b) if backward else kv_x
    # The streams moving during a step, by when each is done: kv alone (stream kv); backward's
    # kv and dkv (streams kv and q) share the link, so the smaller is done after twice its
    # bytes and the other one at the step's end. SM contention counts each stream moving.
    moving = [both_x, xfer_s(2 * min(kv_b, dkv_b))] if backward else [kv_x]

    def while_moving(c: float, streams: list[float]) -> float:
        # A tile of ``c`` seconds, slowed while the step's streams move (effects.slowed_s).
        return effects.slowed_s(cluster, c, streams)

    home = xfer_s(dkv_b) if backward else 0.0
    return (max(while_moving(first, [kv_x]), kv_x)
            + (n - 2) * max(while_moving(step, moving), both_x) + step + home)


def check_lines(rows: Sequence[dict]) -> list[str]:
    """The printed checks of an emulated run's result rows (empty: nothing to check)."""
    ok = [r for r in rows if r.get("status") == "ok" and r.get("model_ms") not in (None, "")]
    if not ok:
        return []
    lines = ["emulator checks (device time; docs/emulator.md):"]
    busiest = {r["point"]: r.get("busiest_core_pct") for r in ok}
    for point, pct in sorted(busiest.items()):
        if pct in (None, ""):
            continue
        flag = "CPU-LIMITED: not to be trusted" if pct > CPU_LIMITED * 100 else "ok"
        lines.append(f"  point {point}: busiest core {pct:.0f} % while calls were timed ({flag})")
    for r in ok:
        parts = [f"  {r['algo']:7} {r['pass']:6} measured {r['median_ms']:9.2f} ms",
                 f"model {r['model_ms']:9.2f} ({r['vs_model']:.2f}x)"]
        if r.get("analytic_ring_ms") not in (None, ""):
            parts.append(f"textbook ring {r['analytic_ring_ms']:9.2f} "
                         f"({r['median_ms'] / r['analytic_ring_ms']:.2f}x)")
        off = abs(r["vs_model"] - 1) > MODEL_TOLERANCE
        lines.append(", ".join(parts) + ("  <- over 10 % from the model" if off else ""))
    return lines
