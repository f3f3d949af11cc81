"""Plan builders: ring (TransformerEngine ``p2p``), RM+ and CHARM+ (ALGORITHM.md §3–§6).

Each builder returns one CP rank's op list; :mod:`charm_megatron.plan.registry` names them and
assembles the :class:`~charm_megatron.plan.core.Plan` (``build_plan``). RM+ is CHARM+ with a
single group, so one builder serves both.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass, replace

from charm_megatron.plan.core import (
    Comm,
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
from charm_megatron.plan.pairing import group_rounds, rmplus_rounds
from charm_megatron.plan.roles import Decision, RoleChoice, choose, row_bytes
from charm_megatron.plan.vocab import Direction, Role


class _Program:
    """Accumulates one rank's ops and hands out batch handles."""

    def __init__(self) -> None:
        self.ops: list[Op] = []
        self._next = 0

    def comm(self, stream: Stream, sends: Sequence[Xfer] = (),
             recvs: Sequence[Xfer] = ()) -> int:
        handle = self._next
        self._next += 1
        self.ops.append(Comm(handle, stream, tuple(sends), tuple(recvs)))
        return handle

    def add(self, op: Op) -> None:
        self.ops.append(op)

    def finish(self, ret: _Return) -> None:
        """Complete partials coming back: wait for their batch, merge each into its acc."""
        self.ops.append(Wait(ret.handle))
        self.ops.extend(ret.merges)


# --------------------------------------------------------------------------------------- ring
_OWN_KV = Loc.own(Kind.KV)
_RING_KV = Loc("ring.kv")  # the kv block passing through (two copies: receive while computing)
_RING_DKV = Loc("ring.dkv")  # the dkv partial of the kv block computed here, sent on
_RING_DKV_IN = Loc("ring.dkvin")  # the dkv partial arriving with the next kv block


def _ring(r: int, n: int, causal: bool, backward: bool) -> list[Op]:
    """TransformerEngine's p2p ring: kv walks ``r -> r+1``; the next kv is posted before the
    current tile is computed. Backward carries the dkv partial sums around the ring one step
    behind kv, so a block's dkv arrives home complete after ``n`` hops."""
    p = _Program()
    nxt, prv = (r + 1) % n, (r - 1) % n
    qloc = Loc.own(Kind.QGRAD if backward else Kind.Q)
    if backward:
        p.add(Reset(Plan.DQ, Kind.DQ, r))
    else:
        p.add(Reset(Plan.OUT, Kind.OUT, r))
    cur = _OWN_KV
    kv_handle = dkv_handle = None
    for step in range(n):
        j = (r - step) % n
        spec = tile_spec(r, j, causal)
        if step < n - 1:
            buf = _RING_KV.at(step % 2)
            kv_handle = p.comm(
                Stream.KV,
                sends=[Xfer(nxt, cur, Kind.KV, j, Half.FULL)],
                recvs=[Xfer(prv, buf, Kind.KV, (j - 1) % n, Half.FULL)],
            )
        if not backward:
            p.add(Tile(spec, qloc, cur, Plan.OUT))
        elif n == 1:
            p.add(Reset(Plan.DKV, Kind.DKV, r))
            p.add(TileBwd(spec, qloc, cur, Plan.DQ, Plan.DKV))
        else:
            mine = _RING_DKV.at(step % 2)
            p.add(Reset(mine, Kind.DKV, j))
            p.add(TileBwd(spec, qloc, cur, Plan.DQ, mine))
            if step > 0:
                p.add(Wait(dkv_handle))
                p.add(Merge(mine, _RING_DKV_IN.at((step - 1) % 2)))
            into = Plan.DKV if step == n - 1 else _RING_DKV_IN.at(step % 2)
            dkv_handle = p.comm(
                Stream.Q,  # the dkv ring gets its own stream so it never queues behind kv
                sends=[Xfer(nxt, mine, Kind.DKV, j, Half.FULL)],
                recvs=[Xfer(prv, into, Kind.DKV, (j - 1) % n, Half.FULL)],
            )
        if step < n - 1:
            p.add(Wait(kv_handle))
            cur = buf
    if backward and n > 1:
        p.add(Wait(dkv_handle))
    return p.ops


