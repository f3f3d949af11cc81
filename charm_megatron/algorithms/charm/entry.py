"""The RM+ and CHARM+ registry entries: their settings, the variant each direction runs, and
the memory bound on the assembled plan (docs/algorithm.md, *RM+*, *CHARM+*).

* settings (:data:`SETTINGS`, shared by ``rmplus`` and ``charm``): the pass order, the role
  mix, and whether visiting kv (pass-kv) / a counterpart's q (pass-q) cross in row halves;
  CHARM+ adds :data:`HEAD_PARALLEL`, a head all-to-all of degree ``d`` inside each topology
  group before the plan (:data:`SETTINGS_WITH_HEADS`);
* :class:`CharmVariant`: what one direction's builder runs, made from the settings by
  :func:`charm_variants`: a split set to ``auto`` is the performance model's per-direction
  pick (a timer given), else off;
* :func:`charm_rank`, the registry's builder: the variant unpacked into plain values of a
  :class:`~charm_megatron.algorithms.charm.state.RankState`, whose program
  :func:`~charm_megatron.algorithms.charm.program.rank_program` builds;
* :func:`within_memory_bound`: the plan, or its lighter-memory variant where it would hold
  more than :data:`~charm_megatron.plan.memory.BOUND` x ring's peak; :func:`charm_finish`
  adds the head all-to-all's degree to the plan.

Plan layer: no torch.
"""

from __future__ import annotations

from collections.abc import Callable
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
from charm_megatron.plan.fuse import SUPER_TILES, fuse_ops
from charm_megatron.plan.head_stage import lift_ops, super_groups
from charm_megatron.plan.memory import BOUND, max_peak, peak
from charm_megatron.plan.prune import prune
from charm_megatron.plan.roles import Decision, RoleChoice, RoleShape
from charm_megatron.plan.settings import Setting, Values
from charm_megatron.plan.validate import PlanError, validate
from charm_megatron.plan.vocab import (
    DiagonalMode,
    Direction,
    HeadParallel,
    PassOrder,
    RoleMix,
    SplitMode,
    SuperTileMode,
)

__all__ = ["CHARM", "SETTINGS_WITH_HEADS", "CharmVariant", "HEAD_PARALLEL", "PASS_ORDER", "RMPLUS",
           "ROLES", "SETTINGS", "SPLIT_COUNTERPART_Q", "SPLIT_DIAGONAL", "SPLIT_MARGIN",
           "SPLIT_VISITING", "SUPER_TILES",
           "charm_finish", "charm_rank", "charm_variants", "head_parallel_refusal",
           "within_memory_bound"]

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
    "(on; home: their dK, dV go home on streams of their own) or four quarters (quarters; "
    "their dK, dV on those streams) (docs/algorithm.md)",
    env="CHARM_SPLIT_VISITING")
SPLIT_COUNTERPART_Q = Setting(
    "split_counterpart_q", SplitMode, SplitMode.AUTO,
    "charm pass-q: a counterpart's q block that every tile needs whole crosses in two row "
    "halves, its partial going home per half (on; home: every pass-q partial goes home on "
    "streams of their own) (docs/algorithm.md; no quarters)",
    env="CHARM_SPLIT_COUNTERPART_Q")
# auto by default, like the other splits: the model's pick where a profile times the plans
# (every rank's split pays where later returns sit exposed: 4x8 pass-q forwards, the
# backward with one NIC per node; docs/algorithm.md), off without one.
SPLIT_DIAGONAL = Setting(
    "split_diagonal", DiagonalMode, DiagonalMode.AUTO,
    "charm: on the ranks whose first cross block arrives whole (on) or on every rank (all), "
    "the own causal diagonal tile runs as its three sub-tiles, the two causal squares before "
    "the first cross block, the block between them after the last cross pass (auto: the "
    "performance model's pick per direction; a no-op without a causal mask or a second "
    "group; docs/algorithm.md)",
    env="CHARM_SPLIT_DIAGONAL")
