"""Super-tiles whose kv blocks are received into one buffer (plan/fuse.py, ``joint_kv``): the
executor's side. A super-tile's members' kv blocks land in consecutive rows of one
allocation (each block's k and v after the previous member's), so the kernel reads them as
they are: no concatenation (no copy, and no second copy of the blocks in memory).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch

from charm_megatron.plan.core import Half, Loc, Op, SuperTile
from charm_megatron.plan.fuse import joint_kv

__all__ = ["JointKv"]

# Per op list, computed once (the plans are cached, so the same list objects come back).
_CACHE: dict[int, tuple[Sequence[Op], dict, dict]] = {}
_CACHE_MAX = 1024


def _maps(ops: Sequence[Op]) -> tuple[dict[tuple[int, Loc], tuple[int, int]],
                                      dict[int, list[Half]]]:
    hit = _CACHE.get(id(ops))
    if hit is not None and hit[0] is ops:
        return hit[1], hit[2]
    into: dict[tuple[int, Loc], tuple[int, int]] = {}
    halves: dict[int, list[Half]] = {}
    for j, members in joint_kv(ops).items():
        op = ops[j]
        assert type(op) is SuperTile
        halves[j] = [m.spec.kv_half for m in op.members]
        for idx, (i, loc) in enumerate(members):
            into[(i, loc)] = (j, idx)
    if len(_CACHE) >= _CACHE_MAX:
        _CACHE.clear()
    _CACHE[id(ops)] = (ops, into, halves)
    return into, halves


class JointKv:
    """One run's joint kv buffers: :meth:`receive` gives a receive its rows of the joint
    buffer (the tensors to hold, as they are), :meth:`take` gives a super-tile the whole of
    it (``None``: concatenate)."""

    def __init__(self, ops: Sequence[Op] = ()) -> None:
        self.into, self.halves = _maps(ops) if ops else ({}, {})
        self.groups: dict[int, tuple[tuple[torch.Tensor, ...], list[object]]] = {}

    def receive(self, i: int, loc: Loc, n_rows: Callable[[Half], int],
                alloc: Callable[[int], tuple[torch.Tensor, ...]]) -> tuple | None:
        """The tensors op ``i`` receives kv into ``loc`` (its rows of the joint buffer), or
        ``None`` where the block is not received jointly. ``alloc(rows)``: a kv buffer of that
        many rows."""
        key = self.into.get((i, loc))
        if key is None:
            return None
        j, idx = key
        rows = [n_rows(h) for h in self.halves[j]]
        group = self.groups.get(j)
        if group is None:
            group = (alloc(sum(rows)), [None] * len(rows))
            self.groups[j] = group
        start = sum(rows[:idx])
        group[1][idx] = out = tuple(t[start:start + rows[idx]] for t in group[0])
        return out

    def take(self, j: int, held: Sequence[object]) -> tuple[torch.Tensor, ...] | None:
        """The joint buffer of super-tile ``j`` if what its members' locations hold
        (``held``: their tensors) is still what was received into it."""
        group = self.groups.pop(j, None)
        if group is None or any(a is not b for a, b in zip(group[1], held)):
            return None
        return group[0]
