"""The public entry point: context-parallel attention over a CP process group."""

from __future__ import annotations

import functools
import hashlib
import math
from dataclasses import dataclass

import torch
import torch.distributed as dist

import charm_megatron
from charm_megatron.kernels.base import check_qkv
from charm_megatron.ops import agreement
from charm_megatron.ops.agreement import CPAttentionError, Signature
from charm_megatron.ops.executor import BlockShape, Executor, delta_exponent
from charm_megatron.ops.failsafe import GuardedBackend
from charm_megatron.ops.options import CPOptions, kernel_backend, resolve
from charm_megatron.ops.streams import StreamGroups, control_timeout_s, rebuild, stream_groups
from charm_megatron.plan.core import Plan
from charm_megatron.plan.cost import Problem
from charm_megatron.plan.registry import CHOICES, build_plan, uses_topology
from charm_megatron.plan.roles import RoleShape, check_roles
from charm_megatron.plan.validate import validate

# What ``algo`` accepts: the registered algorithms, and ``auto`` (the performance model picks one).
ALGOS = CHOICES


def _plans(algo: str, groups: tuple[tuple[int, ...], ...], causal: bool, order: str,
           roles: str = "paper", shape: RoleShape | None = None) -> tuple[Plan, Plan]:
    """Forward and backward plans, validated once per (algo, topology, mask, pass order, role
    mix, and the shape the byte rule reads: every rank derives the same plans from them)."""
    return _validated_plans(algo, groups, causal, order, roles, shape)


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


def _check_scale(softmax_scale, head_dim: int) -> float:
    if softmax_scale is None:
        return 1.0 / math.sqrt(head_dim)
    if isinstance(softmax_scale, bool) or not isinstance(softmax_scale, (int, float)):
        raise TypeError(f"cp_attention: softmax_scale must be a number or None, got "
                        f"{type(softmax_scale).__name__}")
    scale = float(softmax_scale)
    if not math.isfinite(scale) or scale <= 0:
        raise ValueError(f"cp_attention: softmax_scale={softmax_scale!r} must be a finite "
                         "number > 0 (None gives 1/sqrt(head_dim)); 0 or a negative scale has "
                         "no meaning for attention and gives NaN under the causal mask")
    return scale


def _check_backend(opts: CPOptions, q: torch.Tensor) -> None:
    if opts.backend == "flash_attn" and (q.device.type != "cuda"
                                         or q.dtype not in (torch.float16, torch.bfloat16)):
        raise ValueError(f"cp_attention: the flash_attn backend runs fp16/bf16 on CUDA only, "
                         f"not {q.dtype} on {q.device.type}; choose backend 'torch' "
                         "(CHARM_ATTN_BACKEND / CPOptions.backend) or cast the inputs")


def _tensor_desc(t) -> tuple:
    if not isinstance(t, torch.Tensor):
        return (type(t).__name__,)
    return (tuple(t.shape), str(t.dtype), t.device.type)


def _topology_desc(topology) -> str:
    groups = getattr(topology, "groups", None)
    return repr(tuple(tuple(g) for g in groups)) if groups is not None else repr(topology)


def _cluster_desc(cluster) -> str | None:
    """A digest of the cluster ``auto`` predicts with (``None``: the generic one), so that ranks
    that read different profile files under one name disagree loudly instead of choosing
    different algorithms."""
    if cluster is None:
        return None
    return hashlib.sha256(repr(cluster).encode()).hexdigest()[:16]


def _auto_cluster(opts: CPOptions):
    """The cluster of ``opts.model_profile`` (``None``: generic); ValueError names the option."""
    from charm_megatron.model import auto_cluster

    return auto_cluster(opts.model_profile,
                        where="model_profile (CPOptions.model_profile / CHARM_MODEL_PROFILE)")