SETTINGS = (PASS_ORDER, ROLES, SPLIT_VISITING, SPLIT_COUNTERPART_Q, SPLIT_DIAGONAL,
            SUPER_TILES)
HEAD_PARALLEL = Setting(
    "head_parallel", HeadParallel, HeadParallel.AUTO,
    "charm: head all-to-all in sub-groups of this many ranks of each topology group before "
    "the plan (1: none; auto: the performance model's pick per call, 1 without one; must "
    "divide the group size and both head counts; docs/algorithm.md)",
    env="CHARM_HEAD_PARALLEL")
#: CHARM+'s settings: RM+'s and the head-parallel degree (RM+ over one flat group keeps
#: none: a head all-to-all there is a2a+p2p's job).
SETTINGS_WITH_HEADS = (*SETTINGS, HEAD_PARALLEL)

#: A split plan is chosen only where it is predicted at least this much faster than whole
#: blocks. The model's errors against measurement are larger than a few per cent
#: (docs/model.md), and a split adds messages and merges; a near-tie keeps the simpler plan.
SPLIT_MARGIN = 0.05


@dataclass(frozen=True)
class CharmVariant:
    """What one direction of an RM+ / CHARM+ plan runs (the builder's ``variant``).

    ``order``: the pass order; ``roles``: the role mix and the shape its bytes are weighed
    for; ``split_visiting`` (pass-kv) / ``split_counterpart_q`` (pass-q): the visiting kv /
    the counterpart's q crosses in row pieces where every tile needs it whole
    (docs/algorithm.md, *Visiting kv in pieces*, *Counterpart q in two halves*):
    ``visiting_pieces`` of them for the visiting kv (2: halves, 4: quarters), two for the
    counterpart's q; ``home_stream``: a split visiting pass's dK, dV go home on the home
    streams (:meth:`~charm_megatron.plan.vocab.Stream.home`, one per direction) instead of
    the cross stream; ``q_home_stream``: every pass-q partial likewise (``split_counterpart_q
    = home``), so that no later q block queues behind a return on the cross stream;
    ``lean`` / ``early_returns``: the memory variants (:func:`within_memory_bound`);
    ``head_parallel``: the head all-to-all's degree (1: none), the same in both directions
    (the backward runs on the heads layout the forward kept); ``super_tiles``: adjacent kv
    units fetched together, their tiles fused (plan/fuse.py); ``split_diagonal``: the own
    causal diagonal tile as its three sub-tiles, placed around the cross passes
    (docs/algorithm.md, *The own diagonal tile in three*), on the ranks whose first cross
    block arrives whole, or with ``split_diagonal_all`` on every rank."""

    order: PassOrder = PassOrder.SPLIT
    roles: RoleChoice = RoleChoice()
    split_visiting: bool = False
    split_counterpart_q: bool = False
    lean: bool = False
    visiting_pieces: int = 2
    home_stream: bool = False
    q_home_stream: bool = False
    early_returns: bool = False
    head_parallel: int = 1
    super_tiles: bool = False
    split_diagonal: bool = False
    split_diagonal_all: bool = False

    @property
    def visiting_split(self) -> str:
        """The visiting kv split in words, for printouts: ``whole``, ``halves`` (``+home``:
        their returns on the home streams) or ``quarters``."""
        if not self.split_visiting:
            return "whole"
        name = "quarters" if self.visiting_pieces == 4 else "halves"
        return name + ("+home" if self.home_stream and self.visiting_pieces == 2 else "")

    def __post_init__(self) -> None:
        # A plain string is accepted and stored as its member (the builders compare by `is`).
        object.__setattr__(self, "order", PASS_ORDER.parse(self.order, "CharmVariant"))
        if self.visiting_pieces not in (2, 4):
            raise ValueError(f"CharmVariant: visiting_pieces={self.visiting_pieces!r}; a split "
                             f"visiting kv block crosses in 2 (halves) or 4 (quarters) pieces")


