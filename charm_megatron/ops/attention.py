"""The public entry point: context-parallel attention over a CP process group.

One call path for both layouts (docs/design.md, "One call"): :func:`cp_attention` prepares
the call (ops/prepare.py: request, agreement, resolution), maps the tensors to the internal
``[s, b, h, d]`` rows of its layout, runs :class:`_CPAttention` (forward and backward plans
under one autograd node) and maps the results back.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from charm_megatron.ops.call import CallArgs
from charm_megatron.ops.options import CPOptions
from charm_megatron.ops.plan_run import run_backward, run_forward
from charm_megatron.ops.prepare import Call, build_request, prepare, tune_call
from charm_megatron.ops.resolution import model_cluster, resolve_call
from charm_megatron.plan.registry import CHOICES

# What ``algo`` accepts: the registered algorithms, and ``auto`` (the performance model picks one).
ALGOS = CHOICES


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
    roles: str | None = None,
    tag: str | None = None,
    softmax_offset: torch.Tensor | None = None,
    window_size: tuple[int, int] | None = None,
):
    """Context-parallel attention over the CP process group ``group``.

    Args:
        q: ``[s_local, b, h_q, d]`` this rank's queries (Megatron sbhd layout). With
            ``causal=True`` the shard is Megatron's load-balanced one (chunks ``r`` and
            ``2n-1-r`` of ``2n``, see :mod:`charm_megatron.layout`); otherwise contiguous.
        k, v: ``[s_local, b, h_kv, d]``; ``h_q`` a multiple of ``h_kv`` (GQA / MQA).
        group: the CP process group (``None``: the default group).
        algo: a registered algorithm (``"ring"``: TransformerEngine's p2p ring; ``"rmplus"``:
            RM+ over a flat group; ``"charm"``: CHARM+, RM+ inside each topology group and
            queries across groups) or ``"auto"`` (the fastest of them for this topology and
            shape, as predicted by :func:`charm_megatron.model.choose_algo` on the cluster of
            ``options.model_profile`` / ``CHARM_MODEL_PROFILE`` if set, else on a generic
            cluster: intra-group links 8x the cross-group ones).
        topology: a :class:`charm_megatron.Topology`, a string (``"2x4"``, ``"0-3,4-7"``,
            ``"flat"``, ``"auto"``) or ``None`` (``CHARM_TOPOLOGY`` or the probe). Only read by
            algorithms that use the topology (``charm``, ``auto``).
        causal: causal mask over the full sequence.
        softmax_scale: defaults to ``1/sqrt(d)``.
        return_lse: also return the log-sum-exp.
        cu_seqlens, cu_seqlens_padded: packed sequences (THD): q ``[t_local, h_q, d]``,
            k, v ``[t_local, h_kv, d]``, global cumulative real / padded document lengths
            (int32, same on every rank), Megatron's THD CP layout; out ``[t_local, h_q, d]``,
            lse ``[h_q, t_local]``. See :mod:`charm_megatron.ops.packed` and docs/api.md.
        options: a :class:`~charm_megatron.CPOptions` (timeout, kernel backend, checks,
            ablation, model profile, the algorithms' settings); ``None`` reads them from the
            ``CHARM_*`` environment variables, once, here (docs/api.md).
        roles: what the exchanges of rmplus / charm move (:mod:`charm_megatron.plan.roles`):
            ``"bytes"`` (per exchange the role that moves fewer bytes for this shape and
            direction), ``"paper"`` (the paper's Algorithm 1), ``"kv"`` or ``"q"`` (every
            exchange passes kv / q); ``None``: the options' ``roles`` setting (default
            ``"bytes"``). The same for packed sequences.
        tag: a name for the call site that every rank must pass alike (the Megatron layer
            passes its layer number), so that ranks whose calls are out of order get an
            error naming it instead of pairing two different calls.
        softmax_offset: ``[h_q]``, one extra logit per query head in every softmax
            denominator (an attention sink: learnable when it requires grad, zeros for
            "off-by-one"; ops/softmax_offset.py), finite and the same on every rank (the
            agreement compares a digest of its values); ``None``: vanilla softmax. Its
            gradient on each rank is that rank's own query rows' share, under every algorithm.
        window_size: ``(left, right)``: query ``i`` sees key ``j`` iff ``i - left <= j <=
            i + right`` in global positions (``-1``: unbounded; flash-attn's and
            megatron-core's convention), on top of ``causal``; ``None``: no window. sbhd:
            plans hold only the tiles the window needs and the messages they read
            (plan/prune.py), a tile it cuts is masked (kernels/window.py). Packed THD: the
            window is measured inside each document; every tile is masked by document.
            The effective window runs and is agreed on (a side reaching the whole sequence
            is unbounded, the right side is 0 under ``causal``; nothing left: no window).

    Returns:
        ``out [s_local, b, h_q, d]`` in q's dtype; with ``return_lse`` also
        ``lse [b, h_q, s_local]`` fp32 (float64 for float64 inputs; with an offset, the
        denominator's log including it). Differentiable in q, k, v and ``softmax_offset``.

    Raises:
        TypeError, ValueError: bad inputs or settings, on every rank, before any data moves.
        CPMismatchError: the ranks disagree on the call (names the field and the ranks), or
            are out of step (names their call numbers).
        CPAttentionError: another rank failed during the call (its error is quoted); the
            failing rank re-raises its own exception. The CP group stays usable.
    """
    args = CallArgs(algo=algo, topology=topology, causal=causal, softmax_scale=softmax_scale,
                    cu_seqlens=cu_seqlens, cu_seqlens_padded=cu_seqlens_padded,
                    options=options, roles=roles, tag=tag, softmax_offset=softmax_offset,
                    window_size=window_size)
    out, lse = _attend(q, k, v, group, args)
    return (out, lse) if return_lse else out


def _attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
            group: dist.ProcessGroup | None, args: CallArgs) -> tuple[torch.Tensor, torch.Tensor]:
    """One call, ``(out, lse)`` in the caller's layout: prepare it, let ``auto_tune`` measure
    its shortlist first where it has one (each candidate is this call with another ``algo``),
    run the plans under one autograd node."""
    if not dist.is_available() or not dist.is_initialized():
        raise RuntimeError("cp_attention: torch.distributed is not initialised; call "
                           "torch.distributed.init_process_group (or run under torchrun) first")
    call = prepare(q, k, v, group, args)
    if call.resolved.tune is not None:  # auto_tune: this shape's first auto call measures
        def candidate(name: str, *tensors: torch.Tensor | None) -> torch.Tensor:
            one = args.with_(algo=name, options=call.options.with_(auto_tune=None),
                             tag=f"{args.tag or 'auto'}: auto-tune {name}",
                             softmax_offset=tensors[3])
            return _attend(*tensors[:3], group, one)[0]

        call = tune_call(call, candidate, q, k, v, args.softmax_offset)
    qi, ki, vi = call.layout.to_internal(q, k, v)
    out, lse_sbh = _CPAttention.apply(qi, ki, vi, args.softmax_offset, call)
    return call.layout.out_from_internal(out, lse_sbh)


def resolve_algo(q: torch.Tensor, k: torch.Tensor, *, group: dist.ProcessGroup | None = None,
                 **arguments: object) -> str:
    """The algorithm ``cp_attention(q, k, v, group=group, **arguments)`` runs (sbhd ``q``,
    ``k``; tensors on the ``meta`` device do; ``algo`` defaults to ``"auto"`` here): for
    ``"auto"`` the performance model's pick, made by the same code as the call's (with
    ``auto_tune``, the pick measured for this shape if it has been, else the model's); any
    other name unchanged. No communication unless the topology is ``"auto"`` (a probe, then a
    collective). For reporting what ``auto`` chose (the benchmark's ``auto`` contender);
    raises what the call would raise for a bad profile or name."""
    args = CallArgs.of(**{"algo": "auto", **arguments})
    cp_size = dist.get_world_size(group)
    request = build_request(q, k, k, cp_size, args)
    if args.algo != "auto":
        return args.algo
    return resolve_call(request, group, cp_size, model_cluster(request.options)).algo


class _CPAttention(torch.autograd.Function):
    """Forward and backward plans under one autograd node (the kernels' lse has no autograd);
    internal ``[s, b, h, d]`` blocks of either layout."""

    @staticmethod
    def forward(ctx, q, k, v, offset, call: Call):
        out, lse, saved = run_forward(call, q, k, v, offset)
        ctx.save_for_backward(*saved, offset)
        ctx.call = call
        ctx.mark_non_differentiable(lse)
        return out, lse

    @staticmethod
    def backward(ctx, dout, _dlse):
        q, k, v, out, lse, offset = ctx.saved_tensors
        grads = run_backward(ctx.call, q, k, v, out, lse, dout, offset)
        return (*grads, *(() if offset is not None else (None,)), None)
