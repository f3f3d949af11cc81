"""Ring, TransformerEngine's ``p2p`` context parallelism (docs/algorithm.md, *Ring*): the
builder, its windowed form and its registry entry. It has no settings and ignores the
topology.

Plan layer: no torch.
"""

from __future__ import annotations

from charm_megatron.plan.core import Merge, Op, Plan, Reset, Tile, TileBwd, Wait, Xfer, tile_spec
from charm_megatron.plan.entries import Algorithm, Groups
from charm_megatron.plan.program import Program
from charm_megatron.plan.tile_rule import TileRule
from charm_megatron.plan.vocab import Direction, Half, Kind, Loc, Stream

__all__ = ["RING", "bounded_ring_rank", "ring_rank"]

_OWN_KV = Loc.own(Kind.KV)
_RING_KV = Loc("ring.kv")  # the kv block passing through (two copies: receive while computing)
_RING_DKV = Loc("ring.dkv")  # the dkv partial of the kv block computed here, sent on
_RING_DKV_IN = Loc("ring.dkvin")  # the dkv partial arriving with the next kv block


def ring_rank(rank: int, groups: Groups, causal: bool, direction: Direction,
              variant: object = None) -> list[Op]:
    """Rank ``rank``'s ring: kv walks ``r -> r+1``; the next kv is posted before the current
    tile is computed. Backward carries the dkv partial sums around the ring one step behind
    kv, so a block's dkv arrives home complete after ``n`` hops. (``groups``: one flat group;
    ``variant``: unused, ring has no settings.)"""
    r, n = rank, sum(len(g) for g in groups)
    backward = Direction(direction) is Direction.BACKWARD
    p = Program()
    nxt, prv = (r + 1) % n, (r - 1) % n
    qloc = Loc.own(Kind.QGRAD if backward else Kind.Q)
    if backward:
        p.add(Reset(Plan.DQ, Kind.DQ, r))
    else:
        p.add(Reset(Plan.OUT, Kind.OUT, r))
    cur = _OWN_KV
    kv_handle = dkv_handle = None
    for step in range(n):
        j = (r - step) % n
        spec = tile_spec(r, j, causal)
        if step < n - 1:
            buf = _RING_KV.at(step % 2)
            kv_handle = p.comm(
                Stream.KV,
                sends=[Xfer(nxt, cur, Kind.KV, j, Half.FULL)],
                recvs=[Xfer(prv, buf, Kind.KV, (j - 1) % n, Half.FULL)],
            )
        if not backward:
            p.add(Tile(spec, qloc, cur, Plan.OUT))
        elif n == 1:
            p.add(Reset(Plan.DKV, Kind.DKV, r))
            p.add(TileBwd(spec, qloc, cur, Plan.DQ, Plan.DKV))
        else:
            mine = _RING_DKV.at(step % 2)
            p.add(Reset(mine, Kind.DKV, j))
            p.add(TileBwd(spec, qloc, cur, Plan.DQ, mine))
            if step > 0:
                p.add(Wait(dkv_handle))
                p.add(Merge(mine, _RING_DKV_IN.at((step - 1) % 2)))
            into = Plan.DKV if step == n - 1 else _RING_DKV_IN.at(step % 2)
            dkv_handle = p.comm(
                Stream.Q,  # the dkv ring gets its own stream so it never queues behind kv
                sends=[Xfer(nxt, mine, Kind.DKV, j, Half.FULL)],
                recvs=[Xfer(prv, into, Kind.DKV, (j - 1) % n, Half.FULL)],
            )
        if step < n - 1:
            p.add(Wait(kv_handle))
            cur = buf
    if backward and n > 1:
        p.add(Wait(dkv_handle))
    return p.ops


_UP_KV = Loc("up.kv")  # a kv block walking r -> r+1 (earlier ranks' kv)
_DOWN_KV = Loc("down.kv")  # a kv block walking r -> r-1 (later ranks' kv)
_UP_DKV = Loc("up.dkv")  # the dkv partial of a walking-up block, sent straight home
_DOWN_DKV = Loc("down.dkv")
_UP_DKV_IN = Loc("up.dkvin")  # this rank's dkv partial from the rank its block walked up to
_DOWN_DKV_IN = Loc("down.dkvin")


