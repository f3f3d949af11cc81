"""RM+ inside a group: its units (one RM+ round each) and passes, the base of every CHARM+
rank builder (docs/algorithm.md, *RM+*; with one group CHARM+ *is* RM+).

A *pass* runs (some of) the group's RM+ rounds for the q blocks a rank holds (its own, or a
counterpart's) against the kv block it holds (its own, or a visiting one). Per unit: post the
next unit's exchange, wait for this one's, compute its tiles; q-pair partials go back one unit
later (:meth:`RmPlusPasses._pass`). What crosses between groups, and in which order the passes
run, is the subclasses' (:mod:`charm_megatron.plan.charm_cross` and the modules it leads to).

Plan layer: no torch.
"""

from __future__ import annotations

import functools
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING

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
    tile_spec,
)
from charm_megatron.plan.entries import Groups
from charm_megatron.plan.pairing import group_rounds, rmplus_rounds
from charm_megatron.plan.program import Program, Return
from charm_megatron.plan.roles import Decision, choose, row_bytes
from charm_megatron.plan.vocab import Direction, Role

if TYPE_CHECKING:
    from charm_megatron.plan.charm import CharmVariant

__all__ = ["OWN_KV", "Item", "KvHeld", "Pass", "RmPlusPasses", "Unit"]

# Locations of RM+ units (slot: the copy of alternating units; item: which of the q blocks
# exchanged in one unit).
OWN_KV = Loc.own(Kind.KV)
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
class KvHeld:
    """The kv block a rank holds in a pass: whose, where, where its dkv accumulates."""

    owner: int
    loc: Loc
    dkv: Loc


