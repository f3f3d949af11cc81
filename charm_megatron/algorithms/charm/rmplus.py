"""RM+ inside a group: its units (one RM+ round each) and passes, which every CHARM+ rank
builder runs (docs/algorithm.md, *RM+*; with one group CHARM+ *is* RM+).

A *pass* runs (some of) the group's RM+ rounds for the q blocks a rank holds (its own, or a
counterpart's) against the kv block it holds (its own, or a visiting one). Per unit: post the
next unit's exchange, wait for this one's, compute its tiles; q-pair partials go back one unit
later (:func:`run_pass`). What crosses between groups, and in which order the passes run, is
the other modules' (:mod:`charm_megatron.algorithms.charm.cross` and the modules it leads to).

Functions over :class:`~charm_megatron.algorithms.charm.state.RankState`; the settings read here
(``roles``, ``lean``, ``early_returns``) are its plain values.

Plan layer: no torch.
"""

from __future__ import annotations

import functools
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, replace

from charm_megatron.algorithms.charm.state import OWN_KV, KvHeld, RankState
from charm_megatron.plan.core import (
    Half,
    Kind,
    Loc,
    Merge,
    Op,
    Plan,
    Reset,
    Stream,
    Tile,
    TileBwd,
    TileSpec,
    Wait,
    Xfer,
    diagonal_sub_tiles,
    tile_spec,
)
from charm_megatron.plan.program import Return
from charm_megatron.plan.roles import Decision, choose, row_bytes
from charm_megatron.plan.vocab import Role

__all__ = ["Item", "Pass", "Unit", "hold_own_kv", "kv_half", "owners", "q_half", "run_pass"]

# Locations of RM+ units (slot: the copy of alternating units; item: which of the q blocks
# exchanged in one unit).
_KV_RX = Loc("kv.rx")  # the peer's kv block of a kv unit
_KV_DRET = Loc("kv.dret")  # our dkv partial coming back from a kv unit's peer
_PEER_DKV = Loc("acc.pdkv")  # the kv unit peer's dkv partial, computed here
_Q_RX = Loc("q.rx")  # the peer's q blocks of a q unit
_Q_RET = Loc("q.ret")  # our q blocks' partials coming back from a q unit's peer
_SERVED = Loc("acc.svc")  # the partial of a tile served for a q unit's peer (sent back)


@dataclass(frozen=True)
class Item:
    """A q block processed in a pass: whose rows, where they are, where they accumulate."""

    owner: int
    q_loc: Loc
    acc: Loc


@dataclass(frozen=True)
class Pass:
    """One run of (some of) the group's RM+ rounds for the q blocks a rank holds.

    ``own``: the rank's own q; ``cross``: the counterpart's q of cross round ``cross_round``;
    ``rounds``: indices into the group's RM+ rounds; ``own_kv``: also the tiles with the kv
    block the rank holds in the pass. ``visiting`` (pass-kv): the rank holds the visiting kv
    block of its counterpart of ``cross_round`` instead of its own, and only its own q.
    """

    own: bool
    cross_round: int | None
    rounds: tuple[int, ...]
    own_kv: bool
    visiting: bool = False


@dataclass(frozen=True)
class Unit:
    """One RM+ round of a pass as one rank runs it: exchange ``role`` blocks with ``peer``,
    which holds the q blocks of ``peer_owners`` in this pass; receive into copy ``slot``;
    post on ``stream`` (by the round's parity, whatever the role: both streams stay busy).

    Steps (see :func:`run_pass`): *post* the exchange one unit ahead, *compute* its tiles
    once it arrived, *return* the partials it produced to their owners (completed one unit
    later).
    """

    index: int
    role: Role
    peer: int
    peer_owners: tuple[int, ...]
    slot: int
    stream: Stream
    peer_kv: int  # whose kv block the peer holds in this pass (its own, or a visiting one)


def _union(halves: Iterable[Half]) -> Half:
    """The rows a message must carry: the union of the rows its tiles use."""
    out = None
    for h in halves:
        out = h if out is None else out.union(h)
    return out or Half.FULL


