"""Head all-to-all (Ulysses): the stage that turns sequence shards into head shards, and the
plans that run after it.

In consecutive groups of ``a`` CP ranks (TransformerEngine's inner groups of ``a2a+p2p``;
the whole CP group for ``a2a``), rank ``r = g*a + k`` sends every member ``g*a + j`` the
``j``-th of ``a`` equal slices of its heads, and receives from each member that member's rows
of head slice ``k``. Afterwards rank ``r`` holds the *super-block* ``g`` of *lane* ``k``: the
rows of all ``a`` members (in the load-balanced layout of ``m = n/a`` ranks: the members'
first halves in rank order, then their second halves in reverse rank order, which is
Megatron's layout of ``m`` ranks with ``a`` times the rows) with ``1/a`` of the heads. Lanes
never meet again: each lane runs an ordinary plan over its ``m`` super-blocks (``m = 1``: one
local attention over the whole sequence, which is Ulysses; else a ring across the groups,
which is TE's hierarchical CP), and a second all-to-all sends every result home.

Here is what is pure data: where a super-block's rows come from (:meth:`HeadStage.pieces`),
the *lift* of an ``m``-rank plan into an ``n``-rank one whose ranks, owners and tiles are the
CP ranks of each lane (:func:`lift_rank`; its tiles pair ranks of one lane only,
:func:`~charm_megatron.plan.tile_rule.lane_rule`, so the validator proves it as any plan), and
the stage's own messages as plans of sends and receives of head slices (:func:`stage_plans`),
which the performance model and the byte counts price like any other plan. The exchange
itself runs in :mod:`charm_megatron.ops.head_stage`.

Plan layer: no torch.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from dataclasses import dataclass

from charm_megatron.plan.core import (
    Comm,
    Merge,
    Op,
    Plan,
    Reset,
    SuperTile,
    Tile,
    TileBwd,
    TileSpec,
    Wait,
    Xfer,
)
from charm_megatron.plan.vocab import OWN, RESULT, Direction, Half, Kind, Loc, Stream

__all__ = ["HEAD_COPIES", "HeadStage", "copy_passes", "flat_super_groups", "lift_ops",
           "lift_rank", "stage_kinds", "stage_plans", "stage_refusal", "super_groups"]

Groups = tuple[tuple[int, ...], ...]


@dataclass(frozen=True)
class HeadStage:
    """The head all-to-all of ``n`` CP ranks in consecutive groups of ``a``."""

    n: int
    a: int
    causal: bool

    @property
    def m(self) -> int:
        """Super-blocks per lane (ranks of the plan after the stage)."""
        return self.n // self.a

    def members(self, rank: int) -> tuple[int, ...]:
        """The ranks of ``rank``'s group, in order (index ``j`` holds head slice ``j``)."""
        g = rank // self.a
        return tuple(range(g * self.a, (g + 1) * self.a))

    def pieces(self, j: int, rows: int) -> tuple[tuple[slice, slice], ...]:
        """Where member ``j``'s ``rows`` local rows lie in the super-block: ``(local rows,
        super rows)`` pairs. Causal: its first half after the first halves of members
        ``0..j-1``, its second half after the second halves of members ``a-1..j+1``;
        otherwise its rows after those of members ``0..j-1``."""
        if not self.causal:
            return ((slice(0, rows), slice(j * rows, (j + 1) * rows)),)
        c = rows // 2
        second = (2 * self.a - 1 - j) * c
        return ((slice(0, c), slice(j * c, (j + 1) * c)),
                (slice(c, rows), slice(second, second + c)))


