"""A toy algorithm with a setting of its own, registered the way docs/design.md "Adding an
algorithm" says: one builder and one registry entry, in this file only (issue 26 item 6).

``toyoverlap`` is tests/toy_algorithm.py's all-gather-like schedule (at step ``s`` every rank
sends its own kv to rank ``r+s`` and receives the kv of rank ``r-s``) with one setting,
``toy_overlap``: ``on`` posts the next step's exchange before computing the current tile (two
receive buffers), ``off`` waits for each exchange before computing (one), ``auto`` (default)
is the faster of the two forward plans by the performance model's clock when the call has one
(a model profile), else ``off``. Backward never overlaps: a setting may act on one direction.

Module level so forkserver children can import it and register it themselves.
"""

from __future__ import annotations

import enum
import itertools
from dataclasses import dataclass

from charm_megatron.plan import registry
from charm_megatron.plan.core import (
    Comm,
    Half,
    Merge,
    Op,
    Plan,
    Reset,
    Tile,
    TileBwd,
    Wait,
    Xfer,
    tile_spec,
)
from charm_megatron.plan.entries import assemble
from charm_megatron.plan.settings import Setting
from charm_megatron.plan.vocab import Direction

NAME = "toyoverlap"


class Overlap(str, enum.Enum):
    AUTO = "auto"
    OFF = "off"
    ON = "on"


OVERLAP = Setting("toy_overlap", Overlap, Overlap.AUTO,
                  "toy: post the next kv before computing (on), after (off), or the model's "
                  "pick (auto)", env="CHARM_TOY_OVERLAP")


@dataclass(frozen=True)
class ToyVariant:
    overlap: bool


def toy_rank(rank: int, groups: registry.Groups, causal: bool, direction: Direction,
             variant: ToyVariant) -> list[Op]:
    """The builder: rank ``rank``'s ops (``groups`` is one flat group: no topology)."""
    n = sum(len(g) for g in groups)
    ops: list[Op] = []
    handles = itertools.count()

    def post(stream: str, send: Xfer, recv: Xfer) -> int:
        ops.append(Comm(handle := next(handles), stream, (send,), (recv,)))
        return handle

    def kv_step(s: int) -> int:
        slot = s % 2 if variant.overlap else 0
        src, dst = (rank - s) % n, (rank + s) % n
        return post("kv", Xfer(dst, "own.kv", "kv", rank, Half.FULL),
                    Xfer(src, f"toy.kv{slot}", "kv", src, Half.FULL))

    if direction is Direction.BACKWARD:
        ops += [Reset(Plan.DQ, "dq", rank), Reset(Plan.DKV, "dkv", rank),
                TileBwd(tile_spec(rank, rank, causal), "own.qgrad", "own.kv", Plan.DQ, Plan.DKV)]
        for s in range(1, n):
            src, dst = (rank - s) % n, (rank + s) % n
            ops.append(Wait(kv_step(s)))
            ops += [Reset("toy.dkv", "dkv", src),
                    TileBwd(tile_spec(rank, src, causal), "own.qgrad", "toy.kv0", Plan.DQ,
                            "toy.dkv")]
            ops.append(Wait(post("q", Xfer(src, "toy.dkv", "dkv", src, Half.FULL),
                                 Xfer(dst, "toy.dkvin", "dkv", rank, Half.FULL))))
            ops.append(Merge(Plan.DKV, "toy.dkvin"))
        return ops
    ops.append(Reset(Plan.OUT, "out", rank))
    pending = kv_step(1) if variant.overlap and n > 1 else None
    ops.append(Tile(tile_spec(rank, rank, causal), "own.q", "own.kv", Plan.OUT))
    for s in range(1, n):
        if variant.overlap:
            handle, pending = pending, (kv_step(s + 1) if s + 1 < n else None)
        else:
            handle = kv_step(s)
        ops.append(Wait(handle))
        src = (rank - s) % n
        slot = s % 2 if variant.overlap else 0
        ops.append(Tile(tile_spec(rank, src, causal), "own.q", f"toy.kv{slot}", Plan.OUT))
    return ops


def toy_variants(values, ctx: registry.VariantContext) -> tuple[ToyVariant, ToyVariant]:
    """The entry's variant rule: ``on`` / ``off`` as given; ``auto`` the faster forward plan
    by ``ctx.timer`` (``off`` without a timer)."""
    mode = values[OVERLAP.name]
    if mode is Overlap.AUTO:
        on = False
        if ctx.timer is not None:
            plans = [assemble(NAME, toy_rank, Direction.FORWARD, ctx.groups, ctx.causal,
                              ToyVariant(flag)) for flag in (False, True)]
            on = ctx.timer.seconds(plans[1]) < ctx.timer.seconds(plans[0])
    else:
        on = mode is Overlap.ON
    return ToyVariant(on), ToyVariant(False)


#: The registry entry.
ENTRY = registry.Algorithm(NAME, toy_rank, uses_topology=False,
                           description="toy: one peer's kv at a time, overlap as set (a test)",
                           settings=(OVERLAP,), variants=toy_variants)


def ensure_registered() -> None:
    """Register the toy unless it already is (idempotent, for children and fixtures)."""
    if NAME not in registry.names():
        registry.register(ENTRY)


def run_registered(rank: int, world: int, modes: list[str]):
    """A forkserver child: register the toy, then one forward+backward per rank with its
    ``toy_overlap`` of ``modes`` (one per rank). Returns ("ok", max error vs float64, the
    forward variant's overlap) or (exception type, message)."""
    import torch

    from charm_megatron import CPOptions, cp_attention
    from dist_cases import local_part, make_inputs, reference, rel_err

    ensure_registered()
    s, b, hq, hkv, d = 8 * world, 2, 4, 2, 16
    q, k, v, dout = make_inputs(3, s, b, hq, hkv, d)
    ref = reference(q, k, v, dout, True, d ** -0.5)
    ql, kl, vl = (local_part(t, rank, world, True).float().requires_grad_() for t in (q, k, v))
    try:
        out = cp_attention(ql, kl, vl, algo=NAME, options=CPOptions(timeout_s=20.0,
                                                                    toy_overlap=modes[rank]))
        out.backward(local_part(dout, rank, world, True).float())
    except Exception as exc:  # noqa: BLE001 - the type is part of what the test checks
        return type(exc).__name__, str(exc)
    got = [out, ql.grad, kl.grad, vl.grad]
    want = [local_part(t, rank, world, True) for t in (ref[0], *ref[2:])]
    err = max(rel_err(g, w) for g, w in zip(got, want))
    del torch
    return "ok", err, out.grad_fn.call.resolved.variants[0].overlap
