#!/usr/bin/env python3
"""One-shot device check: kernel correctness, then a measured kernel profile for the model.

For the few minutes a GPU is lent (< 8 min on one H100 / H200; usually ~1-2)::

    python scripts/gpu_check.py --out gpu-profile.json            # CUDA, the full grid
    python scripts/gpu_check.py --device cpu --tiny --out p.json   # what the tests run

1. **Correctness** against a float64 reference (``kernels.reference``) for every kernel path we
   ship on the device: ``torch`` (aten flash for fp16 / bf16; aten memory-efficient for fp32),
   ``flash_attn`` when importable; MHA and GQA; causal diagonal tiles and the non-causal
   half-tiles of the load-balanced causal layout (q half x full kv, full q x kv half); out,
   lse, dq, dk, dv. Then ``cp_attention`` at CP size 1 on the device (ring, rmplus, charm;
   causal and not; GQA) through autograd, out / lse / dq / dk / dv against the same reference.
2. **Measurement**: forward and backward time of the default backend on square tiles
   (sequence grid x head dims, batch x seq and heads x dim held constant as in the
   FlashAttention papers' benchmarks) -> the kernel-rate table; the time of a tiny
   ``cp_attention`` call (per-op executor overhead) and of a merge (merge rate).
3. **Profile**: the base profile (``--base``; default ``h100`` on CUDA, ``cpu-testbed`` on CPU)
   with its compute terms replaced by the fitted ones (``tflops``, ``kernel_q_rows`` /
   ``kernel_k_rows``, ``head_dim_factors``, ``bwd_factor``, ``op_overhead_us``,
   ``merge_gbps``), written to ``--out``: ``charm-megatron model --profile FILE`` and
   ``CHARM_MODEL_PROFILE=FILE`` read it. Link rates stay the base's (``charm-megatron topo``
   measures them; ``--calibrate`` fits them from a bench run).

Exit status 1 if any correctness check fails (the profile is still written, marked).
Timings on a shared or loaded machine are noise; the numbers are for the device it ran on.
"""

from __future__ import annotations

import argparse
import math
import os
import statistics
import sys
import tempfile
import time
from dataclasses import replace
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402

# Relative tolerances against float64: max |err| / max |ref| (out, grads); absolute for lse.
TOL = {torch.float32: (2e-4, 1e-4), torch.float16: (5e-3, 5e-3), torch.bfloat16: (3e-2, 3e-2)}


# ------------------------------------------------------------------------------ correctness
def _rel(a: torch.Tensor, ref: torch.Tensor) -> float:
    return float((a.double() - ref).abs().max() / ref.abs().max().clamp(min=1e-30))


def _abs(a: torch.Tensor, ref: torch.Tensor) -> float:
    return float((a.double() - ref).abs().max())


def _rand(shape, dtype, dev, gen):
    return torch.randn(shape, generator=gen, dtype=torch.float32).to(dev, dtype)