# ------------------------------------------------------------------------------- RM+ / CHARM+
# Locations of RM+ and CHARM+ (slot: the copy of alternating units or passes; item: which of
# the q blocks exchanged in one unit).
_KV_RX = Loc("kv.rx")  # the peer's kv block of a kv unit
_KV_DRET = Loc("kv.dret")  # our dkv partial coming back from a kv unit's peer
_PEER_DKV = Loc("acc.pdkv")  # the kv unit peer's dkv partial, computed here
_Q_RX = Loc("q.rx")  # the peer's q blocks of a q unit
_Q_RET = Loc("q.ret")  # our q blocks' partials coming back from a q unit's peer
_SERVED = Loc("acc.svc")  # the partial of a tile served for a q unit's peer (sent back)
_CROSS_Q = Loc("cross.q")  # the counterpart's q block (slot: the cross round's parity)
_CROSS_ACC = Loc("acc.cross")  # the counterpart's partial, accumulated here
_CROSS_RET = Loc("cross.ret")  # our partial coming home from the counterpart
_CROSS_KV = Loc("cross.kv")  # pass-kv: the counterpart's visiting kv block (or its 1st half)
_CROSS_KV2 = Loc("cross.kvb")  # pass-kv, split: the visiting block's second half
_VISIT_DKV = Loc("acc.vdkv")  # pass-kv backward: the visiting block's dkv, accumulated here
_VISIT_DKV2 = Loc("acc.vdkvb")  # pass-kv backward, split: the second half's dkv
_CROSS_RET2 = Loc("cross.retb")  # a split return's second message (pass-kv dkv, pass-q)
_CROSS_Q2 = Loc("cross.qb")  # pass-q, split: the counterpart's q block's second half
_CROSS_ACC2 = Loc("acc.crossb")  # pass-q, split: the second half's partial


@dataclass(frozen=True)
class _Item:
    """A q block processed in a pass: whose rows, where they are, where they accumulate."""

    owner: int
    q_loc: Loc
    acc: Loc


@dataclass(frozen=True)
class _Pass:
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
class _KvHeld:
    """The kv block a rank holds in a pass: whose, where, where its dkv accumulates."""

    owner: int
    loc: Loc
    dkv: Loc


@dataclass(frozen=True)
class _Return:
    """Partials on their way back to this rank in batch ``handle``: complete by waiting and
    applying ``merges``. ``unit``: the RM+ unit that posted it (-1: a cross return, which is
    completed pass by pass instead)."""

    unit: int
    handle: int
    merges: tuple[Merge, ...]


