"""CHARM+ across groups: what both cross roles share (docs/algorithm.md, *CHARM+*).

Each cross round pairs our group with a partner group, rank with counterpart (the rank of the
same local index). Per round the pair picks a role (:func:`cross_roles`): pass-q (the paper:
the counterpart's q block visits our group and its partial goes home,
:mod:`charm_megatron.algorithms.charm.pass_q`) or pass-kv (our kv block visits theirs and,
backward, its dK, dV come home, :mod:`charm_megatron.algorithms.charm.pass_kv`). Both post the
visiting block, whole or as two row halves (:func:`post_cross_halves`), and send a partial
home the same way (:func:`home`), at most one pass's return in flight
(:func:`keep_one_return`).

Functions over :class:`~charm_megatron.algorithms.charm.state.RankState` (its ``cross_in``,
``cross_in2``, ``trailing`` and ``going_home``).

Plan layer: no torch.
"""

from __future__ import annotations

from dataclasses import dataclass

from charm_megatron.algorithms.charm.rmplus import kv_half, q_half
from charm_megatron.algorithms.charm.state import RankState
from charm_megatron.plan.core import Half, Kind, Loc, Merge, Stream, Xfer
from charm_megatron.plan.program import Return
from charm_megatron.plan.roles import Decision, choose, row_bytes
from charm_megatron.plan.vocab import Role

__all__ = ["CrossReturn", "cross_roles", "home", "keep_one_return", "post_cross_halves"]

_CROSS_RET = Loc("cross.ret")  # our partial coming home from the counterpart
_CROSS_RET2 = Loc("cross.retb")  # a split return's second message (pass-kv dkv, pass-q)


@dataclass(frozen=True)
class CrossReturn:
    """The partials of a cross round that go home to counterpart ``cp`` (pass-kv backward:
    its visiting block's dK, dV; pass-q: its q block's partial) and ours coming back, blocks
    of ``kind`` merged into ``result``. ``accs``: where the partial accumulated (whole or 1st
    half, 2nd half); ``rows``: the rows that go home and that come back (whole returns);
    ``slot``: the return buffers' copy; ``split``: whether our pass of the round was split,
    and whether the counterpart's was."""

    cp: int
    kind: Kind
    result: Loc
    accs: tuple[Loc, Loc]
    rows: tuple[Half, Half]
    slot: int
    split: tuple[bool, bool]


def cross_roles(st: RankState) -> list[Role]:
    """The role of every cross round, each recorded in ``st.decisions``."""
    return [_cross_role(st, k) for k in range(len(st.cross))]


def _cross_role(st: RankState, k: int) -> Role:
    """Pass-q (the paper) or pass-kv for cross round ``k``: forced, or by the bytes both
    alternatives move between our group and its partner (summed over the group, so every
    rank of both groups decides alike)."""
    partner = st.cross[k].get(st.g)
    if partner is None:
        return Role.Q
    shape = st.roles.shape
    kv_b = q_b = None
    other = st.groups[partner]
    if shape is not None:
        kv_b = q_b = 0.0
        kv_kinds = (Kind.KV, Kind.DKV) if st.bwd else (Kind.KV,)
        q_kinds = (st.qkind, st.pkind)
        for a, b in ((st.group, other), (other, st.group)):
            for x in a:
                kv_b += sum(row_bytes(kd, shape, kv_half(st, x, b)) for kd in kv_kinds)
                q_b += sum(row_bytes(kd, shape, q_half(st, x, b)) for kd in q_kinds)
        kv_b, q_b = kv_b / len(st.group), q_b / len(st.group)
    role = choose(st.roles, Role.Q, kv_b, q_b)
    st.decisions.append(Decision("cross", other[st.local], role, kv_b, q_b))
    return role


def post_cross_halves(st: RankState, k: int, cp: int, src: Loc, kind: Kind,
                      rx: tuple[Loc, Loc], rows: tuple[Half, Half],
                      split: tuple[bool, bool]) -> None:
    """Post the cross exchange of round ``k`` with counterpart ``cp``: block ``kind`` from
    ``src`` out, the counterpart's into ``rx[0]``; ``rows``: the rows sent and received
    (whole blocks). Where a side splits (``split``: whether the counterpart splits what we
    send, whether we split what we receive), the first row half goes in this batch and the
    second in one of its own right after (same stream, so it arrives second, into ``rx[1]``),
    waited for only by the second sub-pass (``st.cross_in2[k]``); a send-only second half is
    waited for at the end (``st.trailing``)."""
    r, slot = st.rank, k % 2
    (send_rows, recv_rows), (out_split, in_split) = rows, split
    st.cross_in[k] = st.p.comm(
        Stream.CROSS,
        sends=[Xfer(cp, src, kind, r, Half.FIRST if out_split else send_rows)],
        recvs=[Xfer(cp, rx[0].at(slot), kind, cp, Half.FIRST if in_split else recv_rows)],
    )
    if not (out_split or in_split):
        return
    h = st.p.comm(
        Stream.CROSS,
        sends=[Xfer(cp, src, kind, r, Half.SECOND)] if out_split else [],
        recvs=[Xfer(cp, rx[1].at(slot), kind, cp, Half.SECOND)] if in_split else [],
    )
    if in_split:
        st.cross_in2[k] = h
    else:
        st.trailing.append(h)


def home(st: RankState, ret: CrossReturn, first: bool) -> list[Return]:
    """Post the partial ``ret`` that goes home and ours coming back. Where our pass was split
    (the block came in halves) ours go in two batches, posted after each sub-pass
    (``first``: the one after the first); where the counterpart's was, theirs come in two:
    the first batch carries the first halves (or a whole return), the second the rest. Both
    sides derive the same two batches, so the messages pair up in order."""
    cp, kind, accs, slot = ret.cp, ret.kind, ret.accs, ret.slot
    mine, theirs = ret.split
    send_h, recv_h = ret.rows
    if not (mine or theirs):  # one batch, both ways whole
        loc = _CROSS_RET.at(slot)
        h = st.p.comm(Stream.CROSS,
                      sends=[Xfer(cp, accs[0], kind, cp, send_h)],
                      recvs=[Xfer(cp, loc, kind, st.rank, recv_h)])
        return [Return(-1, h, (Merge(ret.result, loc),))]
    batches = []
    if first:  # the first batch: first halves (or whole, where not split)
        batches.append(([(accs[0], Half.FIRST if mine else send_h)],
                        [(_CROSS_RET.at(slot), Half.FIRST if theirs else recv_h)]))
    if not (first and mine):  # the second batch: what is left in halves
        batches.append(([(accs[1], Half.SECOND)] if mine else [],
                        [(_CROSS_RET2.at(slot), Half.SECOND)] if theirs else []))
    out = []
    for sends, recvs in batches:
        h = st.p.comm(Stream.CROSS,
                      sends=[Xfer(cp, loc, kind, cp, hf) for loc, hf in sends],
                      recvs=[Xfer(cp, loc, kind, st.rank, hf) for loc, hf in recvs])
        out.append(Return(-1, h, tuple(Merge(ret.result, loc) for loc, _ in recvs)))
    return out


def keep_one_return(st: RankState) -> None:
    """Keep at most one pass's cross return in flight: its buffers are reused two passes
    on."""
    while len(st.going_home) > 1:
        for ret in st.going_home.pop(0):
            st.p.finish(ret)
