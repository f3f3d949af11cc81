"""One rank's CHARM+ (or, with one group, RM+) forward or backward program: the pass order
and the assembly of the passes (docs/algorithm.md, *CHARM+*).

Structure: *passes* run the RM+ rounds of the group for the q blocks a rank holds
(:mod:`~charm_megatron.algorithms.charm.rmplus`); a cross round is pass-q
(:mod:`~charm_megatron.algorithms.charm.pass_q`) or pass-kv
(:mod:`~charm_megatron.algorithms.charm.pass_kv`), each block crossing one pass ahead of the pass
that uses it; a counterpart's partial goes home at the end of its pass.

Pass order (``RankState.order``):

* ``split`` (default): the own q's first rounds while the counterpart's q crosses the slow
  link; then one pass per counterpart q (all rounds), each sent home as soon as it is done;
  then the own q's remaining rounds, which hide the last slow return. A forward pass whose
  cross rounds are all pass-kv has no slow return to hide: all own rounds come first. kv
  blocks of the rounds are fetched once per pass that needs them (intra-group links are the
  fast ones).
* ``joint``: the paper's single pass with own and counterpart q side by side (kv fetched once
  for both), the own q's last tile deferred until the counterpart's partial is sent.

Plan layer: no torch.
"""

from __future__ import annotations

from collections.abc import Sequence

from charm_megatron.algorithms.charm.cross import cross_roles
from charm_megatron.algorithms.charm.pass_kv import post_visiting_kv, run_visiting_pass
from charm_megatron.algorithms.charm.pass_q import post_counterpart_q, run_q_pass
from charm_megatron.algorithms.charm.rmplus import Pass
from charm_megatron.algorithms.charm.state import RankState
from charm_megatron.plan.core import Half, Kind, Op, Plan, Reset, Wait, tile_spec
from charm_megatron.plan.vocab import PassOrder, Role

__all__ = ["passes", "rank_program"]


def rank_program(st: RankState) -> list[Op]:
    """Build the program of ``st``: its ops (the roles of its exchanges in
    ``st.decisions``)."""
    p, r = st.p, st.rank
    roles = cross_roles(st)  # the cross rounds' decisions come first, as printed
    if st.bwd:
        p.add(Reset(Plan.DQ, Kind.DQ, r))
        p.add(Reset(Plan.DKV, Kind.DKV, r))
    else:
        p.add(Reset(Plan.OUT, Kind.OUT, r))
    if st.cross:
        _post_cross_exchange(st, roles, 0)
    st.split_diagonal = st.split_diagonal and (st.split_diagonal_all
                                               or _first_block_whole(st, roles))
    order = passes(st, roles)
    last_cross = max((i for i, ps in enumerate(order) if ps.cross_round is not None),
                     default=None)
    for i, ps in enumerate(order):
        if ps.cross_round is not None:  # its next block posted first to travel during it
            _post_cross_exchange(st, roles, ps.cross_round + 1)
        if ps.visiting:
            run_visiting_pass(st, ps)
        else:
            run_q_pass(st, ps)
        if i == last_cross:  # split_diagonal: the rest of the own diagonal tile hides the
            # last cross pass's partials going home (they need no communication)
            for op in st.diagonal_rest:
                st.p.add(op)
            st.diagonal_rest.clear()
    for rets in st.going_home:
        for ret in rets:
            p.finish(ret)
    for h in st.trailing:
        p.add(Wait(h))
    return p.ops


def passes(st: RankState, roles: Sequence[Role]) -> list[Pass]:
    """The passes in the order of ``st.order``, and which q blocks each holds; ``roles``:
    the cross rounds' (:func:`~charm_megatron.algorithms.charm.cross.cross_roles`)."""
    every = tuple(range(len(st.rounds)))
    if not st.cross:
        return [Pass(True, None, every, True)]

    def cross_pass(k: int) -> Pass:
        if roles[k] is Role.KV:  # pass-kv: own q against the visiting kv
            return Pass(True, k, every, True, visiting=True)
        return Pass(False, k, every, True)

    if st.order is PassOrder.JOINT and roles[0] is Role.Q:
        return [Pass(True, 0, every, True)] + [cross_pass(k) for k in range(1, len(st.cross))]
    if st.order is PassOrder.JOINT:  # a pass-kv first round: own kv, then the visitors
        return [Pass(True, None, every, True)] + [cross_pass(k) for k in range(len(st.cross))]
    # Forward pass-kv brings nothing home across the slow link, so no own rounds need to
    # be kept back to hide a return: all of them go first, hiding the visiting kv's trip
    # (measured on 2x4 with one NIC per node: 315 vs 347 ms forward, docs/performance.md).
    # Pass-q, and backward (the visitors' dK, dV go home), keep half the rounds for last.
    paired = [role for k, role in enumerate(roles) if st.g in st.cross[k]]
    if not st.bwd and paired and all(role is Role.KV for role in paired):
        head = every
    else:
        head = every[: len(every) // 2]
    tail = every[len(head):]
    out = [Pass(True, None, head, True)]
    out += [cross_pass(k) for k in range(len(st.cross))]
    if tail:
        out.append(Pass(True, None, tail, False))
    return out


def _first_block_whole(st: RankState, roles: Sequence[Role]) -> bool:
    """Whether the block our group receives in its first cross round is whole (the visiting
    kv, pass-kv; the counterpart's q, pass-q): under the causal layout the lower group's.
    Only such a rank splits its own diagonal tile (``split_diagonal``): its dK, dV (or
    partials) going home are the whole ones, which end the backward, and the sub-tiles let
    them start early. A rank receiving halves keeps it whole, because its returns, started
    early, would share its node's slow link with the whole blocks the other group still
    waits for (the model: 2x8, h200, one NIC per node, Llama-8B-like 16k backward, 3.18 ms
    with both groups split against 2.68 with the lower one alone and 2.74 unsplit)."""
    k = next((k for k, rd in enumerate(st.cross) if st.g in rd), None)
    if k is None:
        return False
    other = st.groups[st.cross[k][st.g]]
    if roles[k] is Role.KV:
        need = {tile_spec(i, j, st.causal).kv_half for i in st.group for j in other}
    else:
        need = {tile_spec(i, j, st.causal).q_half for i in other for j in st.group}
    return Half.FULL in need


def _post_cross_exchange(st: RankState, roles: Sequence[Role], k: int) -> None:
    """Swap blocks with the counterpart of cross round ``k`` (if our group has one): our kv
    (pass-kv, it visits the counterpart's group) or our q (pass-q)."""
    partner = st.cross[k].get(st.g) if k < len(st.cross) else None
    if partner is None:
        return
    cp, other = st.groups[partner][st.local], st.groups[partner]
    if roles[k] is Role.KV:
        post_visiting_kv(st, k, cp, other)
    else:
        post_counterpart_q(st, k, cp, other)
