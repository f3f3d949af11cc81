#!/usr/bin/env python3
"""What one GPU can tell about costs that are not the attention kernel (a companion of
``scripts/gpu_check.py``, for the few minutes a GPU is lent)::

    python scripts/gpu_overheads.py --out overheads.json          # CUDA
    python scripts/gpu_overheads.py --device cpu --tiny            # smoke run (no contention)

1. **Host cost of a call**: ``cp_attention`` at CP size 1 on a tiny problem (the device idles,
   so the time is the host's: plan, executor, agreement check), forward and forward +
   backward, with ``check="every_call"`` and ``check="off"``.
   (The per-op floor, a tiny tile issued back to back, is ``gpu_check.py``'s
   ``op_overhead_us``.)
2. **Executor efficiency at CP 1**: ``cp_attention`` on a real-sized causal problem against
   the bare kernel on the same tensors (the executor's own cost on real work).
3. **SM contention** (CUDA with Triton only): attention forward and backward timed alone and
   while a persistent copy kernel of ``k`` thread blocks runs on another stream, for several
   ``k``. The copy kernel stands in for NCCL's point-to-point kernels, which move data with a
   few SMs (one block per channel); it reads and writes local memory (NVLink traffic reads
   locally and writes remotely), so its memory pressure is an upper bound for the same
   block count. Also the copy rate ``k`` blocks reach alone.

Prints a table and writes the numbers as JSON. Timings are for the device it ran on.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402


def _sync(device: str) -> None:
    if device == "cuda":
        torch.cuda.synchronize()


def wall_per_call(fn, device: str, reps: int) -> float:
    """Median seconds of ``fn`` with the device drained after each call."""
    fn()
    _sync(device)
    ts = []
    for _ in range(reps):
        t0 = time.perf_counter()
        fn()
        _sync(device)
        ts.append(time.perf_counter() - t0)
    return statistics.median(ts)


def host_costs(device: str, tiny: bool) -> dict:
    from charm_megatron import CPOptions, cp_attention

    dt = torch.bfloat16 if device == "cuda" else torch.float32
    reps = 10 if tiny else 50
    q = torch.randn(16, 1, 2, 64, device=device, dtype=dt, requires_grad=True)
    out = {}
    for check in ("every_call", "off"):
        opts = CPOptions(check=check)

        def fwd(o=opts):
            with torch.no_grad():
                cp_attention(q, q, q, algo="ring", causal=True, options=o)

        def fwd_bwd(o=opts):
            cp_attention(q, q, q, algo="ring", causal=True, options=o).sum().backward()

        out[f"call_fwd_us[{check}]"] = wall_per_call(fwd, device, reps) * 1e6
        out[f"call_fwd_bwd_us[{check}]"] = wall_per_call(fwd_bwd, device, reps) * 1e6
    return out


def executor_efficiency(device: str, tiny: bool) -> dict:
    from charm_megatron import cp_attention
    from charm_megatron.kernels import get_backend

    dt = torch.bfloat16 if device == "cuda" else torch.float32
    s, b, h, d = (256, 1, 2, 32) if tiny else (8192, 1, 32, 128)
    reps = 3 if tiny else 10
    q = torch.randn(s, b, h, d, device=device, dtype=dt, requires_grad=True)
    k = torch.randn(s, b, h, d, device=device, dtype=dt, requires_grad=True)
    v = torch.randn(s, b, h, d, device=device, dtype=dt, requires_grad=True)
    dout = torch.randn(s, b, h, d, device=device, dtype=dt)
    be = get_backend(device, dt)
    scale = 1.0 / math.sqrt(d)

    def kernel_pair():
        o, lse = be.forward(q.detach(), k.detach(), v.detach(), True, scale)
        be.backward(dout, q.detach(), k.detach(), v.detach(), o, lse, True, scale)

    def call_pair():
        cp_attention(q, k, v, algo="ring", causal=True).backward(dout)

    from charm_megatron.kernels import merge_fused

    t_k = wall_per_call(kernel_pair, device, reps)
    t_c = wall_per_call(call_pair, device, reps)
    usable = merge_fused.usable
    merge_fused.usable = lambda *a: False  # the same call with the PyTorch-ops merge
    try:
        t_u = wall_per_call(call_pair, device, reps)
    finally:
        merge_fused.usable = usable
    return {"shape": f"s={s} b={b} h={h} d={d} causal", "kernel_fwd_bwd_ms": t_k * 1e3,
            "cp_attention_fwd_bwd_ms": t_c * 1e3, "call_over_kernel": t_c / t_k,
            "cp_attention_unfused_merge_ms": t_u * 1e3}


def device_trace(device: str, tiny: bool) -> str:
    """torch.profiler over a real-sized forward + backward at CP size 1: each op's device time
    and the host's runtime calls (a stream or device synchronize there means the host cannot
    run ahead of the device)."""
    from torch.profiler import ProfilerActivity, profile

    from charm_megatron import cp_attention

    dt = torch.bfloat16 if device == "cuda" else torch.float32
    s, b, h, d = (256, 1, 2, 32) if tiny else (8192, 1, 32, 128)
    q, k, v = (torch.randn(s, b, h, d, device=device, dtype=dt, requires_grad=True)
               for _ in range(3))
    dout = torch.randn(s, b, h, d, device=device, dtype=dt)

    def step():
        cp_attention(q, k, v, algo="ring", causal=True).backward(dout)

    for _ in range(3):
        step()
    _sync(device)
    acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device == "cuda" else [])
    with profile(activities=acts) as prof:
        for _ in range(3):
            step()
        _sync(device)
    ka = prof.key_averages()
    key = "self_device_time_total" if device == "cuda" else "self_cpu_time_total"
    try:
        text = ka.table(sort_by=key, row_limit=30)
    except Exception:  # noqa: BLE001 - older profilers name it cuda
        text = ka.table(sort_by="self_cuda_time_total", row_limit=30)
    return text + "\n" + ka.table(sort_by="cpu_time_total", row_limit=40)


def host_profile(device: str, tiny: bool) -> str:
    """cProfile of tiny forward + backward calls at CP size 1: where the host's time goes."""
    import cProfile
    import io
    import pstats

    from charm_megatron import cp_attention

    dt = torch.bfloat16 if device == "cuda" else torch.float32
    q = torch.randn(16, 1, 2, 64, device=device, dtype=dt, requires_grad=True)

    def step():
        cp_attention(q, q, q, algo="ring", causal=True).sum().backward()

    for _ in range(3):
        step()
    _sync(device)
    prof = cProfile.Profile()
    prof.enable()
    for _ in range(5 if tiny else 30):
        step()
    _sync(device)
    prof.disable()
    buf = io.StringIO()
    st = pstats.Stats(prof, stream=buf)
    st.sort_stats("tottime").print_stats(25)
    st.sort_stats("cumulative").print_stats(35)
    return buf.getvalue()


