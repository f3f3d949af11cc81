"""The head all-to-all of ``a2a`` / ``a2a+p2p`` on tensors (plan/head_stage.py says what
moves where): :func:`to_heads` before a lifted plan, :func:`to_rows` after it.

Every tensor is ``[rows, b, heads, ...]`` (blocks, lse ``[s, b, h]``); the heads are dim 2.
All of a call's tensors travel in one batch on the kv stream's communicator, through the
executor's :meth:`~charm_megatron.ops.executor.Executor.exchange` (its bound, its errors, the
timed device's hooks). A rank's own slice is copied, not sent.
"""

from __future__ import annotations

import torch

from charm_megatron.ops.executor import Executor
from charm_megatron.plan.head_stage import HeadStage
from charm_megatron.plan.vocab import Stream

__all__ = ["to_heads", "to_rows"]


def _heads(t: torch.Tensor, j: int, a: int) -> slice:
    h = t.shape[2] // a
    return slice(j * h, (j + 1) * h)


def to_heads(ex: Executor, stage: HeadStage, rank: int,
             *tensors: torch.Tensor) -> tuple[torch.Tensor, ...]:
    """This rank's ``[s, b, h, ...]`` tensors as its super-block: ``[a*s, b, h/a, ...]``,
    every member's rows of this rank's head slice (its lane), in the super-block's order."""
    a, members = stage.a, stage.members(rank)
    rows = tensors[0].shape[0]
    outs = [t.new_empty((a * rows, t.shape[1], t.shape[2] // a, *t.shape[3:])) for t in tensors]
    sends, recvs, landed = [], [], []
    for j, peer in enumerate(members):
        for t, out in zip(tensors, outs):
            mine = t[:, :, _heads(t, j, a)]
            if peer == rank:
                _place(out, mine, stage.pieces(j, rows))
                continue
            sends.append((peer, mine.contiguous()))
            buf = t.new_empty(mine.shape)
            recvs.append((peer, buf))
            landed.append((out, buf, j))
    if sends or recvs:
        ex.exchange(Stream.KV, sends, recvs)
    for out, buf, j in landed:
        _place(out, buf, stage.pieces(j, rows))
    return tuple(outs)


def to_rows(ex: Executor, stage: HeadStage, rank: int,
            *tensors: torch.Tensor) -> tuple[torch.Tensor, ...]:
    """The inverse of :func:`to_heads`: super-block tensors ``[a*s, b, h/a, ...]`` back to this
    rank's ``[s, b, h, ...]`` (every member's head slice of this rank's rows)."""
    a, members = stage.a, stage.members(rank)
    rows = tensors[0].shape[0] // a
    outs = [t.new_empty((rows, t.shape[1], t.shape[2] * a, *t.shape[3:])) for t in tensors]
    k = members.index(rank)
    sends, recvs, landed = [], [], []
    for j, peer in enumerate(members):
        for t, out in zip(tensors, outs):
            theirs = _gather(t, stage.pieces(j, rows))  # member j's rows of this lane's heads
            if peer == rank:
                out[:, :, _heads(out, k, a)] = theirs
                continue
            sends.append((peer, theirs))
            buf = t.new_empty(theirs.shape)
            recvs.append((peer, buf))
            landed.append((out, buf, j))
    if sends or recvs:
        ex.exchange(Stream.KV, sends, recvs)
    for out, buf, j in landed:
        out[:, :, _heads(out, j, a)] = buf
    return tuple(outs)


def _place(out: torch.Tensor, rows: torch.Tensor, pieces) -> None:
    for local, sup in pieces:
        out[sup] = rows[local]


def _gather(t: torch.Tensor, pieces) -> torch.Tensor:
    return torch.cat([t[sup] for _, sup in pieces]) if len(pieces) > 1 else \
        t[pieces[0][1]].contiguous()
