"""Plans: who sends what to whom, in which order, and which tile is computed where.

A plan is pure data (no torch, no process groups). For each CP rank it is an ordered list of
ops that the executor interprets with real communication and kernels, the validator checks
symbolically, and the performance model replays with costs.

Vocabulary (:mod:`charm_megatron.plan.vocab`)
---------------------------------------------
* A *block* is one rank's shard of one :class:`Kind` of tensor. Forward kinds: ``q``, ``kv``
  (K and V packed), ``out`` (a partial output with its log-sum-exp). Backward kinds: ``qgrad``
  (q and dout of a rank's rows, with the final lse and ``delta = rowsum(dout * out)``), ``kv``,
  ``dq``, ``dkv`` (gradient partials). :data:`~charm_megatron.plan.vocab.BLOCKS` lists each
  kind's tensors and dtypes.
* ``Half`` says which rows of a block a message or a tile uses: under Megatron's causal
  load-balanced layout most tiles need only the first or second half of a block.
* A :class:`Loc` is a buffer on a rank: ``own.*`` (the rank's own inputs), ``acc.*``
  (accumulators), anything else a reused receive buffer. The set of locations a plan uses is
  fixed and small, which is what keeps memory O(1) in the CP size.
* Communication is posted in *batches* (``Comm``) on a :class:`Stream` and completed by
  ``Wait``. Each stream maps to its own process group (own NCCL communicator) so streams really
  overlap.

Interpreters of plans (the executor, the validator, the performance model, the printout)
subclass :class:`OpInterpreter`: one method per op type, one dispatch.
"""

from __future__ import annotations

import abc
import functools
from dataclasses import dataclass, field
from typing import Generic, TypeVar

from charm_megatron.plan.vocab import RESULT, Direction, Half, Kind, Loc, Stream, as_loc

__all__ = [
    "STREAMS", "Comm", "Direction", "Half", "Kind", "Loc", "Merge", "Op", "OpInterpreter",
    "Plan", "Reset", "Stream", "SuperTile", "Tile", "TileBwd", "TileSpec", "Wait", "Xfer",
    "diagonal_sub_tiles", "format_op", "tile_spec",
]

STREAMS = tuple(Stream)


def _typed(op: object, **types: type) -> None:
    """Normalise plain strings in an op's fields (``"kv"``, ``"own.kv"``) to the vocabulary's
    types, so hand-written plans and typed ones are the same values."""
    for name, cls in types.items():
        value = getattr(op, name)
        if type(value) is str:
            object.__setattr__(op, name, as_loc(value) if cls is Loc else cls(value))


@dataclass(frozen=True)
class TileSpec:
    """Which rows of q-block ``q_owner`` attend to which rows of kv-block ``kv_owner``."""

    q_owner: int
    kv_owner: int
    q_half: Half
    kv_half: Half
    causal: bool


