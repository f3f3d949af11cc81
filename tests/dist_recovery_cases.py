"""Rank functions for tests/test_cp_recovery.py (issue 27): a rank-local error on one rank only,
a rank that skips a call or pauses past the timeout, and float64 packed calls.

Module level so that the forkserver can pickle them. Every call passes a short explicit timeout.
"""

from __future__ import annotations

import time

import torch
from dist_failure_cases import one_call

import packed_cases
from charm_megatron import cp_attention
from charm_megatron.ops.agreement import CPAttentionError
from charm_megatron.ops.options import CPOptions

TIMEOUT_S = 3.0


def _opts(**kw) -> CPOptions:
    return CPOptions(timeout_s=TIMEOUT_S, **kw)


def _packed_call(rank: int, world: int, algo: str, topology, seed: int, **kw):
    """One packed forward+backward; its max error vs the float64 reference (1.0 when padding
    rows were not left zero)."""
    errs, zero, _ = packed_cases.one_case(rank, world, algo, topology, True, "fp32", 2,
                                          "unequal", seed=seed, options=kw.pop("options",
                                                                             _opts()), **kw)
    return max(*errs.values(), 0.0 if zero else 1.0)


def _call(rank: int, world: int, algo: str, topology, packed: bool, seed: int) -> float:
    if packed:
        return _packed_call(rank, world, algo, topology, seed)
    return one_call(rank, world, algo, topology, seed=seed, options=_opts())


def _outcome(fn) -> tuple[str, str, float]:
    """(``"ok"`` and the error vs float64, or the exception's type and text; seconds)."""
    t0 = time.monotonic()
    try:
        err = fn()
    except Exception as exc:  # noqa: BLE001 - the type is part of what the test checks
        return type(exc).__name__, str(exc), time.monotonic() - t0
    return "ok", repr(err), time.monotonic() - t0


def local_error_on_one_rank(rank: int, world: int, algo: str, topology, packed: bool,
                            what: str):
    """The last rank alone passes a bad ``what`` (``algo`` or ``options``); then every rank
    makes two ordinary calls. Returns the three outcomes."""
    bad = rank == world - 1
    s = 4 * 2 * world
    g = torch.Generator().manual_seed(rank)
    kw: dict = {"algo": "bogus" if bad and what == "algo" else algo, "topology": topology,
                "options": "x" if bad and what == "options" else _opts()}
    if packed:
        q = torch.randn(s // world, 4, 8, generator=g).requires_grad_()
        k, v = (torch.randn(s // world, 2, 8, generator=g) for _ in range(2))
        kw["cu_seqlens"] = torch.tensor([0, s // 2, s], dtype=torch.int32)
    else:
        q = torch.randn(s // world, 1, 4, 8, generator=g).requires_grad_()
        k, v = (torch.randn(s // world, 1, 2, 8, generator=g) for _ in range(2))
    first = _outcome(lambda: cp_attention(q, k, v, **kw).sum().backward())
    rest = [_outcome(lambda seed=seed: _call(rank, world, algo, topology, packed, seed))
            for seed in (21, 22)]
    return [first, *rest]


def skipped_call(rank: int, world: int, algo: str, topology, packed: bool, pause_s: float,
                 calls: int, same_inputs: bool = False):
    """Every rank makes a call; then rank 1 sleeps ``pause_s`` instead of making the next one,
    which the others make (it times out); then every rank makes ``calls`` more (each with its
    own inputs, or all with the same ones). Returns the others' timed-out outcome (None on
    rank 1) and the outcomes of the calls after."""
    first = _call(rank, world, algo, topology, packed, 20)
    assert first < 1e-5, first
    if rank == 1:
        time.sleep(pause_s)
        skipped = None
    else:
        skipped = _outcome(lambda: _call(rank, world, algo, topology, packed, 30))
    seeds = [31] * calls if same_inputs else range(31, 31 + calls)
    after = [_outcome(lambda seed=seed: _call(rank, world, algo, topology, packed, seed))
             for seed in seeds]
    return skipped, after


def float64_both_layouts(rank: int, world: int, algo: str, topology):
    """float64 inputs through the packed and the sbhd path: max error vs float64 of each and
    the lse dtypes."""
    errs, zero, got = packed_cases.one_case(rank, world, algo, topology, True, "fp64", 2,
                                            "unequal" if world > 1 else "odd",
                                            options=_opts())
    packed_err = max(*errs.values(), 0.0 if zero else 1.0)
    sbhd_err = one_call(rank, world, algo, topology, dtype=torch.float64, options=_opts())
    return packed_err, sbhd_err, str(got[1].dtype)


__all__ = ["CPAttentionError", "float64_both_layouts", "local_error_on_one_rank",
           "skipped_call"]
