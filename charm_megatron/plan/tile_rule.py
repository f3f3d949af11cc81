"""Which tiles a call needs: all of them (full attention) or those a sliding window reaches.

A plan computes, for each (q owner, kv owner) pair of ranks, one *tile* of rows
(:func:`charm_megatron.plan.core.tile_spec`). A sliding window ``(left, right)`` (query ``i``
sees key ``j`` iff ``i - left <= j <= i + right`` in global positions, ``-1``: unbounded; on
top of the causal mask) makes many of those tiles empty, and others need only one half of
their rows. A :class:`TileRule` says, pair by pair, which tile a plan must compute: the tile of
the full attention narrowed to the halves with any pair the window keeps, or none. Plans,
their validator and their pruning (:mod:`charm_megatron.plan.prune`) read only that.

:class:`WindowGeometry` holds what places rows in global positions (Megatron's load-balanced
layout for causal calls, contiguous shards otherwise, ``c`` rows per half block) and counts,
exactly and without enumerating rows, the pairs of a tile the window keeps: what the timed
device and the performance model charge a windowed tile, and whether a tile needs a mask at
all (:meth:`WindowGeometry.fully_kept`).

Plan layer: no torch.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass, replace

from charm_megatron.plan.core import TileSpec, tile_spec
from charm_megatron.plan.vocab import Half

__all__ = ["TileRule", "WindowGeometry", "full_rule", "lane_rule", "scaled", "window_rule"]

_HALVES = (Half.FIRST, Half.SECOND)
_INF = float("inf")


@dataclass(frozen=True)
class WindowGeometry:
    """A window on ``n`` ranks of ``rows`` rows each; ``causal`` calls are load-balanced
    (Megatron's layout: chunks ``r`` and ``2n-1-r`` of ``rows / 2``), others contiguous.

    ``group`` ``a > 1``: the plan runs after a head all-to-all in consecutive groups of ``a``
    ranks (plan/head_stage.py), so its blocks are super-blocks: rank ``r`` holds super-block
    ``r // a`` of ``n / a`` (``rows`` is then the super-block's rows) for lane ``r % a``, and
    a super-block lies in global positions as block ``r // a`` of ``n / a`` ranks would (its
    causal halves are chunks ``g`` and ``2n/a-1-g``). Ranks of two lanes share no pair."""

    left: int
    right: int
    n: int
    rows: int
    causal: bool
    group: int = 1

    def start(self, owner: int, half: Half) -> int:
        """First global position of rows ``half`` (a half or a quarter, not FULL) of
        ``owner``'s block: a half is one chunk; a quarter lies in its half's chunk, as many
        rows in as :meth:`Half.span` puts it."""
        parent = half.parent
        if parent is None:
            raise ValueError("the start of a whole block's rows: ask for each half's")
        if parent is not Half.FULL:  # a quarter, inside its half's chunk
            return self.start(owner, parent) + half.span(self.rows)[0] - \
                parent.span(self.rows)[0]
        c = self.rows // 2
        block, blocks = owner // self.group, self.n // self.group
        if self.causal:
            return (block if half is Half.FIRST else 2 * blocks - 1 - block) * c
        return block * self.rows + (0 if half is Half.FIRST else c)

    def same_lane(self, q_owner: int, kv_owner: int) -> bool:
        """Whether the two ranks' blocks hold the same heads (always, without a group)."""
        return (q_owner - kv_owner) % self.group == 0

    def size(self, half: Half) -> int:
        """Rows of ``half`` (the executor's split, :meth:`Half.span`: the first
        ``rows // 2``, the rest; a quarter its half's cut alike)."""
        lo, hi = half.span(self.rows)
        return hi - lo

    def bounds(self, causal_tile: bool) -> tuple[float, float]:
        """The kept ``query - key`` differences ``[lo, hi]``: the window's, and ``>= 0``
        under a causal mask."""
        lo = -self.right if self.right >= 0 else -_INF
        if self.causal or causal_tile:
            lo = max(lo, 0)
        hi = self.left if self.left >= 0 else _INF
        return lo, hi

    def kept_pairs(self, spec: TileSpec) -> int:
        """How many (query row, key row) pairs of ``spec`` the window (and the mask) keep."""
        if not self.same_lane(spec.q_owner, spec.kv_owner):
            return 0
        lo, hi = self.bounds(spec.causal)
        return sum(self._quarter_pairs(spec.q_owner, a, spec.kv_owner, b, lo, hi)
                   for a in _split(spec.q_half) for b in _split(spec.kv_half))

    def fraction(self, spec: TileSpec) -> float:
        """The share of ``spec``'s pairs the window keeps, of what the tile's own mask keeps
        (a causal tile's lower triangle, every pair of another): what a windowed kernel pays
        of the kernel without a window. Memoised: the executor and the model ask per tile."""
        return _fraction(self, spec)

    def fully_kept(self, spec: TileSpec) -> bool:
        """True if the window removes no pair the tile's own mask keeps: then the fused kernel
        without a window computes it exactly."""
        return self.fraction(spec) == 1.0

    def _quarter_pairs(self, i: int, a: Half, j: int, b: Half, lo: float, hi: float) -> int:
        shift = self.start(i, a) - self.start(j, b)  # query - key of the quarters' first rows
        sq, sk = self.size(a), self.size(b)
        upper = _pairs_at_most(hi - shift, sq, sk) if hi < _INF else sq * sk
        lower = _pairs_at_most(lo - 1 - shift, sq, sk) if lo > -_INF else 0
        return max(0, upper - lower)

    def needed(self, spec: TileSpec) -> TileSpec | None:
        """``spec`` narrowed to the halves of each side with any kept pair (``None``: none)."""
        if not self.same_lane(spec.q_owner, spec.kv_owner):
            return None
        lo, hi = self.bounds(spec.causal)
        qs, ks = set(), set()
        for a in _split(spec.q_half):
            for b in _split(spec.kv_half):
                if self._quarter_pairs(spec.q_owner, a, spec.kv_owner, b, lo, hi):
                    qs.add(a)
                    ks.add(b)
        if not qs:
            return None
        return TileSpec(spec.q_owner, spec.kv_owner, _join(qs), _join(ks), spec.causal)


