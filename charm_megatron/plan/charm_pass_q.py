"""CHARM+ pass-q cross rounds (the paper's): a counterpart's q block visits our group, runs
through the group's RM+ rounds with our kv blocks and its partial goes home; incl. the split
counterpart q (docs/algorithm.md, *Counterpart q in two halves*).

Plan layer: no torch.
"""

from __future__ import annotations

from collections.abc import Sequence

from charm_megatron.plan.charm_cross import CrossExchange
from charm_megatron.plan.core import Half, Loc, tile_spec
from charm_megatron.plan.program import Return
from charm_megatron.plan.rmplus import Item, Pass
from charm_megatron.plan.vocab import PassOrder

__all__ = ["PassQ"]

_CROSS_Q = Loc("cross.q")  # the counterpart's q block (slot: the cross round's parity)
_CROSS_Q2 = Loc("cross.qb")  # split: the counterpart's q block's second half
_CROSS_ACC = Loc("acc.cross")  # the counterpart's partial, accumulated here
_CROSS_ACC2 = Loc("acc.crossb")  # split: the second half's partial


class PassQ(CrossExchange):
    """The passes that hold q blocks: the own q's, a counterpart's, or both (the joint order's
    first pass).

    ``variant.split_counterpart_q``: where every tile of a counterpart's q block needs all its rows
    and no mask (the earlier group under the causal layout; both groups without a mask), the
    block crosses as two row-half messages and its pass runs as two sub-passes, q rows 1st
    then 2nd; each half's partial goes home as soon as its sub-pass is done, so the first
    half's crosses back while the second half is computed (:meth:`_run_counterpart_pass`).
    """

    def _post_counterpart_q(self, k: int, cp: int, other: Sequence[int]) -> None:
        """Swap q blocks with ``cp``, our counterpart of pass-q round ``k`` in group
        ``other``, in halves where either side splits."""
        self._post_cross_halves(
            k, cp, self.own_q, self.qkind, (_CROSS_Q, _CROSS_Q2),
            self._q_half(self.rank, other), self._q_half(cp, self.group),
            self._q_splits(k, other, self.group), self._q_splits(k, self.group, other))

    def _run_q_pass(self, ps: Pass) -> None:
        """A pass with q blocks against the held kv blocks, then the counterpart's partial sent
        home and ours coming back."""
        p, r, k = self.p, self.rank, ps.cross_round
        self.hold_own_kv()
        owners = self._owners(ps, self.local)
        if not owners:
            return
        items = [Item(o, self.own_q, self.own_acc) if o == r else
                 Item(o, _CROSS_Q.at(k % 2), _CROSS_ACC.at(self.n_cross_done % 2))
                 for o in owners]
        if not ps.own and k in self.cross_in2:
            self._run_counterpart_pass(ps, k, owners[0])
            return
        held_back = self._pass(ps, items, self.cross_in.get(k) if k is not None else None)
        for it in items:
            if it.owner == r:
                continue
            slot = self.n_cross_done % 2
            self.going_home.append(self._home(k, it.owner, self.pkind, self.own_acc,
                                              (it.acc, _CROSS_ACC2.at(slot)),
                                              self._q_home(k, it.owner), slot, first=True,
                                              split=self._q_split_sides(k)))
            self.n_cross_done += 1
        for op in held_back:
            p.add(op)
        self._keep_one_return()

    def _q_home(self, k: int, cp: int) -> tuple[Half, Half]:
        """The rows of the counterpart ``cp``'s partial of cross round ``k`` that go home, and
        of ours that come back (whole returns)."""
        other = self.groups[self.cross[k][self.g]]
        return self._q_half(cp, self.group), self._q_half(self.rank, other)

    def _q_split_sides(self, k: int) -> tuple[bool, bool]:
        """Whether our pass of round ``k`` ran split, and whether the counterpart's did."""
        other = self.groups[self.cross[k][self.g]]
        return k in self.cross_in2, self._q_splits(k, other, self.group)

    def _run_counterpart_pass(self, ps: Pass, k: int, cp: int) -> None:
        """Split (:meth:`_q_splits`): the counterpart ``cp``'s q block in two sub-passes, the
        first with its first row half (tiles ``q.1st x kv``), which starts as soon as that half
        arrived, the second with the second half; each circulates only its half through the
        RM+ rounds and accumulates in its own half-sized accumulator, which goes home as soon
        as its sub-pass is done (the first half's partial travels during the second
        sub-pass). Forward, the counterpart lse-merges the two halves' rows into its output;
        backward, they are its dq rows (our kv's dK, dV stay here, summed over both
        sub-passes). The return batches pair up with the counterpart's as in :meth:`_home`."""
        slot = self.n_cross_done % 2
        home = self._q_home(k, cp)
        split = self._q_split_sides(k)
        accs = (_CROSS_ACC.at(slot), _CROSS_ACC2.at(slot))
        rets: list[Return] = []
        for rows, q_loc, acc, handle in (
                (Half.FIRST, _CROSS_Q.at(k % 2), accs[0], self.cross_in[k]),
                (Half.SECOND, _CROSS_Q2.at(k % 2), accs[1], self.cross_in2[k])):
            self.q_rows = rows
            held_back = self._pass(ps, [Item(cp, q_loc, acc)], handle)
            self.q_rows = Half.FULL
            assert not held_back  # only an own q's tile is ever held back
            rets += self._home(k, cp, self.pkind, self.own_acc, accs, home, slot,
                               first=rows is Half.FIRST, split=split)
        self.going_home.append(rets)
        self.n_cross_done += 1
        self._keep_one_return()

    def _q_splits(self, k: int, receiving: Sequence[int], visiting: Sequence[int]) -> bool:
        """Whether group ``receiving`` runs its pass-q pass of cross round ``k`` with the q
        blocks of group ``visiting`` in two row halves: asked for, the pass holds only those
        blocks (not the joint order's first pass, which holds the own q too), and every one
        of their tiles needs all q rows and no mask (so each tile is exactly its two q-half
        sub-tiles). Both groups compute it alike for both directions of the exchange."""
        if not self.variant.split_counterpart_q or (self.order is PassOrder.JOINT and k == 0):
            return False
        return all((s := tile_spec(i, j, self.causal)).q_half is Half.FULL and not s.causal
                   for i in visiting for j in receiving)
