"""How a rank runs a prepared call's plans: one executor factory, :func:`run_forward` and
:func:`run_backward`, and the failure model's status exchange after each plan (docs/api.md).
The same for both layouts; the layout builds the executor (ops/layouts.py)."""

from __future__ import annotations

import torch
import torch.distributed as dist

from charm_megatron.kernels.head_dims import HeadDimPadding
from charm_megatron.kernels.window import Window
from charm_megatron.ops import agreement, softmax_offset
from charm_megatron.ops.agreement import CPAttentionError
from charm_megatron.ops.executor import BlockShape, Executor, delta_exponent
from charm_megatron.ops.failsafe import GuardedBackend
from charm_megatron.ops.options import kernel_backend
from charm_megatron.ops.prepare import Call
from charm_megatron.ops.streams import StreamGroups, control_timeout_s, stream_groups
from charm_megatron.plan.core import Plan
from charm_megatron.plan.vocab import Direction


def make_executor(call: Call, sg: StreamGroups, q: torch.Tensor, k: torch.Tensor,
                  v: torch.Tensor, direction: Direction) -> Executor:
    """The executor of one direction of ``call`` on internal ``[s, b, h, d]`` blocks: its
    kernels behind the failure guard, its layout's tile computation."""
    opts = call.options
    dv = v.shape[3]
    shape = BlockShape(q.shape[0], q.shape[1], q.shape[2], k.shape[2], q.shape[3], q.dtype,
                       q.device, dv)
    backend = kernel_backend(opts, q.device, q.dtype)
    if dv != q.shape[3]:
        backend = HeadDimPadding(backend)  # the fused kernels take one head dim
    backend = GuardedBackend(backend)
    window = call.request.window
    extra = {} if window is None else {"window": Window(
        window[0], window[1], sg.size, q.shape[0], causal=call.request.causal)}
    return call.layout.executor(sg, backend, shape, call.scale,
                                forced_backend=opts.backend is not None,
                                compute=opts.compute, comm=opts.comm,
                                timeout_s=opts.timeout_s, what=call.what(direction), **extra)


def run_plan(call: Call, sg: StreamGroups, ex: Executor, ops, direction: Direction) -> None:
    """Run this rank's ops, then share how it went (docs/api.md, failure model).

    A kernel error is held back by the guarded backend, so every transfer still completes;
    any other error (a transfer that failed or timed out) marks the stream communicators for
    rebuilding, which every rank does together at the next call. Either way every rank
    raises."""
    exc: BaseException | None = None
    code = agreement.OK
    try:
        ex.run(ops)
    except Exception as e:  # noqa: BLE001 - shared with the other ranks, then re-raised
        exc, code = e, agreement.BROKEN
        sg.needs_rebuild = True
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


def run_forward(call: Call, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                offset: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """This rank's forward plan on internal blocks: ``out`` in q's dtype and the accumulated
    lse ``[s, b, h]`` (fp32; float64 for float64 inputs); with a softmax ``offset`` both
    include it (ops/softmax_offset.py), applied to the accumulator before the cast."""
    fwd, _ = call.plans()
    sg = stream_groups(call.group, call.options.timeout_s)
    ex = make_executor(call, sg, q, k, v, Direction.FORWARD)
    ex.set_own("own.q", "q", q)
    ex.set_own("own.kv", "kv", k, v)
    run_plan(call, sg, ex, fwd.ops[dist.get_rank(call.group)], Direction.FORWARD)
    acc_out, acc_lse = ex.result(Plan.OUT)
    if offset is not None:
        acc_out, acc_lse = softmax_offset.apply_forward(acc_out, acc_lse, offset)
    return acc_out.to(q.dtype), acc_lse


def run_backward(call: Call, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                 out: torch.Tensor, lse_sbh: torch.Tensor, dout: torch.Tensor,
                 offset: torch.Tensor | None = None) -> tuple[torch.Tensor, ...]:
    """This rank's backward plan after the ranks agree again: dq, dk, dv in the inputs'
    dtypes, and with a softmax ``offset`` its gradient (this rank's rows' share)."""
    _, bwd = call.plans()
    sg = stream_groups(call.group, call.options.timeout_s)
    if sg.size > 1 and call.checked:
        timeout_s = call.options.timeout_s
        agreement.open_call(sg, timeout_s, forward_call=call.seq)
        sig = agreement.Signature(call.fields(Direction.BACKWARD))
        agreement.agree(sg, sig, call.seq, True, timeout_s)
    ex = make_executor(call, sg, q, k, v, Direction.BACKWARD)
    dout = dout.to(q.dtype)
    # delta = rowsum(dout * out) is all the tiles' backward needs of the output (see
    # executor._out_with_delta), so the q-side bundle carries it instead of out, scaled by
    # the row's power of two 2**-e (e from max|dout|) so that it never overflows or
    # underflows; the receiver recomputes e from the dout it receives.
    wide = torch.float64
    e = delta_exponent(dout)
    unscaled = (dout.to(wide) * out.to(wide)).sum(-1)
    delta = torch.ldexp(unscaled, -e.to(wide))
    ex.set_own("own.qgrad", "qgrad", q, dout,
               torch.stack([lse_sbh, delta.to(lse_sbh.dtype)], -1))
    ex.set_own_output("own.qgrad", out.to(q.dtype))
    ex.set_own("own.kv", "kv", k, v)
    run_plan(call, sg, ex, bwd.ops[dist.get_rank(call.group)], Direction.BACKWARD)
    (dq,) = ex.result(Plan.DQ)
    dk, dv = ex.result(Plan.DKV)
    grads = (dq.to(q.dtype), dk.to(k.dtype), dv.to(v.dtype))
    if offset is None:
        return grads
    return (*grads, softmax_offset.offset_grad(lse_sbh, unscaled, offset))
