"""Buffer lifetimes of one rank's op list: when each buffer is born, which rows it must hold,
and after which op it can be freed.

A plan names a small fixed set of locations (:class:`~charm_megatron.plan.vocab.Loc`) and
reuses them, but a location is not busy all the time: a receive buffer is dead between its last
read and the next receive into it, and a block received for one unit is often needed for one
tile only. Holding every location at full size for the whole call (what a fixed buffer table
does) makes the peak the *sum* of all locations; allocating each *lifetime* when it begins, at
the rows it actually uses, and freeing it after its last use makes the peak the largest set of
lifetimes alive at one time. On CPU and with CUDA's caching allocator a fresh allocation per
lifetime costs next to nothing.

A lifetime starts where a location is written afresh: a receive into it (:class:`Comm`), a
:class:`Reset`, or a ``fresh`` tile result. It ends at its last use: a read by a tile or a
merge, a read-modify-write of an accumulator, or a send from it, which lasts until the
:class:`Wait` of its batch (the data must stay put while it travels); a receive lasts at least
until its Wait. Its rows are those of the receive or the fresh tile, or, for an accumulator,
the union of the rows any op touches (a causal counterpart's partial often needs only one
half). Own inputs (``own.*``) belong to the caller and the results (``acc.out``, ``acc.dq``,
``acc.dkv``) to the end of the call: they are never freed and results are always full.

The executor allocates and frees by this analysis; the validator replays it (frees included)
on every rank, so a plan whose buffers would be read after being freed, or outside the rows
they were allocated with, is rejected before it runs.

Plan layer: no torch.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

from charm_megatron.plan.core import Comm, Half, Merge, Op, Reset, SuperTile, Tile, TileBwd, Wait
from charm_megatron.plan.vocab import OWN, RESULT, Loc

__all__ = ["Lifetimes", "lifetimes"]

_KEEP = frozenset(OWN.values()) | frozenset(RESULT.values())


@dataclass(frozen=True)
class Lifetimes:
    """One rank's buffer lifetimes.

    ``rows[(i, loc)]``: the rows the buffer that op ``i`` creates in ``loc`` must hold (a
    compact half-sized buffer where they are one half). ``free_after[i]``: the locations whose
    lifetime ends with op ``i``.
    """

    rows: dict[tuple[int, Loc], Half] = field(default_factory=dict)
    free_after: dict[int, tuple[Loc, ...]] = field(default_factory=dict)


@dataclass
class _Life:
    born: int
    rows: Half | None  # None: an accumulator whose rows are still being collected
    fixed: bool  # rows set by what created it (a receive, a fresh tile); accesses stay inside
    last: int


class _Scan:
    def __init__(self) -> None:
        self.live: dict[Loc, _Life] = {}
        self.done: list[tuple[Loc, _Life]] = []
        self.sending: dict[int, list[Loc]] = {}  # handle -> locations its batch reads/writes
        self.inflight: dict[Loc, int] = {}  # transfers from or into a location, not waited

    def begin(self, i: int, loc: Loc, rows: Half | None) -> None:
        # The validator rejects these plans too; here they would free the wrong buffer.
        if self.inflight.get(loc):
            raise ValueError(f"op {i} writes {loc} while a transfer from or into it is in "
                             "flight")
        old = self.live.pop(loc, None)
        if old is not None:
            if old.last >= i:
                raise ValueError(f"op {i} both reads {loc} and writes it afresh")
            self.done.append((loc, old))
        self.live[loc] = _Life(i, rows, rows is not None, i)

    def use(self, i: int, loc: Loc, rows: Half | None) -> None:
        life = self.live.get(loc)
        if life is None:
            return  # an own input (the caller's) or a location the plan never created
        life.last = max(life.last, i)
        if rows is not None and not life.fixed:
            life.rows = rows if life.rows is None else life.rows.union(rows)

    def held(self, loc: Loc) -> Half | None:
        life = self.live.get(loc)
        return None if life is None else life.rows


def _tile(scan: _Scan, i: int, op: Tile | TileBwd) -> None:
    s = op.spec
    scan.use(i, op.q_loc, s.q_half)
    scan.use(i, op.kv_loc, s.kv_half)
    if type(op) is Tile:
        results = ((op.acc, op.fresh, s.q_half),)
    else:
        results = ((op.dq_acc, op.fresh_dq, s.q_half), (op.dkv_acc, op.fresh_dkv, s.kv_half))
    for loc, fresh, rows in results:
        if fresh:
            scan.begin(i, loc, rows)
        else:
            scan.use(i, loc, rows)


def lifetimes(ops: Sequence[Op]) -> Lifetimes:
    """The lifetimes of the buffers of one rank's op list (see the module docstring)."""
    scan = _Scan()
    for i, op in enumerate(ops):
        t = type(op)
        if t is Comm:
            touched = []
            for x in op.sends:
                scan.use(i, x.loc, x.half)
                touched.append(x.loc)
            for x in op.recvs:
                scan.begin(i, x.loc, x.half)
                touched.append(x.loc)
            for loc in touched:
                scan.inflight[loc] = scan.inflight.get(loc, 0) + 1
            scan.sending[op.handle] = touched
        elif t is Wait:
            for loc in scan.sending.pop(op.handle, ()):
                scan.use(i, loc, None)
                scan.inflight[loc] -= 1
        elif t is Reset:
            scan.begin(i, op.loc, None)
        elif t is Tile or t is TileBwd:
            _tile(scan, i, op)
        elif t is SuperTile:  # its members, all at op i
            for m in op.members:
                _tile(scan, i, m)
        elif t is Merge:
            rows = scan.held(op.src)
            scan.use(i, op.src, rows)
            scan.use(i, op.acc, rows)
    scan.done.extend(scan.live.items())
    # A batch never waited (a broken plan, which the validator rejects as such): its buffers
    # are never freed.
    unwaited = {loc for locs in scan.sending.values() for loc in locs}
    out = Lifetimes()
    free: dict[int, list[Loc]] = {}
    for loc, life in scan.done:
        keep = loc in _KEEP or (loc in unwaited and scan.live.get(loc) is life)
        rows = Half.FULL if keep or life.rows is None else life.rows
        out.rows[(life.born, loc)] = rows
        if not keep:
            free.setdefault(life.last, []).append(loc)
    out.free_after.update({i: tuple(locs) for i, locs in free.items()})
    return out