def charm_rank(rank: int, groups: Groups, causal: bool, direction: Direction,
               variant: CharmVariant) -> tuple[list[Op], list[Decision]]:
    """The registry's builder: rank ``rank``'s ops and the role of each of its exchanges.
    With a head-parallel degree ``d > 1``: CHARM+ over the super-blocks of each lane,
    grouped as their ranks are (plan/head_stage.py, :func:`lift_ops`); the role decisions
    are then the lane's (they name super-blocks)."""
    d = variant.head_parallel
    if d > 1:
        inner = replace(variant, head_parallel=1)
        ops, decisions = charm_rank(rank // d, super_groups(groups, d), causal, direction,
                                    inner)
        return lift_ops(ops, d, rank % d), decisions
    st = RankState(rank, groups, causal, direction, roles=variant.roles, lean=variant.lean,
                   early_returns=variant.early_returns, order=variant.order,
                   split_visiting=variant.split_visiting,
                   visiting_pieces=variant.visiting_pieces, home_stream=variant.home_stream,
                   split_counterpart_q=variant.split_counterpart_q,
                   q_home_stream=variant.q_home_stream,
                   split_diagonal=variant.split_diagonal,
                   split_diagonal_all=variant.split_diagonal_all,
                   super_tiles=variant.super_tiles)
    ops = rank_program(st)
    return (fuse_ops(ops) if variant.super_tiles else ops), st.decisions


def charm_variants(values: Values, ctx: VariantContext) -> tuple[CharmVariant, CharmVariant]:
    """The forward and backward variant of ``values`` (the entry's settings) in ``ctx``.

    A split ``off`` / ``on`` is as given; ``auto`` is, per direction, the split plan where it
    differs from whole blocks and ``ctx.timer`` says it is more than :data:`SPLIT_MARGIN`
    faster (each split judged with the other off: a cross round is pass-kv or pass-q, so they
    rarely touch the same plan), and whole blocks without a timer. One group has no cross
    round to split: never. ``head_parallel``: a degree is checked and used in both
    directions; ``auto`` is the degree (splits decided for each) whose forward plus backward
    ``ctx.timer`` predicts fastest, 1 without a timer or a shape. A pure function of its
    arguments, so every rank decides alike."""
    base = CharmVariant(values[PASS_ORDER.name], RoleChoice(values[ROLES.name], ctx.shape))
    hp = values.get(HEAD_PARALLEL.name, HeadParallel.D1)
    if hp.degree is not None:
        why = head_parallel_refusal(ctx.groups, hp.degree, ctx.shape)
        if why is not None and _kv_heads_shared(hp.degree, ctx.shape):
            raise NotImplementedError(
                f"charm head_parallel={hp.degree} needs the {ctx.shape.hkv} kv heads shared "
                f"by the ranks of each sub-group of {hp.degree}; sharing kv heads is not "
                f"implemented yet: choose a head_parallel that divides the kv heads, 1 or "
                f"auto")
        if why is not None:
            raise ValueError(why)
        return _with_splits(values, replace(base, head_parallel=hp.degree), ctx)
    degrees = [d for d in _degrees(ctx.groups) if head_parallel_refusal(ctx.groups, d,
                                                                         ctx.shape) is None]
    if ctx.timer is None or ctx.shape is None or len(degrees) == 1:
        return _with_splits(values, base, ctx)
    # auto: the degree whose forward plus backward is predicted fastest (one degree for
    # both directions: the backward runs on the heads layout the forward kept). Ties keep
    # the smaller degree.
    timer = ctx.timer
    best, best_s = None, float("inf")
    for d in degrees:
        fwd, bwd = _with_splits(values, replace(base, head_parallel=d), ctx)
        s = timer.seconds(_plan(Direction.FORWARD, ctx, fwd)) + \
            timer.seconds(_plan(Direction.BACKWARD, ctx, bwd))
        if s < best_s:
            best, best_s = (fwd, bwd), s
    assert best is not None
    return best


