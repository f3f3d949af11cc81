"""The plan vocabulary: block kinds and their tensors, streams, roles, directions, rows, places.

Everything a plan names is a value of this module, so the builders, the executor, the
validator, the cost model and the performance model agree by construction:

* :class:`Kind` - what a block is; :data:`BLOCKS` - the one table of each kind's tensors,
  their shapes and dtypes (in a message and in an accumulator) and so its bytes;
* :class:`Stream` - which communicator a batch is posted on; :class:`Role` - what an RM+ pair
  exchanges; :class:`Direction` - forward or backward;
* :class:`PassOrder`, :class:`RoleMix`, :class:`SplitMode`, :class:`SuperTileMode`,
  :class:`DiagonalMode` - the values of CHARM+'s
  settings (:mod:`charm_megatron.algorithms.charm.entry`);
* :class:`Half` - which rows of a block a message or a tile uses;
* :class:`Loc` - a buffer of a rank (where a block or a partial lives).

The enums with string values compare and hash equal to their value and print as it
(``Kind.KV == "kv"``, ``f"{Kind.KV}" == "kv"``), so printouts and plain-string callers are
unchanged.
"""

from __future__ import annotations

import enum
import math
from collections.abc import Mapping
from dataclasses import dataclass
from typing import NamedTuple


class _Named(str, enum.Enum):
    """A string-valued enum that prints as its value."""

    def __str__(self) -> str:
        return self.value

    def __format__(self, spec: str) -> str:
        return format(self.value, spec)


class Kind(_Named):
    """What a block is (one rank's shard of one kind of tensor; see :data:`BLOCKS`)."""

    Q = "q"  # forward: the rank's queries
    KV = "kv"  # keys and values, packed
    OUT = "out"  # forward partial: output rows with their log-sum-exp
    QGRAD = "qgrad"  # backward: q, dout, and the final lse with delta = rowsum(dout * out)
    DQ = "dq"  # backward partial: dq rows
    DKV = "dkv"  # backward partial: dk and dv rows
    DOUT = "dout"  # backward: the output's gradient alone (moved by a head all-to-all only)

    @property
    def spec(self) -> BlockSpec:
        return BLOCKS[self]

    @property
    def partial(self) -> bool:
        """True for the results of tiles (accumulated, merged, sent home)."""
        return BLOCKS[self].partial


class Stream(_Named):
    """The communicator a batch is posted on (one process group each, so they overlap).
    ``home_up`` / ``home_down``: the dK, dV pieces a split visiting pass sends home to a
    higher / lower rank, so that a return neither queues behind the round's later pieces
    still crossing on ``cross`` nor waits for the return going the other way (one stream
    per direction: each batch is a send or a receive alone)."""

    KV = "kv"
    Q = "q"
    CROSS = "cross"
    HOME_UP = "home_up"
    HOME_DOWN = "home_down"

    @staticmethod
    def home(src: int, dst: int) -> Stream:
        """The home stream of a return from rank ``src`` to rank ``dst``."""
        return Stream.HOME_UP if dst > src else Stream.HOME_DOWN


class Role(_Named):
    """What an RM+ pair exchanges: kv blocks (each computes with the other's kv) or q blocks
    (each computes the other's tiles and sends the partials back)."""

    KV = "kv"
    Q = "q"


class Direction(_Named):
    FORWARD = "forward"
    BACKWARD = "backward"

    @property
    def query(self) -> Kind:
        """The block a rank's q side travels as: ``q`` forward, ``qgrad`` backward."""
        return Kind.Q if self is Direction.FORWARD else Kind.QGRAD

    @property
    def query_partial(self) -> Kind:
        """What a tile produces for a q block: ``out`` forward, ``dq`` backward."""
        return Kind.OUT if self is Direction.FORWARD else Kind.DQ


class PassOrder(_Named):
    """CHARM+'s pass order (docs/algorithm.md): ``split`` runs the own q's first rounds while
    a counterpart's q crosses, then one pass per counterpart, then the own q's rest; ``joint``
    is the paper's single pass with own and counterpart q side by side."""

    SPLIT = "split"
    JOINT = "joint"


class RoleMix(_Named):
    """How RM+ / CHARM+ exchanges pick their roles (:mod:`charm_megatron.plan.roles`):
    ``bytes`` the cheaper role for the call's shape (the paper's without a shape), ``paper``
    Algorithm 1, ``kv`` / ``q`` every exchange passes kv / q."""

    BYTES = "bytes"
    PAPER = "paper"
    KV = "kv"
    Q = "q"


