"""Ring, TransformerEngine's ``p2p`` context parallelism (docs/algorithm.md, *Ring*): the
builder and its registry entry. It has no settings and ignores the topology.

Plan layer: no torch.
"""

from __future__ import annotations

from charm_megatron.plan.core import Merge, Op, Plan, Reset, Tile, TileBwd, Wait, Xfer, tile_spec
from charm_megatron.plan.entries import Algorithm, Groups, register
from charm_megatron.plan.program import Program
from charm_megatron.plan.vocab import Direction, Half, Kind, Loc, Stream

__all__ = ["RING", "ring_rank"]

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


RING = register(Algorithm("ring", ring_rank, uses_topology=False, te_name="p2p",
                          description="TransformerEngine's p2p ring over a flat group"))