def bounded_ring_rank(rank: int, groups: Groups, rule: TileRule, direction: Direction,
                      variant: object = None) -> list[Op]:
    """Rank ``rank``'s ring under a sliding window (``rule``: the tiles it needs): two rings
    that stop where the window does. Earlier ranks' kv walks up (``r -> r+1``) for as many
    steps as the window reaches below a rank, later ranks' kv walks down as far as it reaches
    above; both in one batch per step, so a step exchanges with the two neighbours. Neither
    walk wraps around, so no block is visited twice. A window that needs as many steps as
    the ring gets the ring itself. Backward: each tile's dkv partial goes
    straight home one step later (there is no ring to close). The plan is then pruned
    (plan/prune.py) to the rows each tile needs."""
    r, n = rank, rule.n
    below, above = rule.reach()
    if max(below, above) >= n - 1:  # as many steps as the ring: the ring itself
        return ring_rank(rank, groups, rule.causal, direction, variant)
    backward = Direction(direction) is Direction.BACKWARD
    qloc = Loc.own(Kind.QGRAD if backward else Kind.Q)
    p = Program()
    if backward:
        p.add(Reset(Plan.DQ, Kind.DQ, r))
        p.add(Reset(Plan.DKV, Kind.DKV, r))
    else:
        p.add(Reset(Plan.OUT, Kind.OUT, r))
    up = down = _OWN_KV  # at step s: kv of ranks r - s and r + s
    dkv_handle, dkv_merges = None, []
    for s in range(max(below, above) + 1):
        handle, sends, recvs = None, [], []
        if s < below:
            if r - s >= 0 and r + 1 < n:
                sends.append(Xfer(r + 1, up, Kind.KV, r - s, Half.FULL))
            if r - 1 - s >= 0:
                recvs.append(Xfer(r - 1, _UP_KV.at(s % 2), Kind.KV, r - 1 - s, Half.FULL))
        if s < above:
            if r + s < n and r >= 1:
                sends.append(Xfer(r - 1, down, Kind.KV, r + s, Half.FULL))
            if r + 1 + s < n:
                recvs.append(Xfer(r + 1, _DOWN_KV.at(s % 2), Kind.KV, r + 1 + s, Half.FULL))
        if sends or recvs:
            handle = p.comm(Stream.KV, sends=sends, recvs=recvs)
        # (kv owner, where its block is, where a backward tile's dkv partial goes)
        held = [(r, _OWN_KV, None)] if s == 0 else []
        if 0 < s <= below and r - s >= 0:
            held.append((r - s, up, _UP_DKV.at(s % 2)))
        if 0 < s <= above and r + s < n:
            held.append((r + s, down, _DOWN_DKV.at(s % 2)))
        partials = []
        for owner, loc, out in held:
            spec = tile_spec(r, owner, rule.causal)
            if not backward:
                p.add(Tile(spec, qloc, loc, Plan.OUT))
            elif out is None:
                p.add(TileBwd(spec, qloc, loc, Plan.DQ, Plan.DKV))
            else:
                p.add(TileBwd(spec, qloc, loc, Plan.DQ, out, fresh_dkv=True))
                partials.append(Xfer(owner, out, Kind.DKV, owner, spec.kv_half))
        if backward and s > 0:
            if dkv_handle is not None:
                p.add(Wait(dkv_handle))
                p.ops.extend(dkv_merges)
            homes = []  # my block's partials from the ranks it reached at step s
            if s <= below and r + s < n:
                homes.append(Xfer(r + s, _UP_DKV_IN.at(s % 2), Kind.DKV, r,
                                  tile_spec(r + s, r, rule.causal).kv_half))
            if s <= above and r - s >= 0:
                homes.append(Xfer(r - s, _DOWN_DKV_IN.at(s % 2), Kind.DKV, r,
                                  tile_spec(r - s, r, rule.causal).kv_half))
            dkv_handle = (p.comm(Stream.Q, sends=partials, recvs=homes)
                          if partials or homes else None)
            dkv_merges = [Merge(Plan.DKV, x.loc) for x in homes]
        if handle is not None:
            p.add(Wait(handle))
            if s < below and r - 1 - s >= 0:
                up = _UP_KV.at(s % 2)
            if s < above and r + 1 + s < n:
                down = _DOWN_KV.at(s % 2)
    if dkv_handle is not None:
        p.add(Wait(dkv_handle))
        p.ops.extend(dkv_merges)
    return p.ops


RING = Algorithm("ring", ring_rank, uses_topology=False, te_name="p2p",
                          windowed_rank=bounded_ring_rank,
                          description="TransformerEngine's p2p ring over a flat group")