@dataclass(frozen=True)
class Unit:
    """One RM+ round of a pass as one rank runs it: exchange ``role`` blocks with ``peer``,
    which holds the q blocks of ``peer_owners`` in this pass; receive into copy ``slot``;
    post on ``stream`` (by the round's parity, whatever the role: both streams stay busy).

    Steps (see :meth:`RmPlusPasses._pass`): *post* the exchange one unit ahead, *compute* its
    tiles once it arrived, *return* the partials it produced to their owners (completed one
    unit later).
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


class RmPlusPasses:
    """One rank's RM+ units and passes: the state and steps every CHARM+ rank builder shares.

    ``variant`` (:class:`~charm_megatron.plan.charm.CharmVariant`) gives the role choice and
    the memory variants (``lean``, ``early_returns``) read here; the splits and the pass order
    are read by the subclasses where they act.
    """

    def __init__(self, rank: int, groups: Groups, causal: bool, direction: Direction,
                 variant: CharmVariant) -> None:
        self.rank = rank
        self.groups = groups
        self.causal = causal
        self.direction = direction = Direction(direction)
        self.bwd = direction is Direction.BACKWARD
        self.variant = variant  # the splits and the pass order are read where they act
        self.roles = variant.roles
        # lean: a unit's exchange is posted only once the previous unit's tiles ran and its
        # partials came home (one unit's blocks in memory instead of two and its returns;
        # transfers no longer hide behind the previous unit's compute). The CHARM+ entry's
        # memory bound asks for it where the plan would otherwise hold more than
        # plan.memory.BOUND x ring's peak (plan.charm.within_memory_bound).
        self.lean = variant.lean
        # early_returns: a unit's returns (forward: a q-pair's partials, the one served and the
        # one back; backward: also a kv-pair's dK, dV partials) are completed right after the
        # next unit's blocks arrived, before its tiles, so a tile never sees two units'
        # returns: less memory, but each return has only the next unit's transfer time to
        # travel and the peer's tile to finish, a wait with nothing to hide it on a rank with
        # its own device. Only where the memory bound needs it, in both directions: the
        # model predicts returns left in flight over the next unit's tiles up to ~10 % faster
        # backward on GPU clusters (h100 2x8, MHA, 32k: 7.2 -> 6.6 ms); on the CPU testbed the
        # two measure alike (CPU-bound; MHA 416 vs 415 ms, 8/2 heads within the noise), and
        # forward measured ~10 % slower with it.
        self.early_returns = variant.early_returns
        # The rows of the kv (q) blocks held in the current (sub-)pass: a split visiting pass
        # holds one row half of each visiting kv block at a time, a split pass-q pass one of
        # the counterpart's q block; every tile and message of the pass is restricted to them.
        self.kv_rows = Half.FULL
        self.q_rows = Half.FULL
        self.decisions: list[Decision] = []  # the role of every exchange, for printouts
        self.g = next(i for i, grp in enumerate(groups) if rank in grp)
        self.group = groups[self.g]
        self.local = self.group.index(rank)
        self.rounds = rmplus_rounds(len(self.group))
        self.cross = group_rounds(len(groups))
        self.p = Program()
        self.qkind = direction.query
        self.pkind = direction.query_partial  # what comes back for a q block
        self.own_q = Loc.own(self.qkind)
        self.own_acc = Plan.DQ if self.bwd else Plan.OUT
        self.hold_own_kv()

    def hold_own_kv(self) -> None:
        """Hold the rank's own kv block in the passes that follow (its dkv: the result)."""
        self.kv = KvHeld(self.rank, OWN_KV, Plan.DKV)

    # -- which blocks a rank holds in a pass, and its units ------------------------------------
    def _owners(self, ps: Pass, local: int) -> list[int]:
        """Owners of the q blocks that local index ``local`` of our group holds in pass ``ps``."""
        owners = [self.group[local]] if ps.own else []
        if ps.cross_round is not None and not ps.visiting:
            partner = self.cross[ps.cross_round].get(self.g)
            if partner is not None:
                owners.append(self.groups[partner][local])
        return owners

    def _units(self, ps: Pass) -> list[Unit]:
        """The rounds of ``ps`` this rank takes part in. A unit's buffers live until the end of
        the next unit, so only two adjacent units of the same role need different slots
        (memory: one set of receive buffers per stream when kv and q rounds alternate, two at
        most)."""
        units: list[Unit] = []
        for i in ps.rounds:
            rd = self.rounds[i]
            if self.local not in rd.partner:
                continue
            peer_local = rd.partner[self.local]
            peer_owners = tuple(self._owners(ps, peer_local))
            role = self._pair_role(rd.role, self.group[peer_local], peer_owners,
                                   self._owners(ps, self.local), self._kv_owner(ps, peer_local))
            slot = 1 - units[-1].slot if units and units[-1].role is role else 0
            stream = Stream.KV if i % 2 == 0 else Stream.Q
            units.append(Unit(len(units), role, self.group[peer_local], peer_owners, slot,
                              stream, self._kv_owner(ps, peer_local)))
        return units

    def _kv_owner(self, ps: Pass, local: int) -> int:
        """Whose kv block local index ``local`` of our group holds in pass ``ps``."""
        if ps.visiting:
            return self.groups[self.cross[ps.cross_round][self.g]][local]
        return self.group[local]

    def _pair_role(self, paper: Role, peer: int, peer_owners: Sequence[int],
                   owners: Sequence[int], peer_kv: int) -> Role:
        """The role of the RM+ pair (us, ``peer``) in a pass: the paper's, forced, or by the
        bytes both alternatives move in both directions (computed alike on both sides)."""
        kv_b = q_b = None
        shape = self.roles.shape
        if shape is not None:
            # Sums of whole and half row sizes are exact in floating point, so the peer,
            # which adds the same terms in the other order, gets the same bytes.
            kv_b = q_b = 0.0
            kv_kinds = (Kind.KV, Kind.DKV) if self.bwd else (Kind.KV,)
            q_kinds = (self.qkind, self.pkind)
            for src, dst, held, other in ((self.kv.owner, peer_kv, owners, peer_owners),
                                          (peer_kv, self.kv.owner, peer_owners, owners)):
                half = self._kv_half(src, other)
                kv_b += sum(row_bytes(k, shape, half) for k in kv_kinds)
                for o in held:  # these q blocks served by the other kv, partials back
                    q_b += sum(row_bytes(k, shape, self._q_half(o, [dst])) for k in q_kinds)
        role = choose(self.roles, paper, kv_b, q_b)
        context = (f"q[{','.join(map(str, owners))}] x kv[{self.kv.owner}]"
                   f" | q[{','.join(map(str, peer_owners))}] x kv[{peer_kv}]")
        self.decisions.append(Decision("pair", peer, role, kv_b, q_b, context))
        return role

    # -- message halves --------------------------------------------------------------------------

    def _q_half(self, owner: int, kv_owners: Sequence[int]) -> Half:
        """Rows of q block ``owner`` that its tiles with ``kv_owners`` need (within the rows
        held in the current sub-pass)."""
        return _q_rows_needed(owner, tuple(kv_owners), self.causal, self.q_rows)

    def _kv_half(self, kv_owner: int, q_owners: Sequence[int]) -> Half:
        """Rows of kv block ``kv_owner`` that its tiles with ``q_owners`` need (within the rows
        held in the current sub-pass)."""
        return _kv_rows_needed(kv_owner, tuple(q_owners), self.causal, self.kv_rows)

    def _spec(self, owner: int, kv_owner: int) -> TileSpec:
        """Tile ``(owner, kv_owner)``, restricted to the kv (or q) rows held in the current
        sub-pass."""
        spec = tile_spec(owner, kv_owner, self.causal)
        if self.kv_rows is not Half.FULL:
            spec = replace(spec, kv_half=_within(spec.kv_half, self.kv_rows))
        if self.q_rows is not Half.FULL:
            spec = replace(spec, q_half=_within(spec.q_half, self.q_rows))
        return spec

    # -- ops ---------------------------------------------------------------------------------

    def _tile(self, owner: int, q_loc: Loc, kv_owner: int, kv_loc: Loc, acc: Loc,
              dkv_acc: Loc, fresh_dq: bool = False, fresh_dkv: bool = False) -> Op:
        spec = self._spec(owner, kv_owner)
        if self.bwd:
            return TileBwd(spec, q_loc, kv_loc, acc, dkv_acc, fresh_dq, fresh_dkv)
        return Tile(spec, q_loc, kv_loc, acc)

    # -- a pass: its units posted, computed and returned ----------------------------------------

    def _pass(self, ps: Pass, items: list[Item], cross_handle: int | None) -> list[Op]:
        """Emit the units of ``ps`` for ``items``; return the ops held back until the
        counterpart's partial has been sent home (the own q's last tile, forward, joint)."""
        p, r = self.p, self.rank
        units = self._units(ps)
        cross = next((it for it in items if it.owner != r), None)
        own = [it for it in items if it.owner == r]
        # The counterpart's q is awaited before anything uses it, and at the latest once the
        # own q's tiles with own kv (which need no communication) hide its arrival.
        awaiting = cross is not None
        if awaiting and units and units[0].role is Role.Q:
            self._await_cross(cross_handle, cross)
            awaiting = False
        pending = self._post(units[0], items) if units else None
        kv = self.kv
        if ps.own_kv:
            for it in own:
                p.add(self._tile(it.owner, it.q_loc, kv.owner, kv.loc, it.acc, kv.dkv))
        if awaiting:
            self._await_cross(cross_handle, cross)
        if ps.own_kv and cross is not None:
            p.add(self._tile(cross.owner, cross.q_loc, r, OWN_KV, cross.acc, Plan.DKV))
        last_kv = max((u.index for u in units if u.role is Role.KV), default=None)
        # Forward, joint: the own q's tile of the last kv unit waits until the counterpart's
        # partial is on its way (it is not needed before the end).
        hold_own = not self.bwd and cross is not None
        returns: list[Return] = []
        held_back: list[Op] = []
        for u in units:
            if self.lean:  # the previous unit's partials home first, then this unit's blocks
                if u.index > 0:
                    while returns:
                        p.finish(returns.pop(0))
                    pending = self._post(u, items)
                nxt = None
            else:
                nxt = self._post(units[u.index + 1], items) if u.index + 1 < len(units) else None
            p.add(Wait(pending))
            pending = nxt
            if self.early_returns:
                while returns and returns[0].unit < u.index:
                    p.finish(returns.pop(0))
            if u.role is Role.KV:
                held_back += self._compute_kv(u, items, returns, hold_own and u.index == last_kv)
            else:
                self._compute_q(u, items, returns)
            # Partials of the previous unit have had a whole unit of compute to arrive.
            while returns and returns[0].unit < u.index:
                p.finish(returns.pop(0))
        # A counterpart's partial must be complete before it goes home.
        for ret in returns:
            p.finish(ret)
        return held_back

    def _await_cross(self, handle: int | None, cross: Item) -> None:
        self.p.add(Wait(handle))
        self.p.add(Reset(cross.acc, self.pkind, cross.owner))

    def _post(self, u: Unit, items: list[Item]) -> int:
        """Post unit ``u``'s exchange: our kv block, or our q blocks of this pass."""
        y, mine, theirs = u.peer, self.kv, u.peer_kv
        if u.role is Role.KV:
            return self.p.comm(
                u.stream,
                sends=[Xfer(y, mine.loc, Kind.KV, mine.owner,
                            self._kv_half(mine.owner, u.peer_owners))],
                recvs=[Xfer(y, _KV_RX.at(u.slot), Kind.KV, theirs,
                            self._kv_half(theirs, [it.owner for it in items]))],
            )
        return self.p.comm(
            u.stream,
            sends=[Xfer(y, it.q_loc, self.qkind, it.owner, self._q_half(it.owner, [theirs]))
                   for it in items],
            recvs=[Xfer(y, _Q_RX.at(u.slot, i), self.qkind, o, self._q_half(o, [mine.owner]))
                   for i, o in enumerate(u.peer_owners)],
        )

    def _compute_kv(self, u: Unit, items: list[Item], returns: list[Return],
                    hold_own: bool) -> list[Op]:
        """Our q blocks against the peer's kv; backward, the peer's dkv partial goes back.
        Returns the own q's tile if ``hold_own`` (held back by the caller)."""
        r, y, theirs = self.rank, u.peer, u.peer_kv
        buf, dkv = _KV_RX.at(u.slot), _PEER_DKV.at(u.slot)
        # One q block: the peer's dk/dv partial is one tile's, sent as the kernel made it.
        fresh_dkv = self.bwd and len(items) == 1
        if self.bwd and not fresh_dkv:
            self.p.add(Reset(dkv, Kind.DKV, theirs))
        held: list[Op] = []
        # Counterpart's q first: its partial must travel home, the own q's need not.
        for it in sorted(items, key=lambda it: it.owner == r):
            op = self._tile(it.owner, it.q_loc, theirs, buf, it.acc, dkv, fresh_dkv=fresh_dkv)
            if hold_own and it.owner == r:
                held.append(op)
            else:
                self.p.add(op)
        if self.bwd:
            back = _KV_DRET.at(u.slot)
            h = self.p.comm(
                u.stream,
                sends=[Xfer(y, dkv, Kind.DKV, theirs,
                            self._kv_half(theirs, [it.owner for it in items]))],
                recvs=[Xfer(y, back, Kind.DKV, self.kv.owner,
                            self._kv_half(self.kv.owner, u.peer_owners))],
            )
            returns.append(Return(u.index, h, (Merge(self.kv.dkv, back),)))
        return held

    def _compute_q(self, u: Unit, items: list[Item], returns: list[Return]) -> None:
        """Serve the peer's q blocks with our kv and send the partials back; ours come back
        from the peer into ``q.ret``."""
        y, kv = u.peer, self.kv
        sends = []
        for i, o in enumerate(u.peer_owners):
            acc, q_loc = _SERVED.at(u.slot, i), _Q_RX.at(u.slot, i)
            if self.bwd:
                self.p.add(self._tile(o, q_loc, kv.owner, kv.loc, acc, kv.dkv, fresh_dq=True))
            else:
                # A served tile is one partial sent straight back: no accumulator.
                self.p.add(Tile(self._spec(o, kv.owner), q_loc, kv.loc, acc, fresh=True))
            sends.append(Xfer(y, acc, self.pkind, o, self._q_half(o, [kv.owner])))
        recvs = [Xfer(y, _Q_RET.at(u.slot, i), self.pkind, it.owner,
                      self._q_half(it.owner, [u.peer_kv])) for i, it in enumerate(items)]
        h = self.p.comm(u.stream, sends=sends, recvs=recvs)
        returns.append(Return(u.index, h, tuple(Merge(it.acc, _Q_RET.at(u.slot, i))
                                                 for i, it in enumerate(items))))
