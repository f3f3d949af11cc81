"""A toy algorithm registered the way docs/design.md "Adding an algorithm" says: one builder and
one registry entry. It is all-gather-like and deliberately naive: at step ``s`` every rank
sends its own kv to rank ``r+s`` and receives the kv of rank ``r-s``, waits, and computes that
tile (no overlap); backward sends each kv's dk/dv partial straight home after its tile.

Module level so forkserver children can import it and register it themselves."""

from __future__ import annotations

import itertools

import dist_cases
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
from charm_megatron.plan.vocab import Direction

NAME = "toygather"


def toygather_rank(rank: int, groups: registry.Groups, causal: bool, direction: Direction,
                   variant: object) -> list[Op]:
    """The builder: rank ``rank``'s ops (``groups`` is one flat group: it ignores topology;
    ``variant``: its settings' values, none)."""
    n = sum(len(g) for g in groups)
    backward = direction == Direction.BACKWARD
    ops: list[Op] = []
    handles = itertools.count()

    def comm(stream: str, send: Xfer, recv: Xfer) -> int:
        ops.append(Comm(handle := next(handles), stream, (send,), (recv,)))
        return handle

    if backward:
        ops += [Reset(Plan.DQ, "dq", rank), Reset(Plan.DKV, "dkv", rank),
                TileBwd(tile_spec(rank, rank, causal), "own.qgrad", "own.kv", Plan.DQ, Plan.DKV)]
    else:
        ops += [Reset(Plan.OUT, "out", rank),
                Tile(tile_spec(rank, rank, causal), "own.q", "own.kv", Plan.OUT)]
    for s in range(1, n):
        src, dst = (rank - s) % n, (rank + s) % n
        ops.append(Wait(comm("kv", Xfer(dst, "own.kv", "kv", rank, Half.FULL),
                             Xfer(src, "toy.kv", "kv", src, Half.FULL))))
        spec = tile_spec(rank, src, causal)
        if not backward:
            ops.append(Tile(spec, "own.q", "toy.kv", Plan.OUT))
            continue
        ops += [Reset("toy.dkv", "dkv", src),
                TileBwd(spec, "own.qgrad", "toy.kv", Plan.DQ, "toy.dkv")]
        ops.append(Wait(comm("q", Xfer(src, "toy.dkv", "dkv", src, Half.FULL),
                             Xfer(dst, "toy.dkvin", "dkv", rank, Half.FULL))))
        ops.append(Merge(Plan.DKV, "toy.dkvin"))
    return ops


#: The registry entry.
ENTRY = registry.Algorithm(NAME, toygather_rank, uses_topology=False,
                           description="toy: one peer's kv at a time, no overlap (a test)")


def ensure_registered() -> None:
    """Register the toy unless it already is (idempotent, for children and fixtures)."""
    if NAME not in registry.names():
        registry.register(ENTRY)


def run_attention_registered(rank: int, world: int, *args):
    """A forkserver child: register the toy, then run ``dist_cases.run_attention``."""
    ensure_registered()
    return dist_cases.run_attention(rank, world, *args)
