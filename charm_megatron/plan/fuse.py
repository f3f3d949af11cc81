"""Super-tiles: adjacent tiles of one rank over several kv blocks for the same q rows become
one kernel call (:class:`~charm_megatron.plan.core.SuperTile`; docs/algorithm.md,
*Super-tiles*).

A rank that holds several kv blocks at once for the same q rows (the blocks of a step of RM+
units fetched together, an all-gather's blocks) runs one tile per block: one kernel launch,
one tile-size penalty and one fold of the partial into the fp32 accumulator each. Fused, the
kv rows are concatenated and the kernel runs once: one launch, the efficiency of the long
tile, one fold. :func:`fuse_ops` fuses what a builder wrote next to each other; it moves no
op, so a plan's order of events (and its validity) is unchanged.

Plan layer: no torch.
"""

from __future__ import annotations

from collections.abc import Sequence

from charm_megatron.plan.core import (
    Comm,
    Loc,
    Op,
    Reset,
    SuperTile,
    Tile,
    TileBwd,
    Xfer,
    super_tile_refusal,
)
from charm_megatron.plan.lifetimes import lifetimes
from charm_megatron.plan.settings import Setting
from charm_megatron.plan.vocab import SuperTileMode

__all__ = ["SUPER_TILES", "fuse_ops", "joint_kv", "unfuse_ops"]

#: The setting of the algorithms whose plans hold several kv blocks for the same q rows at
#: once (rmplus / charm: :mod:`charm_megatron.algorithms.charm.entry`; allgather).
SUPER_TILES = Setting(
    "super_tiles", SuperTileMode, SuperTileMode.OFF,
    "rmplus / charm / allgather: tiles of the same q rows against kv blocks held at once "
    "(rmplus / charm: adjacent kv exchanges fetched together) run as one kernel call over "
    "the concatenated kv (a super-tile; auto: the performance model's pick per direction, "
    "off without one; docs/algorithm.md)",
    env="CHARM_SUPER_TILES")


def fuse_ops(ops: Sequence[Op]) -> list[Op]:
    """``ops`` with every maximal run of adjacent tiles that can be one super-tile (same q
    block, rows and q-side accumulator, accumulated, no causal mask;
    :func:`~charm_megatron.plan.core.super_tile_refusal`) replaced by one."""
    out: list[Op] = []
    run: list[Tile | TileBwd] = []

    def flush() -> None:
        if len(run) > 1:
            out.append(SuperTile(tuple(run)))
        else:
            out.extend(run)
        run.clear()

    for op in ops:
        if type(op) in (Tile, TileBwd):
            if run and super_tile_refusal((*run, op)) is None:
                run.append(op)
                continue
            flush()
            if _may_fuse(op):
                run.append(op)  # may start a run
            else:
                out.append(op)
            continue
        flush()
        out.append(op)
    flush()
    return out


def _may_fuse(op: Tile | TileBwd) -> bool:
    """A tile that could be a super-tile's member: unmasked, its q-side result accumulated."""
    fresh = op.fresh if type(op) is Tile else op.fresh_dq
    return not op.spec.causal and not fresh


def unfuse_ops(ops: Sequence[Op]) -> list[Op]:
    """``ops`` with every super-tile replaced by its members (what it computes, tile by
    tile)."""
    out: list[Op] = []
    for op in ops:
        if type(op) is SuperTile:
            out.extend(op.members)
        else:
            out.append(op)
    return out


def joint_kv(ops: Sequence[Op]) -> dict[int, tuple[tuple[int, Loc], ...]]:
    """The super-tiles of ``ops`` whose members' kv blocks can be received into one buffer,
    each member's rows after the previous one's, so that the kernel reads them as they are
    (no concatenation): op index of the super-tile -> ``(receiving op index, location)`` per
    member, in member order. A member qualifies where its kv block arrived by a receive of
    exactly the rows the member uses, nothing wrote the location since, and the super-tile
    is the block's last use (the joint buffer lives as long as any member's rows, so all of
    them end together). The executor allocates so, and the memory model and the model count
    no concatenation for these."""
    if not any(type(op) is SuperTile for op in ops):
        return {}
    life = lifetimes(ops)
    written: dict[Loc, tuple[int, Xfer] | None] = {}  # loc -> its receive, None: other write
    out: dict[int, tuple[tuple[int, Loc], ...]] = {}
    for i, op in enumerate(ops):
        t = type(op)
        if t is Comm:
            for x in op.recvs:
                written[x.loc] = (i, x)
        elif t is Reset:
            written[op.loc] = None
        elif t is SuperTile:
            ends = set(life.free_after.get(i, ()))
            got = []
            for m in op.members:
                rx = written.get(m.kv_loc)
                if rx is None or rx[1].half is not m.spec.kv_half or m.kv_loc not in ends:
                    break
                got.append((rx[0], m.kv_loc))
            else:
                if len({loc for _, loc in got}) == len(got):
                    out[i] = tuple(got)
            for m in op.members:  # its fresh results are written here
                for loc in _fresh_results(m):
                    written[loc] = None
        elif t in (Tile, TileBwd):
            for loc in _fresh_results(op):
                written[loc] = None
    return out


def _fresh_results(op: Tile | TileBwd) -> list[Loc]:
    if type(op) is Tile:
        return [op.acc] if op.fresh else []
    return [loc for loc, fresh in ((op.dq_acc, op.fresh_dq), (op.dkv_acc, op.fresh_dkv))
            if fresh]
