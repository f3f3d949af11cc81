"""CHARM+ pass-kv cross rounds (beyond the paper): our kv block visits the partner group, its
queries run against it through their RM+ rounds and, backward, its dK, dV come home; incl.
the split visiting kv (docs/algorithm.md, *Pass-kv across groups*, *Visiting kv in two
halves*).

Plan layer: no torch.
"""

from __future__ import annotations

from collections.abc import Sequence

from charm_megatron.plan.charm_cross import CrossExchange
from charm_megatron.plan.core import Half, Kind, Loc, Plan, Reset, Wait, tile_spec
from charm_megatron.plan.program import Return
from charm_megatron.plan.rmplus import OWN_KV, Item, KvHeld, Pass

__all__ = ["PassKv"]

_CROSS_KV = Loc("cross.kv")  # the counterpart's visiting kv block (or its 1st half)
_CROSS_KV2 = Loc("cross.kvb")  # split: the visiting block's second half
_VISIT_DKV = Loc("acc.vdkv")  # backward: the visiting block's dkv, accumulated here
_VISIT_DKV2 = Loc("acc.vdkvb")  # backward, split: the second half's dkv


class PassKv(CrossExchange):
    """The visiting passes: the own q against the counterpart's kv block.

    ``variant.split_visiting``: where every tile of a visiting pass needs all rows of the visiting kv
    blocks (the earlier group under the causal layout; both groups without a mask), those
    blocks cross in two messages, first row half then second, and the visiting pass runs as
    two sub-passes, one per kv row half: the first half's tiles run while the second half is
    still on the slow link (:meth:`_run_visiting_pass`).
    """

    def _post_visiting_kv(self, k: int, cp: int, other: Sequence[int]) -> None:
        """Swap kv blocks with ``cp``, our counterpart of pass-kv round ``k`` in group
        ``other`` (ours visits their group), in halves where either side splits."""
        self._post_cross_halves(
            k, cp, OWN_KV, Kind.KV, (_CROSS_KV, _CROSS_KV2),
            self._kv_half(self.rank, other), self._kv_half(cp, self.group),
            self._splits(other, self.group), self._splits(self.group, other))

    def _run_visiting_pass(self, ps: Pass) -> None:
        """The group's queries against the visiting kv blocks of cross round ``k`` (each rank
        holds its counterpart's, routed through the RM+ rounds like the own kv); backward, the
        visiting block's dkv (summed over every tile it served in our group) goes home and
        ours comes back.

        Split (:meth:`_splits`): two sub-passes, the first with the visiting blocks' first row
        halves (tiles ``q x kv.1st``), which start as soon as those arrived, the second with
        the second halves (``q x kv.2nd``); each circulates only its half through the RM+
        rounds. Forward, the two sub-tiles of a tile lse-merge into the output like any two
        tiles; backward, dq sums, and each half's dK, dV accumulate in their own half-sized
        accumulator, which goes home as soon as its sub-pass is done (the first half travels
        during the second sub-pass). A split return on either side is two batches, first half
        then second; the counterpart receives them in that order (:meth:`_home`)."""
        k = ps.cross_round
        partner = self.cross[k].get(self.g)
        if partner is None:  # our group idles this round (an odd number of groups)
            return
        p, r = self.p, self.rank
        cp = self.groups[partner][self.local]
        other = self.groups[partner]
        slot = self.n_cross_done % 2
        dkv = _VISIT_DKV.at(slot) if self.bwd else Plan.DKV
        # The rows that go home and come back, fixed before any sub-pass narrows kv_rows.
        home = (self._kv_half(cp, self.group), self._kv_half(r, other))
        split = (k in self.cross_in2, self._splits(other, self.group))
        dkvs = (_VISIT_DKV.at(slot), _VISIT_DKV2.at(slot))
        self.kv = KvHeld(cp, _CROSS_KV.at(k % 2), dkv)
        p.add(Wait(self.cross_in[k]))
        if self.bwd:
            p.add(Reset(self.kv.dkv, Kind.DKV, cp))
        items = [Item(r, self.own_q, self.own_acc)]
        rets: list[Return] = []
        if k in self.cross_in2:
            self.kv_rows = Half.FIRST
            self._pass(ps, items, None)
            if self.bwd:
                rets += self._home(k, cp, Kind.DKV, Plan.DKV, dkvs, home, slot, first=True,
                                   split=split)
            p.add(Wait(self.cross_in2[k]))
            dkv2 = _VISIT_DKV2.at(slot) if self.bwd else Plan.DKV
            self.kv = KvHeld(cp, _CROSS_KV2.at(k % 2), dkv2)
            if self.bwd:
                p.add(Reset(dkv2, Kind.DKV, cp))
            self.kv_rows = Half.SECOND
            self._pass(ps, items, None)
            self.kv_rows = Half.FULL
        else:
            self._pass(ps, items, None)
        if self.bwd:
            rets += self._home(k, cp, Kind.DKV, Plan.DKV, dkvs, home, slot, first=not rets,
                               split=split)
            self.going_home.append(rets)
        self.n_cross_done += 1
        self.hold_own_kv()
        self._keep_one_return()

    def _splits(self, receiving: Sequence[int], visiting: Sequence[int]) -> bool:
        """Whether group ``receiving`` runs its visiting pass with the kv blocks of group
        ``visiting`` in two row halves: asked for, and every one of its tiles needs all kv rows
        and no mask (so each tile is exactly its two kv-half sub-tiles). Both groups compute
        it alike for both directions of the exchange."""
        return self.variant.split_visiting and all(
            (s := tile_spec(i, j, self.causal)).kv_half is Half.FULL and not s.causal
            for i in receiving for j in visiting)
