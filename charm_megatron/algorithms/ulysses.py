"""Ulysses CP and hierarchical CP, TransformerEngine's ``a2a`` and ``a2a+p2p``: their registry
entries (docs/algorithm.md, *Head all-to-all*; docs/design.md says why they are lifted rings).

Both are a head all-to-all (plan/head_stage.py) around a ring over the super-blocks of each
lane, lifted to the CP ranks:

* ``a2a`` - the all-to-all spans the whole CP group (``a = n``), so each lane holds the whole
  sequence and its ring has one rank: one local attention over all rows for ``h/n`` heads.
* ``a2a+p2p`` - the all-to-all spans each topology group (consecutive ranks of one size, TE's
  inner groups; normally a node), then the ring crosses the ``n/a`` groups on the gathered
  rows (TE's p2p ring on ``a`` times longer blocks with ``h/a`` heads). One group is ``a2a``;
  groups of one rank are the ring (as TE reduces them).

Neither has settings. Both need the q heads and the kv heads to divide by ``a`` (GQA's kv
heads are split, never repeated). A sliding window prunes the lanes' ring to the super-block
tiles it needs (plan/tile_rule.py, ``WindowGeometry.group``; the all-to-alls move
everything, as TE's do); packed THD reorders each lane's super-block into the THD layout of
``n/a`` ranks (ops/packed.lane_order). A softmax offset (sink) is applied on each lane's
heads after the ring.

Plan layer: no torch.
"""

from __future__ import annotations

from charm_megatron.algorithms.ring import ring_rank
from charm_megatron.plan.core import Plan
from charm_megatron.plan.entries import Algorithm, CallTraits, Groups, VariantContext
from charm_megatron.plan.head_stage import lift_rank, stage_refusal

__all__ = ["A2A", "A2A_P2P", "head_group_of"]


def _whole(groups: Groups) -> int:
    return sum(len(g) for g in groups)


def _inner(groups: Groups) -> int:
    return len(groups[0])


def head_group_of(name: str, groups: Groups) -> int:
    """The all-to-all group size of entry ``name`` on ``groups``."""
    return _whole(groups) if name == "a2a" else _inner(groups)


def _finish(a_of):
    def finish(plan: Plan, ctx: VariantContext, variant: object) -> Plan:
        plan.head_group = a_of(ctx.groups)
        return plan
    return finish


_ALTERNATIVES = {"a2a": "a2a+p2p, ring, allgather, rmplus or charm",
                 "a2a+p2p": "a2a (if the heads divide by the CP size), ring, allgather, rmplus "
                            "or charm"}


def _check(name: str):
    def check(traits: CallTraits) -> None:
        n = _whole(traits.groups)
        groups = traits.groups if name == "a2a+p2p" else (tuple(range(n)),)
        why = stage_refusal(groups, n, traits.hq, traits.hkv, f"cp_attention(algo={name!r})",
                            _ALTERNATIVES[name])
        if why is not None:
            raise ValueError(why)
    return check


A2A = Algorithm(
    "a2a", lift_rank(ring_rank, _whole), uses_topology=False, te_name="a2a",
    finish=_finish(_whole), check=_check("a2a"),
    description="TransformerEngine's a2a (Ulysses): q, k, v all-to-all from sequence to head "
                "shards, one attention over the whole sequence, the output back; the q and kv "
                "heads must divide by the CP size")

A2A_P2P = Algorithm(
    "a2a+p2p", lift_rank(ring_rank, _inner), uses_topology=True, te_name="a2a+p2p",
    finish=_finish(_inner), check=_check("a2a+p2p"),
    description="TransformerEngine's hierarchical a2a+p2p: Ulysses inside each topology group "
                "(consecutive ranks), the kv ring across the groups on the gathered rows; the "
                "heads must divide by the group size")