# Pure functions of their arguments, asked for every message a builder posts: memoised.
@functools.lru_cache(maxsize=8192)
def _q_rows_needed(owner: int, kv_owners: tuple[int, ...], causal: bool, held: Half) -> Half:
    return _within(_union(tile_spec(owner, j, causal).q_half for j in kv_owners), held)


@functools.lru_cache(maxsize=8192)
def _kv_rows_needed(kv_owner: int, q_owners: tuple[int, ...], causal: bool, held: Half) -> Half:
    return _within(_union(tile_spec(i, kv_owner, causal).kv_half for i in q_owners), held)


def _within(half: Half, rows: Half) -> Half:
    """The rows of ``half`` inside ``rows`` (``rows`` is FULL, or ``half`` covers it)."""
    if rows is Half.FULL:
        return half
    if not half.covers(rows):
        raise AssertionError(f"rows {half} hold none of rows {rows}")
    return rows


def hold_own_kv(st: RankState) -> None:
    """Hold the rank's own kv block in the passes that follow (its dkv: the result)."""
    st.kv = KvHeld(st.rank, OWN_KV, Plan.DKV)


# -- which blocks a rank holds in a pass, and its units ----------------------------------------

def owners(st: RankState, ps: Pass, local: int) -> list[int]:
    """Owners of the q blocks that local index ``local`` of our group holds in pass ``ps``."""
    out = [st.group[local]] if ps.own else []
    if ps.cross_round is not None and not ps.visiting:
        partner = st.cross[ps.cross_round].get(st.g)
        if partner is not None:
            out.append(st.groups[partner][local])
    return out


def _units(st: RankState, ps: Pass) -> list[Unit]:
    """The rounds of ``ps`` this rank takes part in. A unit's buffers live until the end of
    the next unit, so only two adjacent units of the same role need different slots (memory:
    one set of receive buffers per stream when kv and q rounds alternate, two at most)."""
    units: list[Unit] = []
    for i in ps.rounds:
        rd = st.rounds[i]
        if st.local not in rd.partner:
            continue
        peer_local = rd.partner[st.local]
        peer_owners = tuple(owners(st, ps, peer_local))
        role = _pair_role(st, rd.role, st.group[peer_local], peer_owners,
                          owners(st, ps, st.local), _kv_owner(st, ps, peer_local))
        slot = 1 - units[-1].slot if units and units[-1].role is role else 0
        stream = Stream.KV if i % 2 == 0 else Stream.Q
        units.append(Unit(len(units), role, st.group[peer_local], peer_owners, slot,
                          stream, _kv_owner(st, ps, peer_local)))
    return units


def _kv_owner(st: RankState, ps: Pass, local: int) -> int:
    """Whose kv block local index ``local`` of our group holds in pass ``ps``."""
    if ps.visiting:
        return st.groups[st.cross[ps.cross_round][st.g]][local]
    return st.group[local]


def _pair_role(st: RankState, paper: Role, peer: int, peer_owners: Sequence[int],
               mine: Sequence[int], peer_kv: int) -> Role:
    """The role of the RM+ pair (us, ``peer``) in a pass, ``mine`` the q blocks we hold: the
    paper's, forced, or by the bytes both alternatives move in both directions (computed
    alike on both sides)."""
    kv_b = q_b = None
    shape = st.roles.shape
    if shape is not None:
        # Sums of whole and half row sizes are exact in floating point, so the peer,
        # which adds the same terms in the other order, gets the same bytes.
        kv_b = q_b = 0.0
        kv_kinds = (Kind.KV, Kind.DKV) if st.bwd else (Kind.KV,)
        q_kinds = (st.qkind, st.pkind)
        for src, dst, held, other in ((st.kv.owner, peer_kv, mine, peer_owners),
                                      (peer_kv, st.kv.owner, peer_owners, mine)):
            half = kv_half(st, src, other)
            kv_b += sum(row_bytes(k, shape, half) for k in kv_kinds)
            for o in held:  # these q blocks served by the other kv, partials back
                q_b += sum(row_bytes(k, shape, q_half(st, o, [dst])) for k in q_kinds)
    role = choose(st.roles, paper, kv_b, q_b)
    context = (f"q[{','.join(map(str, mine))}] x kv[{st.kv.owner}]"
               f" | q[{','.join(map(str, peer_owners))}] x kv[{peer_kv}]")
    st.decisions.append(Decision("pair", peer, role, kv_b, q_b, context))
    return role


