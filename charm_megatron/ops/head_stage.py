"""The head all-to-all of ``a2a`` / ``a2a+p2p`` / CHARM+ ``head_parallel`` on tensors
(plan/head_stage.py says what moves where): :func:`to_heads` before a lifted plan,
:func:`to_rows` after it.

Every tensor is ``[rows, b, heads, ...]`` (blocks, lse ``[s, b, h]``); the heads are dim 2.
All of a call's tensors travel in one batch on the kv stream's communicator through the
executor's :meth:`~charm_megatron.ops.executor.Executor.exchange` (its bound, its errors, the
timed device's hooks), one message per peer, tensor and row piece (a causal member's rows are
two pieces of the super-block, a full-attention member's one): every message is a contiguous
piece of a buffer the stage needs anyway, so nothing is packed into a message or unpacked
out of one. What is copied, once (``copy_passes``): before the plan each tensor's head slices
into one ``[a, rows, b, h/a, ...]`` buffer (one strided copy per tensor; slice ``j`` is member
``j``'s, its row pieces are contiguous), whose pieces are sent as they are and received into
their places in the super-block; on the way home the pieces received into one ``[a, rows,
b, h/a, ...]`` buffer, then one strided copy per tensor back to ``[rows, b, h, ...]``. A rank's
own slice is copied, not sent. TransformerEngine's all-to-all reorders before and after its
collective (two passes each way, priced for its ``te-*`` contenders).
"""

from __future__ import annotations

import torch

from charm_megatron.ops.executor import Executor
from charm_megatron.plan.head_stage import HeadStage
from charm_megatron.plan.vocab import Stream

__all__ = ["to_heads", "to_rows"]


def _by_slice(t: torch.Tensor, a: int) -> torch.Tensor:
    """``t`` ``[rows, b, h, ...]`` as ``[a, rows, b, h/a, ...]`` (slice ``j``: heads
    ``j*h/a .. (j+1)*h/a``), copied once so that every slice and row range is contiguous."""
    rows, b, h = t.shape[:3]
    view = t.reshape(rows, b, a, h // a, *t.shape[3:])
    return view.movedim(2, 0).contiguous()


def to_heads(ex: Executor, stage: HeadStage, rank: int,
             *tensors: torch.Tensor) -> tuple[torch.Tensor, ...]:
    """This rank's ``[s, b, h, ...]`` tensors as its super-block: ``[a*s, b, h/a, ...]``,
    every member's rows of this rank's head slice (its lane), in the super-block's order."""
    a, members = stage.a, stage.members(rank)
    me = members.index(rank)
    rows = tensors[0].shape[0]
    outs = [t.new_empty((a * rows, t.shape[1], t.shape[2] // a, *t.shape[3:])) for t in tensors]
    sliced = [_by_slice(t, a) for t in tensors]
    sends, recvs = [], []
    for j, peer in enumerate(members):
        for packed, out in zip(sliced, outs):
            if peer == rank:  # our own slice: placed, not sent
                for local, sup in stage.pieces(me, rows):
                    out[sup] = packed[me][local]
                continue
            # member j places our rows of its slice where pieces(me) says; we place its
            # rows of our slice where pieces(j) says
            sends += [(peer, packed[j][local]) for local, _ in stage.pieces(me, rows)]
            recvs += [(peer, out[sup]) for _, sup in stage.pieces(j, rows)]
    if sends:
        ex.exchange(Stream.KV, sends, recvs)
    ex.stage_copied(list(tensors), a, home=False)
    return tuple(outs)


def to_rows(ex: Executor, stage: HeadStage, rank: int,
            *tensors: torch.Tensor) -> tuple[torch.Tensor, ...]:
    """The inverse of :func:`to_heads`: super-block tensors ``[a*s, b, h/a, ...]`` back to this
    rank's ``[s, b, h, ...]`` (every member's head slice of this rank's rows)."""
    a, members = stage.a, stage.members(rank)
    me = members.index(rank)
    rows = tensors[0].shape[0] // a
    tensors = tuple(t.contiguous() for t in tensors)  # row pieces are then contiguous
    # got[j]: this rank's rows of member j's head slice, as member j sends them
    got = [t.new_empty((a, rows, *t.shape[1:])) for t in tensors]
    sends, recvs = [], []
    for j, peer in enumerate(members):
        for t, g in zip(tensors, got):
            if peer == rank:
                for local, sup in stage.pieces(me, rows):
                    g[me][local] = t[sup]
                continue
            sends += [(peer, t[sup]) for _, sup in stage.pieces(j, rows)]
            recvs += [(peer, g[j][local]) for local, _ in stage.pieces(me, rows)]
    if sends:
        ex.exchange(Stream.KV, sends, recvs)
    outs = tuple(g.movedim(0, 2).reshape(rows, g.shape[2], g.shape[3] * a, *g.shape[4:])
                 for g in got)
    ex.stage_copied(list(tensors), a, home=True)
    return outs
