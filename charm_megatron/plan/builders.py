"""Plan builders: ring (TransformerEngine ``p2p``), RM+ and CHARM+ (ALGORITHM.md §3–§6).

Each builder returns one CP rank's op list; :mod:`charm_megatron.plan.registry` names them and
assembles the :class:`~charm_megatron.plan.core.Plan` (``build_plan``). RM+ is CHARM+ with a
single group, so one builder serves both.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass

from charm_megatron.plan.core import (
    Comm,
    Half,
    Merge,
    Op,
    Plan,
    Reset,
    Tile,
    TileBwd,
    Wait,
    Xfer,
    tile_spec,
)
from charm_megatron.plan.pairing import group_rounds, rmplus_rounds


class _Program:
    """Accumulates one rank's ops and hands out batch handles."""

    def __init__(self) -> None:
        self.ops: list[Op] = []
        self._next = 0

    def comm(self, stream: str, sends: Sequence[Xfer] = (), recvs: Sequence[Xfer] = ()) -> int:
        handle = self._next
        self._next += 1
        self.ops.append(Comm(handle, stream, tuple(sends), tuple(recvs)))
        return handle

    def add(self, op: Op) -> None:
        self.ops.append(op)


# --------------------------------------------------------------------------------------- ring
def _ring(r: int, n: int, causal: bool, backward: bool) -> list[Op]:
    """TransformerEngine's p2p ring: kv walks ``r -> r+1``; the next kv is posted before the
    current tile is computed. Backward carries the dkv partial sums around the ring one step
    behind kv, so a block's dkv arrives home complete after ``n`` hops."""
    p = _Program()
    nxt, prv = (r + 1) % n, (r - 1) % n
    qloc = "own.qgrad" if backward else "own.q"
    if backward:
        p.add(Reset(Plan.DQ, "dq", r))
    else:
        p.add(Reset(Plan.OUT, "out", r))
    cur = "own.kv"
    kv_handle = dkv_handle = None
    for step in range(n):
        j = (r - step) % n
        spec = tile_spec(r, j, causal)
        if step < n - 1:
            buf = f"ring.kv{step % 2}"
            kv_handle = p.comm(
                "kv",
                sends=[Xfer(nxt, cur, "kv", j, Half.FULL)],
                recvs=[Xfer(prv, buf, "kv", (j - 1) % n, Half.FULL)],
            )
        if not backward:
            p.add(Tile(spec, qloc, cur, Plan.OUT))
        elif n == 1:
            p.add(Reset(Plan.DKV, "dkv", r))
            p.add(TileBwd(spec, qloc, cur, Plan.DQ, Plan.DKV))
        else:
            mine = f"ring.dkv{step % 2}"
            p.add(Reset(mine, "dkv", j))
            p.add(TileBwd(spec, qloc, cur, Plan.DQ, mine))
            if step > 0:
                p.add(Wait(dkv_handle))
                p.add(Merge(mine, f"ring.dkvin{(step - 1) % 2}"))
            into = Plan.DKV if step == n - 1 else f"ring.dkvin{step % 2}"
            dkv_handle = p.comm(
                "q",  # the dkv ring gets its own stream so it never queues behind kv
                sends=[Xfer(nxt, mine, "dkv", j, Half.FULL)],
                recvs=[Xfer(prv, into, "dkv", (j - 1) % n, Half.FULL)],
            )
        if step < n - 1:
            p.add(Wait(kv_handle))
            cur = buf
    if backward and n > 1:
        p.add(Wait(dkv_handle))
    return p.ops


# ------------------------------------------------------------------------------- RM+ / CHARM+
@dataclass(frozen=True)
class _Item:
    """A q block processed in a pass: whose rows, where they are, where they accumulate."""

    owner: int
    q_loc: str
    acc: str


@dataclass(frozen=True)
class _Pass:
    """One run of (some of) the group's RM+ rounds for the q blocks a rank holds.

    ``own``: the rank's own q; ``cross``: the counterpart's q of cross round ``cross_round``;
    ``rounds``: indices into the group's RM+ rounds; ``own_kv``: also the tiles with own kv.
    """

    own: bool
    cross_round: int | None
    rounds: tuple[int, ...]
    own_kv: bool


ORDERS = ("split", "joint")


