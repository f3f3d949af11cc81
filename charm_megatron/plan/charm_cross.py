"""CHARM+ across groups: what both cross roles share (docs/algorithm.md, *CHARM+*).

Each cross round pairs our group with a partner group, rank with counterpart (the rank of the
same local index). Per round the pair picks a role (:meth:`CrossExchange._cross_role`): pass-q
(the paper: the counterpart's q block visits our group and its partial goes home,
:mod:`charm_megatron.plan.charm_pass_q`) or pass-kv (our kv block visits theirs and,
backward, its dK, dV come home, :mod:`charm_megatron.plan.charm_pass_kv`). Both post the
visiting block, whole or as two row halves (:meth:`CrossExchange._post_cross_halves`), and
send a partial home the same way (:meth:`CrossExchange._home`), at most one pass's return
in flight.

Plan layer: no torch.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from charm_megatron.plan.core import Half, Kind, Loc, Merge, Stream, Xfer
from charm_megatron.plan.entries import Groups
from charm_megatron.plan.program import Return
from charm_megatron.plan.rmplus import RmPlusPasses
from charm_megatron.plan.roles import Decision, choose, row_bytes
from charm_megatron.plan.vocab import Direction, Role

if TYPE_CHECKING:
    from charm_megatron.plan.charm import CharmVariant

__all__ = ["CrossExchange"]

_CROSS_RET = Loc("cross.ret")  # our partial coming home from the counterpart
_CROSS_RET2 = Loc("cross.retb")  # a split return's second message (pass-kv dkv, pass-q)


class CrossExchange(RmPlusPasses):
    """RM+ passes plus the cross-group exchange's shared state: the role and the handles of
    every cross round, the pass order (it decides which pass holds a counterpart's q), and
    the partials on their way home."""

    def __init__(self, rank: int, groups: Groups, causal: bool, direction: Direction,
                 variant: CharmVariant) -> None:
        super().__init__(rank, groups, causal, direction, variant)
        self.order = variant.order
        self.cross_in: dict[int, int] = {}  # cross round -> handle of its block's exchange
        # cross round -> handle of its block's second half (rounds sent in halves only)
        self.cross_in2: dict[int, int] = {}
        self.trailing: list[int] = []  # send-only second halves, waited at the end
        # Our partials coming home from counterparts, one list per cross pass (a split
        # return is two batches).
        self.going_home: list[list[Return]] = []
        # Cross accumulators and return buffers alternate per pass that has a counterpart's q
        # (an idle group's rounds, when G is odd, do not count).
        self.n_cross_done = 0
        self.cross_roles = [self._cross_role(k) for k in range(len(self.cross))]

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

    def _post_cross_halves(self, k: int, cp: int, src: Loc, kind: Kind, rx: tuple[Loc, Loc],
                           send_rows: Half, recv_rows: Half, out_split: bool,
                           in_split: bool) -> None:
        """Post the cross exchange of round ``k`` with counterpart ``cp``: block ``kind`` from
        ``src`` out, the counterpart's into ``rx[0]``. Where a side splits (``out_split``: the
        counterpart splits what we send; ``in_split``: we split what we receive), the first
        row half goes in this batch and the second in one of its own right after (same stream,
        so it arrives second, into ``rx[1]``), waited for only by the second sub-pass
        (``cross_in2[k]``); a send-only second half is waited for at the end."""
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
            self.cross_in2[k] = h
        else:
            self.trailing.append(h)

    def _home(self, k: int, cp: int, kind: Kind, result: Loc, accs: tuple[Loc, Loc],
              home: tuple[Half, Half], slot: int, first: bool,
              split: tuple[bool, bool]) -> list[Return]:
        """Post the partial of cross round ``k`` that goes home to ``cp`` (pass-kv backward:
        its visiting block's dK, dV; pass-q: its q block's partial) and ours coming back,
        merged into ``result``. ``accs``: where the partial accumulated (whole or 1st half,
        2nd half); ``home``: the rows of each (whole returns). Where our pass was split (the
        block of ``k`` came in halves) ours go in two batches, posted after each sub-pass
        (``first``: the one after the first); where the counterpart's was, theirs come in
        two: the first batch carries the first halves (or a whole return), the second the
        rest. Both sides derive the same two batches, so the messages pair up in order.
        ``split``: whether our pass of ``k`` was split, and whether the counterpart's was."""
        mine, theirs = split
        send_h, recv_h = home
        if not (mine or theirs):  # one batch, both ways whole
            loc = _CROSS_RET.at(slot)
            h = self.p.comm(Stream.CROSS,
                            sends=[Xfer(cp, accs[0], kind, cp, send_h)],
                            recvs=[Xfer(cp, loc, kind, self.rank, recv_h)])
            return [Return(-1, h, (Merge(result, loc),))]
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
            out.append(Return(-1, h, tuple(Merge(result, loc) for loc, _ in recvs)))
        return out

    def _keep_one_return(self) -> None:
        """Keep at most one pass's cross return in flight: its buffers are reused two passes
        on."""
        while len(self.going_home) > 1:
            for ret in self.going_home.pop(0):
                self.p.finish(ret)
