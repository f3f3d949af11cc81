"""Predictions per algorithm, the ring's CCR, and the ``auto`` choice."""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from functools import lru_cache

from charm_megatron.model.cluster import Cluster, default_cluster_for
from charm_megatron.model.sim import SimResult, simulate
from charm_megatron.model.timer import ClusterTimer
from charm_megatron.plan import registry
from charm_megatron.plan.charm import SPLIT_MARGIN  # noqa: F401  (docs cite it from here)
from charm_megatron.plan.core import Plan
from charm_megatron.plan.cost import Problem
from charm_megatron.plan.registry import ALGORITHM_NAMES as ALGOS
from charm_megatron.plan.roles import RoleShape, check_roles
from charm_megatron.plan.vocab import SplitMode

Groups = tuple[tuple[int, ...], ...]


def _groups(groups: Sequence[Sequence[int]]) -> Groups:
    return tuple(tuple(int(r) for r in g) for g in groups)


def _plans(algo: str, groups: Groups, causal: bool, roles: str, problem: Problem,
           timer: ClusterTimer | None = None, **splits: object) -> tuple[Plan, Plan]:
    """``algo``'s forward and backward plans as the model replays them: role mix ``roles``
    (for ``bytes``, the byte rule reads ``problem``'s shape), the CHARM+ splits ``splits``
    (a mode or a bool each; ``auto`` is timed with ``timer``, off without one). Memoised by
    :func:`~charm_megatron.plan.registry.plans`: plans depend on the topology, mask, role mix
    and settings, not on the sequence length."""
    roles, shape = _role_key(roles, problem)
    return registry.plans(algo, groups, causal, shape=shape, timer=timer, roles=roles, **splits)


def _plan(algo: str, direction: str, groups: Groups, causal: bool, roles: str = "paper",
          shape: RoleShape | None = None, split_visiting: bool = False,
          split_counterpart_q: bool = False) -> Plan:
    """One direction of ``algo``'s plan (for callers that hold a shape rather than a problem)."""
    fwd, bwd = registry.plans(algo, groups, causal, shape=shape, roles=roles,
                              split_visiting=split_visiting,
                              split_counterpart_q=split_counterpart_q)
    return fwd if direction == "forward" else bwd


def role_shape(problem: Problem) -> RoleShape:
    """What the role rule reads of ``problem``."""
    return RoleShape(problem.hq, problem.hkv, problem.d, problem.elem)


def _role_key(roles: str, problem: Problem) -> tuple[str, RoleShape | None]:
    check_roles(roles)
    return roles, (role_shape(problem) if roles == "bytes" else None)


@dataclass(frozen=True)
class Prediction:
    """Predicted forward and backward of one algorithm."""

    algo: str
    forward: SimResult
    backward: SimResult

    @property
    def total_s(self) -> float:
        """Forward plus backward (they do not overlap: backward needs the final output)."""
        return self.forward.time_s + self.backward.time_s


def predict(algo: str, groups: Sequence[Sequence[int]], problem: Problem, cluster: Cluster,
            causal: bool, roles: str = "paper", split_visiting: bool = False,
            split_counterpart_q: bool = False) -> Prediction:
    """Simulate ``algo``'s forward and backward plans on ``cluster`` with hardware ``groups``
    (``roles``: the role mix of rmplus / charm, :data:`charm_megatron.plan.roles.ROLE_MIXES`;
    ``bytes`` is what ``cp_attention`` runs by default; ``split_visiting``,
    ``split_counterpart_q``: as :func:`~charm_megatron.plan.registry.build_plan`'s)."""
    g = _groups(groups)
    fwd, bwd = _plans(algo, g, causal, roles, problem, split_visiting=split_visiting,
                      split_counterpart_q=split_counterpart_q)
    return Prediction(algo, simulate(fwd, problem, cluster, g), simulate(bwd, problem, cluster, g))


