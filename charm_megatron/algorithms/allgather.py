"""All-gather CP, TransformerEngine's ``allgather`` (Llama 3's context parallelism): the builder
and its registry entry (docs/algorithm.md, *All-gather*). It ignores the topology; its one
setting is ``super_tiles`` (plan/fuse.py): the gathered blocks' tiles of the same q rows as
one kernel call, as TE's one attention call over the gathered sequence.

Forward: every rank's kv block goes to every other rank in one batch (an all-gather as sends
and receives, so the validator, the model and the printout read it as they read the ring);
the rank attends its own kv while the batch is in flight, then every gathered block.
Backward: kv is gathered again (TE keeps only the local k, v between the passes: the gathered
sequence is not held through the layer), each tile's dk, dv partial goes to its block's owner
in one batch (a reduce-scatter) and is summed there.

The gather moves whole kv blocks, as the collective does, although under the causal
load-balanced layout a rank needs only the first half of an earlier rank's kv. The scatter
sends each partial's rows only (half a block for an earlier rank's kv), which is fewer bytes
than TE's reduce-scatter of whole dk, dv: where the two differ, the peer is given the edge.
Memory is O(n): every rank holds all ``n`` kv blocks (and, in the
backward, ``n`` dkv partials) at once, which is what the all-gather costs.

Plan layer: no torch.
"""

from __future__ import annotations

from charm_megatron.plan.core import Merge, Op, Plan, Reset, Tile, TileBwd, Wait, Xfer, tile_spec
from charm_megatron.plan.entries import Algorithm, Groups, VariantContext, assemble
from charm_megatron.plan.fuse import SUPER_TILES, fuse_ops
from charm_megatron.plan.program import Program
from charm_megatron.plan.settings import Values
from charm_megatron.plan.vocab import Direction, Half, Kind, Loc, Stream, SuperTileMode

__all__ = ["ALLGATHER", "allgather_rank", "allgather_variants"]

_OWN_KV = Loc.own(Kind.KV)
_GATHERED_KV = Loc("ag.kv")  # slot j: rank j's kv block
_DKV_OUT = Loc("ag.dkv")  # slot j: this rank's dkv partial of rank j's kv, sent to j
_DKV_IN = Loc("ag.dkvin")  # slot j: rank j's dkv partial of this rank's kv


def allgather_rank(rank: int, groups: Groups, causal: bool, direction: Direction,
                   variant: object = None) -> list[Op]:
    """Rank ``rank``'s all-gather plan (``groups``: one flat group; ``variant``: True for
    super-tiles, :func:`allgather_variants`)."""
    ops = _rank_ops(rank, groups, causal, direction)
    return fuse_ops(ops) if variant is True else ops


def allgather_variants(values: Values, ctx: VariantContext) -> tuple[bool, bool]:
    """Whether each direction runs super-tiles: as the setting says; ``auto``, where
    ``ctx.timer`` predicts the plan with them faster (off without a timer)."""
    mode = values.get(SUPER_TILES.name, SuperTileMode.OFF)
    if mode is not SuperTileMode.AUTO:
        return (mode is SuperTileMode.ON,) * 2
    if ctx.timer is None:
        return False, False
    out = []
    for d in (Direction.FORWARD, Direction.BACKWARD):
        on, off = (assemble("allgather", allgather_rank, d, ctx.groups, ctx.causal, v)
                   for v in (True, False))
        out.append(on.ops != off.ops and ctx.timer.seconds(on) < ctx.timer.seconds(off))
    return out[0], out[1]


def _rank_ops(rank: int, groups: Groups, causal: bool, direction: Direction) -> list[Op]:
    r, n = rank, sum(len(g) for g in groups)
    backward = Direction(direction) is Direction.BACKWARD
    peers = [(r + i) % n for i in range(1, n)]  # nearest first, as a ring-ordered collective
    qloc = Loc.own(Kind.QGRAD if backward else Kind.Q)
    p = Program()
    gather = None
    if peers:
        gather = p.comm(
            Stream.KV,
            sends=[Xfer(j, _OWN_KV, Kind.KV, r, Half.FULL) for j in peers],
            recvs=[Xfer(j, _GATHERED_KV.at(j), Kind.KV, j, Half.FULL) for j in peers],
        )
    if not backward:
        p.add(Reset(Plan.OUT, Kind.OUT, r))
        p.add(Tile(tile_spec(r, r, causal), qloc, _OWN_KV, Plan.OUT))
        if gather is not None:
            p.add(Wait(gather))
        for j in peers:
            p.add(Tile(tile_spec(r, j, causal), qloc, _GATHERED_KV.at(j), Plan.OUT))
        return p.ops
    p.add(Reset(Plan.DQ, Kind.DQ, r))
    p.add(Reset(Plan.DKV, Kind.DKV, r))
    p.add(TileBwd(tile_spec(r, r, causal), qloc, _OWN_KV, Plan.DQ, Plan.DKV))
    if gather is None:
        return p.ops
    p.add(Wait(gather))
    for j in peers:
        # One tile per gathered block: its gradient is the whole partial, sent as it is.
        p.add(TileBwd(tile_spec(r, j, causal), qloc, _GATHERED_KV.at(j), Plan.DQ,
                      _DKV_OUT.at(j), fresh_dkv=True))
    scatter = p.comm(
        Stream.Q,
        sends=[Xfer(j, _DKV_OUT.at(j), Kind.DKV, j, _dkv_rows(r, j, causal)) for j in peers],
        recvs=[Xfer(j, _DKV_IN.at(j), Kind.DKV, r, _dkv_rows(j, r, causal)) for j in peers],
    )
    p.add(Wait(scatter))
    for j in peers:
        p.add(Merge(Plan.DKV, _DKV_IN.at(j)))
    return p.ops


def _dkv_rows(q_owner: int, kv_owner: int, causal: bool) -> Half:
    """The kv rows of the dkv partial of tile ``(q_owner, kv_owner)``."""
    return tile_spec(q_owner, kv_owner, causal).kv_half


ALLGATHER = Algorithm(
    "allgather", allgather_rank, uses_topology=False, te_name="allgather",
    prunes_messages=False,  # TE gathers all of k and v whatever the window
    settings=(SUPER_TILES,), variants=allgather_variants,
    description="TransformerEngine's all_gather: kv gathered from every rank, dk/dv "
                "reduce-scattered")