def stage_refusal(groups: Groups, n: int, hq: int | None, hkv: int | None,
                  algo: str, alternatives: str) -> str | None:
    """Why a head all-to-all in ``groups`` cannot run (``None``: it can): the groups must be
    consecutive ranks of one size (TE's inner groups), and both head counts must divide by
    it. ``hq`` / ``hkv`` ``None``: shape-free (only the groups are checked)."""
    a = len(groups[0])
    if any(g != tuple(range(i * a, (i + 1) * a)) for i, g in enumerate(groups)) or \
            a * len(groups) != n:
        return (f"{algo} runs its all-to-all in consecutive groups of equal size (TE's order "
                f"of a2a+p2p's inner groups), but the topology's groups are "
                f"{[list(g) for g in groups]}; give a topology such as '{len(groups)}x{a}' "
                f"or choose {alternatives}")
    if hq is None or hkv is None or a == 1:
        return None
    bad = [f"{name} {h}" for name, h in (("q heads", hq), ("kv heads", hkv)) if h % a]
    if bad:
        return (f"{algo} splits the heads {a} ways (its all-to-all group of {a} CP ranks), "
                f"but {' and '.join(bad)} {'do' if len(bad) > 1 else 'does'} not divide by "
                f"{a}; use a CP size (or, for a2a+p2p, a topology group size) that divides "
                f"both head counts, or choose {alternatives}")
    return None


