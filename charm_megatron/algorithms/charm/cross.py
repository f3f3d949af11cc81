"""CHARM+ across groups: what both cross roles share (docs/algorithm.md, *CHARM+*).

Each cross round pairs our group with a partner group, rank with counterpart (the rank of the
same local index). Per round the pair picks a role (:func:`cross_roles`): pass-q (the paper:
the counterpart's q block visits our group and its partial goes home,
:mod:`charm_megatron.algorithms.charm.pass_q`) or pass-kv (our kv block visits theirs and,
backward, its dK, dV come home, :mod:`charm_megatron.algorithms.charm.pass_kv`). Both post the
visiting block, whole or in row pieces (two halves, or four quarters for pass-kv,
:func:`post_cross_pieces`), and send a partial home the same way (:func:`home`), at most one
pass's return in flight (:func:`keep_one_return`).

Functions over :class:`~charm_megatron.algorithms.charm.state.RankState` (its ``cross_in``,
``cross_rest``, ``trailing`` and ``going_home``).

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

__all__ = ["CrossReturn", "cross_roles", "home", "home_receives", "keep_one_return",
           "post_cross_pieces"]

# Our partial coming home from the counterpart: a whole return, or each piece of a split
# one (pass-kv dkv, pass-q) in a location of its own (the names of the two-halves plans kept).
_CROSS_RETS = (Loc("cross.ret"), Loc("cross.retb"), Loc("cross.retc"), Loc("cross.retd"))


@dataclass(frozen=True)
class CrossReturn:
    """The partials of a cross round that go home to counterpart ``cp`` (pass-kv backward:
    its visiting block's dK, dV; pass-q: its q block's partial) and ours coming back, blocks
    of ``kind`` merged into ``result``. ``accs``: where the partial accumulated, one location
    per piece; ``rows``: the row pieces that go home (our pass ran one sub-pass per piece;
    one piece: the whole return's rows) and those that come back (the counterpart's);
    ``slot``: the return buffers' copy; ``home_streams``: the returns travel on the home
    streams (:meth:`Stream.home`, one per direction) instead of paired up on the cross
    stream, so that a return queues neither behind the round's later pieces still crossing
    nor behind the counterpart's return."""

    cp: int
    kind: Kind
    result: Loc
    accs: tuple[Loc, ...]
    rows: tuple[tuple[Half, ...], tuple[Half, ...]]
    slot: int
    home_streams: bool = False


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


def post_cross_pieces(st: RankState, k: int, cp: int, src: Loc, kind: Kind,
                      rx: tuple[Loc, ...],
                      rows: tuple[tuple[Half, ...], tuple[Half, ...]]) -> None:
    """Post the cross exchange of round ``k`` with counterpart ``cp``: block ``kind`` from
    ``src`` out, the counterpart's in; ``rows``: the row pieces we send (as the counterpart
    cuts them for its sub-passes) and those we receive (as we cut them for ours); one piece:
    the rows of a whole exchange. The first pieces go in this batch and each further one in
    a batch of its own right after (same stream, so they arrive in row order, piece ``i``
    into ``rx[i]``); the handles of the further received pieces are waited for by the later
    sub-passes (``st.cross_rest[k]``); a send-only batch is waited for at the end
    (``st.trailing``)."""
    r, slot = st.rank, k % 2
    out_rows, in_rows = rows
    st.cross_in[k] = st.p.comm(
        Stream.CROSS,
        sends=[Xfer(cp, src, kind, r, out_rows[0])],
        recvs=[Xfer(cp, rx[0].at(slot), kind, cp, in_rows[0])],
    )
    for i in range(1, max(len(out_rows), len(in_rows))):
        recv = i < len(in_rows)
        h = st.p.comm(
            Stream.CROSS,
            sends=[Xfer(cp, src, kind, r, out_rows[i])] if i < len(out_rows) else [],
            recvs=[Xfer(cp, rx[i].at(slot), kind, cp, in_rows[i])] if recv else [],
        )
        if recv:
            st.cross_rest.setdefault(k, []).append(h)
        else:
            st.trailing.append(h)


def home(st: RankState, ret: CrossReturn, piece: int) -> list[Return]:
    """Post the partial ``ret`` that goes home and ours coming back, after our sub-pass
    ``piece`` (0 where our pass was whole): ours one piece per sub-pass, each posted right
    after it; the counterpart's one piece per sub-pass of theirs.

    On the cross stream the two directions pair up: batch ``i`` carries our piece ``i`` and
    their piece ``i``, and the batches past our last piece are posted with it. On the home
    streams (``ret.home_streams``) each direction has its own: each piece of ours is sent
    in a batch of its own, and theirs are received in batches of their own that
    :func:`home_receives` posted before our first sub-pass. Both sides derive the same
    batches on each stream, so the messages pair up in order."""
    if ret.home_streams:
        return _home_apart(st, ret, piece)
    cp, kind, accs, slot = ret.cp, ret.kind, ret.accs, ret.slot
    send_rows, recv_rows = ret.rows
    mine, theirs = len(send_rows), len(recv_rows)
    last = max(mine, theirs) if piece == mine - 1 else piece + 1
    out = []
    for i in range(piece, last):
        sends = [Xfer(cp, accs[i], kind, cp, send_rows[i])] if i < mine else []
        recvs = [(_CROSS_RETS[i].at(slot), recv_rows[i])] if i < theirs else []
        h = st.p.comm(Stream.CROSS, sends=sends,
                      recvs=[Xfer(cp, loc, kind, st.rank, hf) for loc, hf in recvs])
        out.append(Return(-1, h, tuple(Merge(ret.result, loc) for loc, _ in recvs)))
    return out


def _home_apart(st: RankState, ret: CrossReturn, piece: int) -> list[Return]:
    """:func:`home` on the home streams: a send batch with our piece ``piece`` (on the
    stream of returns towards the counterpart); theirs were posted by
    :func:`home_receives`."""
    r = st.rank
    h = st.p.comm(Stream.home(r, ret.cp),
                  sends=[Xfer(ret.cp, ret.accs[piece], ret.kind, ret.cp, ret.rows[0][piece])])
    return [Return(-1, h, ())]


def home_receives(st: RankState, ret: CrossReturn) -> list[Return]:
    """The receives of the counterpart's return pieces on the home stream towards us, one
    batch per piece, posted before our pass's first sub-pass so that each can flow as soon
    as the counterpart sends it (none where the returns pair up on the cross stream: there
    :func:`home` posts them)."""
    if not ret.home_streams:
        return []
    out = []
    for i, hf in enumerate(ret.rows[1]):
        loc = _CROSS_RETS[i].at(ret.slot)
        h = st.p.comm(Stream.home(ret.cp, st.rank),
                      recvs=[Xfer(ret.cp, loc, ret.kind, st.rank, hf)])
        out.append(Return(-1, h, (Merge(ret.result, loc),)))
    return out


def keep_one_return(st: RankState) -> None:
    """Keep at most one pass's cross return in flight: its buffers are reused two passes
    on."""
    while len(st.going_home) > 1:
        for ret in st.going_home.pop(0):
            st.p.finish(ret)