def _with_splits(values: Values, base: CharmVariant,
                 ctx: VariantContext) -> tuple[CharmVariant, CharmVariant]:
    """``base`` in each direction with its splits as the settings (and the model) say."""
    cq_mode = values[SPLIT_COUNTERPART_Q.name]
    if cq_mode is SplitMode.QUARTERS:
        raise ValueError(
            f"{SPLIT_COUNTERPART_Q.name}={cq_mode.value!r}: a counterpart's q block crosses "
            f"whole or in two halves only (quarters are for split_visiting); choose one of "
            f"{', '.join(m.value for m in SplitMode if m is not SplitMode.QUARTERS)} "
            f"({SPLIT_COUNTERPART_Q.env})")
    visiting = _visiting(values[SPLIT_VISITING.name], base, ctx)
    counterpart_q = _counterpart_q(cq_mode, base, ctx)
    fwd, bwd = (replace(v, split_counterpart_q=q.split_counterpart_q,
                        q_home_stream=q.q_home_stream)
                for v, q in zip(visiting, counterpart_q))
    fwd, bwd = _diagonal(values.get(SPLIT_DIAGONAL.name, DiagonalMode.OFF), fwd, bwd, ctx,
                         plain=base)
    return _super_tiles(values[SUPER_TILES.name], fwd, bwd, ctx)


def _diagonal(mode: DiagonalMode, fwd: CharmVariant, bwd: CharmVariant,
              ctx: VariantContext, plain: CharmVariant) -> tuple[CharmVariant, CharmVariant]:
    """``fwd`` and ``bwd`` with the own diagonal tile split as ``mode`` says: ``on`` (the
    ranks whose first cross block arrives whole) or ``all`` (every rank) in both directions
    (a no-op where there is no causal diagonal or no second group: nothing to split, or no
    cross pass to place its sub-tiles around); ``auto`` per direction the fastest by
    ``ctx.timer`` of the two splits on the plan with the visiting / counterpart splits
    already chosen and, where those differ from ``plain`` (the same variant without them),
    on ``plain`` too, kept where it is more than :data:`SPLIT_MARGIN` faster than the plan with
    those splits (:func:`_beats`); off without a timer. (The splits are decided one after
    the other; a diagonal split can pay on whole blocks more than the visiting or
    counterpart split it would otherwise sit on: 2x8 MHA 64k forward, one NIC per GPU,
    ``d = 8``, 2026-12-07.)"""
    if not ctx.causal or len(ctx.groups) < 2 or mode is DiagonalMode.OFF:
        return fwd, bwd
    lower, every = ({"split_diagonal": True}, {"split_diagonal": True, "split_diagonal_all": True})
    if mode is not DiagonalMode.AUTO:
        kw = every if mode is DiagonalMode.ALL else lower
        return replace(fwd, **kw), replace(bwd, **kw)
    if ctx.timer is None:
        return fwd, bwd
    out = []
    for d, v in ((Direction.FORWARD, fwd), (Direction.BACKWARD, bwd)):
        whole = _plan(d, ctx, v)
        starts = [v] if plain == v else [v, plain]
        timed = [(ctx.timer.seconds(plan), split)
                 for start in starts for split in (replace(start, **lower),
                                                   replace(start, **every))
                 if (plan := _plan(d, ctx, split)).ops != whole.ops]
        best = min(timed, key=lambda t: t[0], default=None)
        keep = best is not None and _beats(best[0], ctx.timer.seconds(whole))
        out.append(best[1] if keep else v)
    return out[0], out[1]


def _super_tiles(mode: SuperTileMode, fwd: CharmVariant, bwd: CharmVariant,
                 ctx: VariantContext) -> tuple[CharmVariant, CharmVariant]:
    """``fwd`` and ``bwd`` with super-tiles as ``mode`` says: ``auto`` per direction where
    ``ctx.timer`` predicts the plan with them faster (off without a timer)."""
    return _switched(mode.value, "super_tiles", fwd, bwd, ctx,
                     lambda on, off: (on.ops != off.ops
                                      and ctx.timer.seconds(on) < ctx.timer.seconds(off)))


