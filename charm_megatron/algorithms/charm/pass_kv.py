"""CHARM+ pass-kv cross rounds (beyond the paper): our kv block visits the partner group, its
queries run against it through their RM+ rounds and, backward, its dK, dV come home; incl.
the split visiting kv (docs/algorithm.md, *Pass-kv across groups*, *Visiting kv in two
halves*).

The visiting passes: the own q against the counterpart's kv block. ``split_visiting``
(:func:`kv_splits`): where every tile of a visiting pass needs all rows of the visiting kv
blocks (the earlier group under the causal layout; both groups without a mask), those blocks
cross in two messages, first row half then second, and the visiting pass runs as two
sub-passes, one per kv row half: the first half's tiles run while the second half is still
on the slow link (:func:`run_visiting_pass`).

Functions over :class:`~charm_megatron.algorithms.charm.state.RankState`.

Plan layer: no torch.
"""

from __future__ import annotations

from collections.abc import Sequence

from charm_megatron.algorithms.charm.cross import (
    CrossReturn,
    home,
    keep_one_return,
    post_cross_halves,
)
from charm_megatron.algorithms.charm.rmplus import Item, Pass, hold_own_kv, kv_half, run_pass
from charm_megatron.algorithms.charm.state import OWN_KV, KvHeld, RankState
from charm_megatron.plan.core import Half, Kind, Loc, Plan, Reset, Wait, tile_spec
from charm_megatron.plan.program import Return

__all__ = ["kv_splits", "post_visiting_kv", "run_visiting_pass"]

_CROSS_KV = Loc("cross.kv")  # the counterpart's visiting kv block (or its 1st half)
_CROSS_KV2 = Loc("cross.kvb")  # split: the visiting block's second half
_VISIT_DKV = Loc("acc.vdkv")  # backward: the visiting block's dkv, accumulated here
_VISIT_DKV2 = Loc("acc.vdkvb")  # backward, split: the second half's dkv


def post_visiting_kv(st: RankState, k: int, cp: int, other: Sequence[int]) -> None:
    """Swap kv blocks with ``cp``, our counterpart of pass-kv round ``k`` in group ``other``
    (ours visits their group), in halves where either side splits."""
    post_cross_halves(
        st, k, cp, OWN_KV, Kind.KV, (_CROSS_KV, _CROSS_KV2),
        (kv_half(st, st.rank, other), kv_half(st, cp, st.group)),
        (kv_splits(st, other, st.group), kv_splits(st, st.group, other)))


def run_visiting_pass(st: RankState, ps: Pass) -> None:
    """The group's queries against the visiting kv blocks of cross round ``k`` (each rank
    holds its counterpart's, routed through the RM+ rounds like the own kv); backward, the
    visiting block's dkv (summed over every tile it served in our group) goes home and ours
    comes back.

    Split (:func:`kv_splits`): two sub-passes, the first with the visiting blocks' first row
    halves (tiles ``q x kv.1st``), which start as soon as those arrived, the second with the
    second halves (``q x kv.2nd``); each circulates only its half through the RM+ rounds.
    Forward, the two sub-tiles of a tile lse-merge into the output like any two tiles;
    backward, dq sums, and each half's dK, dV accumulate in their own half-sized
    accumulator, which goes home as soon as its sub-pass is done (the first half travels
    during the second sub-pass). A split return on either side is two batches, first half
    then second; the counterpart receives them in that order
    (:func:`~charm_megatron.algorithms.charm.cross.home`)."""
    k = ps.cross_round
    partner = st.cross[k].get(st.g)
    if partner is None:  # our group idles this round (an odd number of groups)
        return
    p, r = st.p, st.rank
    cp = st.groups[partner][st.local]
    other = st.groups[partner]
    slot = st.n_cross_done % 2
    dkv = _VISIT_DKV.at(slot) if st.bwd else Plan.DKV
    # The rows that go home and come back, fixed before any sub-pass narrows kv_rows.
    ret = CrossReturn(cp, Kind.DKV, Plan.DKV, (_VISIT_DKV.at(slot), _VISIT_DKV2.at(slot)),
                      (kv_half(st, cp, st.group), kv_half(st, r, other)), slot,
                      (k in st.cross_in2, kv_splits(st, other, st.group)))
    st.kv = KvHeld(cp, _CROSS_KV.at(k % 2), dkv)
    p.add(Wait(st.cross_in[k]))
    if st.bwd:
        p.add(Reset(st.kv.dkv, Kind.DKV, cp))
    items = [Item(r, st.own_q, st.own_acc)]
    rets: list[Return] = []
    if k in st.cross_in2:
        st.kv_rows = Half.FIRST
        run_pass(st, ps, items, None)
        if st.bwd:
            rets += home(st, ret, first=True)
        p.add(Wait(st.cross_in2[k]))
        dkv2 = _VISIT_DKV2.at(slot) if st.bwd else Plan.DKV
        st.kv = KvHeld(cp, _CROSS_KV2.at(k % 2), dkv2)
        if st.bwd:
            p.add(Reset(dkv2, Kind.DKV, cp))
        st.kv_rows = Half.SECOND
        run_pass(st, ps, items, None)
        st.kv_rows = Half.FULL
    else:
        run_pass(st, ps, items, None)
    if st.bwd:
        rets += home(st, ret, first=not rets)
        st.going_home.append(rets)
    st.n_cross_done += 1
    hold_own_kv(st)
    keep_one_return(st)


def kv_splits(st: RankState, receiving: Sequence[int], visiting: Sequence[int]) -> bool:
    """Whether group ``receiving`` runs its visiting pass with the kv blocks of group
    ``visiting`` in two row halves: asked for, and every one of its tiles needs all kv rows
    and no mask (so each tile is exactly its two kv-half sub-tiles). Both groups compute it
    alike for both directions of the exchange."""
    return st.split_visiting and all(
        (s := tile_spec(i, j, st.causal)).kv_half is Half.FULL and not s.causal
        for i in receiving for j in visiting)
