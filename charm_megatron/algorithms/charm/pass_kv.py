"""CHARM+ pass-kv cross rounds (beyond the paper): our kv block visits the partner group, its
queries run against it through their RM+ rounds and, backward, its dK, dV come home; incl.
the split visiting kv (docs/algorithm.md, *Pass-kv across groups*, *Visiting kv in
pieces*).

The visiting passes: the own q against the counterpart's kv block. ``split_visiting``
(:func:`kv_splits`): where every tile of a visiting pass needs all rows of the visiting kv
blocks (the earlier group under the causal layout; both groups without a mask), those blocks
cross in row pieces (two halves, or four quarters), one message each in row order, and the
visiting pass runs as one sub-pass per piece: a piece's tiles run while the later pieces are
still on the slow link (:func:`run_visiting_pass`).

Functions over :class:`~charm_megatron.algorithms.charm.state.RankState`.

Plan layer: no torch.
"""

from __future__ import annotations

from collections.abc import Sequence

from charm_megatron.algorithms.charm.cross import (
    CrossReturn,
    home,
    keep_one_return,
    post_cross_pieces,
)
from charm_megatron.algorithms.charm.rmplus import Item, Pass, hold_own_kv, kv_half, run_pass
from charm_megatron.algorithms.charm.state import OWN_KV, KvHeld, RankState
from charm_megatron.plan.core import Half, Kind, Loc, Plan, Reset, Stream, Wait, tile_spec
from charm_megatron.plan.program import Return

__all__ = ["kv_splits", "post_visiting_kv", "run_visiting_pass"]

# The counterpart's visiting kv block (or its first piece), then its further pieces; and,
# backward, each piece's dkv, accumulated here (the names of the two-halves plans kept).
_CROSS_KV = (Loc("cross.kv"), Loc("cross.kvb"), Loc("cross.kvc"), Loc("cross.kvd"))
_VISIT_DKV = (Loc("acc.vdkv"), Loc("acc.vdkvb"), Loc("acc.vdkvc"), Loc("acc.vdkvd"))


def post_visiting_kv(st: RankState, k: int, cp: int, other: Sequence[int]) -> None:
    """Swap kv blocks with ``cp``, our counterpart of pass-kv round ``k`` in group ``other``
    (ours visits their group), in row pieces where either side splits."""
    post_cross_pieces(
        st, k, cp, OWN_KV, Kind.KV, _CROSS_KV,
        (kv_half(st, st.rank, other), kv_half(st, cp, st.group)),
        (kv_splits(st, other, st.group), kv_splits(st, st.group, other)))


def run_visiting_pass(st: RankState, ps: Pass) -> None:
    """The group's queries against the visiting kv blocks of cross round ``k`` (each rank
    holds its counterpart's, routed through the RM+ rounds like the own kv); backward, the
    visiting block's dkv (summed over every tile it served in our group) goes home and ours
    comes back.

    Split (:func:`kv_splits`): one sub-pass per row piece of the visiting blocks (two
    halves, or four quarters), in row order, each starting as soon as its piece arrived
    (tiles ``q x kv.<piece>``) and circulating only that piece through the RM+ rounds.
    Forward, a tile's sub-tiles lse-merge into the output like any tiles; backward, dq sums,
    and each piece's dK, dV accumulate in their own piece-sized accumulator, which goes home
    as soon as its sub-pass is done (it travels during the later sub-passes), on
    :data:`Stream.HOME` where ``st.home_stream`` (else on the cross stream, behind the
    round's pieces still crossing). A split return on either side is one batch per piece;
    the counterpart receives them in that order
    (:func:`~charm_megatron.algorithms.charm.cross.home`)."""
    k = ps.cross_round
    partner = st.cross[k].get(st.g)
    if partner is None:  # our group idles this round (an odd number of groups)
        return
    p, r = st.p, st.rank
    cp = st.groups[partner][st.local]
    other = st.groups[partner]
    slot = st.n_cross_done % 2
    handles = [st.cross_in[k], *st.cross_rest.get(k, ())]
    pieces = (len(handles), kv_splits(st, other, st.group))
    # The rows that go home and come back, fixed before any sub-pass narrows kv_rows.
    stream = Stream.HOME if st.home_stream and max(pieces) > 1 else Stream.CROSS
    ret = CrossReturn(cp, Kind.DKV, Plan.DKV, tuple(loc.at(slot) for loc in _VISIT_DKV),
                      (kv_half(st, cp, st.group), kv_half(st, r, other)), slot, pieces,
                      stream)
    items = [Item(r, st.own_q, st.own_acc)]
    rets: list[Return] = []
    rows = Half.pieces(len(handles)) if len(handles) > 1 else (Half.FULL,)
    for i, (handle, piece) in enumerate(zip(handles, rows)):
        st.kv = KvHeld(cp, _CROSS_KV[i].at(k % 2), ret.accs[i] if st.bwd else Plan.DKV)
        p.add(Wait(handle))
        if st.bwd:
            p.add(Reset(st.kv.dkv, Kind.DKV, cp))
        st.kv_rows = piece
        run_pass(st, ps, items, None)
        st.kv_rows = Half.FULL
        if st.bwd:
            rets += home(st, ret, i)
    if st.bwd:
        st.going_home.append(rets)
    st.n_cross_done += 1
    hold_own_kv(st)
    keep_one_return(st)


def kv_splits(st: RankState, receiving: Sequence[int], visiting: Sequence[int]) -> int:
    """How many row pieces group ``receiving`` runs its visiting pass with the kv blocks of
    group ``visiting`` in: ``st.visiting_pieces`` where a split is asked for and every one
    of its tiles needs all kv rows and no mask (so each tile is exactly its kv sub-tiles),
    else 1 (whole blocks). Both groups compute it alike for both directions of the
    exchange."""
    split = st.split_visiting and all(
        (s := tile_spec(i, j, st.causal)).kv_half is Half.FULL and not s.causal
        for i in receiving for j in visiting)
    return st.visiting_pieces if split else 1
