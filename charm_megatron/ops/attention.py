"""The public entry point: context-parallel attention over a CP process group."""

from __future__ import annotations

import functools
import math
import os

import torch
import torch.distributed as dist

from charm_megatron.kernels import get_backend
from charm_megatron.ops.executor import BlockShape, Executor
from charm_megatron.ops.streams import stream_groups
from charm_megatron.plan.core import Plan
from charm_megatron.plan.cost import Problem
from charm_megatron.plan.registry import CHOICES, build_plan, uses_topology
from charm_megatron.plan.roles import RoleShape, check_roles
from charm_megatron.plan.validate import validate

_FLOAT_DTYPES = (torch.float16, torch.bfloat16, torch.float32, torch.float64)
# What ``algo`` accepts: the registered algorithms, and ``auto`` (the performance model picks one).
ALGOS = CHOICES


def _plans(algo: str, groups: tuple[tuple[int, ...], ...], causal: bool, roles: str = "paper",
           shape: RoleShape | None = None) -> tuple[Plan, Plan]:
    """Forward and backward plans, validated once per (algo, topology, mask, pass order, role
    mix, and the shape the byte rule reads: every rank derives the same plans from them)."""
    return _validated_plans(algo, groups, causal, os.environ.get("CHARM_PASS_ORDER", "split"),
                            roles, shape)


@functools.lru_cache(maxsize=256)
def _validated_plans(algo: str, groups: tuple[tuple[int, ...], ...], causal: bool,
                     order: str, roles: str = "paper",
                     shape: RoleShape | None = None) -> tuple[Plan, Plan]:
    fwd = build_plan(algo, "forward", groups, causal, order, roles, shape)
    bwd = build_plan(algo, "backward", groups, causal, order, roles, shape)
    validate(fwd)
    validate(bwd)
    return fwd, bwd


def _check_inputs(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, causal: bool,
                  cp_size: int) -> None:
    """Identical checks on every rank, before any communication (ValueError / TypeError)."""
    for name, t in (("q", q), ("k", k), ("v", v)):
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"cp_attention: {name} must be a torch.Tensor, got {type(t).__name__}")
        if t.dim() != 4:
            raise ValueError(f"cp_attention: {name} must be 4-D [s_local, b, heads, head_dim] "
                             f"(Megatron's sbhd layout), got shape {tuple(t.shape)}")
        if t.dtype not in _FLOAT_DTYPES:
            raise TypeError(f"cp_attention: {name} has dtype {t.dtype}; use float16, bfloat16, "
                            "float32 or float64")
    if not (q.dtype == k.dtype == v.dtype):
        raise TypeError(f"cp_attention: q, k, v dtypes differ ({q.dtype}, {k.dtype}, {v.dtype}); "
                        "cast them to one dtype")
    if not (q.device == k.device == v.device):
        raise ValueError(f"cp_attention: q, k, v are on different devices ({q.device}, "
                         f"{k.device}, {v.device}); move them to one device")
    if k.shape != v.shape:
        raise ValueError(f"cp_attention: k {tuple(k.shape)} and v {tuple(v.shape)} must have "
                         "the same shape")
    if q.shape[0] != k.shape[0]:
        raise ValueError(f"cp_attention: q has {q.shape[0]} local tokens but k/v have "
                         f"{k.shape[0]}; all three must be this rank's shard of one sequence")
    if q.shape[1] != k.shape[1]:
        raise ValueError(f"cp_attention: batch sizes differ (q {q.shape[1]}, k/v {k.shape[1]})")
    if q.shape[3] != k.shape[3]:
        raise ValueError(f"cp_attention: head dims differ (q {q.shape[3]}, k/v {k.shape[3]})")
    if q.shape[2] % k.shape[2]:
        raise ValueError(f"cp_attention: h_q={q.shape[2]} is not a multiple of h_kv="
                         f"{k.shape[2]}; GQA needs each kv head to serve a whole group of "
                         "query heads (set num_query_groups to a divisor of the head count)")
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


