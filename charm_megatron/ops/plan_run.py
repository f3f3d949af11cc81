"""How a rank runs a prepared call's plans: one executor factory, :func:`run_forward` and
:func:`run_backward`, and the failure model's status exchange after each plan (docs/api.md).
The same for both layouts; the layout builds the executor (ops/layouts.py)."""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.distributed as dist

from charm_megatron.kernels.head_dims import HeadDimPadding
from charm_megatron.kernels.window import Window
from charm_megatron.ops import agreement, head_stage, softmax_offset
from charm_megatron.ops.agreement import CPAttentionError
from charm_megatron.ops.executor import BlockShape, ExecOptions, Executor
from charm_megatron.ops.failsafe import GuardedBackend
from charm_megatron.ops.options import kernel_backend
from charm_megatron.ops.prepare import Call
from charm_megatron.ops.row_delta import delta_exponent, scaled_delta
from charm_megatron.ops.streams import (
    StreamGroups,
    control_timeout_s,
    ensure_streams,
    stream_groups,
)
from charm_megatron.ops.transport import get_transport
from charm_megatron.plan.core import Plan
from charm_megatron.plan.head_stage import HeadStage
from charm_megatron.plan.vocab import Direction


def make_executor(call: Call, sg: StreamGroups, q: torch.Tensor, k: torch.Tensor,
                  v: torch.Tensor, direction: Direction, head_group: int = 1, *,
                  lanes_held: bool = False) -> Executor:
    """The executor of one direction of ``call`` on internal ``[s, b, h, d]`` blocks: its
    kernels behind the failure guard, its layout's tile computation, its options' transport. ``head_group`` ``a``:
    its blocks are super-blocks of a head all-to-all (``a`` times the rows of ``q``, ``k``,
    ``v``, ``1/a`` of their heads; ``lanes_held``: ``q``, ``k``, ``v`` already are such
    super-blocks, as the backward's saved tensors are)."""
    opts = call.options
    dv = v.shape[3]
    a = head_group
    grow = 1 if lanes_held else a
    shape = BlockShape(q.shape[0] * grow, q.shape[1], q.shape[2] // grow, k.shape[2] // grow,
                       q.shape[3], q.dtype, q.device, dv)
    backend = kernel_backend(opts, q.device, q.dtype)
    if dv != q.shape[3]:
        backend = HeadDimPadding(backend)  # the fused kernels take one head dim
    backend = GuardedBackend(backend)
    window = call.request.window
    extra = {} if window is None else {"window": Window(
        window[0], window[1], sg.size, shape.s, causal=call.request.causal, group=a)}
    run = ExecOptions(compute=opts.compute, comm=opts.comm, timeout_s=opts.timeout_s,
                      what=call.what(direction), wide_partials=opts.wide_partials)
    return call.layout.executor(sg, backend, shape, call.scale,
                                forced_backend=opts.backend is not None, head_group=a,
                                options=run, transport=get_transport(opts.transport), **extra)


def run_plan(call: Call, sg: StreamGroups, ex: Executor, work: Callable[[], None],
             direction: Direction) -> None:
    """Run this rank's part of the call and share how it went (:func:`_run_and_share`), then
    wait for what the device still has queued: an emulated GPU's timed device queues its ops
    as a GPU's stream does (lab/emulate/device.py), and a call must return only when its
    device work is done, so that its measured time holds all of it (on a real device this is
    nothing; the caller synchronises its stream). After the status exchange, whose messages
    need no device result: on a GPU it overlaps the last kernels too."""
    _run_and_share(call, sg, ex, work, direction)
    ex.synchronize()


