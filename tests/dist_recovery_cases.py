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
from dist_cases import local_part, local_reference, make_inputs, reference, rel_err

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


def _step(rank: int, world: int, algo: str, topology, seed: int, tag: str | None,
          backward: bool = True) -> float:
    """One call on inputs drawn from ``seed`` (the same full sequence on every rank, each rank
    its own rows): the largest relative error of out, lse, dq, dk, dv against float64 (of out
    and lse only without the backward)."""
    s, b, hq, hkv, d = 4 * world, 1, 4, 2, 8
    q, k, v, dout = make_inputs(seed, s, b, hq, hkv, d)
    ref = reference(q, k, v, dout, True, d ** -0.5)
    ql, kl, vl = (local_part(t, rank, world, True).float().requires_grad_() for t in (q, k, v))
    out, lse = cp_attention(ql, kl, vl, algo=algo, topology=topology, return_lse=True,
                            tag=tag, options=_opts())
    got = [out, lse]
    if backward:
        out.backward(local_part(dout, rank, world, True).float())
        got += [ql.grad, kl.grad, vl.grad]
    want = local_reference(ref, rank, world, True)
    return max(rel_err(g, w) for g, w in zip(got, want))


def script(rank: int, world: int, algo: str, topology, steps: list[tuple], odd: int,
           odd_steps: list[tuple], tagged: bool):
    """Rank ``odd`` runs ``odd_steps``, every other rank ``steps``: ``("call", seed)`` a
    forward and backward, ``("forward", seed)`` a forward alone, ``("sleep", seconds)``.
    With ``tagged`` every call's tag names its seed (the step of a training loop). Returns
    each call's outcome ``(kind, text, seconds)``, kind ``"ok"`` with the error vs float64."""
    outcomes = []
    for what, value in (odd_steps if rank == odd else steps):
        if what == "sleep":
            time.sleep(value)
            continue
        tag = f"step {value}" if tagged else None
        outcomes.append(_outcome(lambda value=value, what=what, tag=tag: _step(
            rank, world, algo, topology, value, tag, backward=what == "call")))
    return outcomes


def float64_both_layouts(rank: int, world: int, algo: str, topology):
    """float64 inputs through the packed and the sbhd path: max error vs float64 of each and
    the lse dtypes."""
    errs, zero, got = packed_cases.one_case(rank, world, algo, topology, True, "fp64", 2,
                                            "unequal" if world > 1 else "odd",
                                            options=_opts())
    packed_err = max(*errs.values(), 0.0 if zero else 1.0)
    sbhd_err = one_call(rank, world, algo, topology, dtype=torch.float64, options=_opts())
    return packed_err, sbhd_err, str(got[1].dtype)


__all__ = ["CPAttentionError", "float64_both_layouts", "local_error_on_one_rank", "script"]
