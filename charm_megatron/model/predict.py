"""Predictions per algorithm, the ring's CCR, and the ``auto`` choice."""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from functools import lru_cache

from charm_megatron.model.cluster import Cluster, default_cluster_for
from charm_megatron.model.sim import SimResult, simulate
from charm_megatron.plan.core import Plan
from charm_megatron.plan.cost import Problem
from charm_megatron.plan.registry import ALGORITHM_NAMES as ALGOS
from charm_megatron.plan.registry import build_plan
from charm_megatron.plan.roles import RoleShape, check_roles

Groups = tuple[tuple[int, ...], ...]


def _groups(groups: Sequence[Sequence[int]]) -> Groups:
    return tuple(tuple(int(r) for r in g) for g in groups)


@lru_cache(maxsize=256)
def _plan(algo: str, direction: str, groups: Groups, causal: bool, roles: str = "paper",
          shape: RoleShape | None = None, split_visiting: bool = False,
          split_counterpart_q: bool = False) -> Plan:
    # Plans depend on the topology, mask, role mix and (for roles="bytes") the head shape,
    # not on the sequence length: build each once.
    return build_plan(algo, direction, groups, causal, roles=roles, shape=shape,
                      split_visiting=split_visiting, split_counterpart_q=split_counterpart_q)


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
    key = _role_key(roles, problem)
    splits = (split_visiting, split_counterpart_q)
    fwd = simulate(_plan(algo, "forward", g, causal, *key, *splits), problem, cluster, g)
    bwd = simulate(_plan(algo, "backward", g, causal, *key, *splits), problem, cluster, g)
    return Prediction(algo, fwd, bwd)


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
SPLIT_MODES = ("auto", "off", "on")


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
    g = _groups(groups)
    cl = cluster if cluster is not None else default_cluster_for(g)
    # Checked for every call, simulated only where charm is a candidate.
    splits = charm_splits(g if "charm" in algos else (), problem, cl, causal=causal,
                          roles=roles, split_visiting=split_visiting,
                          split_counterpart_q=split_counterpart_q)
    times = [(_predict_as_run(a, g, problem, cl, causal, roles, splits), i, a)
             for i, a in enumerate(algos)]
    return min(times)[2]


def charm_splits(groups: Sequence[Sequence[int]], problem: Problem, cluster: Cluster | None,
                 *, causal: bool = True, roles: str = "paper", split_visiting: str = "off",
                 split_counterpart_q: str = "off") -> tuple[tuple[bool, bool], tuple[bool, bool]]:
    """The ``(split visiting kv, split counterpart q)`` CHARM+ runs with, forward and backward,
    under these modes (:data:`SPLIT_MODES`): ``off`` / ``on`` as given, ``auto`` the model's
    pick on ``cluster`` (:func:`choose_split_visiting`, :func:`choose_split_counterpart_q`).
    One group has no cross round to split: never."""
    for name, mode in (("split_visiting", split_visiting),
                       ("split_counterpart_q", split_counterpart_q)):
        if mode not in SPLIT_MODES:
            raise ValueError(f"choose_algo: {name}={mode!r}; choose one of "
                             f"{', '.join(SPLIT_MODES)}")
    g = _groups(groups)

    def per_direction(mode: str, which: str) -> tuple[bool, bool]:
        if len(g) < 2 or mode == "off":
            return False, False
        if mode == "on":
            return True, True
        return _split_cached(g, problem, cluster, causal, roles, which)

    visiting = per_direction(split_visiting, "visiting")
    counterpart_q = per_direction(split_counterpart_q, "counterpart_q")
    return (visiting[0], counterpart_q[0]), (visiting[1], counterpart_q[1])


def _predict_as_run(algo: str, groups: Groups, problem: Problem, cluster: Cluster, causal: bool,
                    roles: str, splits: tuple[tuple[bool, bool], tuple[bool, bool]]) -> float:
    """Predicted forward + backward seconds of ``algo`` (:func:`predict`'s sum), charm with
    ``splits`` per direction, the others whole."""
    if algo != "charm":
        splits = ((False, False), (False, False))
    key = _role_key(roles, problem)
    return sum(simulate(_plan(algo, direction, groups, causal, *key, *split), problem, cluster,
                        groups).time_s
               for direction, split in zip(("forward", "backward"), splits))


def choose_split_visiting(groups: Sequence[Sequence[int]], problem: Problem,
                          cluster: Cluster | None = None, *, causal: bool = True,
                          roles: str = "paper") -> tuple[bool, bool]:
    """Whether CHARM+ should send visiting kv blocks in two row halves, for the forward and
    for the backward: where the split changes the plan, the one of the two plans predicted
    faster on ``cluster`` by more than :data:`SPLIT_MARGIN` (``None``:
    :func:`default_cluster_for` the topology). Memoised; a pure function of its arguments, so
    every rank decides alike without communicating.

    The split hides the visiting blocks' slow trip where one link carries many of them (one
    NIC per node) and costs more, smaller messages and a merge per split tile elsewhere
    (docs/algorithm.md, *Visiting kv in two halves*)."""
    return _split_cached(_groups(groups), problem, cluster, causal, roles, "visiting")


def choose_split_counterpart_q(groups: Sequence[Sequence[int]], problem: Problem,
                               cluster: Cluster | None = None, *, causal: bool = True,
                               roles: str = "paper") -> tuple[bool, bool]:
    """:func:`choose_split_visiting` for the other side of the exchange: whether CHARM+
    pass-q should send a counterpart's q block that every tile needs whole in two row halves
    (its partial going home per half), forward and backward, by the same rule: where it
    changes the plan, the split where it is predicted more than :data:`SPLIT_MARGIN` faster
    on ``cluster``. It shortens pass-q's serial chain (q across, the group's rounds, the
    partial back) where that chain is the critical path (docs/algorithm.md, *Counterpart q in
    two halves*)."""
    return _split_cached(_groups(groups), problem, cluster, causal, roles, "counterpart_q")


#: A split plan is chosen only where it is predicted at least this much faster than whole
#: blocks. The model's errors against measurement are larger than a few per cent
#: (docs/model.md), and a split adds messages and merges; a near-tie keeps the simpler plan.
SPLIT_MARGIN = 0.05


@lru_cache(maxsize=256)
def _split_cached(groups: Groups, problem: Problem, cluster: Cluster | None, causal: bool,
                  roles: str, which: str) -> tuple[bool, bool]:
    """Per direction, whether the ``which`` split (``visiting``: pass-kv's visiting kv;
    ``counterpart_q``: pass-q's counterpart q) is predicted faster than whole blocks (each
    judged with the other split off: a cross round is pass-kv or pass-q, so they rarely
    touch the same plan), by more than :data:`SPLIT_MARGIN`."""
    cl = cluster if cluster is not None else default_cluster_for(groups)
    key = _role_key(roles, problem)
    on = (True, False) if which == "visiting" else (False, True)
    picks = []
    for direction in ("forward", "backward"):
        whole = _plan("charm", direction, groups, causal, *key, False, False)
        split = _plan("charm", direction, groups, causal, *key, *on)
        if split.ops == whole.ops:
            picks.append(False)
            continue
        t_whole = simulate(whole, problem, cl, groups).time_s
        t_split = simulate(split, problem, cl, groups).time_s
        picks.append(t_split < (1.0 - SPLIT_MARGIN) * t_whole)
    return picks[0], picks[1]


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