def predict_all(groups: Sequence[Sequence[int]], problem: Problem, cluster: Cluster,
                causal: bool, algos: Iterable[str] = ALGOS,
                roles: str = "paper", split_visiting: bool = False,
                split_counterpart_q: bool = False) -> dict[str, Prediction]:
    """:func:`predict` for each of ``algos`` (default ring, rmplus, charm), in that order."""
    return {a: predict(a, groups, problem, cluster, causal, roles, split_visiting,
                       split_counterpart_q) for a in algos}


@dataclass(frozen=True)
class CCR:
    """The paper's computation-to-communication ratio (its Eq. 7) of the ring: its compute
    time with free communication over its communication time with free compute."""

    compute_s: float
    comm_s: float

    @property
    def ratio(self) -> float:
        return self.compute_s / self.comm_s if self.comm_s else float("inf")


def ring_ccr(groups: Sequence[Sequence[int]], problem: Problem, cluster: Cluster,
             causal: bool, direction: str = "forward") -> CCR:
    """The ring's CCR for ``direction`` (``forward`` or ``backward``) on this cluster."""
    g = _groups(groups)
    plan = _plan("ring", direction, g, causal)
    comp = simulate(plan, problem, cluster, g, comm=False).time_s
    comm = simulate(plan, problem, cluster, g, compute=False).time_s
    return CCR(comp, comm)


#: How a split of CHARM+'s blocks is set (``CPOptions.split_visiting`` and
#: ``split_counterpart_q``): ``auto`` is the model's per-direction pick.
SPLIT_MODES = tuple(m.value for m in SplitMode)


def _split_modes(split_visiting: object, split_counterpart_q: object) -> dict[str, SplitMode]:
    """The two split settings, checked (``ValueError`` naming ``choose_algo`` otherwise)."""
    settings = registry.all_settings()
    given = {"split_visiting": split_visiting, "split_counterpart_q": split_counterpart_q}
    return {name: settings[name].parse(mode, "choose_algo") for name, mode in given.items()}


def choose_algo(groups: Sequence[Sequence[int]], problem: Problem,
                cluster: Cluster | None = None, *, causal: bool = True,
                algos: Sequence[str] = ALGOS, roles: str = "paper",
                split_visiting: str = "off", split_counterpart_q: str = "off") -> str:
    """The algorithm of ``algos`` with the smallest predicted forward + backward time
    (rmplus and charm with the role mix ``roles``: pass the one that will run; charm with the
    splits it will run, :func:`charm_splits` of ``split_visiting`` / ``split_counterpart_q``,
    so that a split which makes charm the fastest is weighed before the pick, not after).

    A pure function of its arguments, so every rank that calls it with the same topology,
    problem and cluster gets the same answer without communicating. Ties go to the earlier
    algorithm of ``algos`` (ring, rmplus, charm). ``cluster=None`` means
    :func:`default_cluster_for` the topology (a profile: pass
    :func:`~charm_megatron.model.auto.auto_cluster` of it). ``causal`` defaults to True (GPT
    training).
    """
    if not algos:
        raise ValueError("choose_algo needs at least one algorithm")
    splits = _split_modes(split_visiting, split_counterpart_q)
    g = _groups(groups)
    timer = ClusterTimer(cluster if cluster is not None else default_cluster_for(g), problem, g)
    # Every candidate with the same settings: the splits time plans only where there is a
    # cross round to split (charm), the others' plans are whole.
    times = [(sum(map(timer.seconds, _plans(a, g, causal, roles, problem, timer, **splits))),
              i, a) for i, a in enumerate(algos)]
    return min(times)[2]