def _switched(mode: str, field: str, fwd: CharmVariant, bwd: CharmVariant,
              ctx: VariantContext, wins: Callable[[Plan, Plan], bool]
              ) -> tuple[CharmVariant, CharmVariant]:
    """``fwd`` and ``bwd`` with the boolean variant ``field`` as an on / off / auto setting
    says (``mode``: its value): ``on`` both, ``off`` neither, ``auto`` per direction where
    ``wins(plan with it, plan without)`` (only with ``ctx.timer``; off without one)."""
    if mode == "off" or (mode == "auto" and ctx.timer is None):
        return fwd, bwd
    if mode == "on":
        return replace(fwd, **{field: True}), replace(bwd, **{field: True})
    out = []
    for d, v in ((Direction.FORWARD, fwd), (Direction.BACKWARD, bwd)):
        switched = replace(v, **{field: True})
        out.append(switched if wins(_plan(d, ctx, switched), _plan(d, ctx, v)) else v)
    return out[0], out[1]


def _degrees(groups: Groups) -> list[int]:
    """The degrees worth trying on ``groups``: 1 and every declared degree that divides the
    smallest group."""
    size = min(len(g) for g in groups)
    return [1] + [m.degree for m in HeadParallel
                  if m.degree is not None and 1 < m.degree <= size and size % m.degree == 0]


def head_parallel_refusal(groups: Groups, d: int, shape: RoleShape | None) -> str | None:
    """Why CHARM+ cannot run a head all-to-all of degree ``d`` on ``groups`` for ``shape``
    (``None``: it can; shape-free: only the groups are checked). The sub-groups are ``d``
    consecutive ranks inside one topology group, so every group must be consecutive ranks
    with a size that divides by ``d``; both head counts must divide by ``d`` (GQA's kv heads
    are split, never shared: kv heads fewer than ``d`` are not supported yet)."""
    if d == 1:
        return None
    fix = "choose a head_parallel (CHARM_HEAD_PARALLEL) that does, 1 or auto"
    first = 0
    for g in groups:
        if g != tuple(range(first, first + len(g))) or len(g) % d:
            return (f"charm head_parallel={d} runs its head all-to-all in sub-groups of {d} "
                    f"consecutive ranks inside each topology group, but the groups are "
                    f"{[list(x) for x in groups]}: each must be consecutive ranks whose count "
                    f"divides by {d}; {fix}")
        first += len(g)
    if shape is None:
        return None
    bad = [f"{name} {h}" for name, h in (("q heads", shape.hq), ("kv heads", shape.hkv))
           if h % d]
    if bad:
        return (f"charm head_parallel={d} splits the heads {d} ways, but "
                f"{' and '.join(bad)} {'do' if len(bad) > 1 else 'does'} not divide by {d}; "
                f"{fix}")
    return None


def _kv_heads_shared(d: int, shape: RoleShape | None) -> bool:
    """Whether degree ``d`` would need kv heads shared among ranks: the q heads divide by
    ``d`` but the kv heads are fewer than ``d`` and divide it (GQA with few kv heads)."""
    return (shape is not None and shape.hq % d == 0 and shape.hkv < d
            and d % shape.hkv == 0)


def _counterpart_q(mode: SplitMode, base: CharmVariant,
                   ctx: VariantContext) -> tuple[CharmVariant, CharmVariant]:
    """Forward and backward of ``base`` with the counterpart's q split as ``mode`` says:
    ``on`` two halves (the partials home on the cross stream), ``home`` two halves with every
    pass-q partial home on the home streams; ``auto``, per direction, whole blocks, halves,
    halves with every partial on the home streams, each taken where it beats the one kept so
    far by more than :data:`SPLIT_MARGIN` (:func:`_pick`); whole blocks without a timer."""
    halves = replace(base, split_counterpart_q=True)
    home = replace(halves, q_home_stream=True)
    if len(ctx.groups) < 2 or mode is SplitMode.OFF:
        return base, base
    if mode is SplitMode.ON:
        return halves, halves
    if mode is SplitMode.HOME:
        return home, home
    if ctx.timer is None:  # auto with nothing to time the plans with: whole blocks
        return base, base
    return (_pick(Direction.FORWARD, ctx, base, halves, home, None),
            _pick(Direction.BACKWARD, ctx, base, halves, home, None))