class SplitMode(_Named):
    """Whether a CHARM+ block crosses in row pieces: ``on`` (two halves), ``home`` (two
    halves, the partials going home on the home streams, one communicator per direction,
    instead of the cross stream), ``quarters`` (four quarters, their returns on the home
    streams; visiting kv only), ``off``, or ``auto`` (the performance model's per-direction
    pick among them; off where no model times the plans)."""

    AUTO = "auto"
    OFF = "off"
    ON = "on"
    HOME = "home"
    QUARTERS = "quarters"


class SuperTileMode(_Named):
    """Whether a rank that holds several kv blocks for the same q rows at once makes one
    kernel call over them (a super-tile, plan/fuse.py): ``on``, ``off``, or ``auto`` (the
    performance model's per-direction pick; off where no model times the plans)."""

    AUTO = "auto"
    OFF = "off"
    ON = "on"


class DiagonalMode(_Named):
    """Whether CHARM+ runs the own causal diagonal tile as its three sub-tiles, placed to fill
    the waits on the cross exchange (``split_diagonal``): ``on`` (the ranks whose first cross
    block arrives whole), ``all`` (every rank with a cross pass), ``off``, or ``auto`` (the
    performance model's per-direction pick among the three; off where no model times the
    plans)."""

    AUTO = "auto"
    OFF = "off"
    ON = "on"
    ALL = "all"


class HeadParallel(_Named):
    """CHARM+'s head-parallel degree ``d``: a head all-to-all in sub-groups of ``d``
    consecutive ranks of each topology group before the plan (``1``: none, the CHARM+ of
    the paper), or ``auto``: the performance model's pick per call (``1`` where no model
    times the plans). ``d`` must divide the group size and both head counts."""

    AUTO = "auto"
    D1 = "1"
    D2 = "2"
    D3 = "3"
    D4 = "4"
    D6 = "6"
    D8 = "8"
    D12 = "12"
    D16 = "16"
    D32 = "32"

    @property
    def degree(self) -> int | None:
        """The degree as a number (``None`` for ``auto``)."""
        return None if self is HeadParallel.AUTO else int(self.value)


class Half(enum.Enum):
    """Rows of a block: all, the first half, the second half (Megatron's two chunks), or a
    quarter: each half's first or second half (a visiting kv block crossing in four pieces,
    docs/algorithm.md, *Visiting kv in pieces*).

    Rows nest exactly: a half is its block's rows cut at ``s // 2`` (:meth:`span`), a quarter
    its half's rows cut the same way, so quarters 1 and 2 are the first half's rows and 3 and
    4 the second's, for any row count (an odd part's second piece is one row longer)."""

    FULL = "full"
    FIRST = "first"
    SECOND = "second"
    Q1 = "quarter1"
    Q2 = "quarter2"
    Q3 = "quarter3"
    Q4 = "quarter4"

    @property
    def parent(self) -> Half | None:
        """The rows this piece is one half of (``None`` for FULL)."""
        return _PARENT.get(self)

    def union(self, other: Half) -> Half:
        """The smallest rows that hold both: their closest common enclosing rows (quarters of
        different halves: FULL, a safe over-approximation for every caller, which sizes
        buffers and messages with it)."""
        mine = self._chain()
        for h in other._chain():
            if h in mine:
                return h
        return Half.FULL

    def covers(self, other: Half) -> bool:
        """True if these rows include ``other``'s rows."""
        return self in other._chain()

    def _chain(self) -> tuple[Half, ...]:
        """These rows and every rows that enclose them, innermost first."""
        return _CHAIN[self]

    @property
    def fraction(self) -> float:
        """The share of the block's rows (exact for even row counts)."""
        return _FRACTION[self]

    @property
    def start_fraction(self) -> float:
        """Where these rows start, as a share of the block's rows (orders pieces)."""
        return _START[self]

    def span(self, s: int) -> tuple[int, int]:
        """``(start, stop)`` of these rows in an ``s``-row block: a piece is the first
        ``len // 2`` or the rest of its parent's rows (the executor's, the windows' and the
        packed layout's one rule)."""
        parent = self.parent
        if parent is None:
            return 0, s
        lo, hi = parent.span(s)
        mid = lo + (hi - lo) // 2
        return (lo, mid) if self in (Half.FIRST, Half.Q1, Half.Q3) else (mid, hi)

    @staticmethod
    def pieces(n: int) -> tuple[Half, ...]:
        """A block's rows in ``n`` pieces, in row order: 1 (FULL), 2 (the halves) or 4 (the
        quarters)."""
        if n not in _PIECES:
            raise ValueError(f"a block's rows are cut in 1, 2 or 4 pieces, not {n}")
        return _PIECES[n]

    def cut(self, n: int) -> tuple[Half, ...]:
        """These rows as they lie in a block cut in ``n`` pieces (:meth:`pieces`), in row
        order: FULL in 4 is the quarters, a half in 4 its two quarters, a half in 2 itself."""
        out = tuple(p for p in Half.pieces(n) if self.covers(p))
        if not out:
            raise ValueError(f"rows {self} are not whole pieces of a block cut in {n}")
        return out

    def __str__(self) -> str:  # short form for printouts
        return _SHORT[self]