def _run_and_share(call: Call, sg: StreamGroups, ex: Executor, work: Callable[[], None],
                   direction: Direction) -> None:
    """Run this rank's part of the call (``work``: its plan's ops, with a head all-to-all's
    exchanges around them where the plan has one), then share how it went (docs/api.md,
    failure model).

    A kernel error is held back by the guarded backend, so every transfer still completes;
    any other error (a transfer that failed or timed out) marks the stream communicators for
    rebuilding, which every rank does together at the next call. Either way every rank
    raises."""
    exc: BaseException | None = None
    code = agreement.OK
    try:
        work()
    except Exception as e:  # noqa: BLE001 - shared with the other ranks, then re-raised
        exc, code = e, agreement.BROKEN
        sg.needs_rebuild = True
    ex.posts_done()  # before the status exchange, which no rank's link wait may wait on
    if exc is None and ex.backend.error is not None:
        exc, code = ex.backend.error, agreement.RAISED
    if sg.size == 1 or not call.checked:
        if exc is not None:
            raise exc
        return
    message = f"{type(exc).__name__}: {exc}" if exc is not None else ""
    # Bounded by the control group's longer timeout: a peer may first have to wait out a
    # transfer of its own before it gets here.
    codes, texts = agreement.report_status(sg, call.seq, direction is Direction.BACKWARD, code,
                                           message, control_timeout_s(call.options.timeout_s))
    if agreement.BROKEN in codes:
        sg.needs_rebuild = True  # every rank read the same table: all rebuild at the next call
    if exc is not None:
        raise exc
    failed = [r for r, c in enumerate(codes) if c != agreement.OK]
    if failed:
        detail = "; ".join(f"rank {r}: {texts[r]}" for r in failed)
        state = ("its communicators are rebuilt at the next call" if agreement.BROKEN in codes
                 else "every transfer completed")
        raise CPAttentionError(f"{call.what(direction)} failed on CP rank(s) {failed} "
                               f"({detail}); this rank's results are discarded, {state} and "
                               "the CP group is ready for the next call")


def _stage(call: Call, plan: Plan) -> HeadStage | None:
    """The head all-to-all around ``plan`` (``None``: it has none)."""
    if plan.head_group == 1:
        return None
    return HeadStage(plan.n, plan.head_group, call.request.causal)


def _into_lanes(call: Call, ex: Executor, stage: HeadStage, rank: int,
                *tensors: torch.Tensor) -> tuple[torch.Tensor, ...]:
    """This rank's tensors as its lane's super-block, in the rows the lanes' plan expects
    (packed documents: reordered, ops/packed.lane_order)."""
    placed = head_stage.to_heads(ex, stage, rank, *tensors)
    order = call.layout.lane_rows(stage, rank, tensors[0].device)
    return placed if order is None else tuple(t.index_select(0, order[0]) for t in placed)


def _out_of_lanes(call: Call, ex: Executor, stage: HeadStage, rank: int,
                  *tensors: torch.Tensor) -> tuple[torch.Tensor, ...]:
    """The inverse of :func:`_into_lanes`: super-block results home to their ranks' rows."""
    order = call.layout.lane_rows(stage, rank, tensors[0].device)
    if order is not None:
        tensors = tuple(t.index_select(0, order[1]) for t in tensors)
    return head_stage.to_rows(ex, stage, rank, *tensors)


def _lane_heads(offset: torch.Tensor, stage: HeadStage | None, rank: int) -> torch.Tensor:
    """The offsets of the heads this rank attends: all, or its lane's after a head
    all-to-all."""
    if stage is None:
        return offset
    h = offset.shape[0] // stage.a
    k = rank % stage.a
    return offset[k * h:(k + 1) * h]


def run_forward(call: Call, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                offset: torch.Tensor | None = None
                ) -> tuple[torch.Tensor, torch.Tensor, tuple[torch.Tensor, ...]]:
    """This rank's forward plan on internal blocks: ``out`` in q's dtype, the accumulated lse
    ``[s, b, h]`` (fp32; float64 for float64 inputs) and what the backward needs (``q, k, v,
    out, lse``: as given, or in the heads layout of a head all-to-all, as TE keeps them);
    with a softmax ``offset`` the results include it (ops/softmax_offset.py), applied to the
    accumulator before the cast."""
    fwd, _ = call.plans()
    stage = _stage(call, fwd)
    sg = stream_groups(call.group, call.options.timeout_s)
    ex = make_executor(call, sg, q, k, v, Direction.FORWARD, fwd.head_group)
    rank = dist.get_rank(call.group)
    held: dict[str, tuple[torch.Tensor, ...]] = {}

    def work() -> None:
        # Inside the guarded work: a creation that fails is shared like a failed transfer.
        ensure_streams(sg, fwd)
        qs, ks, vs = (q, k, v) if stage is None else _into_lanes(call, ex, stage, rank,
                                                                 q, k, v)
        ex.set_own("own.q", "q", qs)
        ex.set_own("own.kv", "kv", ks, vs)
        ex.run(fwd.ops[rank])
        acc_out, acc_lse = ex.result(Plan.OUT)
        if offset is not None:  # after a head all-to-all, on this lane's heads
            acc_out, acc_lse = softmax_offset.apply_forward(acc_out, acc_lse,
                                                            _lane_heads(offset, stage, rank))
        out = acc_out.to(q.dtype)
        held["saved"] = (qs, ks, vs, out, acc_lse)
        held["result"] = ((out, acc_lse) if stage is None
                          else _out_of_lanes(call, ex, stage, rank, out, acc_lse))

    run_plan(call, sg, ex, work, Direction.FORWARD)
    out, lse = held["result"]
    return out, lse, held["saved"]


