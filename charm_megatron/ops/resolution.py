"""What an agreed request runs: its topology, its algorithm and the algorithm's validated plans.

Every function here is a pure function of the request the ranks agreed on (and of the probe's
all-gathered result), so every rank resolves a call alike without communicating. Nothing here
names an algorithm or its settings: the registry entries own them (plan/registry.py), and
``auto`` is the performance model's pick among the entries, each weighed with the variants it
would run, or with ``auto_tune`` the pick measured earlier for the same shape (a lookup; the
measurement itself is ops/auto_tune.py's, made between the agreement and the plan).
"""

from __future__ import annotations

from dataclasses import dataclass

from charm_megatron.ops import auto_tune
from charm_megatron.ops.request import CallRequest, cluster_digest
from charm_megatron.plan import registry
from charm_megatron.plan.core import Plan
from charm_megatron.plan.cost import Problem
from charm_megatron.plan.roles import RoleShape
from charm_megatron.plan.tile_rule import TileRule, WindowGeometry, scaled, window_rule
from charm_megatron.plan.validate import validate

Groups = tuple[tuple[int, ...], ...]


@dataclass(frozen=True)
class Resolved:
    """The algorithm a call runs, its groups (one flat group unless it uses the topology),
    the variant its entry runs in each direction, and its validated forward and backward
    plans."""

    algo: str
    groups: Groups
    variants: tuple[object, object]
    plans: tuple[Plan, Plan]
    tune: auto_tune.Pending | None = None  # auto_tune: measure this shortlist first


def model_cluster(opts):
    """The cluster of ``opts.model_profile`` (``None``: none given); ValueError names the
    option."""
    from charm_megatron.model import auto_cluster

    return auto_cluster(opts.model_profile,
                        where="model_profile (CPOptions.model_profile / CHARM_MODEL_PROFILE)")


class _Shape:
    """A stand-in with the ``shape`` of a described tensor (the layouts read shapes only)."""

    def __init__(self, shape: tuple[int, ...]) -> None:
        self.shape = shape


def _heads(request: CallRequest) -> tuple[int, int, int, int, int]:
    return request.layout.heads(_Shape(request.q.shape), _Shape(request.k.shape))


def problem(request: CallRequest, cp_size: int) -> Problem:
    """The performance model's problem of a call (sizes of one rank's shard). A backend that
    times a larger virtual problem than the tensors it is given (the emulator's timed device,
    ``problem_scale``: batch and rows factors) makes that the call's problem, so ``auto`` and
    the variant rules predict for the problem the device times."""
    s, b, hq, hkv, d = _heads(request)
    window = _planned_window(request)
    scale = getattr(request.options.backend, "problem_scale", None)
    if scale is not None:
        s, b = s * scale.rows, b * scale.batch
        if window is not None:  # the window spans as many virtual rows as the rows do
            window = scaled(window, scale.rows)
    return Problem(b, s * cp_size, hq, hkv, d, request.q.element_size, _own_v_dim(request, d),
                   window, request.options.wide_partials)


def role_shape(request: CallRequest) -> RoleShape:
    """What the plan rules (the byte rule, the memory bound) read of a call."""
    _, _, hq, hkv, d = _heads(request)
    return RoleShape(hq, hkv, d, request.q.element_size, _own_v_dim(request, d),
                     request.options.wide_partials)


def _own_v_dim(request: CallRequest, d: int) -> int:
    """The call's v head dim where it differs from ``d`` (MLA), else 0 (the models' "as d")."""
    dv = request.v.shape[-1]
    return 0 if dv == d else dv


def resolve_call(request: CallRequest, group, cp_size: int, cluster) -> Resolved:
    """The topology (the options' default rule), the algorithm (``auto``: the model's pick on
    ``cluster``, or on the generic cluster without a profile) and its plans, from one visit to
    the registry (plan/registry.resolve). A setting left to the model (``auto``, e.g. CHARM+'s
    splits) is the model's pick only where a profile is given (``cluster``); without one it
    is off, so no call guesses from the generic cluster."""
    prob = problem(request, cp_size)

    def hardware() -> Groups:
        from charm_megatron.topology import resolve_topology

        spec = request.options.topology_spec(request.topology)
        topo = resolve_topology(spec[0], group, cp_size, source=spec[1])
        return tuple(tuple(g) for g in topo.groups)

    timer_for = None
    if cluster is not None:
        from charm_megatron.model import ClusterTimer

        def timer_for(groups: Groups) -> ClusterTimer:
            return ClusterTimer(cluster, prob, groups)  # the hardware's groups

    query = registry.PlanQuery(request.algo, cp_size, call_traits(request), request.causal,
                               role_shape(request), request.settings,
                               tile_rule(request, cp_size), hardware, timer_for)
    # The same verdict on every rank (a function of what they agreed on), before data moves.
    found = registry.resolve(query, _Auto(request, prob, cluster, cp_size),
                             request.options.auto_algos)
    fwd, bwd = found.plans
    _validate_once(fwd)
    _validate_once(bwd)
    return Resolved(found.algo, found.groups, found.variants, found.plans, found.choice)


