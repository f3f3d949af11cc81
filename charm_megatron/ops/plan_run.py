"""One CP call's plans and how a rank runs them: the resolved call (:class:`Call`), its validated
forward / backward plans, and :func:`run_forward` / :func:`run_backward` with the failure model's
status exchange (docs/api.md). Shared by the sbhd autograd function (ops/attention.py) and the
packed one (ops/packed.py), which differ only in the executor they build."""

from __future__ import annotations

import functools
from dataclasses import dataclass

import torch
import torch.distributed as dist

from charm_megatron.ops import agreement
from charm_megatron.ops.agreement import CPAttentionError
from charm_megatron.ops.call_setup import signature
from charm_megatron.ops.executor import Executor, delta_exponent
from charm_megatron.ops.options import CPOptions
from charm_megatron.ops.streams import StreamGroups, control_timeout_s, rebuild, stream_groups
from charm_megatron.plan.core import Plan
from charm_megatron.plan.registry import build_plan
from charm_megatron.plan.roles import RoleShape
from charm_megatron.plan.validate import validate


@functools.lru_cache(maxsize=256)
def plans(algo: str, groups: tuple[tuple[int, ...], ...], causal: bool, order: str,
          roles: str = "paper", shape: RoleShape | None = None,
          split: tuple[bool, bool] = (False, False),
          split_q: tuple[bool, bool] = (False, False)) -> tuple[Plan, Plan]:
    """Forward and backward plans, validated once per (algo, topology, mask, pass order, role
    mix, the shape the byte rule reads, split visiting kv and split counterpart q, each
    (forward, backward)): every rank derives the same plans from them."""
    fwd = build_plan(algo, "forward", groups, causal, shape=shape, pass_order=order, roles=roles,
                     split_visiting=split[0], split_counterpart_q=split_q[0])
    bwd = build_plan(algo, "backward", groups, causal, shape=shape, pass_order=order,
                     roles=roles, split_visiting=split[1], split_counterpart_q=split_q[1])
    validate(fwd)
    validate(bwd)
    return fwd, bwd


@dataclass(frozen=True)
class Call:
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
    split: tuple[bool, bool] = (False, False)  # split visiting kv (forward, backward)
    split_q: tuple[bool, bool] = (False, False)  # split counterpart q (forward, backward)

    def what(self, direction: str) -> str:
        return f"cp_attention(algo={self.algo}, {direction})"

    def plans(self) -> tuple[Plan, Plan]:
        return plans(self.algo, self.groups, self.causal, self.options.pass_order, self.roles,
                      self.shape, self.split, self.split_q)


def run_plan(call: Call, sg: StreamGroups, ex: Executor, ops, direction: str) -> None:
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


def run_forward(call: Call, make_executor, q: torch.Tensor, k: torch.Tensor,
                v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """This rank's forward plan (shared by the sbhd and the packed operator): ``out`` in q's
    dtype and the accumulated lse ``[s, b, h]``. ``make_executor(sg, direction)`` builds the
    executor (the packed one adds its document layout)."""
    fwd, _ = call.plans()
    sg = stream_groups(call.group, call.options.timeout_s)
    ex = make_executor(sg, "forward")
    ex.set_own("own.q", "q", q)
    ex.set_own("own.kv", "kv", k, v)
    run_plan(call, sg, ex, fwd.ops[dist.get_rank(call.group)], "forward")
    acc_out, acc_lse = ex.result(Plan.OUT)
    return acc_out.to(q.dtype), acc_lse


def run_backward(call: Call, make_executor, q: torch.Tensor, k: torch.Tensor,
                 v: torch.Tensor, out: torch.Tensor, lse_sbh: torch.Tensor,
                 dout: torch.Tensor, extra: tuple = ()) -> tuple[torch.Tensor, ...]:
    """This rank's backward plan after the ranks agree again (``extra``: more signature
    fields, e.g. the packed layout): dq, dk, dv in the inputs' dtypes."""
    _, bwd = call.plans()
    sg = stream_groups(call.group, call.options.timeout_s)
    if sg.size > 1 and call.options.check != "off":
        sig = signature("backward", call.seq, q, k, v, call.algo, call.groups, call.causal,
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
    ex.set_own_output("own.qgrad", out.to(q.dtype))
    ex.set_own("own.kv", "kv", k, v)
    run_plan(call, sg, ex, bwd.ops[dist.get_rank(call.group)], "backward")
    (dq,) = ex.result(Plan.DQ)
    dk, dv = ex.result(Plan.DKV)
    return dq.to(q.dtype), dk.to(k.dtype), dv.to(v.dtype)
