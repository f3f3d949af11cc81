"""The algorithm registry: the one list of CP attention algorithms, and the plan dispatcher.

Every place that names the algorithms derives its list from here: ``cp_attention``'s ``algo``
choices, the topology rule (which algorithms ignore the topology), Megatron's
``--cp-comm-type`` values, the ``args`` / ``plan`` CLIs and the SLURM scripts (which ask the
``args`` CLI). An entry is a name, a per-rank op builder, whether the algorithm uses the
topology groups, and a one-line description. ``auto`` is not an entry: it names a choice the
performance model makes among the entries (:func:`charm_megatron.model.choose_algo`).

Adding an algorithm: write a builder ``(rank, groups, causal, backward, order) -> list[Op]``
and :func:`register` an :class:`Algorithm` with it (the built-ins are registered at the bottom of
this module). The validator, executor, model, printouts and every list above then know it.

Plan layer: no torch.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from typing import Any

from charm_megatron.plan.builders import _CharmRank, _ring
from charm_megatron.plan.core import Op, Plan
from charm_megatron.plan.cost import Problem
from charm_megatron.plan.memory import BOUND, max_peak, peak
from charm_megatron.plan.roles import ROLE_MIXES, RoleChoice, RoleShape, check_roles

__all__ = [
    "ALGORITHM_NAMES",
    "AUTO",
    "AUTO_DESCRIPTION",
    "Algorithm",
    "CHOICES",
    "DIRECTIONS",
    "Groups",
    "NameView",
    "RankBuilder",
    "build_plan",
    "choices",
    "describe_choices",
    "get",
    "names",
    "register",
    "ROLE_MIXES",
    "unregister",
    "uses_topology",
]

Groups = tuple[tuple[int, ...], ...]
#: ``(rank, groups, causal, backward, order) -> rank's ops``; ``groups`` are CP-local ranks,
#: one flat group for an algorithm that does not use the topology; ``order`` is the CHARM+ pass
#: order (builders without pass orders ignore it).
RankBuilder = Callable[[int, Groups, bool, bool, str], list[Op]]

#: ``algo`` value that lets the performance model pick among the registered algorithms.
AUTO = "auto"
AUTO_DESCRIPTION = ("the fastest registered algorithm for this topology and shape, as predicted "
                    "by the performance model (the same choice on every rank)")
DIRECTIONS = ("forward", "backward")


@dataclass(frozen=True)
class Algorithm:
    """One registry entry."""

    name: str
    build_rank: RankBuilder
    uses_topology: bool
    description: str
    #: The builder takes ``roles=`` (a :class:`~charm_megatron.plan.roles.RoleChoice`) and
    #: returns ``(ops, decisions)``: its exchanges' roles are chosen by bytes or forced.
    uses_roles: bool = False


_REGISTRY: dict[str, Algorithm] = {}


def register(algo: Algorithm) -> Algorithm:
    """Add ``algo``; its name must be new and must not be ``auto``. Returns it."""
    if not isinstance(algo.name, str) or not algo.name.isidentifier():
        raise ValueError(f"algorithm name {algo.name!r} must be an identifier-like string")
    if algo.name == AUTO:
        raise ValueError(f"{AUTO!r} is reserved: it names the performance model's choice")
    if algo.name in _REGISTRY:
        raise ValueError(f"algorithm {algo.name!r} is already registered")
    _REGISTRY[algo.name] = algo
    return algo


def unregister(name: str) -> None:
    """Remove the entry ``name`` (for tests that register a temporary algorithm)."""
    del _REGISTRY[name]


def names() -> tuple[str, ...]:
    """The registered algorithms, in registration order (``auto`` excluded)."""
    return tuple(_REGISTRY)


def choices() -> tuple[str, ...]:
    """What an ``algo`` / ``--cp-comm-type`` served by charm-megatron accepts: the names and
    ``auto``."""
    return (*_REGISTRY, AUTO)


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


def uses_topology(name: str) -> bool:
    """Whether ``name`` runs on the topology's groups (``auto`` does: its choice may).

    Unknown names count as topology users, so a caller's own error about the name is what the
    user sees."""
    entry = _REGISTRY.get(name)
    return entry is None or entry.uses_topology


def describe_choices() -> str:
    """``name: description`` for every choice, ``auto`` last, joined by ``; `` (CLI help)."""
    parts = [f"{a.name}: {a.description}" for a in _REGISTRY.values()]
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


def build_plan(
    algo: str,
    direction: str,
    groups: Sequence[Sequence[int]],
    causal: bool,
    order: str = "split",
    roles: str = "paper",
    shape: RoleShape | None = None,
    split_visiting: bool = False,
    split_counterpart_q: bool = False,
) -> Plan:
    """The plan of the registered ``algo`` for ``direction`` (``forward`` or ``backward``) on CP
    ranks partitioned into ``groups`` (CP-local ranks); an algorithm that does not use the
    topology gets one flat group. ``order`` is the CHARM+ pass order (``split`` or ``joint``).

    ``roles`` is the role mix of RM+ / CHARM+ exchanges (:data:`ROLE_MIXES`; ``bytes`` needs
    ``shape``); algorithms without roles ignore both. Without a shape the default is the
    paper's Algorithm 1, so a shape-free plan is the paper's.

    ``split_visiting`` (CHARM+ pass-kv): visiting kv blocks that every tile needs whole cross
    in two row halves and their pass runs per half (docs/algorithm.md, *Visiting kv in two
    halves*); ``False`` sends them whole. ``split_counterpart_q`` (CHARM+ pass-q): the same
    for a counterpart's q block that every tile needs whole, its partial going home per half
    (*Counterpart q in two halves*). Builders without roles ignore both."""
    entry = get(algo)
    check_roles(roles)
    choice = RoleChoice(roles, shape)
    if direction not in DIRECTIONS:
        raise ValueError(f"direction must be 'forward' or 'backward', got {direction!r}")
    groups_t = tuple(tuple(g) for g in groups)
    n = sum(len(g) for g in groups_t)
    if not entry.uses_topology:
        groups_t = (tuple(range(n)),)
    # Passed only when on, so builders registered before the option need not know it.
    split = {name: True for name, on in (("split_visiting", split_visiting),
                                         ("split_counterpart_q", split_counterpart_q)) if on}
    plan = _assemble(entry, direction, groups_t, n, causal, order, choice, **split)
    if entry.uses_roles and shape is not None:
        plan = _within_memory_bound(plan, entry, groups_t, order, choice, shape, split)
    return plan


def _assemble(entry: Algorithm, direction: str, groups: Groups, n: int, causal: bool,
              order: str, choice: RoleChoice, lean: bool = False, early_returns: bool = False,
              **split: bool) -> Plan:
    plan = Plan(entry.name, direction, n, groups, causal, early_returns=early_returns,
                lean=lean)
    backward = direction == "backward"
    # The memory variants are passed only when on, like the splits.
    variant = {name: True for name, on in (("lean", lean), ("early_returns", early_returns))
               if on}
    for rank in range(n):
        if entry.uses_roles:
            ops, decisions = entry.build_rank(rank, groups, causal, backward, order,
                                              roles=choice, **variant, **split)
            plan.decisions.append(decisions)
        else:
            ops = entry.build_rank(rank, groups, causal, backward, order)
        plan.ops.append(ops)
    return plan


def _within_memory_bound(plan: Plan, entry: Algorithm, groups: Groups, order: str,
                         choice: RoleChoice, shape: RoleShape,
                         split: dict[str, bool] | None = None) -> Plan:
    """``plan`` if its peak memory (:mod:`plan.memory`, the executor's allocation rule) is
    within :data:`~charm_megatron.plan.memory.BOUND` x ring's; else the first variant that is,
    from the least to the most costly in time: q-pair returns completed before the next
    unit's tiles (``early_returns``), then lean (one unit's blocks at a time); else ``plan``.
    Peaks scale with the rows alike, so two rows per rank decide for every sequence length
    (and every rank decides alike)."""
    n = plan.n
    problem = Problem(1, 2 * n, shape.hq, shape.hkv, shape.d, shape.elem)
    ring = _assemble(_REGISTRY["ring"], plan.direction.value, ((*range(n),),), n, plan.causal,
                     order, choice)
    bound = BOUND * max_peak(ring, problem)
    if all(peak(ops, problem, n).bytes <= bound for ops in plan.ops):
        return plan
    backward = plan.direction.value == "backward"
    for flags in ({"early_returns": True}, {"lean": True}):
        variant = Plan(entry.name, plan.direction, n, groups, plan.causal, **flags)
        for rank in range(n):  # rank by rank: the first one over the bound settles it
            ops, decisions = entry.build_rank(rank, groups, plan.causal, backward, order,
                                              roles=choice, **flags, **(split or {}))
            if peak(ops, problem, n).bytes > bound:
                break
            variant.ops.append(ops)
            variant.decisions.append(decisions)
        else:
            return variant
    return plan


# ------------------------------------------------------------------------- built-in entries
def _ring_rank(rank: int, groups: Groups, causal: bool, backward: bool, order: str) -> list[Op]:
    return _ring(rank, sum(len(g) for g in groups), causal, backward)


def _charm_rank(rank: int, groups: Groups, causal: bool, backward: bool, order: str,
                roles: RoleChoice | None = None, lean: bool = False,
                early_returns: bool = False, split_visiting: bool = False,
                split_counterpart_q: bool = False) -> tuple[list[Op], list]:
    builder = _CharmRank(rank, groups, causal, backward, order, roles, lean, early_returns,
                         split_visiting, split_counterpart_q)
    return builder.build(), builder.decisions


register(Algorithm("ring", _ring_rank, uses_topology=False,
                   description="TransformerEngine's p2p ring over a flat group"))
register(Algorithm("rmplus", _charm_rank, uses_topology=False, uses_roles=True,
                   description="RM+ over a flat group (CHARM+ with one group)"))
register(Algorithm("charm", _charm_rank, uses_topology=True, uses_roles=True,
                   description="CHARM+: RM+ inside each topology group, queries across groups"))
