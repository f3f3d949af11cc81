"""The public entry point: context-parallel attention over a CP process group."""

from __future__ import annotations

import torch
import torch.distributed as dist

from charm_megatron.kernels.base import check_qkv
from charm_megatron.ops import agreement
from charm_megatron.ops.call_setup import (
    algo_and_groups,
    check_backend,
    check_scale,
    default_topology,
    model_cluster,
    needs_cluster,
    signature,
    split_choice,
    split_q_choice,
)
from charm_megatron.ops.executor import BlockShape, Executor
from charm_megatron.ops.failsafe import GuardedBackend
from charm_megatron.ops.options import CPOptions, kernel_backend, resolve
from charm_megatron.ops.packed import packed_cp_attention
from charm_megatron.ops.plan_run import Call, run_backward, run_forward
from charm_megatron.ops.streams import StreamGroups, stream_groups
from charm_megatron.plan.registry import CHOICES
from charm_megatron.plan.roles import RoleShape, check_roles

# What ``algo`` accepts: the registered algorithms, and ``auto`` (the performance model picks one).
ALGOS = CHOICES


def _check_inputs(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, causal: bool,
                  cp_size: int) -> None:
    """This rank's checks (ValueError / TypeError); their verdict reaches every rank through
    the agreement check before any data moves."""
    check_qkv(q, k, v, causal=causal, equal_lengths=True, who="cp_attention")
    s_local = q.shape[0]
    if causal and s_local % 2:
        raise ValueError(
            f"cp_attention: causal attention needs the sequence length "
            f"({s_local}*{cp_size}={s_local * cp_size}) divisible by 2*cp_size={2 * cp_size} "
            "(Megatron's load-balanced layout: 2 chunks per rank); pad the sequence or change "
            "--seq-length"
        )
    if s_local == 0:
        raise ValueError("cp_attention: empty sequence shard")



def resolve_algo(q: torch.Tensor, k: torch.Tensor, *, group: dist.ProcessGroup | None = None,
                 algo: str = "auto", topology=None, causal: bool = True,
                 options: CPOptions | None = None, roles: str = "bytes") -> str:
    """The algorithm ``cp_attention(q, k, v, algo=algo, ...)`` runs with these arguments (sbhd
    ``q``, ``k``; tensors on the ``meta`` device do): for ``"auto"`` the performance model's pick,
    made by the same code as the call's (the options' model profile, the same default topology,
    problem and role mix); any other name unchanged. No communication unless the topology is
    ``"auto"`` (a probe, then a collective). For reporting what ``auto`` chose (the benchmark's
    ``auto`` contender); raises what the call would raise for a bad profile or name."""
    opts = resolve(options)
    if algo not in ALGOS:
        raise ValueError(f"cp_attention: unknown algo {algo!r}; choose one of {', '.join(ALGOS)}")
    check_roles(roles, "cp_attention roles")
    if algo != "auto":
        return algo
    cluster = model_cluster(opts)
    topology = default_topology(topology, algo, opts)
    return algo_and_groups(algo, topology, group, dist.get_world_size(group), q, k, causal,
                           cluster, roles, opts)[0]


