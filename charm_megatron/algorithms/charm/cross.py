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

__all__ = ["CrossReturn", "cross_roles", "home", "keep_one_return", "post_cross_pieces"]

# Our partial coming home from the counterpart: a whole return, or each piece of a split
# one (pass-kv dkv, pass-q) in a location of its own (the names of the two-halves plans kept).
_CROSS_RETS = (Loc("cross.ret"), Loc("cross.retb"), Loc("cross.retc"), Loc("cross.retd"))


@dataclass(frozen=True)
class CrossReturn:
    """The partials of a cross round that go home to counterpart ``cp`` (pass-kv backward:
    its visiting block's dK, dV; pass-q: its q block's partial) and ours coming back, blocks
    of ``kind`` merged into ``result``. ``accs``: where the partial accumulated, one location
    per piece (whole: one); ``rows``: the rows that go home and that come back (whole
    returns); ``slot``: the return buffers' copy; ``pieces``: how many row pieces our pass of
    the round ran in (1: whole), and the counterpart's; ``stream``: the communicator the
    returns travel on (:data:`Stream.CROSS`, or :data:`Stream.HOME` so that a return does not
    queue behind the round's later pieces still crossing on the cross stream)."""

    cp: int
    kind: Kind
    result: Loc
    accs: tuple[Loc, ...]
    rows: tuple[Half, Half]
    slot: int
    pieces: tuple[int, int]
    stream: Stream = Stream.CROSS


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
                      rx: tuple[Loc, ...], rows: tuple[Half, Half],
                      pieces: tuple[int, int]) -> None:
    """Post the cross exchange of round ``k`` with counterpart ``cp``: block ``kind`` from
    ``src`` out, the counterpart's into ``rx[0]``; ``rows``: the rows sent and received
    (whole blocks). ``pieces``: how many row pieces (1, 2 or 4, :meth:`Half.pieces`) the
    counterpart cuts what we send into, and we what we receive. The first piece (or the
    whole block) goes in this batch and each further one in a batch of its own right after
    (same stream, so they arrive in row order, piece ``i`` into ``rx[i]``); the handles of
    the further received pieces are waited for by the later sub-passes
    (``st.cross_rest[k]``); a send-only batch is waited for at the end (``st.trailing``)."""
    r, slot = st.rank, k % 2
    (send_rows, recv_rows), (out_n, in_n) = rows, pieces
    out_rows = Half.pieces(out_n) if out_n > 1 else (send_rows,)
    in_rows = Half.pieces(in_n) if in_n > 1 else (recv_rows,)
    st.cross_in[k] = st.p.comm(
        Stream.CROSS,
        sends=[Xfer(cp, src, kind, r, out_rows[0])],
        recvs=[Xfer(cp, rx[0].at(slot), kind, cp, in_rows[0])],
    )
    for i in range(1, max(out_n, in_n)):
        h = st.p.comm(
            Stream.CROSS,
            sends=[Xfer(cp, src, kind, r, out_rows[i])] if i < out_n else [],
            recvs=[Xfer(cp, rx[i].at(slot), kind, cp, in_rows[i])] if i < in_n else [],
        )
        if i < in_n:
            st.cross_rest.setdefault(k, []).append(h)
        else:
            st.trailing.append(h)


def home(st: RankState, ret: CrossReturn, piece: int) -> list[Return]:
    """Post the partial ``ret`` that goes home and ours coming back, after our sub-pass
    ``piece`` (0 where our pass was whole). Where our pass ran in pieces, ours go one batch
    per piece, each posted right after its sub-pass; where the counterpart's did, theirs
    come one batch per piece. Batch ``i`` carries our piece ``i`` (or our whole return, in
    the first) and their piece ``i`` (or theirs whole, in the first); the batches past our
    last piece are posted with it. Both sides derive the same batches, on the same stream,
    so the messages pair up in order."""
    cp, kind, accs, slot = ret.cp, ret.kind, ret.accs, ret.slot
    mine, theirs = ret.pieces
    send_h, recv_h = ret.rows
    send_rows = Half.pieces(mine) if mine > 1 else (send_h,)
    recv_rows = Half.pieces(theirs) if theirs > 1 else (recv_h,)
    last = max(mine, theirs) if piece == mine - 1 else piece + 1
    out = []
    for i in range(piece, last):
        sends = [Xfer(cp, accs[i], kind, cp, send_rows[i])] if i < mine else []
        recvs = [(_CROSS_RETS[i].at(slot), recv_rows[i])] if i < theirs else []
        h = st.p.comm(ret.stream, sends=sends,
                      recvs=[Xfer(cp, loc, kind, st.rank, hf) for loc, hf in recvs])
        out.append(Return(-1, h, tuple(Merge(ret.result, loc) for loc, _ in recvs)))
    return out


def keep_one_return(st: RankState) -> None:
    """Keep at most one pass's cross return in flight: its buffers are reused two passes
    on."""
    while len(st.going_home) > 1:
        for ret in st.going_home.pop(0):
            st.p.finish(ret)