def _visiting(mode: SplitMode, base: CharmVariant,
              ctx: VariantContext) -> tuple[CharmVariant, CharmVariant]:
    """Forward and backward of ``base`` with the visiting kv split as ``mode`` says: ``on``
    two halves (their returns on the cross stream, as before the home stream existed),
    ``quarters`` four pieces (returns on the home stream); ``auto``, per direction, whole
    blocks, halves, halves with their returns on the home stream, quarters, each taken
    where the model predicts it more than :data:`SPLIT_MARGIN` faster than the one kept so
    far (:func:`_pick`); whole blocks without a timer."""
    halves = replace(base, split_visiting=True)
    home = replace(halves, home_stream=True)
    quarters = replace(halves, visiting_pieces=4, home_stream=True)
    if len(ctx.groups) < 2 or mode is SplitMode.OFF:
        return base, base
    if mode is SplitMode.ON:
        return halves, halves
    if mode is SplitMode.HOME:
        return home, home
    if mode is SplitMode.QUARTERS:
        return quarters, quarters
    if ctx.timer is None:  # auto with nothing to time the plans with: whole blocks
        return base, base
    return (_pick(Direction.FORWARD, ctx, base, halves, home, quarters),
            _pick(Direction.BACKWARD, ctx, base, halves, home, quarters))


def _pick(direction: Direction, ctx: VariantContext, whole: CharmVariant,
          halves: CharmVariant, home: CharmVariant,
          quarters: CharmVariant | None) -> CharmVariant:
    """A split's ``auto`` in one direction (:func:`_visiting`, :func:`_counterpart_q`): the
    candidates from the simplest on (whole blocks, halves with their returns on the cross
    stream, halves with them on the home streams, quarters if any), each taken where it beats
    the one kept so far by more than :data:`SPLIT_MARGIN`; each plan built and simulated
    once. (The home streams are weighed against whole blocks where the halves alone do not
    beat them: 2026-12-07, the 4x8 one-NIC-per-node backward at 70B-like 32k and ``d = 8``,
    home 5.9 % faster than whole blocks, the halves 2.6 %, was left whole before.)"""
    assert ctx.timer is not None
    timer = ctx.timer
    plans: dict[CharmVariant, Plan] = {}
    seconds: dict[CharmVariant, float] = {}

    def faster(split: CharmVariant, simpler: CharmVariant) -> bool:
        for v in (split, simpler):
            if v not in plans:
                plans[v] = _plan(direction, ctx, v)
        if plans[split].ops == plans[simpler].ops:
            return False
        for v in (split, simpler):
            if v not in seconds:
                seconds[v] = timer.seconds(plans[v])
        return _beats(seconds[split], seconds[simpler])

    best = whole
    for candidate in (halves, home, quarters):
        if candidate is not None and faster(candidate, best):
            best = candidate
    return best


def _faster(split: Plan, whole: Plan, timer: PlanTimer) -> bool:
    """Whether ``split`` changes the plan and is predicted faster than ``whole`` by more
    than :data:`SPLIT_MARGIN`."""
    if split.ops == whole.ops:
        return False
    return _beats(timer.seconds(split), timer.seconds(whole))


def _beats(split_s: float, simpler_s: float) -> bool:
    """A split plan of ``split_s`` seconds is kept over the simpler one: more than
    :data:`SPLIT_MARGIN` faster."""
    return split_s < (1.0 - SPLIT_MARGIN) * simpler_s


