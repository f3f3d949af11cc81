"""The algorithm registry: the one list of CP attention algorithms, their settings, and the plan
dispatcher.

Every place that names the algorithms derives its list from here: ``cp_attention``'s ``algo``
choices, the topology rule (which algorithms ignore the topology), Megatron's
``--cp-comm-type`` values, the ``args`` / ``plan`` CLIs and the SLURM scripts (which ask the
``args`` CLI). An entry (:class:`Algorithm`) is a name, a per-rank op builder, whether the
algorithm uses the topology groups, a one-line description, and what the algorithm owns: its
settings (:class:`~charm_megatron.plan.settings.Setting`), the rule that turns their values
into the builder's variant per direction, and an optional finish rule on the assembled plan.
``auto`` is not an entry: it names a choice the performance model makes among the entries
(:func:`charm_megatron.model.choose_algo`).

Adding an algorithm: write a builder ``(rank, groups, causal, direction, variant) ->
list[Op]`` and :func:`register` an :class:`Algorithm` with it (the built-ins are the entries of
:data:`charm_megatron.algorithms.BUILTINS`, registered here in one loop). The validator,
executor, model, printouts and every list above then know it.

Plan layer: no torch.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, replace
from functools import lru_cache
from typing import Any

from charm_megatron.algorithms import BUILTINS
from charm_megatron.plan.core import Plan
from charm_megatron.plan.entries import (
    AUTO,
    AUTO_DESCRIPTION,
    Algorithm,
    CallTraits,
    Groups,
    PlanRule,
    PlanTimer,
    RankBuilder,
    VariantContext,
    VariantRule,
    all_settings,
    assemble,
    find,
    get,
    names,
    register,
    registered,
    unregister,
)
from charm_megatron.plan.prune import prune
from charm_megatron.plan.roles import ROLE_MIXES, RoleShape
from charm_megatron.plan.settings import Setting, Values
from charm_megatron.plan.tile_rule import TileRule
from charm_megatron.plan.vocab import Direction

__all__ = [
    "ALGORITHM_NAMES",
    "AUTO",
    "AUTO_DESCRIPTION",
    "Algorithm",
    "CHOICES",
    "CallTraits",
    "DIRECTIONS",
    "Groups",
    "NameView",
    "PlanQuery",
    "PlanRule",
    "PlanTimer",
    "RankBuilder",
    "Resolution",
    "ROLE_MIXES",
    "Setting",
    "Values",
    "VariantContext",
    "VariantRule",
    "all_settings",
    "build_plan",
    "check_call",
    "choices",
    "describe_choices",
    "get",
    "names",
    "plans",
    "register",
    "resolve",
    "settings_values",
    "unregister",
    "uses_topology",
    "variants",
]

DIRECTIONS = tuple(d.value for d in Direction)

for _entry in BUILTINS:  # the one place the built-ins are registered, in their listed order
    register(_entry)


def choices() -> tuple[str, ...]:
    """What an ``algo`` / ``--cp-comm-type`` served by charm-megatron accepts: the names and
    ``auto``."""
    return (*names(), AUTO)


def uses_topology(name: str) -> bool:
    """Whether ``name`` runs on the topology's groups (``auto`` does: its choice may).

    Unknown names count as topology users, so a caller's own error about the name is what the
    user sees."""
    entry = find(name)
    return entry is None or entry.uses_topology


def describe_choices() -> str:
    """``name: description`` for every choice, ``auto`` last, joined by ``; `` (CLI help)."""
    parts = [f"{a.name}: {a.description}" for a in registered()]
    return "; ".join([*parts, f"{AUTO}: {AUTO_DESCRIPTION}"])


class NameView(Sequence[str]):
    """A live, read-only sequence of names computed by ``source`` on every use, so that a list
    kept as a module constant (``ALGOS``, ``CHARM_COMM_TYPES``) also shows algorithms
    registered after import. Compares equal to any sequence with the same names in order."""

    def __init__(self, source: Callable[[], tuple[str, ...]]) -> None:
        self._source = source

    def __getitem__(self, index: Any) -> Any:
        return self._source()[index]

    def __len__(self) -> int:
        return len(self._source())

    def __iter__(self) -> Iterator[str]:
        return iter(self._source())

    def __contains__(self, value: object) -> bool:
        return value in self._source()

    def __eq__(self, other: object) -> bool:
        if isinstance(other, (Sequence, NameView)) and not isinstance(other, str):
            return tuple(self) == tuple(other)
        return NotImplemented

    __hash__ = None  # type: ignore[assignment]  # mutable contents

    def __repr__(self) -> str:
        return repr(self._source())


#: Live views of :func:`names` and :func:`choices`.
ALGORITHM_NAMES = NameView(names)
CHOICES = NameView(choices)


# ------------------------------------------------------------------------------- settings
def settings_values(**given: object) -> Values:
    """Every registered setting's value: those ``given`` (a member, its string value, or
    True / False for an on / off setting) parsed, the defaults for the rest. An unknown name
    is a ``ValueError`` naming the known settings."""
    known = all_settings()
    unknown = sorted(set(given) - set(known))
    if unknown:
        raise ValueError(f"unknown setting{'s' if len(unknown) > 1 else ''} "
                         f"{', '.join(unknown)}; the registered settings are "
                         f"{', '.join(known) or 'none'}")
    return Values(tuple((name, s.parse(given[name]) if name in given else s.default)
                        for name, s in known.items()))


def check_call(algo: str, traits: CallTraits) -> None:
    """Raise what entry ``algo`` says of a call with ``traits`` (``ValueError``: illegal,
    ``NotImplementedError``: not written yet); nothing for an entry without a check. The
    groups are taken as the entry sees them (flat unless it uses the topology)."""
    _check(get(algo), traits)


def _check(entry: Algorithm, traits: CallTraits) -> None:
    if entry.check is not None:
        entry.check(replace(traits, groups=_algo_groups(entry, traits.groups)))


def refusal(algo: str, traits: CallTraits) -> str | None:
    """Why entry ``algo`` refuses a call with ``traits`` (its check's message), ``None`` if it
    runs it: what the bench, the demo and the plan CLI print for a skipped algorithm."""
    try:
        check_call(algo, traits)
    except (ValueError, NotImplementedError) as exc:
        return str(exc)
    return None


def refuses(algo: str, traits: CallTraits) -> bool:
    """True if entry ``algo`` refuses a call with ``traits`` (``auto`` skips it)."""
    return refusal(algo, traits) is not None


# ------------------------------------------------------------------------ one call's plans
@dataclass(frozen=True)
class PlanQuery:
    """What a call asks of the registry: the algorithm by name (or ``auto``), the CP size, the
    call's traits (their ``groups`` are filled in here), the mask, what the rules read
    (``shape``; ``timer_for``: the performance model's clock on given hardware groups,
    ``None``: no profile), every setting's value (``None``: the defaults), a window's tiles
    (``None``: full attention) and ``hardware``: the topology's groups, asked for only when the
    algorithm (or ``auto``) runs on them (it may probe; ``None``: one flat group)."""

    algo: str
    cp_size: int
    traits: CallTraits
    causal: bool
    shape: RoleShape | None = None
    values: Values | None = None
    tiles: TileRule | None = None
    hardware: Callable[[], Groups] | None = None
    timer_for: Callable[[Groups], PlanTimer] | None = None


@dataclass(frozen=True)
class Resolution:
    """What :func:`resolve` answers: the algorithm that runs, the hardware groups it was
    resolved on (flat unless it, or ``auto``, uses the topology), its groups as it sees them,
    the variant it runs per direction, its forward and backward plans (memoised and shared: do
    not modify; not validated), and what ``choose`` said beside its pick (``None`` for a
    named algorithm)."""

    algo: str
    hardware: Groups
    groups: Groups
    variants: tuple[Any, Any]
    plans: tuple[Plan, Plan]
    choice: Any = None


#: ``auto``'s chooser: ``(the entries that run the call, in registry order; the hardware
#: groups; the model's clock or None) -> (the pick, anything the caller wants back in
#: Resolution.choice)``.
Chooser = Callable[[tuple[str, ...], Groups, "PlanTimer | None"], tuple[str, Any]]


def resolve(query: PlanQuery, choose: Chooser | None = None,
            candidates: Sequence[str] | None = None) -> Resolution:
    """A call's whole answer in one visit: the hardware groups where the algorithm uses them;
    for ``auto``, the entries (``candidates``, default all) that do not refuse the call,
    handed to ``choose`` for the pick; the pick's check (``ValueError`` /
    ``NotImplementedError`` as the entry says); its groups, variants and plans. The same on
    every rank for the same query (and the same hardware groups)."""
    algo, choice = query.algo, None
    topology = algo == AUTO or get(algo).uses_topology
    hardware: Groups = (tuple(range(query.cp_size)),)
    if topology and query.hardware is not None:
        hardware = tuple(tuple(g) for g in query.hardware())
    traits = replace(query.traits, groups=hardware)
    timer = query.timer_for(hardware) if query.timer_for is not None else None
    if algo == AUTO:
        if choose is None:
            raise ValueError("resolve: algo 'auto' needs a chooser")
        runnable = tuple(a for a in (candidates or names()) if refusal(a, traits) is None)
        algo, choice = choose(runnable, hardware, timer)
    entry = get(algo)
    _check(entry, traits)
    groups = _algo_groups(entry, hardware)
    values = _own(entry, query.values if query.values is not None else settings_values())
    shape = query.shape
    if entry.variants is None and entry.finish is None:
        shape = timer = None  # nothing of the entry reads them: one plan for every shape
    tiles = query.tiles if query.tiles is not None and query.tiles.windowed else None
    variants = _variants(entry, groups, query.causal, shape, timer, values, tiles)
    fwd_bwd = _plans(entry, groups, query.causal, shape, timer, values, tiles)
    return Resolution(entry.name, hardware, groups, variants, fwd_bwd, choice)


# ---------------------------------------------------------------------------------- plans
def variants(algo: str, groups: Sequence[Sequence[int]], causal: bool, *,
             shape: RoleShape | None = None, timer: PlanTimer | None = None,
             tiles: TileRule | None = None, **settings: object) -> tuple[Any, Any]:
    """The forward and backward variant the builder of ``algo`` runs under ``settings`` (by
    name; the others at their defaults) on ``groups``: its variant rule's, or its settings'
    :class:`Values` for both directions where it has none. ``shape``: what byte and memory
    rules read (``None``: shape-free); ``timer``: the performance model's clock, without
    which a setting left to the model (a split's ``auto``) is off; ``tiles``: a sliding
    window's (the plans a rule times are pruned to it). Memoised."""
    entry = get(algo)
    if tiles is not None and not tiles.windowed:
        tiles = None
    return _variants(entry, _algo_groups(entry, groups), causal, shape, timer,
                     _own(entry, settings_values(**settings)), tiles)


def build_plan(algo: str, direction: Direction | str, groups: Sequence[Sequence[int]],
               causal: bool, *, shape: RoleShape | None = None,
               timer: PlanTimer | None = None, tiles: TileRule | None = None,
               **settings: object) -> Plan:
    """The plan of the registered ``algo`` for ``direction`` (``forward`` or ``backward``) on CP
    ranks partitioned into ``groups`` (CP-local ranks); an algorithm that does not use the
    topology gets one flat group. ``settings``: the algorithm's settings by name (e.g.
    ``pass_order="joint", roles="kv", split_visiting=True``; :func:`all_settings`), the others
    at their defaults; ``shape``, ``timer``: as :func:`variants`'. Without a shape the plan is
    shape-free (the default role mix ``bytes`` is then the paper's Algorithm 1). ``tiles``:
    a sliding window's :class:`TileRule` (``None``: full attention)."""
    entry = get(algo)
    if direction not in DIRECTIONS:
        raise ValueError(f"direction must be 'forward' or 'backward', got {direction!r}")
    if tiles is not None and not tiles.windowed:
        tiles = None
    ctx = VariantContext(_algo_groups(entry, groups), causal, shape, timer, tiles)
    fwd, bwd = _variants(entry, ctx.groups, causal, shape, timer,
                         _own(entry, settings_values(**settings)), tiles)
    return _build(entry, Direction(direction), ctx, fwd if direction == "forward" else bwd,
                  tiles)


def plans(algo: str, groups: Sequence[Sequence[int]], causal: bool, *,
          shape: RoleShape | None = None, timer: PlanTimer | None = None,
          values: Values | None = None, tiles: TileRule | None = None,
          **settings: object) -> tuple[Plan, Plan]:
    """The forward and backward plans of :func:`build_plan`, memoised (callers share them:
    do not modify) and not validated (callers validate). ``values``: resolved settings
    (:func:`settings_values`); ``settings`` by name override them."""
    if values is None or settings:
        values = settings_values(**{**(values or {}), **settings})
    entry = get(algo)
    if entry.variants is None and entry.finish is None:
        shape = timer = None  # nothing of the entry reads them: one plan for every shape
    if tiles is not None and not tiles.windowed:
        tiles = None
    return _plans(entry, _algo_groups(entry, groups), causal, shape, timer, _own(entry, values),
                  tiles)


def _algo_groups(entry: Algorithm, groups: Sequence[Sequence[int]]) -> Groups:
    """``groups`` as ``entry`` sees them: one flat group unless it uses the topology."""
    groups_t = tuple(tuple(g) for g in groups)
    if entry.uses_topology:
        return groups_t
    return (tuple(range(sum(len(g) for g in groups_t))),)


def _own(entry: Algorithm, values: Values) -> Values:
    """The values of ``entry``'s own settings (what its rules see, and what keys its plans)."""
    return values.only(s.name for s in entry.settings)


@lru_cache(maxsize=256)
def _variants(entry: Algorithm, groups: Groups, causal: bool, shape: RoleShape | None,
              timer: PlanTimer | None, values: Values,
              tiles: TileRule | None = None) -> tuple[Any, Any]:
    if entry.variants is None:
        return values, values
    return entry.variants(values, VariantContext(groups, causal, shape, timer, tiles))


def _build(entry: Algorithm, direction: Direction, ctx: VariantContext, variant: Any,
           tiles: TileRule | None = None) -> Plan:
    """The entry's plan; under a window (``tiles``), built by its windowed builder where it
    has one, then pruned to the window (plan/prune.py)."""
    windowed = tiles is not None and tiles.windowed
    build_rank = entry.build_rank
    if windowed and entry.windowed_rank is not None:
        def build_rank(rank, groups, causal, direction, variant):  # noqa: ANN001, ARG001
            return entry.windowed_rank(rank, groups, tiles, direction, variant)
    plan = assemble(entry.name, build_rank, direction, ctx.groups, ctx.causal, variant)
    assert plan is not None  # no keep test: every rank assembled
    if entry.finish is not None:
        plan = entry.finish(plan, ctx, variant)
    if windowed:
        # After a head all-to-all the plan's blocks are its lanes' super-blocks: the window
        # needs the tiles of those (plan/tile_rule.py, WindowGeometry.group).
        plan = prune(plan, tiles.for_lanes(plan.head_group), messages=entry.prunes_messages)
    return plan


@lru_cache(maxsize=256)
def _plans(entry: Algorithm, groups: Groups, causal: bool, shape: RoleShape | None,
           timer: PlanTimer | None, values: Values,
           tiles: TileRule | None = None) -> tuple[Plan, Plan]:
    # Keyed on the entry itself (not its name), so a re-registered name never hits old plans.
    ctx = VariantContext(groups, causal, shape, timer, tiles)
    fwd, bwd = _variants(entry, groups, causal, shape, timer, values, tiles)
    return (_build(entry, Direction.FORWARD, ctx, fwd, tiles),
            _build(entry, Direction.BACKWARD, ctx, bwd, tiles))
