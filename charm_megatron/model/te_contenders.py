"""TransformerEngine's context-parallel types as a Megatron user gets them ("as shipped").

A Megatron user who does not pick ``--cp-comm-type charm`` runs TransformerEngine's
``p2p``, ``a2a``, ``a2a+p2p`` or ``all_gather``. Each moves the same blocks as one of our
plans (the registry entry whose ``te_name`` it is), but on TE's fused attention kernel, with
TE's wire dtypes and TE's refusals. The contenders here are those, named ``te-*`` so that nobody
takes them for ours:

* **kernel**: every tile is priced on the profile's curve of the kernel TE runs on the device
  (:data:`TE_KERNEL`; :func:`~charm_megatron.model.kernel_rates.cluster_on`), ``assumed``
  unless measured; a profile without that curve prices it as our own kernel;
* **wire**: what travels, in what dtype (:attr:`TeContender.partials`);
* **refusals**: a call TE refuses is refused here too (:func:`te_refusal`).

docs/performance.md ("TransformerEngine as shipped") lists each convention with the lines of
TE's code it comes from. Plan layer and model only: no torch.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass, replace

from charm_megatron.model.cluster import Cluster, Profile
from charm_megatron.model.kernel_rates import cluster_on, kernels_of
from charm_megatron.model.predict import Prediction, call_traits, predict
from charm_megatron.plan import registry
from charm_megatron.plan.cost import Problem

#: The profile kernel curve TE's fused attention runs at (cuDNN's, on Hopper).
TE_KERNEL = "cudnn"


@dataclass(frozen=True)
class TeContender:
    """One of TE's CP types: ``name`` (``te-p2p``), TE's ``cp_comm_type``, ``algo`` (our
    registry entry that moves the same blocks), ``partials`` (the dtype partial outputs and
    gradients travel in: ``input`` or ``fp32``), ``collective`` (its bytes move in NCCL
    collectives, priced by :func:`ring_collective_seconds`, not as ``algo``'s messages: TE's
    all-gather), and why TE refuses a packed, windowed,
    sink or ``d_v != d_qk`` call (``None``: it runs it). Head counts that do not divide the
    all-to-all group are refused by ``algo``'s own check, as TE's (CP:4242-4246)."""

    name: str
    cp_comm_type: str
    algo: str
    partials: str
    collective: bool = False
    packed: str | None = None
    window: str | None = None
    sinks: str | None = None
    mla: str | None = None


def _contenders() -> dict[str, TeContender]:
    # TransformerEngine v2.18, context_parallel.py (CP) and utils.py (U); docs/performance.md,
    # "TransformerEngine as shipped", has each line. Every type sends its partials (dkv on the
    # ring, out / dq / dk / dv through the all-to-alls, dk / dv reduce-scattered) in the
    # input dtype: CP:2396-2401, 4832-4846, 4120-4121.
    te = "TransformerEngine's context parallelism"
    no_sinks = (f"{te} runs attention sinks (softmax_type other than vanilla) only with "
                "cp_comm_type a2a (CP:5061-5067): compare with te-a2a")
    return {c.name: c for c in (
        TeContender("te-p2p", "p2p", "ring", "input",
                    window=f"{te} takes a sliding window only with cp_comm_type a2a or "
                    "all_gather (CP:5054-5060)", sinks=no_sinks),
        TeContender("te-a2a", "a2a", "a2a", "input"),
        TeContender("te-a2a+p2p", "a2a+p2p", "a2a+p2p", "input",
                    packed=f"{te} with cp_comm_type a2a+p2p takes no packed (THD) input "
                    "(CP:5021-5023)",
                    window=f"{te} takes a sliding window only with cp_comm_type a2a or "
                    "all_gather (CP:5054-5060)", sinks=no_sinks),
        TeContender("te-allgather", "all_gather", "allgather", "input", collective=True,
                    sinks=no_sinks),
    )}


#: Every TE contender by name, in the order tables list them.
TE_CONTENDERS: dict[str, TeContender] = _contenders()
TE_NAMES: tuple[str, ...] = tuple(TE_CONTENDERS)


def get(name: str) -> TeContender:
    try:
        return TE_CONTENDERS[name]
    except KeyError:
        raise ValueError(f"unknown TransformerEngine contender {name!r}; choose one of "
                         f"{', '.join(TE_NAMES)}") from None


def te_refusal(name: str, traits: registry.CallTraits, *, mla: bool = False) -> str | None:
    """Why TE's ``name`` cannot run a call with ``traits`` (``mla``: ``d_v != d_qk``): TE's own
    refusal first, then that of the plan that moves its blocks (heads that must divide the
    all-to-all group); ``None`` if it runs."""
    c = get(name)
    for flag, why in ((traits.packed, c.packed), (traits.windowed, c.window),
                      (traits.offset, c.sinks), (mla, c.mla)):
        if flag and why is not None:
            return why
    return registry.refusal(c.algo, traits)


def te_problem(name: str, problem: Problem) -> Problem:
    """``problem`` with TE's wire dtype for partials."""
    return replace(problem, wide_partials=get(name).partials == "fp32")