def charm_splits(groups: Sequence[Sequence[int]], problem: Problem, cluster: Cluster | None,
                 *, causal: bool = True, roles: str = "paper", split_visiting: str = "off",
                 split_counterpart_q: str = "off") -> tuple[tuple[bool, bool], tuple[bool, bool]]:
    """The ``(split visiting kv, split counterpart q)`` CHARM+ runs with, forward and backward,
    under these modes (:data:`SPLIT_MODES`): ``off`` / ``on`` as given, ``auto`` the model's
    pick on ``cluster`` (:func:`choose_split_visiting`, :func:`choose_split_counterpart_q`;
    the rule is the CHARM+ entry's, :func:`charm_megatron.plan.charm.charm_variants`). One
    group has no cross round to split: never."""
    splits = _split_modes(split_visiting, split_counterpart_q)
    g = _groups(groups)
    if len(g) < 2:  # nothing to time (and no cluster to default to for no groups)
        return (False, False), (False, False)
    timer = ClusterTimer(cluster if cluster is not None else default_cluster_for(g), problem, g)
    roles, shape = _role_key(roles, problem)
    fwd, bwd = registry.variants("charm", g, causal, shape=shape, timer=timer, roles=roles,
                                 **splits)
    return ((fwd.split_visiting, fwd.split_counterpart_q),
            (bwd.split_visiting, bwd.split_counterpart_q))


def choose_split_visiting(groups: Sequence[Sequence[int]], problem: Problem,
                          cluster: Cluster | None = None, *, causal: bool = True,
                          roles: str = "paper") -> tuple[bool, bool]:
    """Whether CHARM+ should send visiting kv blocks in two row halves, for the forward and
    for the backward: where the split changes the plan, the one of the two plans predicted
    faster on ``cluster`` by more than :data:`~charm_megatron.plan.charm.SPLIT_MARGIN`
    (``None``: :func:`default_cluster_for` the topology). Memoised; a pure function of its
    arguments, so every rank decides alike without communicating.

    The split hides the visiting blocks' slow trip where one link carries many of them (one
    NIC per node) and costs more, smaller messages and a merge per split tile elsewhere
    (docs/algorithm.md, *Visiting kv in two halves*)."""
    fwd, bwd = charm_splits(groups, problem, cluster, causal=causal, roles=roles,
                            split_visiting="auto")
    return fwd[0], bwd[0]


def choose_split_counterpart_q(groups: Sequence[Sequence[int]], problem: Problem,
                               cluster: Cluster | None = None, *, causal: bool = True,
                               roles: str = "paper") -> tuple[bool, bool]:
    """:func:`choose_split_visiting` for the other side of the exchange: whether CHARM+
    pass-q should send a counterpart's q block that every tile needs whole in two row halves
    (its partial going home per half), forward and backward, by the same rule: where it
    changes the plan, the split where it is predicted more than
    :data:`~charm_megatron.plan.charm.SPLIT_MARGIN` faster on ``cluster``. It shortens
    pass-q's serial chain (q across, the group's rounds, the partial back) where that chain is
    the critical path (docs/algorithm.md, *Counterpart q in two halves*)."""
    fwd, bwd = charm_splits(groups, problem, cluster, causal=causal, roles=roles,
                            split_counterpart_q="auto")
    return fwd[1], bwd[1]


@lru_cache(maxsize=256)
def _choose_cached(groups: Groups, problem: Problem, cluster: Cluster | None, causal: bool,
                   algos: tuple[str, ...], roles: str = "paper",
                   splits: tuple[str, str] = ("off", "off")) -> str:
    return choose_algo(groups, problem, cluster, causal=causal, algos=algos, roles=roles,
                       split_visiting=splits[0], split_counterpart_q=splits[1])


def choose_algo_cached(groups: Sequence[Sequence[int]], problem: Problem,
                       cluster: Cluster | None = None, *, causal: bool = True,
                       algos: Sequence[str] = ALGOS, roles: str = "paper",
                       split_visiting: str = "off", split_counterpart_q: str = "off") -> str:
    """:func:`choose_algo` memoised on its (hashable) arguments: cheap to call every step.
    ``cluster=None`` is the generic one; :func:`~charm_megatron.model.auto.auto_cluster`
    re-reads a recalibrated profile file, so the cache follows it."""
    return _choose_cached(_groups(groups), problem, cluster, causal, tuple(algos), roles,
                          (split_visiting, split_counterpart_q))
