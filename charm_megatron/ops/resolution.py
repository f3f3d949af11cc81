"""What an agreed request runs: its topology, its algorithm and the algorithm's validated plans.

Every function here is a pure function of the request the ranks agreed on (and of the probe's
all-gathered result), so every rank resolves a call alike without communicating.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

from charm_megatron.ops.request import CallRequest
from charm_megatron.plan.core import Plan
from charm_megatron.plan.cost import Problem
from charm_megatron.plan.registry import build_plan, uses_topology
from charm_megatron.plan.roles import RoleShape
from charm_megatron.plan.validate import validate

Groups = tuple[tuple[int, ...], ...]


@dataclass(frozen=True)
class Resolved:
    """The algorithm a call runs, its groups (one flat group unless it uses the topology) and
    its validated forward and backward plans."""

    algo: str
    groups: Groups
    plans: tuple[Plan, Plan]


def model_cluster(opts):
    """The cluster of ``opts.model_profile`` (``None``: generic); ValueError names the option."""
    from charm_megatron.model import auto_cluster

    return auto_cluster(opts.model_profile,
                        where="model_profile (CPOptions.model_profile / CHARM_MODEL_PROFILE)")


def problem(request: CallRequest, cp_size: int) -> Problem:
    """The performance model's problem of a call (sizes of one rank's shard)."""
    s, b, hq, hkv, d = request.layout.heads(_Shape(request.q.shape), _Shape(request.k.shape))
    return Problem(b, s * cp_size, hq, hkv, d, request.q.element_size)


def role_shape(request: CallRequest) -> RoleShape:
    """What the byte rule reads of a call."""
    _, _, hq, hkv, d = request.layout.heads(_Shape(request.q.shape), _Shape(request.k.shape))
    return RoleShape(hq, hkv, d, request.q.element_size)


class _Shape:
    """A stand-in with the ``shape`` of a described tensor (the layouts read shapes only)."""

    def __init__(self, shape: tuple[int, ...]) -> None:
        self.shape = shape


def resolve_call(request: CallRequest, group, cp_size: int, cluster) -> Resolved:
    """The topology (the options' default rule), the algorithm (``auto``: the model's pick on
    ``cluster``, weighing each candidate with the variants it would run) and its plans."""
    from charm_megatron.topology import resolve_topology

    opts = request.options
    spec = opts.topology_for(request.algo, request.topology)
    flat = (tuple(range(cp_size)),)
    topo_groups = flat
    if spec is not None:
        topo = resolve_topology(spec[0], group, cp_size, source=spec[1])
        topo_groups = tuple(tuple(g) for g in topo.groups)
    algo = request.algo
    prob, shape = problem(request, cp_size), role_shape(request)
    if algo == "auto":
        from charm_megatron.model import choose_algo_cached

        visiting, counterpart_q = _split_modes(request, cluster)
        algo = choose_algo_cached(topo_groups, prob, cluster, causal=request.causal,
                                  roles=request.setting("roles"), split_visiting=visiting,
                                  split_counterpart_q=counterpart_q)
    groups = topo_groups if uses_topology(algo) else flat
    split, split_q = _splits(request, algo, groups, prob, cluster)
    plans = _validated(algo, groups, request.causal, request.setting("pass_order"),
                       request.setting("roles"), shape, split, split_q)
    return Resolved(algo, groups, plans)


def _split_modes(request: CallRequest, cluster) -> tuple[str, str]:
    profiled = request.options.model_profile is not None and cluster is not None

    def mode(m: str) -> str:
        return "off" if m == "auto" and not profiled else m

    return mode(request.setting("split_visiting")), mode(request.setting("split_counterpart_q"))


def _splits(request: CallRequest, algo: str, groups: Groups, prob: Problem, cluster):
    if algo != "charm":
        return (False, False), (False, False)
    from charm_megatron.model import charm_splits

    visiting, counterpart_q = _split_modes(request, cluster)
    forward, backward = charm_splits(groups, prob, cluster, causal=request.causal,
                                     roles=request.setting("roles"), split_visiting=visiting,
                                     split_counterpart_q=counterpart_q)
    return (forward[0], backward[0]), (forward[1], backward[1])


@functools.lru_cache(maxsize=256)
def _validated(algo: str, groups: Groups, causal: bool, order: str, roles: str,
               shape: RoleShape, split: tuple[bool, bool],
               split_q: tuple[bool, bool]) -> tuple[Plan, Plan]:
    """Forward and backward plans, validated once per key: every rank derives the same."""
    fwd = build_plan(algo, "forward", groups, causal, order, roles, shape,
                     split_visiting=split[0], split_counterpart_q=split_q[0])
    bwd = build_plan(algo, "backward", groups, causal, order, roles, shape,
                     split_visiting=split[1], split_counterpart_q=split_q[1])
    validate(fwd)
    validate(bwd)
    return fwd, bwd