def cp_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    *,
    group: dist.ProcessGroup | None = None,
    algo: str = "ring",
    topology=None,
    causal: bool = True,
    softmax_scale: float | None = None,
    return_lse: bool = False,
    cu_seqlens: torch.Tensor | None = None,
    cu_seqlens_padded: torch.Tensor | None = None,
    options: CPOptions | None = None,
    roles: str = "bytes",
):
    """Context-parallel attention over the CP process group ``group``.

    Args:
        q: ``[s_local, b, h_q, d]`` this rank's queries (Megatron sbhd layout). With
            ``causal=True`` the shard is Megatron's load-balanced one (chunks ``r`` and
            ``2n-1-r`` of ``2n``, see :mod:`charm_megatron.layout`); otherwise contiguous.
        k, v: ``[s_local, b, h_kv, d]``; ``h_q`` a multiple of ``h_kv`` (GQA / MQA).
        group: the CP process group (``None``: the default group).
        algo: ``"ring"`` (TransformerEngine's p2p ring), ``"rmplus"`` (RM+ over a flat group),
            ``"charm"`` (CHARM+: RM+ inside each topology group, queries across groups),
            ``"auto"`` (the fastest of the three for this topology and shape, as predicted by
            :func:`charm_megatron.model.choose_algo` on the cluster of
            ``options.model_profile`` / ``CHARM_MODEL_PROFILE`` if set, else on a generic
            cluster: intra-group links 8x the cross-group ones).
        topology: a :class:`charm_megatron.Topology`, a string (``"2x4"``, ``"0-3,4-7"``,
            ``"flat"``, ``"auto"``) or ``None`` (flat for rmplus; ``CHARM_TOPOLOGY`` or the
            probe for charm). Ignored by ``ring``.
        causal: causal mask over the full sequence.
        softmax_scale: defaults to ``1/sqrt(d)``.
        return_lse: also return the log-sum-exp.
        cu_seqlens, cu_seqlens_padded: packed sequences (THD): q ``[t_local, h_q, d]``,
            k, v ``[t_local, h_kv, d]``, global cumulative real / padded document lengths
            (int32, same on every rank), Megatron's THD CP layout; out ``[t_local, h_q, d]``,
            lse ``[h_q, t_local]``. See :mod:`charm_megatron.ops.packed` and docs/api.md.
        options: a :class:`~charm_megatron.ops.options.CPOptions` (pass order, timeout, kernel
            backend, checks, ablation, model profile); ``None`` reads them from the ``CHARM_*`` environment
            variables, once, here (docs/api.md).
        roles: what the exchanges of rmplus / charm move (:mod:`charm_megatron.plan.roles`):
            ``"bytes"`` (default: per exchange the role that moves fewer bytes for this shape
            and direction), ``"paper"`` (the paper's Algorithm 1), ``"kv"`` or ``"q"`` (every
            exchange passes kv / q). The same for packed sequences.

    Returns:
        ``out [s_local, b, h_q, d]`` in q's dtype; with ``return_lse`` also
        ``lse [b, h_q, s_local]`` fp32 (float64 for float64 inputs). Differentiable in q, k
        and v.

    Raises:
        TypeError, ValueError: bad inputs or settings, on every rank, before any data moves.
        CPMismatchError: the ranks disagree on the call (names the field and the ranks).
        CPAttentionError: another rank failed during the call (its error is quoted); the
            failing rank re-raises its own exception. The CP group stays usable.
    """
    if not dist.is_available() or not dist.is_initialized():
        raise RuntimeError("cp_attention: torch.distributed is not initialised; call "
                           "torch.distributed.init_process_group (or run under torchrun) first")
    if cu_seqlens is not None or cu_seqlens_padded is not None:
        # Packed documents (THD): its own module, the same plans and the same failure model
        # (agreement with the document lengths as extra fields, status exchange; ops/packed.py).
        if algo not in ALGOS:
            raise ValueError(f"cp_attention: unknown algo {algo!r}; choose one of "
                             f"{', '.join(ALGOS)}")
        return packed_cp_attention(q, k, v, cu_seqlens=cu_seqlens,
                                   cu_seqlens_padded=cu_seqlens_padded, group=group, algo=algo,
                                   topology=topology, causal=causal,
                                   softmax_scale=softmax_scale, return_lse=return_lse,
                                   options=resolve(options), roles=roles)
    cp_size = dist.get_world_size(group)
    opts, scale, error, cluster = None, softmax_scale, None, None
    try:  # this rank's own checks; the verdict is shared by the agreement check below
        opts = resolve(options)
        if algo not in ALGOS:
            raise ValueError(f"cp_attention: unknown algo {algo!r}; choose one of "
                             f"{', '.join(ALGOS)}")
        check_roles(roles, "cp_attention roles")
        _check_inputs(q, k, v, causal, cp_size)
        scale = check_scale(softmax_scale, q.shape[-1])
        check_backend(opts, q)
        if needs_cluster(algo, opts):  # a profile this rank cannot read fails every rank,
            cluster = model_cluster(opts)  # before any data moves
    except (TypeError, ValueError) as exc:
        error = exc
    timeout_s = opts.timeout_s if opts is not None else CPOptions().timeout_s
    sg = stream_groups(group, timeout_s)
    seq = sg.calls
    sg.calls += 1
    if cp_size > 1 and (opts is None or opts.check != "off"):
        sig = signature("forward", seq, q, k, v, algo, topology, causal, scale, opts, error,
                         cluster, roles)
        agreement.agree(sig, sg.control, cp_size, timeout_s, error)
    elif error is not None:
        raise error
    topology = default_topology(topology, algo, opts)
    algo, groups = algo_and_groups(algo, topology, group, cp_size, q, k, causal, cluster, roles,
                                   opts)
    # The byte rule reads the shape; the ranks agreed on the shapes, so on the plans too.
    shape = RoleShape(q.shape[2], k.shape[2], q.shape[3], q.element_size())
    split = split_choice(opts, algo, groups, causal, roles, q, k, cp_size, cluster)
    split_q = split_q_choice(opts, algo, groups, causal, roles, q, k, cp_size, cluster)
    call = Call(group, algo, groups, causal, scale, opts, seq, roles, shape, split, split_q)
    out, lse = _CPAttention.apply(q, k, v, call)
    return (out, lse) if return_lse else out


def _make_executor(call: Call, sg: StreamGroups, q: torch.Tensor, k: torch.Tensor,
                   direction: str) -> Executor:
    shape = BlockShape(q.shape[0], q.shape[1], q.shape[2], k.shape[2], q.shape[3], q.dtype,
                       q.device)
    opts = call.options
    backend = GuardedBackend(kernel_backend(opts, q.device, q.dtype))
    return Executor(sg, backend, shape, call.scale, compute=opts.compute, comm=opts.comm,
                    timeout_s=opts.timeout_s, what=call.what(direction))


class _CPAttention(torch.autograd.Function):
    """Forward and backward plans under one autograd node (the kernels' lse has no autograd)."""

    @staticmethod
    def forward(ctx, q, k, v, call: Call):
        out, acc_lse = run_forward(
            call, lambda sg, d: _make_executor(call, sg, q, k, d), q, k, v)
        ctx.save_for_backward(q, k, v, out, acc_lse)
        ctx.call = call
        lse = acc_lse.permute(1, 2, 0).contiguous()
        ctx.mark_non_differentiable(lse)
        return out, lse

    @staticmethod
    def backward(ctx, dout, _dlse):
        q, k, v, out, lse_sbh = ctx.saved_tensors
        call: Call = ctx.call
        grads = run_backward(call, lambda sg, d: _make_executor(call, sg, q, k, d),
                             q, k, v, out, lse_sbh, dout)
        return (*grads, None)
