"""Plans: who sends what to whom, in which order, and which tile is computed where.

A plan is pure data (no torch, no process groups). For each CP rank it is an ordered list of
ops that the executor interprets with real communication and kernels, the validator checks
symbolically, and the performance model replays with costs.

Vocabulary
----------
* A *block* is one rank's shard of one kind of tensor. Forward kinds: ``q``, ``kv`` (K and V
  packed), ``out`` (a partial output with its log-sum-exp). Backward kinds: ``qgrad`` (q and dout of a
  rank's rows, with the final lse and ``delta = rowsum(dout * out)``), ``kv``, ``dq``, ``dkv`` (fp32 gradient partials).
* ``Half`` says which rows of a block a message or a tile uses: under Megatron's causal
  load-balanced layout most tiles need only the first or second half of a block.
* A *location* is a named buffer on a rank: ``own.*`` (the rank's own inputs), ``acc.*``
  (fp32 accumulators), anything else a reused receive buffer. The set of names a plan uses is
  fixed and small, which is what keeps memory O(1) in the CP size.
* Communication is posted in *batches* (``Comm``) on a named stream and completed by ``Wait``.
  Each stream maps to its own process group (own NCCL communicator) so streams really overlap.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass, field

STREAMS = ("kv", "q", "cross")


class Half(enum.Enum):
    """Rows of a block: all, the first half, or the second half (Megatron's two chunks)."""

    FULL = "full"
    FIRST = "first"
    SECOND = "second"

    def union(self, other: Half) -> Half:
        return self if self is other else Half.FULL

    def covers(self, other: Half) -> bool:
        """True if these rows include ``other``'s rows."""
        return self is Half.FULL or self is other

    @property
    def fraction(self) -> float:
        return 1.0 if self is Half.FULL else 0.5

    def __str__(self) -> str:  # short form for printouts
        return {"full": "all", "first": "1st", "second": "2nd"}[self.value]


@dataclass(frozen=True)
class TileSpec:
    """Which rows of q-block ``q_owner`` attend to which rows of kv-block ``kv_owner``."""

    q_owner: int
    kv_owner: int
    q_half: Half
    kv_half: Half
    causal: bool


def tile_spec(q_owner: int, kv_owner: int, causal: bool) -> TileSpec:
    """The tile ``(q_owner, kv_owner)`` under Megatron's load-balanced layout (ALGORITHM.md §5).

    Diagonal: causal over both local chunks. Earlier kv (``kv < q``): all q rows against the
    first kv half, no mask. Later kv: the second q half against all kv rows, no mask.
    """
    if not causal:
        return TileSpec(q_owner, kv_owner, Half.FULL, Half.FULL, False)
    if q_owner == kv_owner:
        return TileSpec(q_owner, kv_owner, Half.FULL, Half.FULL, True)
    if kv_owner < q_owner:
        return TileSpec(q_owner, kv_owner, Half.FULL, Half.FIRST, False)
    return TileSpec(q_owner, kv_owner, Half.SECOND, Half.FULL, False)


@dataclass(frozen=True)
class Xfer:
    """One message of a batch: ``loc`` is the source (send) or destination (receive)."""

    peer: int
    loc: str
    kind: str
    owner: int
    half: Half


@dataclass(frozen=True)
class Comm:
    """Post a batch of sends and receives on ``stream``; completed by ``Wait(handle)``."""

    handle: int
    stream: str
    sends: tuple[Xfer, ...] = ()
    recvs: tuple[Xfer, ...] = ()


@dataclass(frozen=True)
class Wait:
    handle: int


@dataclass(frozen=True)
class Reset:
    """Make accumulator ``loc`` empty (outputs 0 with lse −inf; gradients 0)."""

    loc: str
    kind: str
    owner: int


@dataclass(frozen=True)
class Tile:
    """Forward: attention of ``spec`` (q rows from ``q_loc``, kv rows from ``kv_loc``) merged
    into accumulator ``acc``; with ``fresh``, the partial *replaces* what ``acc`` held and keeps
    the kernel's dtype and only the tile's rows (a partial that is only sent on, never merged
    into, needs no fp32 accumulator)."""

    spec: TileSpec
    q_loc: str
    kv_loc: str
    acc: str
    fresh: bool = False


@dataclass(frozen=True)
class TileBwd:
    """Backward of tile ``spec``: dq rows added into ``dq_acc``, dk/dv rows into ``dkv_acc``.
    With ``fresh_dq`` / ``fresh_dkv`` the kernel's gradient *replaces* what the location held
    (input dtype, the tile's rows only): a one-tile partial that is only sent on."""

    spec: TileSpec
    q_loc: str
    kv_loc: str
    dq_acc: str
    dkv_acc: str
    fresh_dq: bool = False
    fresh_dkv: bool = False


@dataclass(frozen=True)
class Merge:
    """Combine the partial received in ``src`` into accumulator ``acc`` (lse-merge for ``out``,
    sum for gradients), at the rows the partial holds."""

    acc: str
    src: str


Op = Comm | Wait | Reset | Tile | TileBwd | Merge


@dataclass
class Plan:
    """Per-rank op lists for one direction (``forward`` or ``backward``) of one algorithm."""

    algo: str
    direction: str
    n: int
    groups: tuple[tuple[int, ...], ...]
    causal: bool
    ops: list[list[Op]] = field(default_factory=list)

    # Where the executor finds the results on every rank.
    OUT = "acc.out"
    DQ = "acc.dq"
    DKV = "acc.dkv"

    def describe(self, rank: int) -> str:
        """A readable listing of ``rank``'s ops (used by ``charm-megatron plan``)."""
        lines = []
        for op in self.ops[rank]:
            lines.append("  " + format_op(op))
        return "\n".join(lines)


def format_op(op: Op) -> str:
    if isinstance(op, Comm):
        parts = [f"send {x.kind}[{x.owner}].{x.half}->{x.peer}" for x in op.sends]
        parts += [f"recv {x.kind}[{x.owner}].{x.half}<-{x.peer} into {x.loc}" for x in op.recvs]
        return f"post #{op.handle} on {op.stream}: " + ", ".join(parts)
    if isinstance(op, Wait):
        return f"wait #{op.handle}"
    if isinstance(op, Reset):
        return f"reset {op.loc}"
    if isinstance(op, Tile):
        s = op.spec
        mask = " causal" if s.causal else ""
        arrow = "=>" if op.fresh else "->"
        return (f"tile q[{s.q_owner}].{s.q_half} x kv[{s.kv_owner}].{s.kv_half}{mask}"
                f" {arrow} {op.acc}")
    if isinstance(op, TileBwd):
        s = op.spec
        mask = " causal" if s.causal else ""
        a = "=>" if op.fresh_dq else "->"
        b = "=>" if op.fresh_dkv else "->"
        return (f"tile-bwd q[{s.q_owner}].{s.q_half} x kv[{s.kv_owner}].{s.kv_half}{mask}"
                f" dq {a} {op.dq_acc}, dkv {b} {op.dkv_acc}")
    if isinstance(op, Merge):
        return f"merge {op.src} into {op.acc}"
    raise TypeError(op)
