"""Predictions per algorithm, the ring's CCR, and the ``auto`` choice."""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from functools import lru_cache

from charm_megatron.model.cluster import Cluster, default_cluster_for
from charm_megatron.model.sim import SimResult, simulate
from charm_megatron.model.timer import ClusterTimer
from charm_megatron.plan import registry
from charm_megatron.plan.core import Plan
from charm_megatron.plan.cost import Problem
from charm_megatron.plan.registry import ALGORITHM_NAMES as ALGOS
from charm_megatron.plan.roles import RoleShape

Groups = tuple[tuple[int, ...], ...]


def _groups(groups: Sequence[Sequence[int]]) -> Groups:
    return tuple(tuple(int(r) for r in g) for g in groups)


def _plans(algo: str, groups: Groups, problem: Problem, causal: bool,
           timer: ClusterTimer | None, settings: dict[str, object]) -> tuple[Plan, Plan]:
    """``algo``'s forward and backward plans as a call runs them: its settings by name (the
    others at their defaults), the rules reading ``problem``'s shape (the byte rule, the memory
    bound), a setting left to the model (``auto``) timed with ``timer`` (off without one).
    Memoised by :func:`~charm_megatron.plan.registry.plans`: plans depend on the topology,
    mask, shape and settings, and under a sliding window on the tiles it needs (which the
    sequence length decides), not otherwise on the sequence length."""
    n = sum(len(g) for g in groups)
    return registry.plans(algo, groups, causal, shape=role_shape(problem), timer=timer,
                          tiles=problem.tiles(n, causal), **settings)


def _plan(algo: str, direction: str, groups: Groups, causal: bool,
          problem: Problem | None = None) -> Plan:
    """One direction of ``algo``'s shape-free plan at its default settings (the ring's CCR,
    calibration); with ``problem``, under its window's tiles where it has one."""
    tiles = None if problem is None else problem.tiles(sum(len(g) for g in groups), causal)
    fwd, bwd = registry.plans(algo, groups, causal, tiles=tiles)
    return fwd if direction == "forward" else bwd


def call_traits(groups: Groups, problem: Problem) -> registry.CallTraits:
    """What the entries' checks read of ``problem`` on ``groups``."""
    return registry.CallTraits(groups, problem.hq, problem.hkv,
                               windowed=problem.window is not None)


def role_shape(problem: Problem) -> RoleShape:
    """What the plan rules read of ``problem`` (heads, kv heads, head dim, element bytes)."""
    return RoleShape(problem.hq, problem.hkv, problem.d, problem.elem, problem.dv,
                     problem.wide_partials)


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
            causal: bool, *, tune: bool = False, compute_only: bool = False,
            **settings: object) -> Prediction:
    """Simulate ``algo``'s forward and backward plans on ``cluster`` with hardware ``groups``.

    ``settings``: the algorithm's settings by name (:func:`~charm_megatron.plan.registry.
    all_settings`; e.g. ``roles="paper"``, ``split_visiting=True``), the others at their
    defaults; ``tune``: a setting left to the model (``auto``) is decided on ``cluster``
    (``False``: off, as a call without a model profile runs it); ``compute_only``: messages
    are free (the plan's compute alone, ``CPOptions(ablation="compute_only")``'s part)."""
    g = _groups(groups)
    registry.check_call(algo, call_traits(g, problem))  # a2a: heads that divide, ...
    timer = ClusterTimer(cluster, problem, g)
    fwd, bwd = _plans(algo, g, problem, causal, timer if tune else None, settings)
    if compute_only:
        return Prediction(algo, simulate(fwd, problem, cluster, g, comm=False),
                          simulate(bwd, problem, cluster, g, comm=False))
    return Prediction(algo, timer.result(fwd), timer.result(bwd))


def predict_all(groups: Sequence[Sequence[int]], problem: Problem, cluster: Cluster,
                causal: bool, algos: Iterable[str] = ALGOS, *, tune: bool = False,
                **settings: object) -> dict[str, Prediction]:
    """:func:`predict` for each of ``algos`` (default: every registered one) that can run the
    problem (its entry's check: ``a2a`` needs heads divisible by the CP size), in that
    order; each algorithm reads the settings it owns."""
    traits = call_traits(_groups(groups), problem)
    return {a: predict(a, groups, problem, cluster, causal, tune=tune, **settings)
            for a in algos if not registry.refuses(a, traits)}


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
    plan = _plan("ring", direction, g, causal, problem)
    comp = simulate(plan, problem, cluster, g, comm=False).time_s
    comm = simulate(plan, problem, cluster, g, compute=False).time_s
    return CCR(comp, comm)


