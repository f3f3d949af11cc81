"""CHARM+ pass-q cross rounds (the paper's): a counterpart's q block visits our group, runs
through the group's RM+ rounds with our kv blocks and its partial goes home; incl. the split
counterpart q (docs/algorithm.md, *Counterpart q in two halves*).

The passes that hold q blocks: the own q's, a counterpart's, or both (the joint order's first
pass). ``split_counterpart_q`` (:func:`q_splits`): where every tile of a counterpart's q
block needs all its rows and no mask (the earlier group under the causal layout; both groups
without a mask), the block crosses as two row-half messages and its pass runs as two
sub-passes, q rows 1st then 2nd; each half's partial goes home as soon as its sub-pass is
done, so the first half's crosses back while the second half is computed
(:func:`_run_counterpart_pass`).

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
from charm_megatron.algorithms.charm.rmplus import Item, Pass, hold_own_kv, owners, q_half, run_pass
from charm_megatron.algorithms.charm.state import RankState
from charm_megatron.plan.core import Half, Loc, tile_spec
from charm_megatron.plan.program import Return
from charm_megatron.plan.vocab import PassOrder

__all__ = ["post_counterpart_q", "q_splits", "run_q_pass"]

# The counterpart's q block (slot: the cross round's parity), or its first half; split: its
# second half.
_CROSS_Q = (Loc("cross.q"), Loc("cross.qb"))
# The counterpart's partial, accumulated here (split: the first half's, the second half's).
_CROSS_ACC = (Loc("acc.cross"), Loc("acc.crossb"))


def post_counterpart_q(st: RankState, k: int, cp: int, other: Sequence[int]) -> None:
    """Swap q blocks with ``cp``, our counterpart of pass-q round ``k`` in group ``other``,
    in halves where either side splits."""
    post_cross_pieces(st, k, cp, st.own_q, st.qkind, _CROSS_Q,
                      (_q_rows(st, k, other, st.group, st.rank),
                       _q_rows(st, k, st.group, other, cp)))


def run_q_pass(st: RankState, ps: Pass) -> None:
    """A pass with q blocks against the held kv blocks, then the counterpart's partial sent
    home and ours coming back (with ``st.q_home_stream`` on the home streams, ours received
    on a batch posted before the pass, so it can land whenever the counterpart sends it)."""
    p, r, k = st.p, st.rank, ps.cross_round
    hold_own_kv(st)
    held = owners(st, ps, st.local)
    if not held:
        return
    items = [Item(o, st.own_q, st.own_acc) if o == r else
             Item(o, _CROSS_Q[0].at(k % 2), _CROSS_ACC[0].at(st.n_cross_done % 2))
             for o in held]
    if not ps.own and k in st.cross_rest:
        _run_counterpart_pass(st, ps, k, held[0])
        return
    # One counterpart per pass at most (the pass's cross round): its return, and where it
    # goes home on the home streams, the receive of ours posted now.
    slot = st.n_cross_done % 2
    rets = {it.owner: _q_return(st, k, it.owner, (it.acc, _CROSS_ACC[1].at(slot)), slot)
            for it in items if it.owner != r}
    received = {cp: home_receives(st, ret) for cp, ret in rets.items()}
    held_back = run_pass(st, ps, items, st.cross_in.get(k) if k is not None else None)
    for cp, ret in rets.items():
        st.going_home.append(received[cp] + home(st, ret, 0))
        st.n_cross_done += 1
    for op in held_back:
        p.add(op)
    keep_one_return(st)


def _q_return(st: RankState, k: int, cp: int, accs: tuple[Loc, Loc],
              slot: int) -> CrossReturn:
    """The counterpart ``cp``'s partial of cross round ``k``, accumulated in ``accs``, going
    home, and ours coming back, each in the row pieces its pass ran in."""
    other = st.groups[st.cross[k][st.g]]
    rows = _q_rows(st, k, st.group, other, cp), _q_rows(st, k, other, st.group, st.rank)
    return CrossReturn(cp, st.pkind, st.own_acc, accs, rows, slot,
                       home_streams=st.q_home_stream)


def _q_rows(st: RankState, k: int, receiving: Sequence[int], visiting: Sequence[int],
            owner: int) -> tuple[Half, ...]:
    """The row pieces in which group ``receiving`` runs its pass-q pass of cross round ``k``
    with q block ``owner`` of group ``visiting``: its two halves where :func:`q_splits`,
    else the rows its tiles need as one piece."""
    if q_splits(st, k, receiving, visiting):
        return Half.pieces(2)
    return (q_half(st, owner, receiving),)


def _run_counterpart_pass(st: RankState, ps: Pass, k: int, cp: int) -> None:
    """Split (:func:`q_splits`): the counterpart ``cp``'s q block in two sub-passes, the
    first with its first row half (tiles ``q.1st x kv``), which starts as soon as that half
    arrived, the second with the second half; each circulates only its half through the
    RM+ rounds and accumulates in its own half-sized accumulator, which goes home as soon
    as its sub-pass is done (the first half's partial travels during the second
    sub-pass). Forward, the counterpart lse-merges the two halves' rows into its output;
    backward, they are its dq rows (our kv's dK, dV stay here, summed over both
    sub-passes). The return batches pair up with the counterpart's as in
    :func:`~charm_megatron.algorithms.charm.cross.home`."""
    slot = st.n_cross_done % 2
    accs = tuple(loc.at(slot) for loc in _CROSS_ACC)
    ret = _q_return(st, k, cp, accs, slot)
    rets: list[Return] = home_receives(st, ret)
    handles = (st.cross_in[k], *st.cross_rest[k])
    for i, (rows, handle) in enumerate(zip(Half.pieces(2), handles)):
        st.q_rows = rows
        held_back = run_pass(st, ps, [Item(cp, _CROSS_Q[i].at(k % 2), accs[i])], handle)
        st.q_rows = Half.FULL
        assert not held_back  # only an own q's tile is ever held back
        rets += home(st, ret, i)
    st.going_home.append(rets)
    st.n_cross_done += 1
    keep_one_return(st)


def q_splits(st: RankState, k: int, receiving: Sequence[int], visiting: Sequence[int]) -> bool:
    """Whether group ``receiving`` runs its pass-q pass of cross round ``k`` with the q
    blocks of group ``visiting`` in two row halves: asked for, the pass holds only those
    blocks (not the joint order's first pass, which holds the own q too), and every one
    of their tiles needs all q rows and no mask (so each tile is exactly its two q-half
    sub-tiles). Both groups compute it alike for both directions of the exchange."""
    if not st.split_counterpart_q or (st.order is PassOrder.JOINT and k == 0):
        return False
    return all((s := tile_spec(i, j, st.causal)).q_half is Half.FULL and not s.causal
               for i in visiting for j in receiving)
