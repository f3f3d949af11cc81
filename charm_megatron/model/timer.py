"""The performance model as the plan layer's clock (:class:`~charm_megatron.plan.entries.
PlanTimer`): what a variant rule times plans with, e.g. CHARM+'s ``auto`` splits."""

from __future__ import annotations

from dataclasses import dataclass

from charm_megatron.model.cluster import Cluster
from charm_megatron.model.sim import SimResult, simulate
from charm_megatron.plan.core import Plan
from charm_megatron.plan.cost import Problem

__all__ = ["ClusterTimer"]


@dataclass(frozen=True)
class ClusterTimer:
    """Seconds of a plan for ``problem`` on ``cluster`` with hardware ``groups`` (the model's
    simulation). Frozen and hashable: the plan layer keys its caches on it."""

    cluster: Cluster
    problem: Problem
    groups: tuple[tuple[int, ...], ...]

    def result(self, plan: Plan) -> SimResult:
        return simulate(plan, self.problem, self.cluster, self.groups)

    def seconds(self, plan: Plan) -> float:
        return self.result(plan).time_s