def _signature(direction: str, seq: int, q, k, v, algo: str, topology, causal: bool, scale,
               opts: CPOptions | None, error: BaseException | None,
               cluster=None, roles: str | None = None,
               extra: tuple[tuple[str, object], ...] = ()) -> Signature:
    """What the ranks must agree on. The plan is a pure function of these fields (and of the
    probe's all-gathered result), so agreeing on them is agreeing on the plan; the package
    version stands for the plan builders' code. ``extra`` fields go at the end (the packed
    path's document lengths, ops/packed.py)."""
    fields: tuple[tuple[str, object], ...] = (
        ("charm_megatron version", charm_megatron.__version__),
        ("direction", direction),
        ("call number on this CP group", seq),
        ("q shape/dtype/device", _tensor_desc(q)),
        ("k shape/dtype/device", _tensor_desc(k)),
        ("v shape/dtype/device", _tensor_desc(v)),
        ("algo", algo),
        ("topology", _topology_desc(topology)),
        ("causal", bool(causal)),
        ("softmax_scale", scale if isinstance(scale, float) else repr(scale)),
    )
    if opts is not None:
        fields += (
            ("pass order", opts.pass_order),
            ("kernel backend", opts.backend_name),
            ("default topology (CHARM_TOPOLOGY)", opts.topology),
            ("ablation", opts.ablation),
            ("model profile (CHARM_MODEL_PROFILE)", (opts.model_profile,
                                                     _cluster_desc(cluster))),
        )
    # The role mix picks the plans of rmplus / charm as much as the algorithm does.
    fields += (("roles", roles),) + tuple(extra)
    return Signature(fields, f"{type(error).__name__}: {error}" if error is not None else "")


def _resolve(algo: str, topology, group, cp_size: int, q: torch.Tensor, k: torch.Tensor,
             causal: bool, cluster=None,
             roles: str = "paper") -> tuple[str, tuple[tuple[int, ...], ...]]:
    """The algorithm to run and its groups (one flat group for ring and rmplus); ``auto``
    predicts with ``cluster`` (``None``: the generic one for the topology)."""
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
        algo = choose_algo_cached(groups, problem, cluster, causal=causal, roles=roles)
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
        from charm_megatron.ops.packed import packed_cp_attention

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
        scale = _check_scale(softmax_scale, q.shape[-1])
        _check_backend(opts, q)
        if algo == "auto":  # a profile this rank cannot read fails every rank, before any data
            cluster = _auto_cluster(opts)
    except (TypeError, ValueError) as exc:
        error = exc
    timeout_s = opts.timeout_s if opts is not None else CPOptions().timeout_s
    sg = stream_groups(group, timeout_s)
    seq = sg.calls
    sg.calls += 1
    if cp_size > 1 and (opts is None or opts.check != "off"):
        sig = _signature("forward", seq, q, k, v, algo, topology, causal, scale, opts, error,
                         cluster, roles)
        agreement.agree(sig, sg.control, cp_size, timeout_s, error)
    elif error is not None:
        raise error
    if topology is None and uses_topology(algo):
        # The options' default (CHARM_TOPOLOGY) or the probe, passed explicitly so that the
        # topology code never reads the environment behind the options' back.
        topology = opts.topology or "auto"
    algo, groups = _resolve(algo, topology, group, cp_size, q, k, causal, cluster, roles)
    # The byte rule reads the shape; the ranks agreed on the shapes, so on the plans too.
    shape = RoleShape(q.shape[2], k.shape[2], q.shape[3], q.element_size())
    call = _Call(group, algo, groups, causal, scale, opts, seq, roles, shape)
    out, lse = _CPAttention.apply(q, k, v, call)
    return (out, lse) if return_lse else out


@dataclass(frozen=True)
class _Call:
    """One call's resolved settings, kept in the autograd context for its backward."""

    group: dist.ProcessGroup | None
    algo: str
    groups: tuple[tuple[int, ...], ...]
    causal: bool
    scale: float
    options: CPOptions
    seq: int  # the forward's call number on its CP group
    roles: str = "paper"  # the role mix of rmplus / charm (plan/roles.py)
    shape: RoleShape | None = None  # what the byte rule reads

    def what(self, direction: str) -> str:
        return f"cp_attention(algo={self.algo}, {direction})"

    def plans(self) -> tuple[Plan, Plan]:
        return _plans(self.algo, self.groups, self.causal, self.options.pass_order, self.roles,
                      self.shape)


def _make_executor(call: _Call, sg: StreamGroups, q: torch.Tensor, k: torch.Tensor,
                   direction: str) -> Executor:
    shape = BlockShape(q.shape[0], q.shape[1], q.shape[2], k.shape[2], q.shape[3], q.dtype,
                       q.device)
    opts = call.options
    backend = GuardedBackend(kernel_backend(opts, q.device, q.dtype))
    return Executor(sg, backend, shape, call.scale, compute=opts.compute, comm=opts.comm,
                    timeout_s=opts.timeout_s, what=call.what(direction))