_PARENT = {Half.FIRST: Half.FULL, Half.SECOND: Half.FULL, Half.Q1: Half.FIRST,
           Half.Q2: Half.FIRST, Half.Q3: Half.SECOND, Half.Q4: Half.SECOND}
_CHAIN: dict[Half, tuple[Half, ...]] = {}
for _h in Half:
    _c, _p = [_h], _PARENT.get(_h)
    while _p is not None:
        _c.append(_p)
        _p = _PARENT.get(_p)
    _CHAIN[_h] = tuple(_c)
_FRACTION = {h: 0.5 ** (len(_CHAIN[h]) - 1) for h in Half}
_START = {Half.FULL: 0.0, Half.FIRST: 0.0, Half.SECOND: 0.5, Half.Q1: 0.0, Half.Q2: 0.25,
          Half.Q3: 0.5, Half.Q4: 0.75}
_PIECES = {1: (Half.FULL,), 2: (Half.FIRST, Half.SECOND),
           4: (Half.Q1, Half.Q2, Half.Q3, Half.Q4)}
_SHORT = {Half.FULL: "all", Half.FIRST: "1st", Half.SECOND: "2nd", Half.Q1: "1/4",
          Half.Q2: "2/4", Half.Q3: "3/4", Half.Q4: "4/4"}


# ------------------------------------------------------------------------------ block table
class Dtype(_Named):
    """A tensor's dtype: the attention inputs' (bf16, fp16, ...) or fp32. Also the wire dtype
    of partials a call chooses (``CPOptions.partials``)."""

    INPUT = "input"
    FP32 = "fp32"

    def size(self, input_bytes: int) -> int:
        return input_bytes if self is Dtype.INPUT else 4


class Side(enum.Enum):
    """Which operand of a tile a block's rows are rows of (so which half of the tile's rows)."""

    Q = "q"
    KV = "kv"


@dataclass(frozen=True)
class TensorSpec:
    """One tensor of a block. ``dims``: its shape in the sizes ``s`` (the rank's rows, first, so
    a half is a contiguous slice), ``b``, ``hq``, ``hkv``, ``d`` and literal numbers. ``wire``:
    its dtype in a message (and in a receive buffer); ``acc``: in an accumulator (a ``Reset``
    location); ``empty``: its value in an empty accumulator."""

    name: str
    dims: str
    wire: Dtype = Dtype.INPUT
    acc: Dtype | None = None  # None: as on the wire
    empty: float = 0.0

    def shape(self, sizes: Mapping[str, int]) -> tuple[int, ...]:
        return tuple(sizes[t] if t.isalpha() else int(t) for t in self.dims.split())

    def dtype(self, accumulator: bool, wide: bool = False) -> Dtype:
        """Its dtype in an accumulator, else on the wire; ``wide``: partials travel in their
        accumulators' dtype (fp32) instead of the input dtype (``CPOptions(partials="fp32")``)."""
        if accumulator or (wide and self.acc is not None):
            return self.acc or self.wire
        return self.wire

    def row_bytes(self, sizes: Mapping[str, int], input_bytes: int, wide: bool = False) -> int:
        """Bytes of one row (one of ``s``) in a message (``wide``: as :meth:`dtype`)."""
        per_row = self.dtype(False, wide).size(input_bytes)
        for t in self.dims.split()[1:]:
            per_row *= sizes[t] if t.isalpha() else int(t)
        return per_row


@dataclass(frozen=True)
class BlockSpec:
    """A kind's tensors; ``partial``: a tile result (accumulated in fp32, sent in the input
    dtype); ``side``: the tile operand whose rows it holds; ``lse_merge``: partials combine by
    log-sum-exp (the first tensor weighted by the second), else by sum."""

    tensors: tuple[TensorSpec, ...]
    side: Side
    partial: bool = False
    lse_merge: bool = False

    def row_bytes(self, sizes: Mapping[str, int], input_bytes: int, wide: bool = False) -> int:
        return sum(t.row_bytes(sizes, input_bytes, wide) for t in self.tensors)