class _Auto:
    """``auto``'s chooser (plan/registry.Chooser): the model's pick among the entries that run
    the call, or with ``auto_tune`` the pick measured for this shape; and the shortlist still
    to measure, if any (dense calls on more than one rank)."""

    def __init__(self, request: CallRequest, prob: Problem, cluster, cp_size: int) -> None:
        self.request, self.prob, self.cluster, self.cp_size = request, prob, cluster, cp_size

    def __call__(self, candidates: tuple[str, ...], groups: Groups,
                 timer: object) -> tuple[str, auto_tune.Pending | None]:
        from charm_megatron.model import rank_algos_cached

        request, cluster = self.request, self.cluster
        if not candidates:
            given = request.options.auto_algos
            raise ValueError(f"cp_attention(algo='auto'): none of auto_algos={list(given)} "
                             "(CHARM_AUTO_ALGOS) can run this call; add ring, rmplus or charm")
        ranked = rank_algos_cached(groups, self.prob, cluster, causal=request.causal,
                                   tune=cluster is not None, **request.settings,
                                   algos=list(candidates))
        margin = request.options.auto_tune
        if margin is None or self.cp_size == 1 or request.layout.name != "sbhd":
            return ranked[0][1], None
        short = auto_tune.shortlist(ranked, margin)
        if len(short) == 1:
            return short[0], None
        # Everything the times depend on, nothing that names the call site (tag, call
        # number): one measurement serves every layer of a model. Named, each value with a
        # stable text (the cluster by its digest): the key of a pick file (auto_tune.key_text).
        key = (("groups", groups), ("problem", self.prob),
               ("profile digest", cluster_digest(cluster)), ("causal", request.causal),
               ("softmax_scale", request.scale), ("window", request.window),
               ("softmax_offset", request.softmax_offset is not None),
               ("backend", request.options.backend_name), ("dtype", request.q.dtype),
               ("settings", request.settings), ("shortlist", short))
        held = auto_tune.lookup(key)
        return (held, None) if held is not None else (short[0], auto_tune.Pending(key, short))


def call_traits(request: CallRequest) -> registry.CallTraits:
    """What the entries' checks read of a call (plan/entries.CallTraits; the registry fills
    in its groups)."""
    _, _, hq, hkv, _ = _heads(request)
    return registry.CallTraits((), hq, hkv, packed=request.layout.name != "sbhd",
                               windowed=request.window is not None,
                               offset=request.softmax_offset is not None)


def _planned_window(request: CallRequest) -> tuple[int, int] | None:
    """The window the call's plans (and so the model) see: the call's, except on packed
    sequences, whose documents each place it differently (their plans keep every tile, each
    masked document by document)."""
    return request.window if request.layout.name == "sbhd" else None


def tile_rule(request: CallRequest, cp_size: int) -> TileRule | None:
    """The tiles a windowed call needs (plan/tile_rule.py); ``None`` without one."""
    window = _planned_window(request)
    if window is None:
        return None
    left, right = window
    rows = _heads(request)[0]
    return window_rule(WindowGeometry(left, right, cp_size, rows, request.causal))


# Plans proved correct, by their content (ops are frozen and hashable): shapes that lead to
# the same schedule (a role rule that decides alike) are validated once.
_PROVED: set[tuple] = set()


def _validate_once(plan: Plan) -> None:
    key = (plan.algo, plan.direction, plan.n, plan.groups, plan.causal, plan.tiles,
           tuple(tuple(ops) for ops in plan.ops))
    if key in _PROVED:
        return
    validate(plan)
    if len(_PROVED) > 4096:
        _PROVED.clear()
    _PROVED.add(key)
