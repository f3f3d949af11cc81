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


# The pick file (CPOptions.auto_tune_file, issue 42 item 6): 2 ranks, a learnable sink (whose
# per-rank gradient differed between picks by up to 3.7 in one configuration).
FILE_ALGOS = ("ring", "allgather", "a2a")


def _file_opts(path: str, **changes) -> CPOptions:
    return CPOptions(auto_tune="all", auto_algos=FILE_ALGOS, auto_tune_file=path,
                     **{"timeout_s": 30.0, **changes})


def _sink_step(rank: int, world: int, opts: CPOptions, algo: str = "auto"):
    """One forward + backward with a learnable sink: out, dq, dk, dv and this rank's share of
    the sink's gradient."""
    q, k, v, dout = dc.make_inputs(7, WORLD_ROWS * world, B, HQ, HKV, D)
    ql, kl, vl = (dc.local_part(t, rank, world, True).float().requires_grad_()
                  for t in (q, k, v))
    sink = torch.linspace(-1.0, 1.0, HQ).requires_grad_()
    out = cp_attention(ql, kl, vl, algo=algo, topology="1x2", options=opts,
                       softmax_offset=sink)
    out.backward(dc.local_part(dout, rank, world, True).float())
    return [t.detach() for t in (out, ql.grad, kl.grad, vl.grad, sink.grad)]


def picks_run(rank: int, world: int, path: str, favour: str | None):
    """One launch with the pick file ``path``: the call measures with fake times (``favour``
    fastest; ``None``: all alike, the model's order decides) unless the file holds its pick.
    The picks held after, what was measured, out and gradients, and (``others``) those of
    every other candidate run by name."""
    opts = _file_opts(path)
    real = auto_tune.measure
    measured: list[str] = []

    def fake(run, algo, *args):
        measured.append(algo)
        return 1.0 if favour in (None, algo) else 2.0

    auto_tune.measure = fake
    try:
        bits = _sink_step(rank, world, opts)
    finally:
        auto_tune.measure = real
    report = auto_tune.last_report()
    held = auto_tune.picks()
    others = {a: _sink_step(rank, world, opts, a) for a in FILE_ALGOS
              if a not in held.values()}
    return {"held": held, "measured": measured,
            "report_pick": None if report is None else report.pick,
            "digest": auto_tune.picks_digest(), "bits": bits, "others": others}


def files_disagree(rank: int, world: int, corrupt: str, good: str, other: str,
                   missing: str):
    """Per scenario, what each rank raised: every rank a corrupt file; rank 1's file missing
    (rank 0 reads ``good``); rank 1 reading ``other`` (the same key, another algorithm). No
    measurement may start."""
    real = auto_tune.measure
    measured: list[str] = []

    def fake(run, algo, *args):
        measured.append(algo)
        return 1.0

    auto_tune.measure = fake
    outcomes = []
    try:
        for paths in ((corrupt, corrupt), (good, missing), (good, other)):
            try:
                _sink_step(rank, world, _file_opts(paths[rank]))
                outcomes.append("ran")
            except Exception as exc:  # noqa: BLE001 - the test reads what was raised
                outcomes.append(f"{type(exc).__name__}: {exc}")
    finally:
        auto_tune.measure = real
    return outcomes, measured