# ------------------------------------------------------------------------------ contention
def _copy_kernel():
    import triton
    import triton.language as tl

    @triton.jit
    def persistent_copy(src, dst, n, loops, BLOCK: tl.constexpr):
        pid = tl.program_id(0)
        step = tl.num_programs(0) * BLOCK
        for _ in range(loops):
            for start in range(pid * BLOCK, n, step):
                offs = start + tl.arange(0, BLOCK)
                m = offs < n
                tl.store(dst + offs, tl.load(src + offs, mask=m), mask=m)

    return persistent_copy


def contention(tiny: bool) -> dict:
    kern = _copy_kernel()
    n = 1 << 28  # 1 GiB of fp32 per buffer: far past L2, as a peer's buffers are
    src = torch.randn(n, device="cuda")
    dst = torch.empty_like(src)
    side = torch.cuda.Stream()
    s, b, h, d = 8192, 2, 32, 128
    from charm_megatron.kernels import get_backend

    be = get_backend("cuda", torch.bfloat16)
    q, k, v, dout = (torch.randn(s, b, h, d, device="cuda", dtype=torch.bfloat16)
                     for _ in range(4))
    scale = 1.0 / math.sqrt(d)
    o, lse = be.forward(q, k, v, True, scale)
    reps = 10

    def timed_attn() -> tuple[float, float]:
        ev = [torch.cuda.Event(enable_timing=True) for _ in range(3)]
        ev[0].record()
        for _ in range(reps):
            be.forward(q, k, v, True, scale)
        ev[1].record()
        for _ in range(reps):
            be.backward(dout, q, k, v, o, lse, True, scale)
        ev[2].record()
        torch.cuda.synchronize()
        return ev[0].elapsed_time(ev[1]) / reps, ev[1].elapsed_time(ev[2]) / reps

    def copy_rate(blocks: int, loops: int) -> float:
        kern[(blocks,)](src, dst, n, loops, BLOCK=4096, num_warps=8)
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        kern[(blocks,)](src, dst, n, loops, BLOCK=4096, num_warps=8)
        torch.cuda.synchronize()
        return 2 * 4 * n * loops / (time.perf_counter() - t0) / 1e9  # read + write bytes

    timed_attn()
    alone_f, alone_b = timed_attn()
    rows = []
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    for blocks in (2, 4, 8, 16, 32, 66):
        rate = copy_rate(blocks, 1)
        # Enough loops that the copy outlasts the timed attention (about 2x its time).
        one = 2 * 4 * n / (rate * 1e9)
        loops = max(1, math.ceil(2 * reps * (alone_f + alone_b) * 1e-3 / one))
        torch.cuda.synchronize()
        with torch.cuda.stream(side):
            kern[(blocks,)](src, dst, n, loops, BLOCK=4096, num_warps=8)
        f, bw = timed_attn()  # the attention stream runs while the side kernel copies
        torch.cuda.synchronize()
        rows.append({"copy_blocks": blocks, "sm_fraction": blocks / sms,
                     "copy_alone_gbps": rate, "fwd_ms": f, "bwd_ms": bw,
                     "fwd_slowdown": f / alone_f - 1, "bwd_slowdown": bw / alone_b - 1})
    return {"attention": f"s={s} b={b} h={h} d={d} bf16 causal", "sms": sms,
            "alone_fwd_ms": alone_f, "alone_bwd_ms": alone_b, "rows": rows}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--device", default="cuda", choices=("cuda", "cpu"))
    ap.add_argument("--tiny", action="store_true")
    ap.add_argument("--out", default="gpu-overheads.json")
    ap.add_argument("--skip-contention", action="store_true")
    args = ap.parse_args(argv)
    import torch.distributed as dist

    store = dist.FileStore(os.path.join(tempfile.mkdtemp(prefix="gpu-over-"), "store"), 1)
    dist.init_process_group("nccl" if args.device == "cuda" else "gloo", store=store, rank=0,
                            world_size=1)
    res: dict = {"device": torch.cuda.get_device_name(0) if args.device == "cuda" else "cpu",
                 "torch": torch.__version__}
    for name, fn in (("host", host_costs), ("executor", executor_efficiency)):
        try:
            res[name] = fn(args.device, args.tiny)
        except Exception as exc:  # noqa: BLE001 - report and go on: one lease, every number
            res[name] = {"error": f"{type(exc).__name__}: {exc}"}
        print(name, json.dumps(res[name], indent=None, default=float))
    try:
        text = device_trace(args.device, args.tiny)
        Path(args.out).with_suffix(".trace.txt").write_text(text)
        print(text)
    except Exception as exc:  # noqa: BLE001
        print("device_trace", type(exc).__name__, exc)
    try:
        text = host_profile(args.device, args.tiny)
        Path(args.out).with_suffix(".prof.txt").write_text(text)
        print(text[:6000])
    except Exception as exc:  # noqa: BLE001
        print("host_profile", type(exc).__name__, exc)
    if args.device == "cuda" and not args.skip_contention:
        try:
            res["contention"] = contention(args.tiny)
            c = res["contention"]
            print(f"contention: {c['attention']}, alone fwd {c['alone_fwd_ms']:.3f} ms bwd "
                  f"{c['alone_bwd_ms']:.3f} ms, {c['sms']} SMs")
            for r in c["rows"]:
                print(f"  copy blocks {r['copy_blocks']:3d} ({r['sm_fraction']:.0%} of SMs) "
                      f"alone {r['copy_alone_gbps']:7.0f} GB/s   attention fwd "
                      f"{r['fwd_slowdown']:+.1%} bwd {r['bwd_slowdown']:+.1%}")
        except Exception as exc:  # noqa: BLE001
            res["contention"] = {"error": f"{type(exc).__name__}: {exc}"}
            print("contention", res["contention"])
    Path(args.out).write_text(json.dumps(res, indent=1, default=float))
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
