"""What a registry entry is, and the one table of them.

An algorithm module (:mod:`charm_megatron.algorithms.ring`, :mod:`charm_megatron.algorithms.charm.entry`) builds
its :class:`Algorithm` and :func:`register`\\ s it here; :mod:`charm_megatron.plan.registry`
imports those modules (so the built-ins are registered in order: ring, rmplus, charm) and
offers the public API on top of this table. This module imports no algorithm, which is what
lets the algorithm modules import it without a cycle.

Plan layer: no torch.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Protocol

from charm_megatron.plan.core import Op, Plan
from charm_megatron.plan.roles import Decision, RoleShape
from charm_megatron.plan.settings import Setting, Values
from charm_megatron.plan.tile_rule import TileRule
from charm_megatron.plan.vocab import Direction

__all__ = ["AUTO", "AUTO_DESCRIPTION", "Algorithm", "CallCheck", "CallTraits", "Groups", "PlanRule", "PlanTimer",
           "RankBuilder", "VariantContext", "VariantRule", "all_settings", "assemble", "find",
           "get", "names", "register", "registered", "unregister"]

Groups = tuple[tuple[int, ...], ...]
#: ``(rank, groups, causal, direction, variant) -> rank's ops``, or ``(ops, decisions)`` for an
#: algorithm whose exchanges choose roles (:class:`~charm_megatron.plan.roles.Decision`, for
#: printouts). ``groups`` are CP-local ranks, one flat group for an algorithm that does not use
#: the topology; ``variant`` is what the entry's variant rule made of the call's settings.
RankBuilder = Callable[[int, Groups, bool, Direction, Any],
                       "list[Op] | tuple[list[Op], list[Decision]]"]

#: ``algo`` value that lets the performance model pick among the registered algorithms.
AUTO = "auto"
AUTO_DESCRIPTION = ("the fastest registered algorithm for this topology and shape, as predicted "
                    "by the performance model (the same choice on every rank)")

# Keywords of registry.build_plan / plans themselves: a setting may not shadow them.
_RESERVED = frozenset({"algo", "direction", "groups", "causal", "shape", "timer", "values"})


class PlanTimer(Protocol):
    """A clock for plans: the seconds one plan takes on the call's cluster and problem (the
    performance model provides one, ``model.ClusterTimer``). Hashable: it keys plan caches."""

    def seconds(self, plan: Plan) -> float: ...


@dataclass(frozen=True)
class VariantContext:
    """What a variant or finish rule may read besides the settings: the ``groups`` as the
    algorithm sees them (flat for ``uses_topology=False``), the mask, the ``shape`` byte and
    memory rules read (``None``: shape-free), the ``timer`` (``None``: no profile to
    predict with) and a sliding window's ``tiles`` (``None``: full attention), to which the
    plans a rule times are pruned as the call's are: a variant picked on the unpruned plans
    can be the slower one under the window."""

    groups: Groups
    causal: bool
    shape: RoleShape | None = None
    timer: PlanTimer | None = None
    tiles: TileRule | None = None


#: ``(values of the entry's settings, context) -> (forward variant, backward variant)``.
VariantRule = Callable[[Values, VariantContext], tuple[Any, Any]]
#: ``(assembled plan, context, its variant) -> the plan to use``.
PlanRule = Callable[[Plan, VariantContext, Any], Plan]


@dataclass(frozen=True)
class CallTraits:
    """What an entry's ``check`` may refuse a call for: its ``groups`` as the algorithm sees
    them, its head counts (``None``: shape-free), and whether it is packed (THD), windowed or
    has a softmax offset."""

    groups: Groups
    hq: int | None = None
    hkv: int | None = None
    packed: bool = False
    windowed: bool = False
    offset: bool = False


#: ``traits -> None``, raising ``ValueError`` (illegal for this call) or
#: ``NotImplementedError`` (not written yet) with a sentence naming the fix.
CallCheck = Callable[[CallTraits], None]


@dataclass(frozen=True)
class Algorithm:
    """One registry entry: a name, a per-rank op builder, whether it runs on the topology's
    groups, a one-line description, and what it owns: its ``settings``, the rule that turns
    their values into the builder's ``variant`` per direction (``None``: the values
    themselves, both directions) and an optional ``finish`` applied to the assembled plan.
    ``te_name``: the ``--cp-comm-type`` under which TransformerEngine offers the same
    algorithm (``p2p`` for ring), so printouts and docs can name the peer it stands for; an
    entry whose own name is a TE comm type (``allgather``) is a *peer*: Megatron's
    ``--cp-comm-type`` of that name stays TE's (docs/megatron.md).

    Under a sliding window every plan is pruned to the tiles and messages the window needs
    (plan/prune.py); ``windowed_rank`` builds it instead of ``build_rank`` where the
    algorithm has a shape of its own for windows (ring: two bounded rings), given the
    :class:`~charm_megatron.plan.tile_rule.TileRule` in place of ``causal``.
    ``prunes_messages`` False keeps every message (a collective that moves everything,
    as TE's all-gather does) and prunes tiles only. ``check`` refuses calls the algorithm
    cannot run (:data:`CallCheck`); ``auto`` never picks an entry that refuses the call."""

    name: str
    build_rank: RankBuilder
    uses_topology: bool
    description: str
    settings: tuple[Setting, ...] = ()
    variants: VariantRule | None = None
    finish: PlanRule | None = None
    te_name: str | None = None
    windowed_rank: RankBuilder | None = None
    prunes_messages: bool = True
    check: CallCheck | None = None


_REGISTRY: dict[str, Algorithm] = {}


def register(algo: Algorithm) -> Algorithm:
    """Add ``algo``; its name must be new and must not be ``auto``, and a setting it shares by
    name with another entry must be that entry's declaration (so a name means one thing).
    Returns it."""
    # '+' joins two comm types, as TE's hierarchical "a2a+p2p" does.
    if not isinstance(algo.name, str) or not algo.name.replace("+", "_").isidentifier():
        raise ValueError(f"algorithm name {algo.name!r} must be an identifier-like string "
                         "(letters, digits, '_', '+')")
    if algo.name == AUTO:
        raise ValueError(f"{AUTO!r} is reserved: it names the performance model's choice")
    if algo.name in _REGISTRY:
        raise ValueError(f"algorithm {algo.name!r} is already registered")
    known = all_settings()
    for s in algo.settings:
        if s.name in _RESERVED:
            raise ValueError(f"algorithm {algo.name!r}: setting name {s.name!r} is reserved "
                             "(a keyword of registry.build_plan)")
        if s.name in known and known[s.name] != s:
            raise ValueError(f"algorithm {algo.name!r}: setting {s.name!r} differs from the "
                             "one already registered under that name")
    _REGISTRY[algo.name] = algo
    return algo


def unregister(name: str) -> None:
    """Remove the entry ``name`` (for tests that register a temporary algorithm)."""
    del _REGISTRY[name]


def names() -> tuple[str, ...]:
    """The registered algorithms, in registration order (``auto`` excluded)."""
    return tuple(_REGISTRY)


def registered() -> tuple[Algorithm, ...]:
    """The entries, in registration order."""
    return tuple(_REGISTRY.values())


def find(name: object) -> Algorithm | None:
    """The entry ``name``, ``None`` if there is none."""
    return _REGISTRY.get(name) if isinstance(name, str) else None


def get(name: str) -> Algorithm:
    """The entry ``name``; ``ValueError`` naming the choices for an unknown name (``auto``
    included: resolve it with the model first)."""
    try:
        return _REGISTRY[name]
    except (KeyError, TypeError):
        hint = (f"{AUTO!r} is resolved to one of them by the performance model first; "
                if name == AUTO else "")
        raise ValueError(f"unknown algo {name!r}; {hint}choose one of "
                         f"{', '.join(_REGISTRY)}") from None


def all_settings() -> dict[str, Setting]:
    """Every registered setting by name (the union over entries, in registration order)."""
    out: dict[str, Setting] = {}
    for entry in registered():
        for s in entry.settings:
            out.setdefault(s.name, s)
    return out


def assemble(name: str, build_rank: RankBuilder, direction: Direction, groups: Groups,
             causal: bool, variant: Any,
             keep: Callable[[list[Op]], bool] | None = None) -> Plan | None:
    """The plan ``name`` of ``build_rank``'s ops for every rank (and their role decisions,
    where the builder returns them). ``keep``: a test of each rank's ops, rank by rank; the
    first rank that fails it stops the assembly (``None``), so a rule that rejects a plan
    over a bound pays for one rank's ops, not all."""
    n = sum(len(g) for g in groups)
    plan = Plan(name, direction, n, groups, causal)
    for rank in range(n):
        built = build_rank(rank, groups, causal, direction, variant)
        ops, decisions = built if isinstance(built, tuple) else (built, None)
        if keep is not None and not keep(ops):
            return None
        plan.ops.append(ops)
        if decisions is not None:
            plan.decisions.append(decisions)
    return plan