def te_cluster(profile: Profile) -> Cluster:
    """``profile``'s cluster on TE's kernel (:data:`TE_KERNEL`), or on its own kernel when it
    has no curve for TE's; its SM contention counts one communicator at most
    (``comm_slowdown_streams=1``): TE's ring posts a step's kv and dk, dv on one process group
    (``flash_attn_p2p_communicate(..., cp_group, ...)``, docs/model.md "Link order") and its
    all-to-alls and all-gathers block, so no two of its communicators move data while it
    computes, where our plans' streams (kv, q, cross) are communicators of their own; its
    head all-to-alls copy as TE's do (``head_copies="te"``: a reorder on each side of the
    collective, plan/head_stage.copy_passes)."""
    cl = cluster_on(profile, TE_KERNEL) if TE_KERNEL in kernels_of(profile) else profile.cluster
    return replace(cl, comm_slowdown_streams=1, head_copies="te")


def predict_te(name: str, groups: Sequence[Sequence[int]], problem: Problem,
               cluster: Cluster, causal: bool, *, sinks: bool = False) -> Prediction:
    """TE's ``name`` at ``problem`` on ``cluster`` (already on TE's kernel: :func:`te_cluster`),
    named ``name`` (``sinks``: the call has attention sinks). :class:`ValueError` with TE's
    reason when it refuses."""
    traits = replace(call_traits(tuple(tuple(g) for g in groups), problem), offset=sinks)
    why = te_refusal(name, traits, mla=bool(problem.dv) and problem.dv != problem.d)
    if why is not None:
        raise ValueError(why)
    c = get(name)
    if c.collective:
        return _collective_prediction(c, groups, te_problem(name, problem), cluster, causal)
    pred = predict(c.algo, groups, te_problem(name, problem), cluster, causal)
    return replace(pred, algo=name)


def ring_collective_seconds(nbytes: float, groups: Sequence[Sequence[int]],
                            cluster: Cluster) -> float:
    """One NCCL ring all-gather (or reduce-scatter) of a tensor of ``nbytes`` (the gathered
    whole) over the CP group: every rank moves ``(n - 1) / n`` of it through its intra port,
    and as many bytes cross between every two consecutive groups of the ring; NCCL runs one
    channel per NIC, so those cross bytes share a group's cross links (one per rank, or one
    per group: ``cluster.nic``). Plus one ``latency_us`` per ring step. The bus-bandwidth
    model of NCCL's ring collectives; TE runs them synchronously (docs/performance.md,
    "TransformerEngine as shipped")."""
    n = sum(len(g) for g in groups)
    if n < 2:
        return 0.0
    share = (n - 1) / n * nbytes
    intra = cluster.intra_gbps
    if cluster.intra_port_gbps is not None:
        intra = max(intra, cluster.intra_port_gbps)
    seconds = share / (intra * 1e9)
    if len(groups) > 1:
        nics = min(len(g) for g in groups) if cluster.nic == "rank" else 1
        seconds = max(seconds, share / (nics * cluster.cross_gbps * 1e9))
    return seconds + (n - 1) * cluster.latency_us * 1e-6


def _collective_prediction(c: TeContender, groups: Sequence[Sequence[int]], problem: Problem,
                           cluster: Cluster, causal: bool) -> Prediction:
    """TE's all-gather: its tiles (``c.algo``'s plan with free messages: it computes the
    same tiles once its kv is gathered) after the synchronous collectives, which nothing
    overlaps: forward all-gathers k and v; backward gathers them again, then reduce-scatters
    dk and dv (all in the input dtype: CP:3213-3214, 3786-3787, 4120-4121)."""
    n = sum(len(g) for g in groups)
    compute = predict(c.algo, groups, problem, cluster, causal, compute_only=True)
    kv = problem.block_bytes("kv", n) * n  # k and v of the whole sequence
    gather = ring_collective_seconds(kv, groups, cluster)
    fwd = replace(compute.forward, algo=c.name, time_s=compute.forward.time_s + gather)
    bwd = replace(compute.backward, algo=c.name, time_s=compute.backward.time_s + 2 * gather)
    return Prediction(c.name, fwd, bwd)


def predict_te_all(groups: Sequence[Sequence[int]], problem: Problem, cluster: Cluster,
                   causal: bool, names: Iterable[str] = TE_NAMES, *,
                   sinks: bool = False) -> dict[str, Prediction]:
    """:func:`predict_te` for each of ``names`` that TE runs at ``problem`` (``sinks``: the
    call has attention sinks), in that order."""
    traits = replace(call_traits(tuple(tuple(g) for g in groups), problem), offset=sinks)
    mla = bool(problem.dv) and problem.dv != problem.d
    return {n: predict_te(n, groups, problem, cluster, causal, sinks=sinks) for n in names
            if te_refusal(n, traits, mla=mla) is None}


def fastest_te(groups: Sequence[Sequence[int]], problem: Problem, cluster: Cluster,
               causal: bool, *, sinks: bool = False) -> Prediction | None:
    """The fastest (forward plus backward) TE contender that runs ``problem`` (``None``: TE
    refuses it with every type)."""
    preds = predict_te_all(groups, problem, cluster, causal, sinks=sinks)
    return min(preds.values(), key=lambda p: p.total_s, default=None)