def _resolve(algo: str, topology, group, cp_size: int, q: torch.Tensor, k: torch.Tensor,
             causal: bool, roles: str = "paper") -> tuple[str, tuple[tuple[int, ...], ...]]:
    """The algorithm to run and its groups (one flat group for ring and rmplus)."""
    flat = (tuple(range(cp_size)),)
    if algo == "ring":
        return algo, flat
    from charm_megatron.topology import resolve_topology

    topo = resolve_topology(topology, group, algo, cp_size)
    groups = tuple(tuple(g) for g in topo.groups)
    if algo == "auto":
        from charm_megatron.model import choose_algo_cached

        # A pure function of shapes and topology: every rank picks the same algorithm.
        problem = Problem(q.shape[1], q.shape[0] * cp_size, q.shape[2], k.shape[2], q.shape[3],
                          q.element_size())
        algo = choose_algo_cached(groups, problem, causal=causal, roles=roles)
    return algo, (groups if uses_topology(algo) else flat)


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
            :func:`charm_megatron.model.choose_algo` on a generic cluster: intra-group links
            8x the cross-group ones).
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
        roles: what the exchanges of rmplus / charm move (:mod:`charm_megatron.plan.roles`):
            ``"bytes"`` (default: per exchange the role that moves fewer bytes for this shape
            and direction), ``"paper"`` (the paper's Algorithm 1), ``"kv"`` or ``"q"`` (every
            exchange passes kv / q). Packed sequences run the paper's roles.

    Returns:
        ``out [s_local, b, h_q, d]`` in q's dtype; with ``return_lse`` also
        ``lse [b, h_q, s_local]`` fp32. Differentiable in q, k and v.
    """
    if algo not in ALGOS:
        raise ValueError(f"cp_attention: unknown algo {algo!r}; choose one of "
                         f"{', '.join(ALGOS)}")
    check_roles(roles, "cp_attention roles")
    if not dist.is_available() or not dist.is_initialized():
        raise RuntimeError("cp_attention: torch.distributed is not initialised; call "
                           "torch.distributed.init_process_group (or run under torchrun) first")
    if cu_seqlens is not None or cu_seqlens_padded is not None:
        # Packed documents (THD): its own module, the same plans (ops/packed.py).
        from charm_megatron.ops.packed import packed_cp_attention

        return packed_cp_attention(q, k, v, cu_seqlens=cu_seqlens,
                                   cu_seqlens_padded=cu_seqlens_padded, group=group, algo=algo,
                                   topology=topology, causal=causal,
                                   softmax_scale=softmax_scale, return_lse=return_lse)
    cp_size = dist.get_world_size(group)
    _check_inputs(q, k, v, causal, cp_size)
    algo, groups = _resolve(algo, topology, group, cp_size, q, k, causal, roles)
    scale = softmax_scale if softmax_scale is not None else 1.0 / math.sqrt(q.shape[-1])
    # The byte rule reads the shape; every rank has the same shapes, so the same plans.
    shape = RoleShape(q.shape[2], k.shape[2], q.shape[3], q.element_size())
    out, lse = _CPAttention.apply(q, k, v, group, algo, groups, causal, float(scale),
                                  (roles, shape))
    return (out, lse) if return_lse else out


def _make_executor(group, q: torch.Tensor, k: torch.Tensor, scale: float) -> Executor:
    shape = BlockShape(q.shape[0], q.shape[1], q.shape[2], k.shape[2], q.shape[3], q.dtype,
                       q.device)
    return Executor(stream_groups(group), get_backend(q.device, q.dtype), shape, scale)


class _CPAttention(torch.autograd.Function):
    """Forward and backward plans under one autograd node (the kernels' lse has no autograd)."""

    @staticmethod
    def forward(ctx, q, k, v, group, algo, groups, causal, scale, role_key):
        fwd, _ = _plans(algo, groups, causal, *role_key)
        rank = dist.get_rank(group)
        ex = _make_executor(group, q, k, scale)
        ex.set_own("own.q", "q", q)
        ex.set_own("own.kv", "kv", k, v)
        ex.run(fwd.ops[rank])
        acc_out, acc_lse = ex.result(Plan.OUT)
        out = acc_out.to(q.dtype)
        ctx.save_for_backward(q, k, v, out, acc_lse)
        ctx.cfg = (group, algo, groups, causal, scale, role_key)
        lse = acc_lse.permute(1, 2, 0).contiguous()
        ctx.mark_non_differentiable(lse)
        return out, lse

    @staticmethod
    def backward(ctx, dout, _dlse):
        q, k, v, out, lse_sbh = ctx.saved_tensors
        group, algo, groups, causal, scale, role_key = ctx.cfg
        _, bwd = _plans(algo, groups, causal, *role_key)
        rank = dist.get_rank(group)
        ex = _make_executor(group, q, k, scale)
        dout = dout.to(q.dtype)
        # delta = rowsum(dout * out) is all the tiles' backward needs of the output (see
        # executor._out_with_delta), so the q-side bundle carries it instead of out.
        delta = (dout.float() * out.float()).sum(-1)
        ex.set_own("own.qgrad", "qgrad", q, dout, torch.stack([lse_sbh, delta], -1))
        ex.set_own("own.kv", "kv", k, v)
        ex.run(bwd.ops[rank])
        (dq,) = ex.result(Plan.DQ)
        dk, dv = ex.result(Plan.DKV)
        return (dq.to(q.dtype), dk.to(k.dtype), dv.to(v.dtype), None, None, None, None, None,
                None)