def variants(algo: str, groups: Sequence[Sequence[int]], problem: Problem,
             cluster: Cluster | None = None, *, causal: bool = True,
             **settings: object) -> tuple[object, object]:
    """The forward and backward variant ``algo``'s entry runs under ``settings`` when a call
    predicts with ``cluster`` (``None``: :func:`default_cluster_for` the topology): e.g.
    CHARM+'s :class:`~charm_megatron.algorithms.charm.entry.CharmVariant`, whose ``auto`` splits are the
    split plans predicted faster by more than ``SPLIT_MARGIN``. Memoised by the registry."""
    g = _groups(groups)
    cl = cluster if cluster is not None else default_cluster_for(g)
    return registry.variants(algo, g, causal, shape=role_shape(problem),
                             timer=ClusterTimer(cl, problem, g),
                             tiles=problem.tiles(sum(len(x) for x in g), causal), **settings)


def rank_algos(groups: Sequence[Sequence[int]], problem: Problem,
               cluster: Cluster | None = None, *, causal: bool = True,
               algos: Sequence[str] = ALGOS, tune: bool = True,
               **settings: object) -> tuple[tuple[float, str], ...]:
    """Every algorithm of ``algos`` that can run the problem with its predicted forward +
    backward seconds, fastest first (ties in the order of ``algos``): what
    :func:`choose_algo` picks from, and what a measured ``auto`` (``CPOptions.auto_tune``,
    ops/auto_tune.py) shortlists. Arguments as :func:`choose_algo`'s."""
    g = _groups(groups)
    algos = [a for a in algos if not registry.refuses(a, call_traits(g, problem))]
    if not algos:
        raise ValueError("choose_algo needs at least one algorithm that can run the problem")
    timer = ClusterTimer(cluster if cluster is not None else default_cluster_for(g), problem, g)
    times = sorted((sum(map(timer.seconds, _plans(a, g, problem, causal, timer if tune else None,
                                                  settings))), i, a)
                   for i, a in enumerate(algos))
    return tuple((t, a) for t, _, a in times)


def choose_algo(groups: Sequence[Sequence[int]], problem: Problem,
                cluster: Cluster | None = None, *, causal: bool = True,
                algos: Sequence[str] = ALGOS, tune: bool = True,
                **settings: object) -> str:
    """The algorithm of ``algos`` with the smallest predicted forward + backward time, each
    weighed as it would run: with ``settings`` (by name, the others at their defaults) and,
    where ``tune``, the variants its entry picks with the model on this cluster (CHARM+'s
    ``auto`` splits), so that a variant which makes an algorithm the fastest counts before
    the pick, not after. ``tune=False``: settings left to the model are off (a call without a
    model profile).

    A pure function of its arguments, so every rank that calls it with the same topology,
    problem and cluster gets the same answer without communicating. Ties go to the earlier
    algorithm of ``algos``. ``cluster=None`` means :func:`default_cluster_for` the topology (a
    profile: pass :func:`~charm_megatron.model.auto.auto_cluster` of it). ``causal`` defaults
    to True (GPT training). An algorithm that refuses the problem (``a2a`` where the heads do
    not divide by the CP size; the entry's ``check``) is never chosen.
    """
    return rank_algos(groups, problem, cluster, causal=causal, algos=algos, tune=tune,
                      **settings)[0][1]


@lru_cache(maxsize=256)
def _rank_cached(groups: Groups, problem: Problem, cluster: Cluster | None, causal: bool,
                 algos: tuple[str, ...], tune: bool, values: registry.Values
                 ) -> tuple[tuple[float, str], ...]:
    return rank_algos(groups, problem, cluster, causal=causal, algos=algos, tune=tune, **values)


def rank_algos_cached(groups: Sequence[Sequence[int]], problem: Problem,
                      cluster: Cluster | None = None, *, causal: bool = True,
                      algos: Sequence[str] = ALGOS, tune: bool = True,
                      **settings: object) -> tuple[tuple[float, str], ...]:
    """:func:`rank_algos` memoised on its (hashable) arguments."""
    return _rank_cached(_groups(groups), problem, cluster, causal, tuple(algos), tune,
                        registry.settings_values(**settings))


def choose_algo_cached(groups: Sequence[Sequence[int]], problem: Problem,
                       cluster: Cluster | None = None, *, causal: bool = True,
                       algos: Sequence[str] = ALGOS, tune: bool = True,
                       **settings: object) -> str:
    """:func:`choose_algo` memoised on its (hashable) arguments: cheap to call every step.
    ``cluster=None`` is the generic one; :func:`~charm_megatron.model.auto.auto_cluster`
    re-reads a recalibrated profile file, so the cache follows it."""
    return rank_algos_cached(groups, problem, cluster, causal=causal, algos=algos, tune=tune,
                             **settings)[0][1]
