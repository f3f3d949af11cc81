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
    home_receives,
    keep_one_return,
    post_cross_pieces,
)
from charm_megatron.algorithms.charm.rmplus import Item, Pass, hold_own_kv, kv_half, run_pass
from charm_megatron.algorithms.charm.state import OWN_KV, KvHeld, RankState
from charm_megatron.plan.core import Half, Kind, Loc, Plan, Reset, Wait, tile_spec
from charm_megatron.plan.program import Return

__all__ = ["kv_splits", "post_visiting_kv", "run_visiting_pass", "visiting_rows"]

# The counterpart's visiting kv block (or its first piece), then its further pieces; and,
# backward, each piece's dkv, accumulated here (the names of the two-halves plans kept).
_CROSS_KV = (Loc("cross.kv"), Loc("cross.kvb"), Loc("cross.kvc"), Loc("cross.kvd"))
_VISIT_DKV = (Loc("acc.vdkv"), Loc("acc.vdkvb"), Loc("acc.vdkvc"), Loc("acc.vdkvd"))


def post_visiting_kv(st: RankState, k: int, cp: int, other: Sequence[int]) -> None:
    """Swap kv blocks with ``cp``, our counterpart of pass-kv round ``k`` in group ``other``
    (ours visits their group), in row pieces where either side splits."""
    post_cross_pieces(st, k, cp, OWN_KV, Kind.KV, _CROSS_KV,
                      (visiting_rows(st, other, st.group, st.rank),
                       visiting_rows(st, st.group, other, cp)))


def run_visiting_pass(st: RankState, ps: Pass) -> None:
    """The group's queries against the visiting kv blocks of cross round ``k`` (each rank
    holds its counterpart's, routed through the RM+ rounds like the own kv); backward, the
    visiting block's dkv (summed over every tile it served in our group) goes home and ours
    comes back.

    Split (:func:`visiting_rows`): one sub-pass per row piece of the visiting blocks (two
    halves, or four quarters, of the rows the tiles need), in row order, each starting as
    soon as its piece arrived (tiles ``q x kv.<piece>``) and circulating only that piece
    through the RM+ rounds. Forward, a tile's sub-tiles lse-merge into the output like any
    tiles; backward, dq sums, and each piece's dK, dV accumulate in their own piece-sized
    accumulator, which goes home as soon as its sub-pass is done (it travels during the
    later sub-passes), on the home streams where ``st.home_stream`` (one per direction,
    :meth:`Stream.home`; else on the cross stream, behind the round's pieces still
    crossing). A split return on either side is one
    batch per piece; the counterpart receives them in that order
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
    # The rows that go home and come back, fixed before any sub-pass narrows kv_rows.
    rows = (visiting_rows(st, st.group, other, cp), visiting_rows(st, other, st.group, r))
    split = len(rows[0]) > 1 or len(rows[1]) > 1
    ret = CrossReturn(cp, Kind.DKV, Plan.DKV, tuple(loc.at(slot) for loc in _VISIT_DKV), rows,
                      slot, home_streams=st.home_stream and split)
    items = [Item(r, st.own_q, st.own_acc)]
    rets: list[Return] = home_receives(st, ret) if st.bwd else []
    for i, (handle, piece) in enumerate(zip(handles, rows[0])):
        st.kv = KvHeld(cp, _CROSS_KV[i].at(k % 2), ret.accs[i] if st.bwd else Plan.DKV)
        p.add(Wait(handle))
        if st.bwd:
            p.add(Reset(st.kv.dkv, Kind.DKV, cp))
        st.kv_rows = piece if len(rows[0]) > 1 else Half.FULL
        run_pass(st, ps, items, None)
        st.kv_rows = Half.FULL
        if st.bwd:
            rets += home(st, ret, i)
    if st.bwd:
        st.going_home.append(rets)
    st.n_cross_done += 1
    hold_own_kv(st)
    keep_one_return(st)


def visiting_rows(st: RankState, receiving: Sequence[int], visiting: Sequence[int],
                  owner: int) -> tuple[Half, ...]:
    """The row pieces in which group ``receiving`` runs its visiting pass with kv block
    ``owner`` of group ``visiting``: the rows its tiles need (:func:`kv_half`), cut in
    ``st.visiting_pieces`` (:meth:`Half.cut`: whole blocks in halves or quarters, a half in
    its two quarters) where :func:`kv_splits`, else those rows as one piece."""
    need = kv_half(st, owner, receiving)
    return need.cut(st.visiting_pieces) if kv_splits(st, receiving, visiting) else (need,)


def kv_splits(st: RankState, receiving: Sequence[int], visiting: Sequence[int]) -> bool:
    """Whether group ``receiving`` runs its visiting pass with the kv blocks of group
    ``visiting`` in row pieces: asked for, and every one of its tiles needs the same kv rows
    (all of them, or, cut in quarters, one half) and no mask, so each tile is exactly its
    kv sub-tiles. Both groups compute it alike for both directions of the exchange."""
    if not st.split_visiting:
        return False
    specs = [tile_spec(i, j, st.causal) for i in receiving for j in visiting]
    need = {s.kv_half for s in specs}
    return (not any(s.causal for s in specs) and len(need) == 1
            and len(next(iter(need)).cut(st.visiting_pieces)) > 1)