def _union(halves: Iterable[Half]) -> Half:
    """The rows a message must carry: the union of the rows its tiles use."""
    out = None
    for h in halves:
        out = h if out is None else out.union(h)
    return out or Half.FULL


class _CharmRank:
    """Builds one rank's CHARM+ (or, with one group, RM+) forward or backward program.

    Structure (ALGORITHM.md §3–§4, §6): *passes* run the RM+ rounds of the group for the q
    blocks a rank holds. Per unit (one RM+ round): post the next unit's exchange, wait for this
    one's, compute. q-pair partials go back one unit later; a counterpart's partial goes home at
    the end of its pass.

    Pass order (``order``):

    * ``split`` (default): the own q's first rounds while the counterpart's q crosses the slow
      link; then one pass per counterpart q (all rounds), each sent home as soon as it is done;
      then the own q's remaining rounds, which hide the last slow return. kv blocks of the
      rounds are fetched once per pass that needs them (intra-group links are the fast ones).
    * ``joint``: the paper's single pass with own and counterpart q side by side (kv fetched
      once for both), the own q's last tile deferred until the counterpart's partial is sent.
    """

    def __init__(self, rank: int, groups: tuple[tuple[int, ...], ...], causal: bool,
                 backward: bool, order: str = "split") -> None:
        if order not in ORDERS:
            raise ValueError(f"unknown CHARM+ pass order {order!r}; choose one of {ORDERS}")
        self.rank = rank
        self.groups = groups
        self.causal = causal
        self.bwd = backward
        self.order = order
        self.g = next(i for i, grp in enumerate(groups) if rank in grp)
        self.local = groups[self.g].index(rank)
        self.rounds = rmplus_rounds(len(groups[self.g]))
        self.cross = group_rounds(len(groups))
        self.p = _Program()
        self.qkind = "qgrad" if backward else "q"
        self.pkind = "dq" if backward else "out"  # what comes back for a q block
        self._deferred: list = []

    # -- the passes and which q blocks a rank holds in each ----------------------------------
    def _passes(self) -> list[_Pass]:
        every = tuple(range(len(self.rounds)))
        if not self.cross:
            return [_Pass(True, None, every, True)]
        if self.order == "joint":
            return [_Pass(True, 0, every, True)] + [
                _Pass(False, k, every, True) for k in range(1, len(self.cross))]
        head = every[: len(every) // 2]
        tail = every[len(head):]
        passes = [_Pass(True, None, head, True)]
        passes += [_Pass(False, k, every, True) for k in range(len(self.cross))]
        if tail:
            passes.append(_Pass(True, None, tail, False))
        return passes

    def _owners(self, ps: _Pass, local: int) -> list[int]:
        """Owners of the q blocks that local index ``local`` of our group holds in pass ``ps``."""
        owners = [self.groups[self.g][local]] if ps.own else []
        if ps.cross_round is not None:
            partner = self.cross[ps.cross_round].get(self.g)
            if partner is not None:
                owners.append(self.groups[partner][local])
        return owners

    # -- message halves --------------------------------------------------------------------------
    def _q_half(self, owner: int, kv_owners: Sequence[int]) -> Half:
        """Rows of q block ``owner`` that its tiles with ``kv_owners`` need."""
        return _union(tile_spec(owner, j, self.causal).q_half for j in kv_owners)

    def _kv_half(self, kv_owner: int, q_owners: Sequence[int]) -> Half:
        """Rows of kv block ``kv_owner`` that its tiles with ``q_owners`` need."""
        return _union(tile_spec(i, kv_owner, self.causal).kv_half for i in q_owners)

    # -- ops ---------------------------------------------------------------------------------
    def _tile(self, owner: int, q_loc: str, kv_owner: int, kv_loc: str, acc: str,
              dkv_acc: str, fresh_dq: bool = False, fresh_dkv: bool = False) -> None:
        spec = tile_spec(owner, kv_owner, self.causal)
        if self.bwd:
            self.p.add(TileBwd(spec, q_loc, kv_loc, acc, dkv_acc, fresh_dq, fresh_dkv))
        else:
            self.p.add(Tile(spec, q_loc, kv_loc, acc))

    def build(self) -> list[Op]:
        p, r = self.p, self.rank
        own_q = "own.qgrad" if self.bwd else "own.q"
        if self.bwd:
            p.add(Reset(Plan.DQ, "dq", r))
            p.add(Reset(Plan.DKV, "dkv", r))
        else:
            p.add(Reset(Plan.OUT, "out", r))
        own_acc = Plan.DQ if self.bwd else Plan.OUT
        group = self.groups[self.g]
        cross_in: dict[int, int] = {}  # cross round -> handle of its q exchange
        cross_ret: list[tuple[int, str]] = []  # (handle, loc) of cross partials coming home
        # Cross accumulators and return buffers alternate per pass that has a counterpart's q
        # (an idle group's rounds, when G is odd, do not count).
        n_cross_done = 0

        def post_cross_exchange(k: int) -> None:
            partner = self.cross[k].get(self.g) if k < len(self.cross) else None
            if partner is None:
                return
            cp = self.groups[partner][self.local]
            cross_in[k] = p.comm(
                "cross",
                sends=[Xfer(cp, own_q, self.qkind, r, self._q_half(r, self.groups[partner]))],
                recvs=[Xfer(cp, f"cross.q{k % 2}", self.qkind, cp, self._q_half(cp, group))],
            )

        if self.cross:
            post_cross_exchange(0)
        for ps in self._passes():
            k = ps.cross_round
            if k is not None:
                post_cross_exchange(k + 1)  # the next counterpart's q travels during this pass
            owners = self._owners(ps, self.local)
            if not owners:
                continue
            items = []
            for o in owners:
                if o == r:
                    items.append(_Item(o, own_q, own_acc))
                else:
                    items.append(_Item(o, f"cross.q{k % 2}", f"acc.cross{n_cross_done % 2}"))
            self._pass(ps, items, cross_in.get(k) if k is not None else None)
            for it in items:
                if it.owner == r:
                    continue
                partner = self.cross[k][self.g]
                ret_loc = f"cross.ret{n_cross_done % 2}"
                h = p.comm(
                    "cross",
                    sends=[Xfer(it.owner, it.acc, self.pkind, it.owner,
                                self._q_half(it.owner, group))],
                    recvs=[Xfer(it.owner, ret_loc, self.pkind, r,
                                self._q_half(r, self.groups[partner]))],
                )
                cross_ret.append((h, ret_loc))
                n_cross_done += 1
            self._flush_deferred()
            # Keep at most one cross return in flight: its buffer is reused two passes on.
            while len(cross_ret) > 1:
                h, loc = cross_ret.pop(0)
                p.add(Wait(h))
                p.add(Merge(own_acc, loc))
        for h, loc in cross_ret:
            p.add(Wait(h))
            p.add(Merge(own_acc, loc))
        return p.ops

    def _pass(self, ps: _Pass, items: list[_Item], cross_handle: int | None) -> None:
        p, r = self.p, self.rank
        group = self.groups[self.g]
        units = [(self.rounds[i].role, self.rounds[i].partner[self.local]) for i in ps.rounds
                 if self.local in self.rounds[i].partner]
        # Buffer slot per unit: a unit's buffers live until the end of the next unit, so only
        # two adjacent units of the same role need different slots (memory: one set of receive
        # buffers per stream when kv and q rounds alternate, two at most).
        slot: list[int] = []
        for u, (role, _) in enumerate(units):
            slot.append(1 - slot[u - 1] if u and units[u - 1][0] == role else 0)
        has_cross = any(it.owner != r for it in items)
        cross_waited = not has_cross

        def ensure_cross() -> None:
            nonlocal cross_waited
            if not cross_waited:
                p.add(Wait(cross_handle))
                it = next(it for it in items if it.owner != r)
                p.add(Reset(it.acc, self.pkind, it.owner))
                cross_waited = True

        def phase1(u: int) -> int:
            role, peer_local = units[u]
            y = group[peer_local]
            peer_owners = self._owners(ps, peer_local)
            if role == "kv":
                return p.comm(
                    "kv",
                    sends=[Xfer(y, "own.kv", "kv", r, self._kv_half(r, peer_owners))],
                    recvs=[Xfer(y, f"kv.rx{slot[u]}", "kv", y,
                                self._kv_half(y, [it.owner for it in items]))],
                )
            ensure_cross()
            return p.comm(
                "q",
                sends=[Xfer(y, it.q_loc, self.qkind, it.owner, self._q_half(it.owner, [y]))
                       for it in items],
                recvs=[Xfer(y, f"q.rx{slot[u]}.{i}", self.qkind, o, self._q_half(o, [r]))
                       for i, o in enumerate(peer_owners)],
            )

        handles: dict[int, int] = {}
        # Pending partial returns: (unit, handle, [(acc, loc)]). A unit's buffers are reused two
        # units later, so its return is completed at the end of the next unit.
        returns: list[tuple[int, int, list[tuple[str, str]]]] = []
        if units:
            handles[0] = phase1(0)
        if ps.own_kv:
            # Own kv first, own q first: needs no communication, which hides the arrivals.
            for it in sorted(items, key=lambda it: it.owner != r):
                if it.owner != r:
                    ensure_cross()
                self._tile(it.owner, it.q_loc, r, "own.kv", it.acc, Plan.DKV)
        ensure_cross()
        last_kv = max((u for u, (role, _) in enumerate(units) if role == "kv"), default=None)
        for u, (role, peer_local) in enumerate(units):
            if u + 1 < len(units):
                handles[u + 1] = phase1(u + 1)
            y = group[peer_local]
            p.add(Wait(handles.pop(u)))
            if role == "kv":
                buf = f"kv.rx{slot[u]}"
                dkv = f"acc.pdkv{slot[u]}"
                # One q block: the peer's dk/dv partial is one tile's, sent as the kernel made it.
                fresh_dkv = self.bwd and len(items) == 1
                if self.bwd and not fresh_dkv:
                    p.add(Reset(dkv, "dkv", y))
                # Counterpart's q first: its partial must travel home, the own q's need not.
                for it in sorted(items, key=lambda it: it.owner == r):
                    if u == last_kv and has_cross and it.owner == r and not self.bwd:
                        self._deferred.append((it.owner, it.q_loc, y, buf, it.acc, dkv))
                        continue
                    self._tile(it.owner, it.q_loc, y, buf, it.acc, dkv, fresh_dkv=fresh_dkv)
                if self.bwd:
                    half_back = self._kv_half(y, [it.owner for it in items])
                    mine_half = self._kv_half(r, self._owners(ps, peer_local))
                    h = p.comm(
                        "kv",
                        sends=[Xfer(y, dkv, "dkv", y, half_back)],
                        recvs=[Xfer(y, f"kv.dret{slot[u]}", "dkv", r, mine_half)],
                    )
                    returns.append((u, h, [(Plan.DKV, f"kv.dret{slot[u]}")]))
            else:
                sends = []
                for i, o in enumerate(self._owners(ps, peer_local)):
                    acc = f"acc.svc{slot[u]}.{i}"
                    if self.bwd:
                        self._tile(o, f"q.rx{slot[u]}.{i}", r, "own.kv", acc, Plan.DKV,
                                   fresh_dq=True)
                    else:
                        # A served tile is one partial sent straight back: no accumulator.
                        p.add(Tile(tile_spec(o, r, self.causal), f"q.rx{slot[u]}.{i}", "own.kv",
                                   acc, fresh=True))
                    sends.append(Xfer(y, acc, self.pkind, o, self._q_half(o, [r])))
                recvs = [Xfer(y, f"q.ret{slot[u]}.{i}", self.pkind, it.owner,
                              self._q_half(it.owner, [y])) for i, it in enumerate(items)]
                h = p.comm("q", sends=sends, recvs=recvs)
                returns.append((u, h, [(it.acc, f"q.ret{slot[u]}.{i}")
                                       for i, it in enumerate(items)]))
            # Partials of the previous unit have had a whole unit of compute to arrive.
            while returns and returns[0][0] < u:
                self._finish_return(returns.pop(0))
        # A counterpart's partial must be complete before it goes home.
        for ret in returns:
            self._finish_return(ret)

    def _finish_return(self, ret: tuple[int, int, list[tuple[str, str]]]) -> None:
        _, h, merges = ret
        self.p.add(Wait(h))
        for acc, loc in merges:
            self.p.add(Merge(acc, loc))

    def _flush_deferred(self) -> None:
        for args in self._deferred:
            self._tile(*args)
        self._deferred = []
