"""The RM+ and CHARM+ registry entries: their settings, the variant each direction runs, and
the memory bound on the assembled plan (docs/algorithm.md, *RM+*, *CHARM+*).

* settings (:data:`SETTINGS`, shared by ``rmplus`` and ``charm``): the pass order, the role
  mix, and whether visiting kv (pass-kv) / a counterpart's q (pass-q) cross in row halves;
* :class:`CharmVariant`: what one direction's builder runs, made from the settings by
  :func:`charm_variants`: a split set to ``auto`` is the performance model's per-direction
  pick (a timer given), else off;
* :func:`charm_rank`, the registry's builder: the variant unpacked into plain values of a
  :class:`~charm_megatron.algorithms.charm.state.RankState`, whose program
  :func:`~charm_megatron.algorithms.charm.program.rank_program` builds;
* :func:`within_memory_bound`: the plan, or its lighter-memory variant where it would hold
  more than :data:`~charm_megatron.plan.memory.BOUND` x ring's peak.

Plan layer: no torch.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from functools import lru_cache

from charm_megatron.algorithms.charm.program import rank_program
from charm_megatron.algorithms.charm.state import RankState
from charm_megatron.algorithms.ring import ring_rank
from charm_megatron.plan.core import Op, Plan
from charm_megatron.plan.cost import Problem
from charm_megatron.plan.entries import (
    Algorithm,
    Groups,
    PlanTimer,
    VariantContext,
    assemble,
)
from charm_megatron.plan.memory import BOUND, max_peak, peak
from charm_megatron.plan.roles import Decision, RoleChoice
from charm_megatron.plan.settings import Setting, Values
from charm_megatron.plan.vocab import Direction, PassOrder, RoleMix, SplitMode

__all__ = ["CHARM", "CharmVariant", "PASS_ORDER", "RMPLUS", "ROLES", "SETTINGS",
           "SPLIT_COUNTERPART_Q", "SPLIT_MARGIN", "SPLIT_VISITING", "charm_rank",
           "charm_variants", "within_memory_bound"]

PASS_ORDER = Setting(
    "pass_order", PassOrder, PassOrder.SPLIT,
    "CHARM+/RM+ pass order: split (default) or joint (docs/algorithm.md)",
    env="CHARM_PASS_ORDER")
# No environment variable: cp_attention(roles=) and the CLIs' --roles set it.
ROLES = Setting(
    "roles", RoleMix, RoleMix.BYTES,
    "role mix of rmplus / charm exchanges: bytes (default: the cheaper role per exchange), "
    "paper (Algorithm 1), kv or q (every exchange passes kv / q)")
# The splits' help says what "on" does; SplitMode says what auto / off mean.
SPLIT_VISITING = Setting(
    "split_visiting", SplitMode, SplitMode.AUTO,
    "charm pass-kv: visiting kv blocks that every tile needs whole cross in two row halves "
    "(docs/algorithm.md)",
    env="CHARM_SPLIT_VISITING")
SPLIT_COUNTERPART_Q = Setting(
    "split_counterpart_q", SplitMode, SplitMode.AUTO,
    "charm pass-q: a counterpart's q block that every tile needs whole crosses in two row "
    "halves, its partial going home per half (docs/algorithm.md)",
    env="CHARM_SPLIT_COUNTERPART_Q")
SETTINGS = (PASS_ORDER, ROLES, SPLIT_VISITING, SPLIT_COUNTERPART_Q)

#: A split plan is chosen only where it is predicted at least this much faster than whole
#: blocks. The model's errors against measurement are larger than a few per cent
#: (docs/model.md), and a split adds messages and merges; a near-tie keeps the simpler plan.
SPLIT_MARGIN = 0.05


@dataclass(frozen=True)
class CharmVariant:
    """What one direction of an RM+ / CHARM+ plan runs (the builder's ``variant``).

    ``order``: the pass order; ``roles``: the role mix and the shape its bytes are weighed
    for; ``split_visiting`` (pass-kv) / ``split_counterpart_q`` (pass-q): the visiting kv /
    the counterpart's q crosses in two row halves where every tile needs it whole
    (docs/algorithm.md, *Visiting kv in two halves*, *Counterpart q in two halves*);
    ``lean`` / ``early_returns``: the memory variants (:func:`within_memory_bound`)."""

    order: PassOrder = PassOrder.SPLIT
    roles: RoleChoice = RoleChoice()
    split_visiting: bool = False
    split_counterpart_q: bool = False
    lean: bool = False
    early_returns: bool = False

    def __post_init__(self) -> None:
        # A plain string is accepted and stored as its member (the builders compare by `is`).
        object.__setattr__(self, "order", PASS_ORDER.parse(self.order, "CharmVariant"))


def charm_rank(rank: int, groups: Groups, causal: bool, direction: Direction,
               variant: CharmVariant) -> tuple[list[Op], list[Decision]]:
    """The registry's builder: rank ``rank``'s ops and the role of each of its exchanges."""
    st = RankState(rank, groups, causal, direction, roles=variant.roles, lean=variant.lean,
                   early_returns=variant.early_returns, order=variant.order,
                   split_visiting=variant.split_visiting,
                   split_counterpart_q=variant.split_counterpart_q)
    return rank_program(st), st.decisions


def charm_variants(values: Values, ctx: VariantContext) -> tuple[CharmVariant, CharmVariant]:
    """The forward and backward variant of ``values`` (the entry's settings) in ``ctx``.

    A split ``off`` / ``on`` is as given; ``auto`` is, per direction, the split plan where it
    differs from whole blocks and ``ctx.timer`` says it is more than :data:`SPLIT_MARGIN`
    faster (each split judged with the other off: a cross round is pass-kv or pass-q, so they
    rarely touch the same plan), and whole blocks without a timer. One group has no cross
    round to split: never. A pure function of its arguments, so every rank decides alike."""
    base = CharmVariant(values[PASS_ORDER.name], RoleChoice(values[ROLES.name], ctx.shape))
    visiting = _split(values[SPLIT_VISITING.name], "split_visiting", base, ctx)
    counterpart_q = _split(values[SPLIT_COUNTERPART_Q.name], "split_counterpart_q", base, ctx)
    fwd, bwd = (replace(base, split_visiting=v, split_counterpart_q=q)
                for v, q in zip(visiting, counterpart_q))
    return fwd, bwd


def _split(mode: SplitMode, field: str, base: CharmVariant,
           ctx: VariantContext) -> tuple[bool, bool]:
    """Forward and backward of the split ``field`` of :class:`CharmVariant` under ``mode``."""
    if len(ctx.groups) < 2 or mode is SplitMode.OFF:
        return False, False
    if mode is SplitMode.ON:
        return True, True
    if ctx.timer is None:  # auto with nothing to time the plans with: whole blocks
        return False, False
    split = replace(base, **{field: True})
    fwd, bwd = (_faster(_plan(d, ctx, split), _plan(d, ctx, base), ctx.timer)
                for d in (Direction.FORWARD, Direction.BACKWARD))
    return fwd, bwd


def _faster(split: Plan, whole: Plan, timer: PlanTimer) -> bool:
    """Whether ``split`` changes the plan and is predicted faster than ``whole`` by more
    than :data:`SPLIT_MARGIN`."""
    if split.ops == whole.ops:
        return False
    return timer.seconds(split) < (1.0 - SPLIT_MARGIN) * timer.seconds(whole)


def _plan(direction: Direction, ctx: VariantContext, variant: CharmVariant) -> Plan:
    """The plan the entry builds for ``variant`` (memory bound included), for timing."""
    return _plan_cached(direction, replace(ctx, timer=None), variant)


@lru_cache(maxsize=256)
def _plan_cached(direction: Direction, ctx: VariantContext, variant: CharmVariant) -> Plan:
    # The rule times plans with two or more groups, which only charm builds.
    plan = assemble("charm", charm_rank, direction, ctx.groups, ctx.causal, variant)
    return within_memory_bound(plan, ctx, variant)


def within_memory_bound(plan: Plan, ctx: VariantContext, variant: CharmVariant) -> Plan:
    """The registry's finish rule: ``plan`` if its peak memory (:mod:`plan.memory`, the
    executor's allocation rule) is within :data:`~charm_megatron.plan.memory.BOUND` x ring's;
    else the first variant that is, from the least to the most costly in time: q-pair returns
    completed before the next unit's tiles (``early_returns``), then lean (one unit's blocks
    at a time); else ``plan``. Shape-free (``ctx.shape`` None): ``plan``. Peaks scale with
    the rows alike, so two rows per rank decide for every sequence length (and every rank
    decides alike)."""
    shape = ctx.shape
    if shape is None:
        return plan
    n = plan.n
    problem = Problem(1, 2 * n, shape.hq, shape.hkv, shape.d, shape.elem, shape.dv,
                      wide_partials=shape.wide)
    bound = BOUND * _ring_peak(n, plan.direction, plan.causal, problem)

    def fits(ops: list[Op]) -> bool:
        return peak(ops, problem, n).bytes <= bound

    if all(fits(ops) for ops in plan.ops):
        return plan
    for lighter in (replace(variant, early_returns=True), replace(variant, lean=True)):
        # rank by rank: the first one over the bound settles it
        out = assemble(plan.algo, charm_rank, plan.direction, ctx.groups, plan.causal, lighter,
                       keep=fits)
        if out is not None:
            out.early_returns, out.lean = lighter.early_returns, lighter.lean
            return out
    return plan


@lru_cache(maxsize=256)
def _ring_peak(n: int, direction: Direction, causal: bool, problem: Problem) -> float:
    """Ring's peak memory per rank, the bound's reference (asked for every rmplus / charm
    plan of a shape)."""
    ring = assemble("ring", ring_rank, direction, ((*range(n),),), causal, None)
    return max_peak(ring, problem)


RMPLUS = Algorithm(
    "rmplus", charm_rank, uses_topology=False,
    description="RM+ over a flat group (CHARM+ with one group)",
    settings=SETTINGS, variants=charm_variants, finish=within_memory_bound)
CHARM = Algorithm(
    "charm", charm_rank, uses_topology=True,
    description="CHARM+: RM+ inside each topology group, queries across groups",
    settings=SETTINGS, variants=charm_variants, finish=within_memory_bound)