def run_backward(call: Call, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                 out: torch.Tensor, lse_sbh: torch.Tensor, dout: torch.Tensor,
                 offset: torch.Tensor | None = None) -> tuple[torch.Tensor, ...]:
    """This rank's backward plan after the ranks agree again: dq, dk, dv in the inputs'
    dtypes, and with a softmax ``offset`` its gradient (this rank's rows' share). ``q`` ...
    ``lse_sbh`` are what :func:`run_forward` saved; ``dout`` is this rank's rows'."""
    _, bwd = call.plans()
    stage = _stage(call, bwd)
    sg = stream_groups(call.group, call.options.timeout_s)
    if sg.size > 1 and call.checked:
        timeout_s = call.options.timeout_s
        agreement.open_call(sg, timeout_s, forward_call=call.seq)
        sig = agreement.Signature(call.fields(Direction.BACKWARD))
        agreement.agree(sg, sig, call.seq, True, timeout_s)
    ex = make_executor(call, sg, q, k, v, Direction.BACKWARD, bwd.head_group, lanes_held=True)
    rank = dist.get_rank(call.group)
    held: dict[str, tuple[torch.Tensor, ...]] = {}

    def work() -> None:
        ensure_streams(sg, bwd)
        d_out = dout.to(q.dtype)
        if stage is not None:
            (d_out,) = _into_lanes(call, ex, stage, rank, d_out)
        # delta = rowsum(dout * out) is all the tiles' backward needs of the output (see
        # row_delta.out_with_delta), so the q-side bundle carries it instead of out, scaled
        # by the row's power of two 2**-e (e from max|dout|) so that it never overflows or
        # underflows; the receiver recomputes e from the dout it receives.
        e = delta_exponent(d_out)
        delta = scaled_delta(d_out, out, e)
        ex.set_own("own.qgrad", "qgrad", q, d_out,
                   torch.stack([lse_sbh, delta.to(lse_sbh.dtype)], -1))
        ex.set_own_output("own.qgrad", out.to(q.dtype))
        ex.set_own("own.kv", "kv", k, v)
        ex.run(bwd.ops[rank])
        (dq,) = ex.result(Plan.DQ)
        dk, dv = ex.result(Plan.DKV)
        grads = (dq.to(q.dtype), dk.to(k.dtype), dv.to(v.dtype))
        shares = None
        if offset is not None:  # each row's share of d offset: exp(o - L) * delta [s, b, h]
            unscaled = torch.ldexp(delta.double(), e.double())  # [s, b, h]: cheap in float64
            shares = softmax_offset.row_shares(lse_sbh, unscaled,
                                               _lane_heads(offset, stage, rank))
        if stage is not None:
            # The shares go home with the gradients (one more message per peer in the same
            # batch, 4 bytes per row and head as the forward's lse): a rank's d offset is its
            # own query rows' share under every algorithm, not its lane's heads'.
            grads = _out_of_lanes(call, ex, stage, rank, *grads,
                                  *(() if shares is None else (shares,)))
            if shares is not None:
                *grads, shares = grads
        held["grads"] = tuple(grads)
        if shares is not None:
            held["offset"] = ((-shares.sum(dim=(0, 1))).to(offset.dtype),)

    run_plan(call, sg, ex, work, Direction.BACKWARD)
    return (*held["grads"], *held.get("offset", ()))