# -- message halves --------------------------------------------------------------------------

def q_half(st: RankState, owner: int, kv_owners: Sequence[int]) -> Half:
    """Rows of q block ``owner`` that its tiles with ``kv_owners`` need (within the rows
    held in the current sub-pass)."""
    return _q_rows_needed(owner, tuple(kv_owners), st.causal, st.q_rows)


def kv_half(st: RankState, kv_owner: int, q_owners: Sequence[int]) -> Half:
    """Rows of kv block ``kv_owner`` that its tiles with ``q_owners`` need (within the rows
    held in the current sub-pass)."""
    return _kv_rows_needed(kv_owner, tuple(q_owners), st.causal, st.kv_rows)


def _spec(st: RankState, owner: int, kv_owner: int) -> TileSpec:
    """Tile ``(owner, kv_owner)``, restricted to the kv (or q) rows held in the current
    sub-pass."""
    spec = tile_spec(owner, kv_owner, st.causal)
    if st.kv_rows is not Half.FULL:
        spec = replace(spec, kv_half=_within(spec.kv_half, st.kv_rows))
    if st.q_rows is not Half.FULL:
        spec = replace(spec, q_half=_within(spec.q_half, st.q_rows))
    return spec


# -- ops ---------------------------------------------------------------------------------

def _tile(st: RankState, it: Item, kv: KvHeld, *, fresh_dq: bool = False,
          fresh_dkv: bool = False) -> Op:
    """The tile of q block ``it`` against kv block ``kv`` (backward: dq into ``it.acc``, dkv
    into ``kv.dkv``)."""
    spec = _spec(st, it.owner, kv.owner)
    if st.bwd:
        return TileBwd(spec, it.q_loc, kv.loc, it.acc, kv.dkv, fresh_dq, fresh_dkv)
    return Tile(spec, it.q_loc, kv.loc, it.acc)


def _own_tile(st: RankState, it: Item, kv: KvHeld) -> None:
    """The tile of the own q block ``it`` against the kv block held with it; with
    ``st.split_diagonal``, a causal diagonal tile as its three sub-tiles
    (:func:`~charm_megatron.plan.core.diagonal_sub_tiles`): the two causal squares (half its
    work) here, where they fill the wait for the first cross block, the unmasked block
    between them held back in ``st.diagonal_rest`` for the program to place after the last
    cross pass (where it hides that pass's trip home). Of the placements the model was asked
    about (h200, one NIC per node, Llama-like 16k-32k at degree 8), this one was the fastest
    or within 0.1 % of it in every backward row (docs/algorithm.md)."""
    op = _tile(st, it, kv)
    pieces = diagonal_sub_tiles(op.spec) if st.split_diagonal and st.cross else None
    if pieces is None:
        st.p.add(op)
        return
    first, between, second = (replace(op, spec=s) for s in pieces)
    st.p.add(first)
    st.p.add(second)
    st.diagonal_rest.append(between)


# -- a pass: its units posted, computed and returned ----------------------------------------