@dataclass(frozen=True)
class _Unit:
    """One RM+ round of a pass as one rank runs it: exchange ``role`` blocks with ``peer``,
    which holds the q blocks of ``peer_owners`` in this pass; receive into copy ``slot``;
    post on ``stream`` (by the round's parity, whatever the role: both streams stay busy).

    Steps (see :meth:`_CharmRank._pass`): *post* the exchange one unit ahead, *compute* its
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


ORDERS = ("split", "joint")


def _union(halves: Iterable[Half]) -> Half:
    """The rows a message must carry: the union of the rows its tiles use."""
    out = None
    for h in halves:
        out = h if out is None else out.union(h)
    return out or Half.FULL


def _within(half: Half, rows: Half) -> Half:
    """The rows of ``half`` inside ``rows`` (``rows`` is FULL, or ``half`` covers it)."""
    if rows is Half.FULL:
        return half
    if not half.covers(rows):
        raise AssertionError(f"rows {half} hold none of rows {rows}")
    return rows


class _CharmRank:
    """Builds one rank's CHARM+ (or, with one group, RM+) forward or backward program.

    Structure (ALGORITHM.md §3–§4, §6): *passes* run the RM+ rounds of the group for the q
    blocks a rank holds. Per unit (one RM+ round): post the next unit's exchange, wait for this
    one's, compute. q-pair partials go back one unit later; a counterpart's partial goes home at
    the end of its pass.

    Pass order (``order``):

    * ``split`` (default): the own q's first rounds while the counterpart's q crosses the slow
      link; then one pass per counterpart q (all rounds), each sent home as soon as it is done;
      then the own q's remaining rounds, which hide the last slow return. A forward pass whose
      cross rounds are all pass-kv has no slow return to hide: all own rounds come first. kv blocks of the
      rounds are fetched once per pass that needs them (intra-group links are the fast ones).
    * ``joint``: the paper's single pass with own and counterpart q side by side (kv fetched
      once for both), the own q's last tile deferred until the counterpart's partial is sent.

    ``split_visiting`` (pass-kv): where every tile of a visiting pass needs all rows of the
    visiting kv blocks (the earlier group under the causal layout; both groups without a mask),
    those blocks cross in two messages, first row half then second, and the visiting pass runs
    as two sub-passes, one per kv row half: the first half's tiles run while the second half is
    still on the slow link (:meth:`_run_visiting_pass`).

    ``split_counterpart_q`` (pass-q): the same on the other side of the exchange. Where every
    tile of a counterpart's q block needs all its rows and no mask (the earlier group under
    the causal layout; both groups without a mask), the block crosses as two row-half
    messages and its pass runs as two sub-passes, q rows 1st then 2nd; each half's partial
    goes home as soon as its sub-pass is done, so the first half's crosses back while the
    second half is computed (:meth:`_run_counterpart_pass`).
    """

    def __init__(self, rank: int, groups: tuple[tuple[int, ...], ...], causal: bool,
                 backward: bool, order: str = "split",
                 roles: RoleChoice | None = None, lean: bool = False,
                 early_returns: bool = False, split_visiting: bool = False,
                 split_counterpart_q: bool = False) -> None:
        if order not in ORDERS:
            raise ValueError(f"unknown CHARM+ pass order {order!r}; choose one of {ORDERS}")
        self.rank = rank
        self.groups = groups
        self.causal = causal
        self.bwd = backward
        self.order = order
        self.roles = roles or RoleChoice()
        # lean: a unit's exchange is posted only once the previous unit's tiles ran and its
        # partials came home (one unit's blocks in memory instead of two and its returns;
        # transfers no longer hide behind the previous unit's compute). registry.build_plan asks for it where the plan would
        # otherwise hold more than plan.memory.BOUND x ring's peak.
        self.lean = lean
        # early_returns: a unit's returns (forward: a q-pair's partials, the one served and the
        # one back; backward: also a kv-pair's dK, dV partials) are completed right after the
        # next unit's blocks arrived, before its tiles, so a tile never sees two units'
        # returns: less memory, but each return has only the next unit's transfer time to
        # travel and the peer's tile to finish, a wait with nothing to hide it on a rank with
        # its own device. Only where the memory bound needs it, in both directions
        # (registry.build_plan): the model predicts returns left in flight over the next
        # unit's tiles up to ~10 % faster backward on GPU clusters (h100 2x8, MHA, 32k:
        # 7.2 -> 6.6 ms); on the CPU testbed the two measure alike (CPU-bound; MHA 416 vs
        # 415 ms, 8/2 heads within the noise), and forward measured ~10 % slower with it.
        self.early_returns = early_returns
        self.split_visiting = split_visiting
        # The rows of the kv blocks held in the current (sub-)pass: a split visiting pass
        # holds one row half of each visiting block at a time; every tile and kv message of
        # the pass is restricted to them.
        self.kv_rows = Half.FULL
        self.split_counterpart_q = split_counterpart_q
        # The same for the counterpart's q rows in a split pass-q pass (every q block of
        # such a pass is a counterpart's).
        self.q_rows = Half.FULL
        self.decisions: list[Decision] = []  # the role of every exchange, for printouts
        self.g = next(i for i, grp in enumerate(groups) if rank in grp)
        self.group = groups[self.g]
        self.local = self.group.index(rank)
        self.rounds = rmplus_rounds(len(self.group))
        self.cross = group_rounds(len(groups))
        self.p = _Program()
        direction = Direction.BACKWARD if backward else Direction.FORWARD
        self.direction = direction
        self.qkind = direction.query
        self.pkind = direction.query_partial  # what comes back for a q block
        self.own_q = Loc.own(self.qkind)
        self.own_acc = Plan.DQ if backward else Plan.OUT
        self.cross_in: dict[int, int] = {}  # cross round -> handle of its q exchange
        # pass-kv, split: cross round -> handle of the visiting block's second half
        self.cross_in2: dict[int, int] = {}
        # pass-q, split: cross round -> handle of the counterpart q block's second half
        self.cross_q_in2: dict[int, int] = {}
        self.trailing: list[int] = []  # send-only second halves, waited at the end
        # Our partials coming home from counterparts, one list per cross pass (a split
        # pass-kv return is two batches).
        self.going_home: list[list[_Return]] = []
        # Cross accumulators and return buffers alternate per pass that has a counterpart's q
        # (an idle group's rounds, when G is odd, do not count).
        self.n_cross_done = 0
        self.kv = _KvHeld(rank, _OWN_KV, Plan.DKV)  # the kv block held in the current pass
        self.cross_roles = [self._cross_role(k) for k in range(len(self.cross))]

    # -- the passes and which q blocks a rank holds in each ----------------------------------
    def _passes(self) -> list[_Pass]:
        every = tuple(range(len(self.rounds)))
        if not self.cross:
            return [_Pass(True, None, every, True)]

        def cross_pass(k: int) -> _Pass:
            if self.cross_roles[k] is Role.KV:  # pass-kv: own q against the visiting kv
                return _Pass(True, k, every, True, visiting=True)
            return _Pass(False, k, every, True)

        if self.order == "joint" and self.cross_roles[0] is Role.Q:
            return [_Pass(True, 0, every, True)] + [cross_pass(k)
                                                     for k in range(1, len(self.cross))]
        if self.order == "joint":  # a pass-kv first round: own kv first, then the visitors
            return [_Pass(True, None, every, True)] + [cross_pass(k)
                                                        for k in range(len(self.cross))]
        # Forward pass-kv brings nothing home across the slow link, so no own rounds need to
        # be kept back to hide a return: all of them go first, hiding the visiting kv's trip
        # (measured on 2x4 with one NIC per node: 315 vs 347 ms forward, docs/performance.md).
        # Pass-q, and backward (the visitors' dK, dV go home), keep half the rounds for last.
        paired = [r for k, r in enumerate(self.cross_roles) if self.g in self.cross[k]]
        if not self.bwd and paired and all(r is Role.KV for r in paired):
            head = every
        else:
            head = every[: len(every) // 2]
        tail = every[len(head):]
        passes = [_Pass(True, None, head, True)]
        passes += [cross_pass(k) for k in range(len(self.cross))]
        if tail:
            passes.append(_Pass(True, None, tail, False))
        return passes

    def _cross_role(self, k: int) -> Role:
        """Pass-q (the paper) or pass-kv for cross round ``k``: forced, or by the bytes both
        alternatives move between our group and its partner (summed over the group, so every
        rank of both groups decides alike)."""
        partner = self.cross[k].get(self.g)
        if partner is None:
            return Role.Q
        shape = self.roles.shape
        kv_b = q_b = None
        other = self.groups[partner]
        if shape is not None:
            kv_b = q_b = 0.0
            kv_kinds = (Kind.KV, Kind.DKV) if self.bwd else (Kind.KV,)
            q_kinds = (self.qkind, self.pkind)
            for a, b in ((self.group, other), (other, self.group)):
                for x in a:
                    kv_b += sum(row_bytes(kd, shape, self._kv_half(x, b)) for kd in kv_kinds)
                    q_b += sum(row_bytes(kd, shape, self._q_half(x, b)) for kd in q_kinds)
            kv_b, q_b = kv_b / len(self.group), q_b / len(self.group)
        role = choose(self.roles, Role.Q, kv_b, q_b)
        self.decisions.append(Decision("cross", other[self.local], role, kv_b, q_b))
        return role

    def _owners(self, ps: _Pass, local: int) -> list[int]:
        """Owners of the q blocks that local index ``local`` of our group holds in pass ``ps``."""
        owners = [self.group[local]] if ps.own else []
        if ps.cross_round is not None and not ps.visiting:
            partner = self.cross[ps.cross_round].get(self.g)
            if partner is not None:
                owners.append(self.groups[partner][local])
        return owners

    def _units(self, ps: _Pass) -> list[_Unit]:
        """The rounds of ``ps`` this rank takes part in. A unit's buffers live until the end of
        the next unit, so only two adjacent units of the same role need different slots
        (memory: one set of receive buffers per stream when kv and q rounds alternate, two at
        most)."""
        units: list[_Unit] = []
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
            units.append(_Unit(len(units), role, self.group[peer_local], peer_owners, slot,
                               stream, self._kv_owner(ps, peer_local)))
        return units

    def _kv_owner(self, ps: _Pass, local: int) -> int:
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
        return _within(_union(tile_spec(owner, j, self.causal).q_half for j in kv_owners),
                       self.q_rows)

    def _kv_half(self, kv_owner: int, q_owners: Sequence[int]) -> Half:
        """Rows of kv block ``kv_owner`` that its tiles with ``q_owners`` need (within the rows
        held in the current sub-pass)."""
        return _within(_union(tile_spec(i, kv_owner, self.causal).kv_half for i in q_owners),
                       self.kv_rows)

    def _splits(self, receiving: Sequence[int], visiting: Sequence[int]) -> bool:
        """Whether group ``receiving`` runs its visiting pass with the kv blocks of group
        ``visiting`` in two row halves: asked for, and every one of its tiles needs all kv rows
        and no mask (so each tile is exactly its two kv-half sub-tiles). Both groups compute
        it alike for both directions of the exchange."""
        return self.split_visiting and all(
            (s := tile_spec(i, j, self.causal)).kv_half is Half.FULL and not s.causal
            for i in receiving for j in visiting)

    def _q_splits(self, k: int, receiving: Sequence[int], visiting: Sequence[int]) -> bool:
        """Whether group ``receiving`` runs its pass-q pass of cross round ``k`` with the q
        blocks of group ``visiting`` in two row halves: asked for, the pass holds only those
        blocks (not the joint order's first pass, which holds the own q too), and every one
        of their tiles needs all q rows and no mask (so each tile is exactly its two q-half
        sub-tiles). Both groups compute it alike for both directions of the exchange."""
        if not self.split_counterpart_q or (self.order == "joint" and k == 0):
            return False
        return all((s := tile_spec(i, j, self.causal)).q_half is Half.FULL and not s.causal
                   for i in visiting for j in receiving)

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

    # -- the program -------------------------------------------------------------------------
    def build(self) -> list[Op]:
        p, r = self.p, self.rank
        if self.bwd:
            p.add(Reset(Plan.DQ, Kind.DQ, r))
            p.add(Reset(Plan.DKV, Kind.DKV, r))
        else:
            p.add(Reset(Plan.OUT, Kind.OUT, r))
        if self.cross:
            self._post_cross_exchange(0)
        for ps in self._passes():
            self._run_pass(ps)
        for rets in self.going_home:
            for ret in rets:
                p.finish(ret)
        for h in self.trailing:
            p.add(Wait(h))
        return p.ops

    def _post_cross_exchange(self, k: int) -> None:
        """Swap blocks with the counterpart of cross round ``k`` (if our group has one): our kv
        (pass-kv, it visits the counterpart's group) or our q (pass-q)."""
        partner = self.cross[k].get(self.g) if k < len(self.cross) else None
        if partner is None:
            return
        r, cp = self.rank, self.groups[partner][self.local]
        other = self.groups[partner]
        if self.cross_roles[k] is Role.KV:
            self._post_cross_halves(
                k, cp, _OWN_KV, Kind.KV, (_CROSS_KV, _CROSS_KV2), self.cross_in2,
                self._kv_half(r, other), self._kv_half(cp, self.group),
                self._splits(other, self.group), self._splits(self.group, other))
            return
        self._post_cross_halves(
            k, cp, self.own_q, self.qkind, (_CROSS_Q, _CROSS_Q2), self.cross_q_in2,
            self._q_half(r, other), self._q_half(cp, self.group),
            self._q_splits(k, other, self.group), self._q_splits(k, self.group, other))

    def _post_cross_halves(self, k: int, cp: int, src: Loc, kind: Kind,
                           rx: tuple[Loc, Loc], second_in: dict[int, int], send_rows: Half,
                           recv_rows: Half, out_split: bool, in_split: bool) -> None:
        """Post the cross exchange of round ``k`` with counterpart ``cp``: block ``kind`` from
        ``src`` out, the counterpart's into ``rx[0]``. Where a side splits (``out_split``: the
        counterpart splits what we send; ``in_split``: we split what we receive), the first
        row half goes in this batch and the second in one of its own right after (same stream,
        so it arrives second, into ``rx[1]``), waited for only by the second sub-pass
        (``second_in[k]``); a send-only second half is waited for at the end."""
        r, slot = self.rank, k % 2
        self.cross_in[k] = self.p.comm(
            Stream.CROSS,
            sends=[Xfer(cp, src, kind, r, Half.FIRST if out_split else send_rows)],
            recvs=[Xfer(cp, rx[0].at(slot), kind, cp, Half.FIRST if in_split else recv_rows)],
        )
        if not (out_split or in_split):
            return
        h = self.p.comm(
            Stream.CROSS,
            sends=[Xfer(cp, src, kind, r, Half.SECOND)] if out_split else [],
            recvs=[Xfer(cp, rx[1].at(slot), kind, cp, Half.SECOND)] if in_split else [],
        )
        if in_split:
            second_in[k] = h
        else:
            self.trailing.append(h)

    def _run_pass(self, ps: _Pass) -> None:
        """One pass, then the counterpart's partial sent home and our own coming back."""
        p, r, k = self.p, self.rank, ps.cross_round
        if k is not None:
            self._post_cross_exchange(k + 1)  # the next counterpart's q travels during this pass
        if ps.visiting:
            partner = self.cross[k].get(self.g)
            if partner is None:
                return
            self._run_visiting_pass(ps, k, partner)
            return
        self.kv = _KvHeld(r, _OWN_KV, Plan.DKV)
        owners = self._owners(ps, self.local)
        if not owners:
            return
        items = [_Item(o, self.own_q, self.own_acc) if o == r else
                 _Item(o, _CROSS_Q.at(k % 2), _CROSS_ACC.at(self.n_cross_done % 2))
                 for o in owners]
        if not ps.own and k in self.cross_q_in2:
            self._run_counterpart_pass(ps, k, owners[0])
            return
        held_back = self._pass(ps, items, self.cross_in.get(k) if k is not None else None)
        for it in items:
            if it.owner == r:
                continue
            slot = self.n_cross_done % 2
            self.going_home.append(self._home(k, it.owner, self.pkind, self.own_acc,
                                              (it.acc, _CROSS_ACC2.at(slot)),
                                              self._q_home(k, it.owner), slot, first=True))
            self.n_cross_done += 1
        for op in held_back:
            p.add(op)
        self._keep_one_return()

    def _q_home(self, k: int, cp: int) -> tuple[Half, Half]:
        """Pass-q: the rows of the counterpart ``cp``'s partial of cross round ``k`` that go
        home, and of ours that come back (whole returns)."""
        other = self.groups[self.cross[k][self.g]]
        return self._q_half(cp, self.group), self._q_half(self.rank, other)

    def _run_counterpart_pass(self, ps: _Pass, k: int, cp: int) -> None:
        """Pass-q, split (:meth:`_q_splits`): the counterpart ``cp``'s q block in two
        sub-passes, the first with its first row half (tiles ``q.1st x kv``), which starts as
        soon as that half arrived, the second with the second half; each circulates only its
        half through the RM+ rounds and accumulates in its own half-sized accumulator, which
        goes home as soon as its sub-pass is done (the first half's partial travels during the
        second sub-pass). Forward, the counterpart lse-merges the two halves' rows into its
        output; backward, they are its dq rows (our kv's dK, dV stay here, summed over both
        sub-passes). The return batches pair up with the counterpart's as in
        :meth:`_home`."""
        slot = self.n_cross_done % 2
        home = self._q_home(k, cp)
        accs = (_CROSS_ACC.at(slot), _CROSS_ACC2.at(slot))
        rets: list[_Return] = []
        for rows, q_loc, acc, handle in (
                (Half.FIRST, _CROSS_Q.at(k % 2), accs[0], self.cross_in[k]),
                (Half.SECOND, _CROSS_Q2.at(k % 2), accs[1], self.cross_q_in2[k])):
            self.q_rows = rows
            held_back = self._pass(ps, [_Item(cp, q_loc, acc)], handle)
            self.q_rows = Half.FULL
            assert not held_back  # only an own q's tile is ever held back
            rets += self._home(k, cp, self.pkind, self.own_acc, accs, home, slot,
                               first=rows is Half.FIRST)
        self.going_home.append(rets)
        self.n_cross_done += 1
        self._keep_one_return()

    def _keep_one_return(self) -> None:
        """Keep at most one pass's cross return in flight: its buffers are reused two passes
        on."""
        while len(self.going_home) > 1:
            for ret in self.going_home.pop(0):
                self.p.finish(ret)

    def _run_visiting_pass(self, ps: _Pass, k: int, partner: int) -> None:
        """Pass-kv: the group's queries against the visiting kv blocks of cross round ``k``
        (each rank holds its counterpart's, routed through the RM+ rounds like the own kv);
        backward, the visiting block's dkv (summed over every tile it served in our group)
        goes home and ours comes back.

        Split (:meth:`_splits`): two sub-passes, the first with the visiting blocks' first row
        halves (tiles ``q x kv.1st``), which start as soon as those arrived, the second with
        the second halves (``q x kv.2nd``); each circulates only its half through the RM+
        rounds. Forward, the two sub-tiles of a tile lse-merge into the output like any two
        tiles; backward, dq sums, and each half's dK, dV accumulate in their own half-sized
        accumulator, which goes home as soon as its sub-pass is done (the first half travels
        during the second sub-pass). A split return on either side is two batches, first half
        then second; the counterpart receives them in that order (:meth:`_dkv_home`)."""
        p, r = self.p, self.rank
        cp = self.groups[partner][self.local]
        other = self.groups[partner]
        slot = self.n_cross_done % 2
        dkv = _VISIT_DKV.at(slot) if self.bwd else Plan.DKV
        # The rows that go home and come back, fixed before any sub-pass narrows kv_rows.
        home = (self._kv_half(cp, self.group), self._kv_half(r, other))
        dkvs = (_VISIT_DKV.at(slot), _VISIT_DKV2.at(slot))
        self.kv = _KvHeld(cp, _CROSS_KV.at(k % 2), dkv)
        p.add(Wait(self.cross_in[k]))
        if self.bwd:
            p.add(Reset(self.kv.dkv, Kind.DKV, cp))
        items = [_Item(r, self.own_q, self.own_acc)]
        rets: list[_Return] = []
        if k in self.cross_in2:
            self.kv_rows = Half.FIRST
            self._pass(ps, items, None)
            if self.bwd:
                rets += self._home(k, cp, Kind.DKV, Plan.DKV, dkvs, home, slot, first=True)
            p.add(Wait(self.cross_in2[k]))
            dkv2 = _VISIT_DKV2.at(slot) if self.bwd else Plan.DKV
            self.kv = _KvHeld(cp, _CROSS_KV2.at(k % 2), dkv2)
            if self.bwd:
                p.add(Reset(dkv2, Kind.DKV, cp))
            self.kv_rows = Half.SECOND
            self._pass(ps, items, None)
            self.kv_rows = Half.FULL
        else:
            self._pass(ps, items, None)
        if self.bwd:
            rets += self._home(k, cp, Kind.DKV, Plan.DKV, dkvs, home, slot, first=not rets)
            self.going_home.append(rets)
        self.n_cross_done += 1
        self.kv = _KvHeld(r, _OWN_KV, Plan.DKV)
        self._keep_one_return()

    def _home(self, k: int, cp: int, kind: Kind, result: Loc, accs: tuple[Loc, Loc],
              home: tuple[Half, Half], slot: int, first: bool) -> list[_Return]:
        """Post the partial of cross round ``k`` that goes home to ``cp`` (pass-kv backward:
        its visiting block's dK, dV; pass-q: its q block's partial) and ours coming back,
        merged into ``result``. ``accs``: where the partial accumulated (whole or 1st half,
        2nd half); ``home``: the rows of each (whole returns). Where our pass was split (the
        block of ``k`` came in halves) ours go in two batches, posted after each sub-pass
        (``first``: the one after the first); where the counterpart's was, theirs come in
        two: the first batch carries the first halves (or a whole return), the second the
        rest. Both sides derive the same two batches, so the messages pair up in order."""
        other = self.groups[self.cross[k][self.g]]
        if kind is Kind.DKV:
            mine, theirs = k in self.cross_in2, self._splits(other, self.group)
        else:
            mine, theirs = k in self.cross_q_in2, self._q_splits(k, other, self.group)
        send_h, recv_h = home
        if not (mine or theirs):  # one batch, both ways whole
            loc = _CROSS_RET.at(slot)
            h = self.p.comm(Stream.CROSS,
                            sends=[Xfer(cp, accs[0], kind, cp, send_h)],
                            recvs=[Xfer(cp, loc, kind, self.rank, recv_h)])
            return [_Return(-1, h, (Merge(result, loc),))]
        batches = []
        if first:  # the first batch: first halves (or whole, where not split)
            batches.append(([(accs[0], Half.FIRST if mine else send_h)],
                            [(_CROSS_RET.at(slot), Half.FIRST if theirs else recv_h)]))
        if not (first and mine):  # the second batch: what is left in halves
            batches.append(([(accs[1], Half.SECOND)] if mine else [],
                            [(_CROSS_RET2.at(slot), Half.SECOND)] if theirs else []))
        out = []
        for sends, recvs in batches:
            h = self.p.comm(Stream.CROSS,
                            sends=[Xfer(cp, loc, kind, cp, hf) for loc, hf in sends],
                            recvs=[Xfer(cp, loc, kind, self.rank, hf) for loc, hf in recvs])
            out.append(_Return(-1, h, tuple(Merge(result, loc) for loc, _ in recvs)))
        return out

    def _pass(self, ps: _Pass, items: list[_Item], cross_handle: int | None) -> list[Op]:
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
            p.add(self._tile(cross.owner, cross.q_loc, r, _OWN_KV, cross.acc, Plan.DKV))
        last_kv = max((u.index for u in units if u.role is Role.KV), default=None)
        # Forward, joint: the own q's tile of the last kv unit waits until the counterpart's
        # partial is on its way (it is not needed before the end).
        hold_own = not self.bwd and cross is not None
        returns: list[_Return] = []
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

    def _await_cross(self, handle: int | None, cross: _Item) -> None:
        self.p.add(Wait(handle))
        self.p.add(Reset(cross.acc, self.pkind, cross.owner))

    def _post(self, u: _Unit, items: list[_Item]) -> int:
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

    def _compute_kv(self, u: _Unit, items: list[_Item], returns: list[_Return],
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
            returns.append(_Return(u.index, h, (Merge(self.kv.dkv, back),)))
        return held

    def _compute_q(self, u: _Unit, items: list[_Item], returns: list[_Return]) -> None:
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
        returns.append(_Return(u.index, h, tuple(Merge(it.acc, _Q_RET.at(u.slot, i))
                                                 for i, it in enumerate(items))))