@functools.lru_cache(maxsize=4096)
def _fraction(geometry: WindowGeometry, spec: TileSpec) -> float:
    full = replace(geometry, left=-1, right=-1)
    whole = full.kept_pairs(spec)
    return geometry.kept_pairs(spec) / whole if whole else 0.0


def scaled(window: tuple[int, int], factor: int) -> tuple[int, int]:
    """``window`` over ``factor`` times as many rows (the emulator's virtual problem); ``0``
    and ``-1`` (unbounded) stay as they are."""
    return tuple(w * factor if w > 0 else w for w in window)


def _pairs_at_most(t: float, a: int, b: int) -> int:
    """``#{(x, y) in [0, a) x [0, b) : x - y <= t}``, without enumerating: row ``x`` keeps
    ``min(b, max(0, b + t - x))`` keys; rows up to ``t`` keep all ``b``, the next ``b`` rows
    one fewer each, the rest none."""
    t = int(t // 1)
    full_rows = max(0, min(a, t + 1))  # x <= t
    lo, hi = full_rows, max(full_rows, min(a, b + t))  # rows keeping b + t - x keys
    partial = (hi - lo) * (b + t) - (hi * (hi - 1) - lo * (lo - 1)) // 2
    return full_rows * b + partial


def _split(h: Half) -> tuple[Half, ...]:
    return _HALVES if h is Half.FULL else (h,)


def _join(halves: set[Half]) -> Half:
    return Half.FULL if len(halves) == 2 else next(iter(halves))


class TileRule:
    """The tile each (q owner, kv owner) pair needs (``None``: none), for ``n`` ranks.

    Rules compare and hash by what they require, so two windows (or sequence lengths) that
    need the same tiles share plans. Full attention is :func:`full_rule`."""

    __slots__ = ("n", "causal", "windowed", "geometry", "_wants", "_hash")

    def __init__(self, n: int, causal: bool,
                 wants: tuple[tuple[TileSpec | None, ...], ...] | None = None,
                 windowed: bool | None = None,
                 geometry: WindowGeometry | None = None) -> None:
        self.n, self.causal = n, causal
        # The window that made the rule (``None``: not a window's), so the rule can be
        # derived again for a plan's lanes (:meth:`for_lanes`).
        self.geometry = geometry
        # A table of wants is a window's unless told otherwise (a head all-to-all's lanes).
        self.windowed = wants is not None if windowed is None else windowed
        if wants is None:
            wants = tuple(tuple(tile_spec(i, j, causal) for j in range(n)) for i in range(n))
        self._wants = wants
        self._hash = hash((n, causal, wants))

    def want(self, q_owner: int, kv_owner: int) -> TileSpec | None:
        """The tile the pair needs, or ``None``."""
        return self._wants[q_owner][kv_owner]

    def pairs(self) -> list[TileSpec]:
        """Every needed tile."""
        return [w for row in self._wants for w in row if w is not None]

    def for_lanes(self, a: int) -> TileRule:
        """This window's rule for a plan run after a head all-to-all in groups of ``a`` ranks
        (``self``: the rule on the call's own blocks; the super-blocks are ``a`` times as
        long). Only a window's rule can be lifted."""
        g = self.geometry
        if a == 1 or not self.windowed:
            return self
        if g is None or g.group != 1:
            raise ValueError(f"{self!r} is not a window's rule on the call's own blocks")
        return window_rule(replace(g, rows=g.rows * a, group=a))

    def reach(self) -> tuple[int, int]:
        """How far a rank's needed kv owners lie below and above it: ``(max r - j over
        needed j < r, max j - r over needed j > r)``."""
        below = above = 0
        for w in self.pairs():
            d = w.q_owner - w.kv_owner
            below, above = max(below, d), max(above, -d)
        return below, above

    def __eq__(self, other: object) -> bool:
        return (isinstance(other, TileRule) and self._hash == other._hash
                and (self.n, self.causal, self._wants) == (other.n, other.causal, other._wants))

    def __hash__(self) -> int:
        return self._hash

    def __repr__(self) -> str:
        if not self.windowed:
            return f"TileRule(n={self.n}, causal={self.causal})"
        return (f"TileRule(n={self.n}, causal={self.causal}, windowed: "
                f"{len(self.pairs())} of {self.n * self.n} tiles)")


@functools.lru_cache(maxsize=64)
def full_rule(n: int, causal: bool) -> TileRule:
    """Every tile of the full attention."""
    return TileRule(n, causal)


@functools.lru_cache(maxsize=64)
def lane_rule(n: int, a: int, causal: bool) -> TileRule:
    """The tiles of a plan run after a head all-to-all in consecutive groups of ``a`` ranks
    (plan/head_stage.py): rank ``r`` then holds super-block ``r // a`` of lane ``r % a`` (that
    lane's heads, ``a`` ranks' rows), so only ranks of one lane pair, and a pair's rows are
    those of its super-blocks on ``n / a`` ranks."""
    def want(i: int, j: int) -> TileSpec | None:
        if i % a != j % a:
            return None
        inner = tile_spec(i // a, j // a, causal)
        return TileSpec(i, j, inner.q_half, inner.kv_half, inner.causal)

    wants = tuple(tuple(want(i, j) for j in range(n)) for i in range(n))
    return TileRule(n, causal, wants, windowed=False)


@functools.lru_cache(maxsize=256)
def window_rule(geometry: WindowGeometry) -> TileRule:
    """The tiles ``geometry``'s window needs: the full attention's (or, after a head
    all-to-all, its lanes': :func:`lane_rule`), narrowed or dropped."""
    n, causal, a = geometry.n, geometry.causal, geometry.group
    base = full_rule(n, causal) if a == 1 else lane_rule(n, a, causal)
    wants = tuple(tuple(None if base.want(i, j) is None else geometry.needed(base.want(i, j))
                        for j in range(n)) for i in range(n))
    return TileRule(n, causal, wants, geometry=geometry)
