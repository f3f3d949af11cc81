"""Rank functions for the measured-auto tests (module level so the forkserver can pickle them)."""

from __future__ import annotations

import torch

import dist_cases as dc
from charm_megatron import cp_attention
from charm_megatron.ops import auto_tune
from charm_megatron.ops.agreement import CPMismatchError
from charm_megatron.ops.attention import resolve_algo
from charm_megatron.ops.options import CPOptions

WORLD_ROWS, B, HQ, HKV, D = 8, 2, 4, 2, 16
ALGOS = ("ring", "charm", "allgather")


def _step(rank: int, world: int, opts: CPOptions, tag: str | None = None):
    """One auto forward + backward against float64: the max relative error over out, lse,
    dq, dk, dv."""
    q, k, v, dout = dc.make_inputs(5, WORLD_ROWS * world, B, HQ, HKV, D)
    ref = dc.reference(q, k, v, dout, True, D ** -0.5)
    ql, kl, vl = (dc.local_part(t, rank, world, True).float().requires_grad_()
                  for t in (q, k, v))
    out, lse = cp_attention(ql, kl, vl, algo="auto", topology="2x2", options=opts, tag=tag,
                            return_lse=True)
    out.backward(dc.local_part(dout, rank, world, True).float())
    want = dc.local_reference(ref, rank, world, True)
    got = [out, lse, ql.grad, kl.grad, vl.grad]
    return max(dc.rel_err(g, w) for g, w in zip(got, want))


def measured_pick(rank: int, world: int):
    """The model's favourite made slow on rank 1 only and another candidate failing on rank
    2 only: every rank must pick the remaining one (the slowest rank decides), run it
    correctly, keep it without measuring again, and report it through resolve_algo."""
    opts = CPOptions(auto_tune="all", auto_algos=ALGOS)
    meta = torch.empty(WORLD_ROWS, B, HQ, D, device="meta")
    meta_kv = torch.empty(WORLD_ROWS, B, HKV, D, device="meta")
    model_pick = resolve_algo(meta, meta_kv, algo="auto", topology="2x2", options=opts)
    real = auto_tune.measure
    measured: list[str] = []
    failing = next(a for a in ALGOS if a != model_pick)

    def fake(run, algo, *args):
        measured.append(algo)
        seconds = real(run, algo, *args)  # the real calls, real communication
        if rank == 1 and algo == model_pick:
            return seconds + 30.0
        if rank == 2 and algo == failing:
            raise RuntimeError("injected: this candidate fails on rank 2")
        return seconds

    auto_tune.measure = fake
    try:
        err1 = _step(rank, world, opts, tag="layer 1")
        first = list(measured)
        err2 = _step(rank, world, opts, tag="layer 2")  # another layer, same shape
    finally:
        auto_tune.measure = real
    report = auto_tune.last_report()
    picked = resolve_algo(meta, meta_kv, algo="auto", topology="2x2", options=opts)
    return {"model": model_pick, "failing": failing, "pick": report.pick,
            "resolved": picked, "measured_first": first, "measured_total": len(measured),
            "seconds": report.seconds, "shortlist": report.shortlist, "errors": (err1, err2)}


def lost_picks(rank: int, world: int):
    """A rank that lost its picks (as a restarted one would) meets a named mismatch on every
    rank instead of running another plan; after every rank forgets, auto measures again."""
    opts = CPOptions(auto_tune="all", auto_algos=ALGOS)
    _step(rank, world, opts)
    if rank == 0:
        auto_tune.forget()
    try:
        _step(rank, world, opts)
        outcome = "ran"
    except CPMismatchError as exc:
        outcome = str(exc)
    auto_tune.forget()
    err = _step(rank, world, opts)
    return outcome, err, auto_tune.last_report() is not None


def peer_stalls_while_measuring(rank: int, world: int):
    """Rank 1 stops responding after measuring its candidates (before the times are shared):
    the others must get an error within their bound (timeout_s), not hang."""
    import time

    from dist_failure_cases import stay_absent_until_the_others_are_done, the_others_are_done

    real = auto_tune.measure
    seen: list[str] = []

    def measure(run, algo, *args):
        seconds = real(run, algo, *args)
        seen.append(algo)
        if rank == 1 and len(seen) == len(ALGOS):
            stay_absent_until_the_others_are_done(30)  # alive, silent: the worst case
            raise SystemExit(0)
        return seconds

    auto_tune.measure = measure
    t0 = time.monotonic()
    try:
        _step(rank, world, CPOptions(auto_tune="all", auto_algos=ALGOS, timeout_s=3.0))
        outcome = "no error"
    except SystemExit:
        return None
    except Exception as exc:  # noqa: BLE001 - the type is checked by the test
        outcome = type(exc).__name__
    finally:
        auto_tune.measure = real
        if rank != 1:
            the_others_are_done()
    return outcome, time.monotonic() - t0