def run_pass(st: RankState, ps: Pass, items: list[Item], cross_handle: int | None) -> list[Op]:
    """Emit the units of ``ps`` for ``items``; return the ops held back until the
    counterpart's partial has been sent home (the own q's last tile, forward, joint).

    The units run in *steps* (:func:`_steps`): one unit each, or with ``st.super_tiles`` up
    to :data:`STEP_UNITS` adjacent kv units whose blocks arrive together and whose tiles run
    as one super-tile per q block. A step is posted one step ahead, waited, computed; its
    partials go back and are completed one step later."""
    p, r = st.p, st.rank
    steps = _steps(st, _units(st, ps), items)
    cross = next((it for it in items if it.owner != r), None)
    own = [it for it in items if it.owner == r]
    # The counterpart's q is awaited before anything uses it, and at the latest once the
    # own q's tiles with own kv (which need no communication) hide its arrival.
    awaiting = cross is not None
    if awaiting and steps and steps[0][0].role is Role.Q:
        _await_cross(st, cross_handle, cross)
        awaiting = False
    pending = [_post(st, u, items) for u in steps[0]] if steps else []
    kv = st.kv
    if ps.own_kv:
        for it in own:
            _own_tile(st, it, kv)
    if awaiting:
        _await_cross(st, cross_handle, cross)
    if ps.own_kv and cross is not None:
        p.add(_tile(st, cross, KvHeld(r, OWN_KV, Plan.DKV)))
    last_kv = max((u.index for step in steps for u in step if u.role is Role.KV), default=None)
    # Forward, joint: the own q's tile of the last kv unit waits until the counterpart's
    # partial is on its way (it is not needed before the end).
    hold_own = not st.bwd and cross is not None
    returns: list[Return] = []
    held_back: list[Op] = []
    for i, step in enumerate(steps):
        if st.lean:  # the previous unit's partials home first, then this unit's blocks
            if i > 0:
                while returns:
                    p.finish(returns.pop(0))
                pending = [_post(st, u, items) for u in step]
            nxt = []
        else:
            nxt = [_post(st, u, items) for u in steps[i + 1]] if i + 1 < len(steps) else []
        for h in pending:
            p.add(Wait(h))
        pending = nxt
        if st.early_returns:
            while returns and returns[0].unit < i:
                p.finish(returns.pop(0))
        if step[0].role is Role.KV:
            held = last_kv if hold_own and any(u.index == last_kv for u in step) else None
            held_back += _compute_kv(st, i, step, items, returns, held)
        else:
            _compute_q(st, i, step[0], items, returns)
        # Partials of the previous step have had a whole step of compute to arrive.
        while returns and returns[0].unit < i:
            p.finish(returns.pop(0))
    # A counterpart's partial must be complete before it goes home.
    for ret in returns:
        p.finish(ret)
    return held_back


#: With super-tiles, how many adjacent kv units at most one step fetches together (their
#: blocks held at once, and the next step's in flight: twice as many kv receive buffers).
STEP_UNITS = 2


def _steps(st: RankState, units: list[Unit], items: list[Item]) -> list[list[Unit]]:
    """``units`` in steps. Without ``st.super_tiles``: one unit per step, as built. With
    it: adjacent kv units whose tiles use the same q rows of every q block held (so each q
    block's tiles of the step are one super-tile) share a step, :data:`STEP_UNITS` at most
    (lean: one step's blocks at a time); a kv step's blocks go to slots
    ``base * STEP_UNITS + j``, ``base`` alternating between adjacent kv steps (a step's
    buffers live until the end of the next)."""
    if not st.super_tiles:
        return [[u] for u in units]

    def rows(u: Unit) -> tuple[Half, ...]:
        return tuple(_spec(st, it.owner, u.peer_kv).q_half for it in items)

    steps: list[list[Unit]] = []
    for u in units:
        last = steps[-1] if steps else None
        if (u.role is Role.KV and last is not None and last[0].role is Role.KV
                and len(last) < STEP_UNITS and rows(last[0]) == rows(u)):
            last.append(u)
        else:
            steps.append([u])
    out: list[list[Unit]] = []
    base = 0
    for i, step in enumerate(steps):
        base = 1 - base if i and steps[i - 1][0].role is step[0].role else 0
        width = STEP_UNITS if step[0].role is Role.KV else 1
        out.append([replace(u, slot=base * width + j) for j, u in enumerate(step)])
    return out


def _await_cross(st: RankState, handle: int | None, cross: Item) -> None:
    st.p.add(Wait(handle))
    st.p.add(Reset(cross.acc, st.pkind, cross.owner))


