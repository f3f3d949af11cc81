"""The head all-to-all of ``a2a`` / ``a2a+p2p`` on tensors (plan/head_stage.py says what
moves where): :func:`to_heads` before a lifted plan, :func:`to_rows` after it.

Every tensor is ``[rows, b, heads, ...]`` (blocks, lse ``[s, b, h]``); the heads are dim 2.
All of a call's tensors travel in one batch on the kv stream's communicator, one message per
peer and dtype (q, k and v together), through the executor's :meth:`~charm_megatron.ops.executor.Executor.exchange` (its bound, its errors, the
timed device's hooks). A rank's own slice is copied, not sent.
"""

from __future__ import annotations

import math

import torch

from charm_megatron.ops.executor import Executor
from charm_megatron.plan.head_stage import HeadStage, copy_passes
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
    slices = {j: [t[:, :, _heads(t, j, a)] for t in tensors] for j in range(a)}
    got = _swap(ex, rank, members, slices)
    for j in range(a):
        for out, piece in zip(outs, got[j]):
            _place(out, piece, stage.pieces(j, rows))
    ex.copied(list(tensors), copy_passes(a)[0])
    return tuple(outs)


def to_rows(ex: Executor, stage: HeadStage, rank: int,
            *tensors: torch.Tensor) -> tuple[torch.Tensor, ...]:
    """The inverse of :func:`to_heads`: super-block tensors ``[a*s, b, h/a, ...]`` back to this
    rank's ``[s, b, h, ...]`` (every member's head slice of this rank's rows)."""
    a, members = stage.a, stage.members(rank)
    rows = tensors[0].shape[0] // a
    outs = [t.new_empty((rows, t.shape[1], t.shape[2] * a, *t.shape[3:])) for t in tensors]
    # Member j gets its rows of this lane's heads.
    slices = {j: [_gather(t, stage.pieces(j, rows)) for t in tensors] for j in range(a)}
    got = _swap(ex, rank, members, slices)
    for j in range(a):
        for out, piece in zip(outs, got[j]):
            out[:, :, _heads(out, j, a)] = piece
    ex.copied(list(tensors), copy_passes(a)[1])
    return tuple(outs)


def _swap(ex: Executor, rank: int, members: tuple[int, ...],
          slices: dict[int, list[torch.Tensor]]) -> dict[int, list[torch.Tensor]]:
    """Send member ``j`` the tensors ``slices[j]`` and receive its tensors of the same shapes
    (a rank's own are kept): one message per peer and dtype (q, k, v travel together; out
    and its fp32 lse in two), all in one batch."""
    k = members.index(rank)
    got: dict[int, list[torch.Tensor]] = {k: slices[k]}
    sends, recvs, unpack = [], [], []
    for j, peer in enumerate(members):
        if peer == rank:
            continue
        for dtype in dict.fromkeys(t.dtype for t in slices[j]):
            idx = [i for i, t in enumerate(slices[j]) if t.dtype == dtype]
            flat = torch.cat([slices[j][i].reshape(-1) for i in idx])
            sends.append((peer, flat))
            buf = torch.empty_like(flat)
            recvs.append((peer, buf))
            unpack.append((j, idx, buf))
    if sends:
        ex.exchange(Stream.KV, sends, recvs)
    for j, idx, buf in unpack:
        got.setdefault(j, [None] * len(slices[j]))
        shapes = [slices[j][i].shape for i in idx]
        parts = torch.split(buf, [math.prod(sh) for sh in shapes])
        for i, part, sh in zip(idx, parts, shapes):
            got[j][i] = part.view(sh)
    return got


def _place(out: torch.Tensor, rows: torch.Tensor, pieces) -> None:
    for local, sup in pieces:
        out[sup] = rows[local]


def _gather(t: torch.Tensor, pieces) -> torch.Tensor:
    return torch.cat([t[sup] for _, sup in pieces]) if len(pieces) > 1 else \
        t[pieces[0][1]].contiguous()