def _plan(direction: Direction, ctx: VariantContext, variant: CharmVariant) -> Plan:
    """The plan the entry builds for ``variant`` (memory bound included), for timing."""
    return _plan_cached(direction, replace(ctx, timer=None), variant)


@lru_cache(maxsize=256)
def _plan_cached(direction: Direction, ctx: VariantContext, variant: CharmVariant) -> Plan:
    # The rule times plans with two or more groups, which only charm builds. Under a window
    # the call runs the plan pruned to it (plan/registry.py's _build), so that is the one
    # timed: whole blocks can win there where a split wins on the full causal plan.
    plan = charm_finish(assemble("charm", charm_rank, direction, ctx.groups, ctx.causal,
                                 variant), ctx, variant)
    if ctx.tiles is not None and ctx.tiles.windowed:
        plan = prune(plan, ctx.tiles.for_lanes(plan.head_group))
    return plan


def charm_finish(plan: Plan, ctx: VariantContext, variant: CharmVariant) -> Plan:
    """The registry's finish rule: :func:`within_memory_bound`, then the head all-to-all's
    degree on the plan (what the executor, the model and the validator read)."""
    plan = within_memory_bound(plan, ctx, variant)
    plan.head_group = variant.head_parallel
    return plan


def within_memory_bound(plan: Plan, ctx: VariantContext, variant: CharmVariant) -> Plan:
    """The registry's finish rule: ``plan`` if its peak memory (:mod:`plan.memory`, the
    executor's allocation rule) is within :data:`~charm_megatron.plan.memory.BOUND` x ring's;
    else the first variant that is, from the least to the most costly in time: q-pair returns
    completed before the next unit's tiles (``early_returns``), then lean (one unit's blocks
    at a time); else ``plan``. A plan with super-tiles is bounded as the same plan without
    them (:func:`_super_tiles_plan`). Shape-free (``ctx.shape`` None): ``plan``. Peaks scale with
    the rows alike, so two rows per rank decide for every sequence length (and every rank
    decides alike)."""
    if variant.super_tiles:
        return _super_tiles_plan(plan, ctx, variant)
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


def _super_tiles_plan(plan: Plan, ctx: VariantContext, variant: CharmVariant) -> Plan:
    """The bound for a plan with super-tiles (``plan``, built with ``variant``): the one of
    the same plan without them. A super-tile step holds its blocks and the next step's
    (:data:`~charm_megatron.algorithms.charm.rmplus.STEP_UNITS` kv blocks each): two kv
    blocks more than without, whatever the CP size, which the 1.1x bound has no room for
    (the plans without them reach 1.0-1.1x ring's peak already): that extra is what
    ``super_tiles`` trades for its fewer kernel calls. So: the plan without
    super-tiles goes through the bound; where it stays as built or needs early returns,
    the plan with super-tiles is built alike; where it needs lean, it is the plan (a lean
    plan hides nothing, and ranks that group their units into steps each by its own tiles
    would wait on each other's steps). Ranks group their units alike only where their tiles
    allow, so the order in which peers post onto a stream is not the plain plan's: the plan
    with super-tiles is kept only where the validator proves it (no deadlock under NCCL's
    serial streams; every plan of tests' sweeps passes), else the plan without them."""
    plain = replace(variant, super_tiles=False)
    bounded = within_memory_bound(
        assemble(plan.algo, charm_rank, plan.direction, ctx.groups, plan.causal, plain),
        ctx, plain)
    if bounded.lean:
        return bounded
    if bounded.early_returns:
        early = replace(variant, early_returns=True)
        plan = assemble(plan.algo, charm_rank, plan.direction, ctx.groups, plan.causal, early)
        plan.early_returns = True
    try:  # the lift's lanes: the degree charm_finish sets after this rule
        validate(replace(plan, head_group=variant.head_parallel))
    except PlanError:
        return bounded
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
    description="CHARM+: RM+ inside each topology group, queries across groups (optionally "
                "after a head all-to-all inside each group: head_parallel)",
    settings=SETTINGS_WITH_HEADS, variants=charm_variants, finish=charm_finish)