def _post(st: RankState, u: Unit, items: list[Item]) -> int:
    """Post unit ``u``'s exchange: our kv block, or our q blocks of this pass."""
    y, mine, theirs = u.peer, st.kv, u.peer_kv
    if u.role is Role.KV:
        return st.p.comm(
            u.stream,
            sends=[Xfer(y, mine.loc, Kind.KV, mine.owner,
                        kv_half(st, mine.owner, u.peer_owners))],
            recvs=[Xfer(y, _KV_RX.at(u.slot), Kind.KV, theirs,
                        kv_half(st, theirs, [it.owner for it in items]))],
        )
    return st.p.comm(
        u.stream,
        sends=[Xfer(y, it.q_loc, st.qkind, it.owner, q_half(st, it.owner, [theirs]))
               for it in items],
        recvs=[Xfer(y, _Q_RX.at(u.slot, i), st.qkind, o, q_half(st, o, [mine.owner]))
               for i, o in enumerate(u.peer_owners)],
    )


def _compute_kv(st: RankState, step: int, units: list[Unit], items: list[Item],
                returns: list[Return], held_unit: int | None) -> list[Op]:
    """Our q blocks against the peers' kv blocks of one step's ``units``; backward, each
    peer's dkv partial goes back. Returns the own q's tile with unit ``held_unit``'s kv
    (held back by the caller), if any. Each q block's tiles of the step are adjacent (one
    super-tile once fused, plan/fuse.py)."""
    r = st.rank
    # One q block: the peer's dk/dv partial is one tile's, sent as the kernel made it.
    fresh_dkv = st.bwd and len(items) == 1
    if st.bwd and not fresh_dkv:
        for u in units:
            st.p.add(Reset(_PEER_DKV.at(u.slot), Kind.DKV, u.peer_kv))
    held: list[Op] = []
    # Counterpart's q first: its partial must travel home, the own q's need not.
    for it in sorted(items, key=lambda it: it.owner == r):
        for u in units:
            op = _tile(st, it, KvHeld(u.peer_kv, _KV_RX.at(u.slot), _PEER_DKV.at(u.slot)),
                       fresh_dkv=fresh_dkv)
            if u.index == held_unit and it.owner == r:
                held.append(op)
            else:
                st.p.add(op)
    if st.bwd:
        for u in units:
            back = _KV_DRET.at(u.slot)
            h = st.p.comm(
                u.stream,
                sends=[Xfer(u.peer, _PEER_DKV.at(u.slot), Kind.DKV, u.peer_kv,
                            kv_half(st, u.peer_kv, [it.owner for it in items]))],
                recvs=[Xfer(u.peer, back, Kind.DKV, st.kv.owner,
                            kv_half(st, st.kv.owner, u.peer_owners))],
            )
            returns.append(Return(step, h, (Merge(st.kv.dkv, back),)))
    return held


def _compute_q(st: RankState, step: int, u: Unit, items: list[Item],
               returns: list[Return]) -> None:
    """Serve the peer's q blocks with our kv and send the partials back; ours come back
    from the peer into ``q.ret``."""
    y, kv = u.peer, st.kv
    sends = []
    for i, o in enumerate(u.peer_owners):
        acc, q_loc = _SERVED.at(u.slot, i), _Q_RX.at(u.slot, i)
        if st.bwd:
            st.p.add(_tile(st, Item(o, q_loc, acc), kv, fresh_dq=True))
        else:
            # A served tile is one partial sent straight back: no accumulator.
            st.p.add(Tile(_spec(st, o, kv.owner), q_loc, kv.loc, acc, fresh=True))
        sends.append(Xfer(y, acc, st.pkind, o, q_half(st, o, [kv.owner])))
    recvs = [Xfer(y, _Q_RET.at(u.slot, i), st.pkind, it.owner,
                  q_half(st, it.owner, [u.peer_kv])) for i, it in enumerate(items)]
    h = st.p.comm(u.stream, sends=sends, recvs=recvs)
    returns.append(Return(step, h, tuple(Merge(it.acc, _Q_RET.at(u.slot, i))
                                             for i, it in enumerate(items))))