# ------------------------------------------------------------------------------- the lift
def flat_super_groups(groups: Groups, a: int) -> Groups:
    """One flat group of the ``n / a`` super-blocks (a ring across the groups)."""
    return (tuple(range(sum(len(g) for g in groups) // a)),)


def super_groups(groups: Groups, a: int) -> Groups:
    """The super-blocks grouped as their ranks are: topology group ``i`` of ``s`` consecutive
    ranks holds the ``s / a`` consecutive super-blocks of its sub-groups (a head all-to-all
    inside each group keeps a super-block's rows on one node)."""
    out, first = [], 0
    for g in groups:
        m = len(g) // a
        out.append(tuple(range(first, first + m)))
        first += m
    return tuple(out)


def lift_rank(inner: Callable, a: int | Callable[[Groups], int],
              inner_groups: Callable[[Groups, int], Groups] = flat_super_groups) -> Callable:
    """A builder of ``n``-rank plans from ``inner``, a builder over the ``m = n/a``
    super-blocks grouped by ``inner_groups`` (default: one flat group): CP rank ``g*a + k``
    runs inner rank ``g``'s ops with every peer and owner ``p`` renamed ``p*a + k`` (lane
    ``k``). ``a`` may be a function of the groups."""
    def build(rank: int, groups: Groups, causal: bool, direction: Direction,
              variant: object = None):
        size = a(groups) if callable(a) else a
        built = inner(rank // size, inner_groups(groups, size), causal, direction, variant)
        ops = built[0] if isinstance(built, tuple) else built
        return lift_ops(ops, size, rank % size)
    return build


def lift_ops(ops: list[Op], a: int, k: int) -> list[Op]:
    """An inner rank's ``ops`` as lane ``k``'s CP rank runs them: every peer and owner ``p``
    renamed ``p*a + k``."""
    return [_lift(op, a, k) for op in ops]


def _lift(op: Op, a: int, k: int) -> Op:
    def rank(p: int) -> int:
        return p * a + k

    def xfer(x: Xfer) -> Xfer:
        return Xfer(rank(x.peer), x.loc, x.kind, rank(x.owner), x.half, x.parts)

    def spec(s: TileSpec) -> TileSpec:
        return TileSpec(rank(s.q_owner), rank(s.kv_owner), s.q_half, s.kv_half, s.causal)

    t = type(op)
    if t is Comm:
        return Comm(op.handle, op.stream, tuple(map(xfer, op.sends)), tuple(map(xfer, op.recvs)))
    if t is Reset:
        return Reset(op.loc, op.kind, rank(op.owner))
    if t is Tile:
        return Tile(spec(op.spec), op.q_loc, op.kv_loc, op.acc, op.fresh)
    if t is TileBwd:
        return TileBwd(spec(op.spec), op.q_loc, op.kv_loc, op.dq_acc, op.dkv_acc, op.fresh_dq,
                       op.fresh_dkv)
    if t is SuperTile:
        return SuperTile(tuple(_lift(m, a, k) for m in op.members))
    if t in (Wait, Merge):
        return op
    raise TypeError(f"cannot lift {op!r}")


# ------------------------------------------------------------------- the stage's messages
# What each all-to-all moves: into the heads layout before the plan, back after it. Forward:
# q and kv in, the output with its lse back. Backward: the output's gradient in (q, kv, out
# and lse stay in the heads layout from the forward, as TE keeps them), dq and dkv back.
_MOVES: dict[Direction, tuple[tuple[Kind, ...], tuple[Kind, ...]]] = {
    Direction.FORWARD: ((Kind.Q, Kind.KV), (Kind.OUT,)),
    Direction.BACKWARD: ((Kind.DOUT,), (Kind.DQ, Kind.DKV)),
}


def stage_kinds(direction: Direction) -> tuple[tuple[Kind, ...], tuple[Kind, ...]]:
    """The blocks the all-to-all moves before and after the lifted plan of ``direction``
    (forward: q and kv in, out home; backward: dout in, dq and dkv home)."""
    return _MOVES[Direction(direction)]


#: Whose head all-to-all a copy count describes: ours (ops/head_stage.py) or
#: TransformerEngine's (``flash_attn_a2a_communicate``), which the ``te-*`` contenders run.
HEAD_COPIES = ("charm", "te")


def copy_passes(a: int, style: str = "charm") -> tuple[float, float]:
    """How many times a rank's blocks are copied outside any kernel in each all-to-all of
    ``a`` ranks (before the plan, and on the way home). ``charm`` (ops/head_stage.py): one
    strided copy of every tensor (its head slices side by side, every message a contiguous
    piece of it, received in place) and the own slice's placement, ``1 + 1/a`` each way.
    ``te``: TransformerEngine's reorder on each side of its ``all_to_all_single`` (a
    ``movedim(...).contiguous()`` and an ``index_select`` of the causal chunks, sbhd) and the
    collective's copy of the own slice, ``2 + 1/a`` each way. The model prices these copies;
    a timed device charges them."""
    if style not in HEAD_COPIES:
        raise ValueError(f"head all-to-all copies must be one of {HEAD_COPIES}, got {style!r}")
    each = (1.0 if style == "charm" else 2.0) + 1.0 / a
    return each, each


_STAGE = "a2a"  # the stage's buffers (a2a.q0: q from rank 0): priced by bytes, not by name


@functools.lru_cache(maxsize=256)  # the model and the byte counts ask per plan they price
def stage_plans(n: int, a: int, direction: Direction, causal: bool) -> tuple[Plan, Plan]:
    """The all-to-alls before and after a lifted plan, as plans of sends and receives of head
    slices (``Xfer.parts = a``: a message carries one of ``a`` head slices of a rank's rows),
    one batch per rank on the kv stream: what the performance model times and the byte counts
    add (memoised and shared: do not modify). One message per peer and kind (the executor
    sends one per tensor and row piece, in place: the same bytes, their latencies side by
    side). Not attention plans (no tiles, no results): they are never validated or
    executed."""
    stage = HeadStage(n, a, causal)
    direction = Direction(direction)
    out = []
    for kinds in _MOVES[direction]:
        plan = Plan(f"a2a-{'/'.join(map(str, kinds))}", direction, n, (tuple(range(n)),),
                    causal)
        for r in range(n):
            g = stage.members(r)
            peers = [g[(g.index(r) + i) % a] for i in range(1, a)]  # nearest first
            sends = tuple(Xfer(p, OWN.get(kind, RESULT.get(kind, Loc(f"{_STAGE}.{kind}"))),
                               kind, r, Half.FULL, parts=a) for p in peers for kind in kinds)
            recvs = tuple(Xfer(p, Loc(f"{_STAGE}.{kind}").at(p), kind, p, Half.FULL, parts=a)
                          for p in peers for kind in kinds)
            plan.ops.append([Comm(0, Stream.KV, sends, recvs), Wait(0)] if peers else [])
        out.append(plan)
    return out[0], out[1]
