"""The peak bytes a plan's buffers occupy on a rank, for a concrete problem size.

A replay of one rank's op list with the executor's allocation rule
(:mod:`charm_megatron.plan.lifetimes`): a buffer is allocated when its lifetime begins, with
the rows it uses (receive buffers in the wire dtypes, accumulators in fp32 as
:data:`~charm_megatron.plan.vocab.BLOCKS` says) and freed after its last use. A tile adds its
kernel output for as long as the tile runs (forward: the partial output and lse of its rows;
backward: dq and dk/dv of its rows), unless that output *is* the new buffer (a ``fresh`` tile);
a super-tile adds its one output and the concatenation of its members' kv rows, unless they
were received into one buffer (:func:`~charm_megatron.plan.fuse.joint_kv`), which is then
allocated whole at the first of those receives.
Kernel workspaces, the backward's stand-in output and the caller's own tensors are not counted.

The model counts what the measured peak (:mod:`charm_megatron.lab.bench.memory`) grows by in the
executor, so the ratio of two plans' peaks is what ``charm-megatron bench`` measures for them
(within a few per cent: the measure also sees the workspaces common to all plans).

Plan layer: no torch.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

from charm_megatron.plan.core import (
    Comm,
    Half,
    Kind,
    Loc,
    Op,
    Plan,
    Reset,
    SuperTile,
    Tile,
    TileBwd,
)
from charm_megatron.plan.cost import Problem
from charm_megatron.plan.fuse import joint_kv
from charm_megatron.plan.lifetimes import lifetimes
from charm_megatron.plan.vocab import BLOCKS, block_sizes

__all__ = ["BOUND", "Peak", "max_peak", "peak", "plan_peak"]

#: Issue 12's memory target: RM+ / CHARM+ peak at most this times ring's (``registry.build_plan``
#: builds a plan lean where that is what it takes).
BOUND = 1.1


@dataclass(frozen=True)
class Peak:
    """A rank's highest point: ``bytes`` at op ``op``, of which ``held`` by each buffer and
    ``tile`` by the running tile's kernel output."""

    bytes: float
    op: int
    held: tuple[tuple[Loc, float], ...]
    tile: float


@functools.lru_cache(maxsize=4096)
def _block_bytes(problem: Problem, n: int, kind: Kind, accumulator: bool, rows: Half) -> float:
    sizes = block_sizes(problem.b, problem.hq, problem.hkv, problem.d, problem.dv)
    per_row = 0
    for t in BLOCKS[Kind(kind)].tensors:
        size = t.dtype(accumulator, problem.wide_partials).size(problem.elem)
        for dim in t.dims.split()[1:]:
            size *= sizes[dim] if dim.isalpha() else int(dim)
        per_row += size
    return problem.s / n * per_row * rows.fraction


def peak(ops: list[Op], problem: Problem, n: int) -> Peak:
    """The peak of one rank's op list (``n``: the CP size, so a block has ``s / n`` rows)."""
    life = lifetimes(ops)
    live: dict[Loc, float] = {}
    held = 0.0  # sum of live
    best = Peak(0.0, -1, (), 0.0)

    def block(kind: Kind, acc: bool, rows: Half) -> float:
        return _block_bytes(problem, n, kind, acc, rows)

    def hold(loc: Loc, nbytes: float) -> None:
        nonlocal held
        held += nbytes - live.get(loc, 0.0)
        live[loc] = nbytes

    joint = joint_kv(ops) if any(type(op) is SuperTile for op in ops) else {}
    # Blocks received into a super-tile's joint buffer: the whole buffer at the first receive.
    jointly: dict[tuple[int, Loc], float] = {}
    for j, members in joint.items():
        sizes = [block(Kind.KV, False, m.spec.kv_half) for m in ops[j].members]
        first = min(range(len(members)), key=lambda k: members[k][0])
        for k, key in enumerate(members):
            jointly[key] = sum(sizes) if k == first else 0.0

    for i, op in enumerate(ops):
        t, tile = type(op), 0.0
        if t is Comm:
            for x in op.recvs:
                hold(x.loc, jointly.get((i, x.loc), block(x.kind, False, x.half)))
        elif t is Reset:
            hold(op.loc, block(op.kind, True, life.rows[(i, op.loc)]))
        elif t is Tile:
            out = block(Kind.OUT, False, op.spec.q_half)
            if op.fresh:
                hold(op.acc, out)
            else:
                tile = out
        elif t is TileBwd:
            tile = _tile_bwd(op, block, hold)
        elif t is SuperTile:
            # The members' kv rows concatenated (a copy, unless received into one buffer),
            # and one kernel output: forward the partial of the q rows; backward dq once
            # and each member's dk, dv.
            tile = 0.0 if i in joint else sum(block(Kind.KV, False, m.spec.kv_half)
                                              for m in op.members)
            if op.backward:
                first = op.first
                tile += block(Kind.DQ, False, first.spec.q_half)
                for m in op.members:
                    tile += _tile_bwd(m, block, hold, dq=False)
            else:
                tile += block(Kind.OUT, False, op.first.spec.q_half)
        if held + tile > best.bytes:
            best = Peak(held + tile, i, tuple(live.items()), tile)
        for loc in life.free_after.get(i, ()):
            held -= live.pop(loc, 0.0)
    return best


def _tile_bwd(op: TileBwd, block, hold, dq: bool = True) -> float:
    """A backward tile's kernel output: its fresh results held in their locations, the
    bytes of the others (the tile's transient) returned; ``dq`` False: its dq is not
    counted (a super-tile's one dq is counted once)."""
    s, tile = op.spec, 0.0
    results = [(op.dkv_acc, op.fresh_dkv, Kind.DKV, s.kv_half)]
    if dq:
        results.insert(0, (op.dq_acc, op.fresh_dq, Kind.DQ, s.q_half))
    for loc, fresh, kind, rows in results:
        b = block(kind, False, rows)
        if fresh:
            hold(loc, b)
        else:
            tile += b
    return tile


def plan_peak(plan: Plan, problem: Problem) -> list[Peak]:
    """Every rank's peak."""
    return [peak(plan.ops[r], problem, plan.n) for r in range(plan.n)]


def max_peak(plan: Plan, problem: Problem) -> float:
    """The highest peak over ranks, in bytes."""
    return max(p.bytes for p in plan_peak(plan, problem))