@functools.lru_cache(maxsize=4096)  # a pure function; builders and the validator ask often
def tile_spec(q_owner: int, kv_owner: int, causal: bool) -> TileSpec:
    """The tile ``(q_owner, kv_owner)`` under Megatron's load-balanced layout
    (docs/algorithm.md, notation).

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


def diagonal_sub_tiles(spec: TileSpec) -> tuple[TileSpec, TileSpec, TileSpec] | None:
    """A causal diagonal tile (``q x kv`` of one block, both whole, under the load-balanced
    layout) as its three sub-tiles, in row order: ``q.1st x kv.1st`` causal (chunk ``r``
    against itself), ``q.2nd x kv.1st`` unmasked (chunk ``2n-1-r`` lies wholly after chunk
    ``r``) and ``q.2nd x kv.2nd`` causal; ``q.1st x kv.2nd`` is wholly masked and so none.
    Together they are exactly the diagonal's (q row, kv row) pairs (docs/algorithm.md, *The
    own diagonal tile in three*). ``None`` for any other tile."""
    if not (spec.causal and spec.q_owner == spec.kv_owner
            and spec.q_half is Half.FULL and spec.kv_half is Half.FULL):
        return None
    q, k = spec.q_owner, spec.kv_owner
    return (TileSpec(q, k, Half.FIRST, Half.FIRST, True),
            TileSpec(q, k, Half.SECOND, Half.FIRST, False),
            TileSpec(q, k, Half.SECOND, Half.SECOND, True))


@dataclass(frozen=True)
class Xfer:
    """One message of a batch: ``loc`` is the source (send) or destination (receive).
    ``parts``: the message carries one of that many equal head slices of the rows (a head
    all-to-all's message, plan/head_stage.py); 1: all heads."""

    peer: int
    loc: Loc
    kind: Kind
    owner: int
    half: Half
    parts: int = 1

    def __post_init__(self) -> None:
        if type(self.kind) is not Kind or type(self.loc) is str:
            _typed(self, kind=Kind, loc=Loc)


@dataclass(frozen=True)
class Comm:
    """Post a batch of sends and receives on ``stream``; completed by ``Wait(handle)``."""

    handle: int
    stream: Stream
    sends: tuple[Xfer, ...] = ()
    recvs: tuple[Xfer, ...] = ()

    def __post_init__(self) -> None:
        if type(self.stream) is not Stream:
            _typed(self, stream=Stream)

    @functools.cached_property
    def peers(self) -> tuple[int, ...]:
        """The ranks this batch exchanges with, in order of first mention."""
        return tuple(dict.fromkeys(x.peer for x in self.sends + self.recvs))

    @functools.cached_property
    def counts(self) -> tuple[dict[int, int], dict[int, int]]:
        """Messages to and from each peer: ``(sends per peer, receives per peer)``."""
        out: dict[int, int] = {}
        into: dict[int, int] = {}
        for x in self.sends:
            out[x.peer] = out.get(x.peer, 0) + 1
        for x in self.recvs:
            into[x.peer] = into.get(x.peer, 0) + 1
        return out, into


@dataclass(frozen=True)
class Wait:
    handle: int


@dataclass(frozen=True)
class Reset:
    """Make accumulator ``loc`` empty (outputs 0 with lse −inf; gradients 0)."""

    loc: Loc
    kind: Kind
    owner: int

    def __post_init__(self) -> None:
        if type(self.kind) is not Kind or type(self.loc) is str:
            _typed(self, kind=Kind, loc=Loc)


@dataclass(frozen=True)
class Tile:
    """Forward: attention of ``spec`` (q rows from ``q_loc``, kv rows from ``kv_loc``) merged
    into accumulator ``acc``; with ``fresh``, the partial *replaces* what ``acc`` held and keeps
    the kernel's dtype and only the tile's rows (a partial that is only sent on, never merged
    into, needs no fp32 accumulator)."""

    spec: TileSpec
    q_loc: Loc
    kv_loc: Loc
    acc: Loc
    fresh: bool = False

    def __post_init__(self) -> None:
        if str in (type(self.q_loc), type(self.kv_loc), type(self.acc)):
            _typed(self, q_loc=Loc, kv_loc=Loc, acc=Loc)


@dataclass(frozen=True)
class TileBwd:
    """Backward of tile ``spec``: dq rows added into ``dq_acc``, dk/dv rows into ``dkv_acc``.
    With ``fresh_dq`` / ``fresh_dkv`` the kernel's gradient *replaces* what the location held
    (input dtype, the tile's rows only): a one-tile partial that is only sent on."""

    spec: TileSpec
    q_loc: Loc
    kv_loc: Loc
    dq_acc: Loc
    dkv_acc: Loc
    fresh_dq: bool = False
    fresh_dkv: bool = False

    def __post_init__(self) -> None:
        if str in (type(self.q_loc), type(self.kv_loc), type(self.dq_acc), type(self.dkv_acc)):
            _typed(self, q_loc=Loc, kv_loc=Loc, dq_acc=Loc, dkv_acc=Loc)


@dataclass(frozen=True)
class Merge:
    """Combine the partial received in ``src`` into accumulator ``acc`` (lse-merge for ``out``,
    sum for gradients), at the rows the partial holds."""

    acc: Loc
    src: Loc

    def __post_init__(self) -> None:
        if str in (type(self.acc), type(self.src)):
            _typed(self, acc=Loc, src=Loc)


@dataclass(frozen=True)
class SuperTile:
    """One kernel call over several kv blocks held at once for the same q rows (a
    *super-tile*, docs/algorithm.md): the ``members`` (all :class:`Tile` or all
    :class:`TileBwd`) share their q block, its rows and the accumulator of the q side, and
    none is masked. The executor concatenates the members' kv rows in order and calls the
    kernel once: forward, one partial merged once into ``acc``; backward, dq added once and
    dk, dv split back by rows into each member's ``dkv_acc`` (``fresh_dkv`` per member). Every
    other interpreter reads it as its members in order (what it computes is exactly theirs).

    Its shape is checked here, so no interpreter meets a malformed one: at least two
    members, one type, the same ``q_loc``, q owner and q rows, the same ``acc`` /
    ``dq_acc`` and not ``fresh`` there, no causal member."""

    members: tuple[Tile, ...] | tuple[TileBwd, ...]

    def __post_init__(self) -> None:
        why = super_tile_refusal(self.members)
        if why is not None:
            raise ValueError(f"not a super-tile: {why}")

    @property
    def backward(self) -> bool:
        return type(self.members[0]) is TileBwd

    @property
    def first(self) -> Tile | TileBwd:
        return self.members[0]


def _q_side(op: Tile | TileBwd) -> tuple:
    """What the members of a super-tile share: q block, its rows, the q-side accumulator."""
    s = op.spec
    if type(op) is Tile:
        return (op.q_loc, s.q_owner, s.q_half, op.acc, op.fresh)
    return (op.q_loc, s.q_owner, s.q_half, op.dq_acc, op.fresh_dq)


def super_tile_refusal(members: tuple) -> str | None:
    """Why ``members`` cannot be one super-tile (``None``: they can)."""
    if len(members) < 2:
        return f"{len(members)} member(s); a super-tile has two or more"
    kind = type(members[0])
    if kind not in (Tile, TileBwd) or any(type(m) is not kind for m in members):
        return "members must be all Tile or all TileBwd"
    if any(m.spec.causal for m in members):
        return "a causal tile runs alone"
    side = _q_side(members[0])
    if side[-1]:
        return "the q-side result must be accumulated, not fresh"
    if any(_q_side(m) != side for m in members[1:]):
        return "members must share the q block, its rows and its accumulator"
    if kind is TileBwd and len({m.dkv_acc for m in members}) < len(members):
        return "each member's dk, dv go to an accumulator of its own"
    return None


Op = Comm | Wait | Reset | Tile | TileBwd | Merge | SuperTile
T = TypeVar("T")


class OpInterpreter(abc.ABC, Generic[T]):
    """Something that gives every op type a meaning: one ``on_*`` method per type.

    :meth:`interpret` is the one dispatch over op types. A new op type is one more abstract
    method here, which every interpreter (executor, validator, performance model, printout)
    must then implement before it can be instantiated.
    """

    def interpret(self, op: Op) -> T:
        name = _HANDLERS.get(type(op))
        if name is None:
            raise TypeError(f"unknown op {op!r}")
        return getattr(self, name)(op)

    @abc.abstractmethod
    def on_comm(self, op: Comm) -> T: ...

    @abc.abstractmethod
    def on_wait(self, op: Wait) -> T: ...

    @abc.abstractmethod
    def on_reset(self, op: Reset) -> T: ...

    @abc.abstractmethod
    def on_tile(self, op: Tile) -> T: ...

    @abc.abstractmethod
    def on_tile_bwd(self, op: TileBwd) -> T: ...

    @abc.abstractmethod
    def on_merge(self, op: Merge) -> T: ...

    @abc.abstractmethod
    def on_super_tile(self, op: SuperTile) -> T: ...


_HANDLERS = {Comm: "on_comm", Wait: "on_wait", Reset: "on_reset", Tile: "on_tile",
             TileBwd: "on_tile_bwd", Merge: "on_merge", SuperTile: "on_super_tile"}


@dataclass
class Plan:
    """Per-rank op lists for one direction (``forward`` or ``backward``) of one algorithm."""

    algo: str
    direction: Direction
    n: int
    groups: tuple[tuple[int, ...], ...]
    causal: bool
    ops: list[list[Op]] = field(default_factory=list)
    #: Per rank, the role of every exchange (``roles.Decision``), for algorithms with roles.
    decisions: list[list] = field(default_factory=list)
    #: Built with q-pair returns completed before the next unit's tiles (``early_returns``)
    #: or lean (one unit's blocks at a time, returns first) to stay within
    #: ``plan.memory.BOUND`` x ring's peak memory (``registry.build_plan``).
    early_returns: bool = False
    lean: bool = False
    #: The tiles the plan computes (:class:`~charm_megatron.plan.tile_rule.TileRule`): those
    #: of a sliding window; ``None``: every tile of the full attention.
    tiles: object = None
    #: ``a > 1``: the plan runs after a head all-to-all inside consecutive groups of ``a``
    #: ranks (Ulysses, plan/head_stage.py): each block then holds ``a`` ranks' rows and
    #: ``1/a`` of the heads, and tiles pair ranks of one lane (``rank % a``) only.
    head_group: int = 1

    # Where the executor finds the results on every rank.
    OUT = RESULT[Kind.OUT]
    DQ = RESULT[Kind.DQ]
    DKV = RESULT[Kind.DKV]

    def __post_init__(self) -> None:
        self.direction = Direction(self.direction)

    @property
    def rule(self):
        """The plan's :class:`~charm_megatron.plan.tile_rule.TileRule` (the full attention's
        where ``tiles`` is ``None``)."""
        if self.tiles is not None:
            return self.tiles
        from charm_megatron.plan.tile_rule import full_rule, lane_rule  # imports this module

        if self.head_group > 1:
            return lane_rule(self.n, self.head_group, self.causal)
        return full_rule(self.n, self.causal)

    @functools.cached_property
    def streams(self) -> frozenset[Stream]:
        """The streams any rank of the plan posts on. Computed once per plan: a call's plans
        are memoised and shared, and their ops do not change after assembly."""
        return frozenset(op.stream for ops in self.ops for op in ops if type(op) is Comm)

    def comms(self, rank: int) -> list[Comm]:
        """``rank``'s batches, in posted order."""
        return [op for op in self.ops[rank] if type(op) is Comm]

    def describe(self, rank: int) -> str:
        """A readable listing of ``rank``'s ops (used by ``charm-megatron plan``)."""
        return "\n".join("  " + format_op(op) for op in self.ops[rank])


class _Printer(OpInterpreter[str]):
    """The one-line form of each op (the format of ``charm-megatron plan`` printouts)."""

    def on_comm(self, op: Comm) -> str:
        parts = [f"send {x.kind}[{x.owner}].{x.half}{_heads(x)}->{x.peer}" for x in op.sends]
        parts += [f"recv {x.kind}[{x.owner}].{x.half}{_heads(x)}<-{x.peer} into {x.loc}"
                  for x in op.recvs]
        return f"post #{op.handle} on {op.stream}: " + ", ".join(parts)

    def on_wait(self, op: Wait) -> str:
        return f"wait #{op.handle}"

    def on_reset(self, op: Reset) -> str:
        return f"reset {op.loc}"

    def on_tile(self, op: Tile) -> str:
        arrow = "=>" if op.fresh else "->"
        return f"tile {_tile_rows(op.spec)} {arrow} {op.acc}"

    def on_tile_bwd(self, op: TileBwd) -> str:
        a = "=>" if op.fresh_dq else "->"
        b = "=>" if op.fresh_dkv else "->"
        return f"tile-bwd {_tile_rows(op.spec)} dq {a} {op.dq_acc}, dkv {b} {op.dkv_acc}"

    def on_merge(self, op: Merge) -> str:
        return f"merge {op.src} into {op.acc}"

    def on_super_tile(self, op: SuperTile) -> str:
        first, s = op.first, op.first.spec
        kv = " + ".join(f"kv[{m.spec.kv_owner}].{m.spec.kv_half}" for m in op.members)
        rows = f"q[{s.q_owner}].{s.q_half} x ({kv})"
        if not op.backward:
            return f"super-tile {rows} -> {first.acc}"
        dkv = ", ".join(f"{'=>' if m.fresh_dkv else '->'} {m.dkv_acc}" for m in op.members)
        return f"super-tile-bwd {rows} dq -> {first.dq_acc}, dkv {dkv}"


def _heads(x: Xfer) -> str:
    return "" if x.parts == 1 else f".heads/{x.parts}"


def _tile_rows(s: TileSpec) -> str:
    mask = " causal" if s.causal else ""
    return f"q[{s.q_owner}].{s.q_half} x kv[{s.kv_owner}].{s.kv_half}{mask}"


_PRINTER = _Printer()


def format_op(op: Op) -> str:
    """One op as a line of a printout (``=>``: the tile's result replaces the location's)."""
    return _PRINTER.interpret(op)