def kernel_cases(device: str, tiny: bool):
    """(backend, dtype, s_q, s_k, b, hq, hkv, d, causal) for every path shipped on ``device``."""
    from charm_megatron.kernels import available_backends

    s = 64 if tiny else 256
    dtypes = [torch.float32, torch.bfloat16]
    if device == "cuda":
        dtypes = [torch.float16, torch.bfloat16, torch.float32]  # flash x2, efficient
    dims = [32] if tiny else ([64, 128] if device == "cpu" else [64, 128, 192])
    from charm_megatron.kernels.registry import why_not

    cases = []
    for backend in available_backends(device):
        if backend == "reference":
            continue
        for dt in dtypes:
            if why_not(backend, device, dt) is not None:
                continue  # e.g. flash_attn and cudnn take fp16 / bf16 only
            for d in dims:
                for hq, hkv in ((4, 4), (4, 2)):
                    cases.append((backend, dt, s, s, 2, hq, hkv, d, True))  # diagonal tile
                    cases.append((backend, dt, s // 2, s, 2, hq, hkv, d, False))  # q half
                    cases.append((backend, dt, s, s // 2, 2, hq, hkv, d, False))  # kv half
    return cases


def check_kernel(case, device: str, gen) -> dict:
    from charm_megatron.kernels import get_backend
    from charm_megatron.kernels.reference import ReferenceBackend

    backend, dt, sq, sk, b, hq, hkv, d, causal = case
    be = get_backend(device, dt, name=backend)
    ref = ReferenceBackend(torch.float64)
    q = _rand((sq, b, hq, d), dt, device, gen)
    k = _rand((sk, b, hkv, d), dt, device, gen)
    v = _rand((sk, b, hkv, d), dt, device, gen)
    dout = _rand((sq, b, hq, d), dt, device, gen)
    scale = 1.0 / math.sqrt(d)
    q64, k64, v64, do64 = (x.double() for x in (q, k, v, dout))
    o_ref, l_ref = ref.forward(q64, k64, v64, causal, scale)
    g_ref = ref.backward(do64, q64, k64, v64, o_ref, l_ref, causal, scale)
    out, lse = be.forward(q, k, v, causal, scale)
    grads = be.backward(dout, q, k, v, out, lse, causal, scale)
    rel_tol, lse_tol = TOL[dt]
    errs = {"out": _rel(out, o_ref), "lse": _abs(lse, l_ref)}
    for name, g, gr in zip(("dq", "dk", "dv"), grads, g_ref):
        errs[name] = _rel(g, gr)
    ok = all(errs[n] <= rel_tol for n in ("out", "dq", "dk", "dv")) and errs["lse"] <= lse_tol
    return {"check": "kernel", "backend": backend, "dtype": str(dt).split(".")[-1],
            "sq": sq, "sk": sk, "heads": f"{hq}/{hkv}", "d": d, "causal": causal,
            "errors": {n: float(f"{e:.3g}") for n, e in errs.items()}, "ok": ok}


def _init_single_process(device: str) -> None:
    import torch.distributed as dist

    if dist.is_initialized():
        return
    store = dist.FileStore(os.path.join(tempfile.mkdtemp(prefix="gpu-check-"), "store"), 1)
    dist.init_process_group("nccl" if device == "cuda" else "gloo", store=store, rank=0,
                            world_size=1)


def cp_cases(device: str, tiny: bool):
    dt = torch.bfloat16 if device == "cuda" else torch.float32
    s = 64 if tiny else 512
    out = []
    for algo in ("ring", "rmplus", "charm"):
        for causal in (True, False):
            for hq, hkv in ((4, 4), (4, 2)):
                out.append((algo, dt, s, 2, hq, hkv, 32 if tiny else 128, causal))
    return out


def check_cp(case, device: str, gen) -> dict:
    from charm_megatron import cp_attention
    from charm_megatron.kernels.reference import ReferenceBackend

    algo, dt, s, b, hq, hkv, d, causal = case
    q = _rand((s, b, hq, d), dt, device, gen).requires_grad_()
    k = _rand((s, b, hkv, d), dt, device, gen).requires_grad_()
    v = _rand((s, b, hkv, d), dt, device, gen).requires_grad_()
    dout = _rand((s, b, hq, d), dt, device, gen)
    out, lse = cp_attention(q, k, v, algo=algo, causal=causal, return_lse=True,
                            topology="flat" if algo == "charm" else None)
    out.backward(dout)
    ref = ReferenceBackend(torch.float64)
    scale = 1.0 / math.sqrt(d)
    q64, k64, v64, do64 = (x.detach().double() for x in (q, k, v, dout))
    o_ref, l_ref = ref.forward(q64, k64, v64, causal, scale)
    g_ref = ref.backward(do64, q64, k64, v64, o_ref, l_ref, causal, scale)
    rel_tol, lse_tol = TOL[dt]
    errs = {"out": _rel(out.detach(), o_ref), "lse": _abs(lse.detach(), l_ref)}
    for name, t, gr in zip(("dq", "dk", "dv"), (q, k, v), g_ref):
        errs[name] = _rel(t.grad, gr)
    ok = all(errs[n] <= rel_tol for n in ("out", "dq", "dk", "dv")) and errs["lse"] <= lse_tol
    return {"check": "cp_attention", "algo": algo, "dtype": str(dt).split(".")[-1], "s": s,
            "heads": f"{hq}/{hkv}", "d": d, "causal": causal,
            "errors": {n: float(f"{e:.3g}") for n, e in errs.items()}, "ok": ok}


def _guarded(check, case, device: str, gen) -> dict:
    """A check that raises is a failed check with its message (a one-shot run must report
    every path, not stop at the first unsupported one)."""
    try:
        return check(case, device, gen)
    except Exception as exc:  # noqa: BLE001 - recorded and reported as FAIL
        if check is check_merge:
            info = _merge_info(case)
        else:
            names = ("backend", "dtype", "sq", "sk", "b", "hq", "hkv", "d", "causal") \
                if check is check_kernel else ("algo", "dtype", "s", "b", "hq", "hkv", "d",
                                               "causal")
            info = dict(zip(names, case))
            info["heads"] = f"{info.pop('hq')}/{info.pop('hkv')}"
            info["check"] = "kernel" if check is check_kernel else "cp_attention"
            info["dtype"] = str(info["dtype"]).split(".")[-1]
        return {**info, "errors": {}, "ok": False, "exception": f"{type(exc).__name__}: {exc}"}


# ------------------------------------------------------------------------------ measurement
def _timer(device: str):
    if device == "cuda":
        def timed(fn, reps):
            fn()
            torch.cuda.synchronize()
            ts = []
            for _ in range(reps):
                a, z = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                a.record()
                fn()
                z.record()
                torch.cuda.synchronize()
                ts.append(a.elapsed_time(z) * 1e-3)
            return statistics.median(ts)
    else:
        def timed(fn, reps):
            fn()
            ts = []
            for _ in range(reps):
                t0 = time.perf_counter()
                fn()
                ts.append(time.perf_counter() - t0)
            return statistics.median(ts)
    return timed


def kernel_table(device: str, tiny: bool, gen, name: str | None = None,
                 short: bool = False) -> list[dict]:
    """Forward / backward TFLOP/s of backend ``name`` (``None``: the automatic choice) on
    square tiles; ``short``: two tile lengths per head dim (the other backends' rates)."""
    from charm_megatron.kernels import get_backend

    dt = torch.bfloat16 if device == "cuda" else torch.float32
    if tiny:
        seqs, dims, tokens, hidden, reps = (64, 128, 256), (32, 64), 512, 128, 3
    elif device == "cuda":
        seqs, dims, tokens, hidden, reps = (512, 1024, 2048, 4096, 8192, 16384), (64, 128, 256), \
            16384, 2048, 10
    else:
        seqs, dims, tokens, hidden, reps = (256, 512, 1024, 2048), (64, 128), 4096, 512, 3
    if short:
        seqs = (seqs[len(seqs) // 2], seqs[-1])
        dims = (*dims, 192) if device == "cuda" else dims
    be = get_backend(device, dt, name=name)
    timed = _timer(device)
    rows = []
    for d in dims:
        h = max(1, hidden // d)
        for L in seqs:
            b = max(1, tokens // L)
            try:
                rows.append(_kernel_row(be, timed, device, dt, gen, L, b, h, d, reps))
            except Exception as exc:  # noqa: BLE001 - one failed size must not lose the rest
                print(f"FAIL kernel timing seq={L} d={d}: {type(exc).__name__}: {exc}")
    return rows


def _kernel_row(be, timed, device, dt, gen, L, b, h, d, reps) -> dict:
    """Forward / backward time of one square tile, full and causal (the causal tile's own
    rate, counted on its unmasked half, says how well the kernel skips the masked half)."""
    q = _rand((L, b, h, d), dt, device, gen)
    k = _rand((L, b, h, d), dt, device, gen)
    v = _rand((L, b, h, d), dt, device, gen)
    scale = 1.0 / math.sqrt(d)
    row = {"seq": L, "d": d, "batch": b, "heads": h}
    flops = 4.0 * b * h * d * L * L
    for causal, tag in ((False, ""), (True, "causal_")):
        out, lse = be.forward(q, k, v, causal, scale)
        dout = torch.randn_like(out)
        args = (q, k, v, causal, scale)
        bargs = (dout, q, k, v, out, lse, causal, scale)
        t_f = timed(lambda a=args: be.forward(*a), reps)
        t_b = timed(lambda a=bargs: be.backward(*a), reps)
        work = flops / 2 if causal else flops
        row.update({f"{tag}fwd_ms": t_f * 1e3, f"{tag}bwd_ms": t_b * 1e3,
                    f"{tag}fwd_tflops": work / t_f / 1e12,
                    f"{tag}bwd_tflops": 2.5 * work / t_b / 1e12})
    return row


def overheads(device: str, tiny: bool, gen) -> dict:
    """Costs besides the attention kernel. ``call_overhead_us``: a whole tiny ``cp_attention``
    forward at CP size 1 (one tile; the device idles, so this is the host's cost per call).
    ``op_overhead_us``: a tiny tile issued back to back through the backend, per tile (the
    cost of one compute op when the host, not the device, is the bottleneck; the profile's
    per-op term). ``merge_gbps``: bytes of partial merged per second by ``merge_into`` on a
    kernel-shaped (permuted) partial, fused on CUDA with Triton; ``merge_unfused_gbps``: the
    PyTorch-ops path on the same tensors."""
    from charm_megatron import cp_attention
    from charm_megatron.kernels import get_backend, merge_fused
    from charm_megatron.kernels.merge import merge_into, merge_into_unfused

    dt = torch.bfloat16 if device == "cuda" else torch.float32
    timed = _timer(device)
    q = _rand((16, 1, 1, 32), dt, device, gen)
    call_s = timed(lambda: cp_attention(q, q, q, algo="ring", causal=False), 20)
    be = get_backend(device, dt)
    tile = _rand((64, 1, 2, 64), dt, device, gen)
    n_tiles = 20 if tiny else 400
    be.forward(tile, tile, tile, False, 0.125)
    _sync(device)
    t0 = time.perf_counter()
    for _ in range(n_tiles):
        be.forward(tile, tile, tile, False, 0.125)
    _sync(device)
    op_s = (time.perf_counter() - t0) / n_tiles
    L, b, h, d = (256, 1, 4, 64) if tiny else (4096, 4, 16, 128)
    acc = torch.zeros((L, b, h, d), dtype=torch.float32, device=device)
    acc_lse = torch.full((L, b, h), -1.0, dtype=torch.float32, device=device)
    # As the kernels return them: [b, h, s, d] storage seen as [s, b, h, d].
    part = _rand((b, h, L, d), dt, device, gen).permute(2, 0, 1, 3)
    plse = torch.zeros((b, h, L), dtype=torch.float32, device=device).permute(2, 0, 1)
    merge_s = timed(lambda: merge_into(acc, acc_lse, part, plse), 5)
    unfused_s = timed(lambda: merge_into_unfused(acc, acc_lse, part, plse), 5)
    partial_bytes = L * b * h * (d * part.element_size() + 4)
    return {"call_overhead_us": call_s * 1e6, "op_overhead_us": op_s * 1e6,
            "merge_gbps": partial_bytes / merge_s / 1e9,
            "merge_unfused_gbps": partial_bytes / unfused_s / 1e9,
            "merge_path": "fused" if merge_fused.usable(acc, acc_lse, part) else "torch"}


def _sync(device: str) -> None:
    if device == "cuda":
        torch.cuda.synchronize()


def merge_cases(device: str, tiny: bool):
    """(dtype of the partial, rows, batch, heads, head dim) for the merge check."""
    dts = [torch.bfloat16, torch.float16, torch.float32] if device == "cuda" \
        else [torch.bfloat16, torch.float32]
    dims = (40, 64) if tiny else (40, 64, 128, 192)
    return [(dt, 33, 2, 3, d) for dt in dts for d in dims]


def _merge_info(case) -> dict:
    """What a merge check's report says of its case."""
    dt, r, b, h, d = case
    return {"check": "merge", "backend": "merge", "dtype": str(dt).split(".")[-1], "sq": r,
            "sk": r, "heads": f"{h}/{h}", "d": d, "causal": False}


def check_merge(case, device: str, gen) -> dict:
    """``merge_into`` on the device (fused where it can be) against a float64 merge of the
    same numbers, with rows no key reached yet on either side or both."""
    from charm_megatron.kernels.merge import merge_into, merge_into_unfused

    dt, r, b, h, d = case
    acc = _rand((r, b, h, d), torch.float32, device, gen)
    acc_lse = _rand((r, b, h), torch.float32, device, gen)
    acc[0], acc_lse[0] = 0.0, float("-inf")
    part = _rand((b, h, r, d), dt, device, gen).permute(2, 0, 1, 3)
    plse = _rand((b, h, r), torch.float32, device, gen)
    plse[:, :, 0:2] = float("-inf")
    plse = plse.permute(2, 0, 1)
    ref_o, ref_l = acc.double().cpu(), acc_lse.double().cpu()
    merge_into_unfused(ref_o, ref_l, part.double().cpu(), plse.double().cpu())
    merge_into(acc, acc_lse, part, plse)
    out_err = _rel(acc.cpu(), ref_o)
    finite = ref_l.isfinite()
    lse_err = float((acc_lse.cpu().double() - ref_l)[finite].abs().max())
    same_inf = bool(torch.equal(acc_lse.cpu().isinf(), ref_l.isinf()))
    ok = out_err <= 1e-5 and lse_err <= 1e-5 and same_inf and not acc.isnan().any()
    return {**_merge_info(case),
            "errors": {"out": float(f"{out_err:.3g}"), "lse": float(f"{lse_err:.3g}")},
            "ok": ok}


def fit_terms(table: list[dict]) -> tuple[dict[str, object], int]:
    """The kernel curve's cluster terms (``tflops``, rows, head-dim factors, backward factor)
    fitted on a kernel table, and the head dim its rate is quoted at."""
    from charm_megatron.lab.calibration.refit import fit_kernel_curve

    dims = sorted({r["d"] for r in table})
    ref_d = 128 if 128 in dims else dims[-1]
    fitted = {}
    for d in dims:
        curve = {r["seq"]: r["fwd_tflops"] for r in table if r["d"] == d}
        fitted[d] = fit_kernel_curve(curve)
    tflops, rows = fitted[ref_d]
    factors = tuple((float(d), float(f"{fitted[d][0] / tflops:.4g}")) for d in dims)
    bwd = statistics.median(r["bwd_ms"] / r["fwd_ms"] for r in table)
    return {"tflops": _r4(tflops), "kernel_q_rows": _r4(rows), "kernel_k_rows": _r4(rows),
            "head_dim_factors": factors, "bwd_factor": _r4(bwd)}, ref_d


def _r4(x: float) -> float:
    return float(f"{x:.4g}")


def measured_curves(per_backend: dict[str, list[dict]], device_name: str) -> tuple:
    """A measured :class:`~charm_megatron.model.kernel_rates.KernelRates` per backend whose
    short table has rows (what a profile's ``kernels`` carries; issue 38)."""
    from charm_megatron.model.kernel_rates import KernelRates

    out = []
    for name, table in sorted(per_backend.items()):
        if not table:
            continue
        terms, ref_d = fit_terms(table)
        out.append(KernelRates(name, "measured", f"measured by scripts/gpu_check.py on "
                               f"{device_name} (short grid, head dim {ref_d} rate)", **terms))
    return tuple(out)


def fit_profile(table: list[dict], over: dict, base_name: str, device_name: str):
    from charm_megatron.model import get_profile

    terms, ref_d = fit_terms(table)
    base = get_profile(base_name)
    cl = replace(base.cluster, **terms, op_overhead_us=_r4(over["op_overhead_us"]),
                 merge_gbps=_r4(over["merge_gbps"]))
    return base, cl, {"ref_head_dim": ref_d, "kernel_table": table, "overheads": over,
                      "device": device_name}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--device", default="cuda", choices=("cuda", "cpu"))
    ap.add_argument("--tiny", action="store_true", help="small grid (tests, CPU)")
    ap.add_argument("--base", default=None, help="profile whose links to keep (default: h100 "
                    "on CUDA, cpu-testbed on CPU)")
    ap.add_argument("--name", default=None, help="name of the written profile")
    ap.add_argument("--out", default="gpu-profile.json", help="profile file to write")
    ap.add_argument("--skip-measure", action="store_true", help="correctness checks only")
    args = ap.parse_args(argv)
    if args.device == "cuda" and not torch.cuda.is_available():
        raise SystemExit("gpu_check: --device cuda but torch.cuda.is_available() is False "
                         "(use --device cpu to try the script without a GPU)")
    if args.device == "cpu":
        torch.set_num_threads(1)  # a CPU profile's rate is per core (a shared pool of cores)
    t0 = time.perf_counter()
    gen = torch.Generator().manual_seed(1234)
    dev_name = torch.cuda.get_device_name(0) if args.device == "cuda" else "cpu"
    print(f"# gpu_check on {dev_name} (torch {torch.__version__})")
    results = [_guarded(check_kernel, case, args.device, gen)
               for case in kernel_cases(args.device, args.tiny)]
    _init_single_process(args.device)
    results += [_guarded(check_cp, case, args.device, gen)
                for case in cp_cases(args.device, args.tiny)]
    results += [_guarded(check_merge, case, args.device, gen)
                for case in merge_cases(args.device, args.tiny)]
    for r in results:
        what = r.get("backend") or r.get("algo")
        shape = (f"sq={r['sq']} sk={r['sk']}" if "sq" in r else f"s={r['s']}")
        errs = " ".join(f"{n} {e:.2g}" for n, e in r["errors"].items()) or r.get("exception")
        print(f"{'ok  ' if r['ok'] else 'FAIL'} {r['check']:12} {what:10} {r['dtype']:8} "
              f"{shape:14} heads {r['heads']:4} d={r['d']:<3} causal={r['causal']!s:5} {errs}")
    failed = [r for r in results if not r["ok"]]
    print(f"# correctness: {len(results) - len(failed)}/{len(results)} ok "
          f"({time.perf_counter() - t0:.0f} s)")
    if args.skip_measure:
        return 1 if failed else 0
    table = kernel_table(args.device, args.tiny, gen)
    for r in table:
        print(f"kernel seq={r['seq']:<6} d={r['d']:<3} b={r['batch']:<3} h={r['heads']:<3} "
              f"fwd {r['fwd_ms']:8.3f} ms {r['fwd_tflops']:8.3f} TFLOP/s   bwd "
              f"{r['bwd_ms']:8.3f} ms {r['bwd_tflops']:8.3f} TFLOP/s   causal fwd "
              f"{r['causal_fwd_tflops']:8.3f} bwd {r['causal_bwd_tflops']:8.3f} TFLOP/s")
    if not table:
        print("# no kernel timing succeeded: no profile written")
        return 1
    over = overheads(args.device, args.tiny, gen)
    print(f"# per call {over['call_overhead_us']:.1f} us, per op {over['op_overhead_us']:.1f} us, "
          f"merge {over['merge_gbps']:.2f} GB/s ({over['merge_path']}; PyTorch ops "
          f"{over['merge_unfused_gbps']:.2f} GB/s)")
    # Every other backend that passed its checks: its rates on a short grid, beside the
    # automatic choice's (a profile carries a rate per kernel backend; issue 38).
    per_backend = {}
    for name in sorted({r["backend"] for r in results if r.get("check") == "kernel"}):
        if any(r.get("backend") == name and not r["ok"] for r in results):
            continue
        per_backend[name] = kernel_table(args.device, args.tiny, gen, name, short=True)
        for r in per_backend[name]:
            print(f"kernel {name:10} seq={r['seq']:<6} d={r['d']:<3} fwd "
                  f"{r['fwd_tflops']:8.3f} bwd {r['bwd_tflops']:8.3f} TFLOP/s")
    from charm_megatron.kernels.selection import choices

    picked = [{"key": [str(x) for x in c.key[1:]], "picked": c.picked,
               "seconds": dict(c.seconds), "refused": dict(c.refused)} for c in choices()]
    for c in picked:
        print(f"# automatic choice {c['key']}: {c['picked']} {c['seconds']} "
              f"refused {c['refused'] or 'none'}")
    base_name = args.base or ("h100" if args.device == "cuda" else "cpu-testbed")
    base, cl, fit = fit_profile(table, over, base_name, dev_name)
    from charm_megatron.devices import save_profile
    from charm_megatron.model.cluster import Profile

    fit.update(method="scripts/gpu_check.py", checks_ok=not failed,
               kernel_rates_by_backend=per_backend, kernel_choices=picked,
               checks=[r for r in results if not r["ok"]] or f"{len(results)} ok")
    name = args.name or f"{base.name}-measured"
    # Every backend measured here gets a measured curve; the base's curves of the others
    # (assumed ones, e.g. FlashAttention-3 where it does not import) are kept as they were.
    measured = measured_curves(per_backend, dev_name)
    done = {k.name for k in measured}
    kernels = measured + tuple(k for k in base.kernels if k.name not in done)
    own = {c["picked"] for c in picked} if picked else set()
    prof = Profile(name, cl, base.topology,
                   f"compute terms measured by scripts/gpu_check.py on {dev_name}; links from "
                   f"profile {base.name}", fit, kernel=own.pop() if len(own) == 1 else "",
                   kernels=kernels)
    save_profile(prof, args.out)
    print(f"# wrote {args.out}: {cl.describe()}")
    print(f"# total {time.perf_counter() - t0:.0f} s")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