def block_sizes(b: int, hq: int, hkv: int, d: int, dv: int = 0,
                s: int | None = None) -> dict[str, int]:
    """The sizes :data:`BLOCKS`' dims are written in: ``d`` the q / k head dim, ``dv`` the v
    (and output) head dim (``0``: as ``d``; they differ only for multi-latent attention),
    and, where a caller shapes whole blocks, ``s`` the rank's rows."""
    sizes = {"b": b, "hq": hq, "hkv": hkv, "d": d, "dv": dv or d}
    if s is not None:
        sizes["s"] = s
    return sizes


_FP32 = Dtype.FP32
# The one statement of every block's layout, in the sizes of block_sizes (MLA: q / k 192,
# v 128). The wire-dtype rule: partials (out, dq, dkv)
# accumulate in fp32 and travel in the input dtype (half the bytes for bf16; one rounding per
# hop, summed in fp32 on both sides), or in fp32 with ``wide`` (CPOptions(partials="fp32"):
# what ring-flash-attention sends, and the paper's ring); lse and the (lse, delta)
# statistics are fp32 everywhere.
# Own blocks are the caller's tensors themselves, in these layouts.
BLOCKS: dict[Kind, BlockSpec] = {
    Kind.Q: BlockSpec((TensorSpec("q", "s b hq d"),), Side.Q),
    Kind.KV: BlockSpec((TensorSpec("k", "s b hkv d"), TensorSpec("v", "s b hkv dv")), Side.KV),
    Kind.QGRAD: BlockSpec((TensorSpec("q", "s b hq d"), TensorSpec("dout", "s b hq dv"),
                           TensorSpec("lse_delta", "s b hq 2", _FP32)), Side.Q),
    Kind.OUT: BlockSpec((TensorSpec("out", "s b hq dv", acc=_FP32),
                         TensorSpec("lse", "s b hq", _FP32, empty=-math.inf)),
                        Side.Q, partial=True, lse_merge=True),
    Kind.DQ: BlockSpec((TensorSpec("dq", "s b hq d", acc=_FP32),), Side.Q, partial=True),
    Kind.DKV: BlockSpec((TensorSpec("dk", "s b hkv d", acc=_FP32),
                         TensorSpec("dv", "s b hkv dv", acc=_FP32)), Side.KV, partial=True),
    Kind.DOUT: BlockSpec((TensorSpec("dout", "s b hq dv"),), Side.Q),
}


# -------------------------------------------------------------------------------- locations
class Loc(NamedTuple):
    """A buffer of a rank. ``stem`` says what it is for (``kv.rx``: kv received from an RM+
    peer); ``slot`` tells apart the copies that alternate between consecutive units or passes;
    ``item`` the q blocks of one exchange. Prints as ``stem[slot][.item]`` (``q.ret0.1``).

    By convention ``own.*`` are the rank's own inputs (the caller's tensors), ``acc.*``
    accumulators and one-tile partials, anything else a receive buffer. A builder declares its
    stems once as constants and derives the numbered copies with :meth:`at`; the set of
    locations a plan uses is fixed and small, which keeps memory O(1) in the CP size.
    (A named tuple: every interpreter looks locations up per op, and tuples hash in C.)
    """

    stem: str
    slot: int | None = None
    item: int | None = None

    def at(self, slot: int, item: int | None = None) -> Loc:
        return Loc(self.stem, slot, item)

    @staticmethod
    def own(kind: Kind) -> Loc:
        """Where a rank's own input block of ``kind`` is (``own.q``, ``own.kv``, ``own.qgrad``)."""
        kind = Kind(kind)
        if kind not in OWN:
            raise ValueError(f"{kind} is a partial, not an input block: no own location")
        return OWN[kind]

    def __str__(self) -> str:
        s = self.stem if self.slot is None else f"{self.stem}{self.slot}"
        return s if self.item is None else f"{s}.{self.item}"


def as_loc(loc: Loc | str) -> Loc:
    """``loc`` as a :class:`Loc`: a plain name (``"own.kv"``, ``"toy.kv"``) is a stem."""
    return Loc(loc) if type(loc) is str else loc


# Where a rank's own inputs are (the caller's tensors, never written by a plan).
OWN: dict[Kind, Loc] = {Kind.Q: Loc("own.q"), Kind.KV: Loc("own.kv"),
                        Kind.QGRAD: Loc("own.qgrad")}
# Where every plan leaves its results (the executor reads them from there).
RESULT: dict[Kind, Loc] = {Kind.OUT: Loc("acc.out"), Kind.DQ: Loc("acc.dq"),
                           Kind.DKV: Loc("acc.dkv")}