def _run(call: _Call, sg: StreamGroups, ex: Executor, ops, direction: str) -> None:
    """Run this rank's ops, then share how it went (docs/api.md, failure model).

    A kernel error is held back by the guarded backend, so every transfer still completes;
    any other error (a transfer that failed or timed out) breaks the stream communicators,
    which every rank then rebuilds together. Either way every rank raises."""
    exc: BaseException | None = None
    code = agreement.OK
    try:
        ex.run(ops)
    except Exception as e:  # noqa: BLE001 - shared with the other ranks, then re-raised
        exc, code = e, agreement.BROKEN
    if exc is None and ex.backend.error is not None:
        exc, code = ex.backend.error, agreement.RAISED
    if sg.size == 1 or call.options.check == "off":
        if exc is not None:
            raise exc
        return
    message = f"{type(exc).__name__}: {exc}" if exc is not None else ""
    try:
        # Bounded by the control group's longer timeout: a peer may first have to wait out
        # a transfer of its own before it gets here.
        codes, texts = agreement.exchange_status(code, message, sg.control, sg.size,
                                                 control_timeout_s(call.options.timeout_s))
    except CPAttentionError:
        sg.parent = None  # even the control group failed: rebuild all from the CP group
        raise
    if agreement.BROKEN in codes:
        rebuild(call.group, sg)
    if exc is not None:
        raise exc
    failed = [r for r, c in enumerate(codes) if c != agreement.OK]
    if failed:
        detail = "; ".join(f"rank {r}: {texts[r]}" for r in failed)
        state = ("its communicators were rebuilt" if agreement.BROKEN in codes
                 else "every transfer completed")
        raise CPAttentionError(f"{call.what(direction)} failed on CP rank(s) {failed} "
                               f"({detail}); this rank's results are discarded, {state} and "
                               "the CP group is ready for the next call")


def run_forward(call: _Call, make_executor, q: torch.Tensor, k: torch.Tensor,
                v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """This rank's forward plan (shared by the sbhd and the packed operator): ``out`` in q's
    dtype and the accumulated lse ``[s, b, h]``. ``make_executor(sg, direction)`` builds the
    executor (the packed one adds its document layout)."""
    fwd, _ = call.plans()
    sg = stream_groups(call.group, call.options.timeout_s)
    ex = make_executor(sg, "forward")
    ex.set_own("own.q", "q", q)
    ex.set_own("own.kv", "kv", k, v)
    _run(call, sg, ex, fwd.ops[dist.get_rank(call.group)], "forward")
    acc_out, acc_lse = ex.result(Plan.OUT)
    return acc_out.to(q.dtype), acc_lse


def run_backward(call: _Call, make_executor, q: torch.Tensor, k: torch.Tensor,
                 v: torch.Tensor, out: torch.Tensor, lse_sbh: torch.Tensor,
                 dout: torch.Tensor, extra: tuple = ()) -> tuple[torch.Tensor, ...]:
    """This rank's backward plan after the ranks agree again (``extra``: more signature
    fields, e.g. the packed layout): dq, dk, dv in the inputs' dtypes."""
    _, bwd = call.plans()
    sg = stream_groups(call.group, call.options.timeout_s)
    if sg.size > 1 and call.options.check != "off":
        sig = _signature("backward", call.seq, q, k, v, call.algo, call.groups, call.causal,
                         call.scale, call.options, None, roles=call.roles, extra=extra)
        agreement.agree(sig, sg.control, sg.size, call.options.timeout_s)
    ex = make_executor(sg, "backward")
    dout = dout.to(q.dtype)
    # delta = rowsum(dout * out) is all the tiles' backward needs of the output (see
    # executor._out_with_delta), so the q-side bundle carries it instead of out, scaled by
    # the row's power of two 2**-e (e from max|dout|) so that it never overflows or
    # underflows; the receiver recomputes e from the dout it receives.
    wide = torch.float64
    e = delta_exponent(dout)
    delta = torch.ldexp((dout.to(wide) * out.to(wide)).sum(-1), -e.to(wide))
    ex.set_own("own.qgrad", "qgrad", q, dout,
               torch.stack([lse_sbh, delta.to(lse_sbh.dtype)], -1))
    ex.set_own("own.kv", "kv", k, v)
    _run(call, sg, ex, bwd.ops[dist.get_rank(call.group)], "backward")
    (dq,) = ex.result(Plan.DQ)
    dk, dv = ex.result(Plan.DKV)
    return dq.to(q.dtype), dk.to(k.dtype), dv.to(v.dtype)


class _CPAttention(torch.autograd.Function):
    """Forward and backward plans under one autograd node (the kernels' lse has no autograd)."""

    @staticmethod
    def forward(ctx, q, k, v, call: _Call):
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
        call: _Call = ctx.call
        grads = run_backward(call, lambda sg, d: _make_executor(call, sg, q, k, d),
                             q, k, v, out, lse_sbh, dout)
        return (*grads, None)
