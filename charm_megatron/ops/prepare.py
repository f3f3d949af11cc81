"""One preparation for every ``cp_attention`` call: request -> agreement -> resolved call.

:func:`prepare` turns a call's arguments into a :class:`Call` in four steps, the same for both
layouts (the layout is a strategy it is given, :mod:`charm_megatron.ops.layouts`):

1. **Request** (this rank alone): options resolved from the environment once, the layout built
   from ``cu_seqlens``, every argument checked, the model profile read. Any ``TypeError`` or
   ``ValueError`` here is kept, not raised.
2. **Agreement** (the CP group): the request's fields, or this rank's error, reach every rank
   before any data moves (ops/agreement.py); every rank raises the same error.
3. **Resolution** (pure functions of what the ranks agreed on, plus the probe's collective):
   the topology, the algorithm (``auto``: the performance model's pick), the algorithm's own
   variants and its validated plans (ops/resolution.py).
4. The :class:`Call`, which the autograd function keeps for the backward.

With ``auto_tune``, the first ``auto`` call of a shape measures its shortlist between 3 and
the plan (:func:`tune_call`: whole calls of each candidate, then one exchange of the times)
and runs the measured pick.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

import torch
import torch.distributed as dist

from charm_megatron.ops import agreement, auto_tune, streams
from charm_megatron.ops.call import CallArgs
from charm_megatron.ops.layouts import Layout, Sbhd, Thd
from charm_megatron.ops.options import CPOptions, resolve
from charm_megatron.ops.request import (
    CallRequest,
    TensorDesc,
    check_backend,
    check_scale,
    check_softmax_offset,
    check_window,
    effective_window,
    offset_values,
)
from charm_megatron.ops.resolution import Resolved, model_cluster, resolve_call
from charm_megatron.ops.streams import StreamGroups, stream_groups
from charm_megatron.plan.core import Plan
from charm_megatron.plan.registry import CHOICES
from charm_megatron.plan.vocab import Direction


@dataclass(frozen=True)
class Call:
    """One call, resolved and agreed on; kept in the autograd context for its backward."""

    group: dist.ProcessGroup | None
    request: CallRequest
    resolved: Resolved
    seq: int  # the forward's call number on its CP group
    cluster: object = None  # the model's cluster the call predicted with (None: generic)

    @property
    def options(self) -> CPOptions:
        return self.request.options

    @property
    def layout(self) -> Layout:
        return self.request.layout

    @property
    def algo(self) -> str:
        return self.resolved.algo

    @property
    def groups(self) -> tuple[tuple[int, ...], ...]:
        return self.resolved.groups

    @property
    def scale(self) -> float:
        return self.request.scale

    @property
    def checked(self) -> bool:
        return self.options.checked

    def what(self, direction: Direction | str) -> str:
        return f"cp_attention(algo={self.algo}, {direction})"

    def plans(self) -> tuple[Plan, Plan]:
        return self.resolved.plans

    def fields(self, direction: Direction) -> tuple[tuple[str, object], ...]:
        return self.request.fields(direction, self.seq, self.cluster)


def build_request(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cp_size: int,
                  args: CallArgs) -> CallRequest:
    """This rank's request, every argument checked (TypeError / ValueError naming it)."""
    opts = resolve(args.options)
    if args.algo not in CHOICES:
        raise ValueError(f"cp_attention: unknown algo {args.algo!r}; choose one of "
                         f"{', '.join(CHOICES)}")
    # cp_attention's roles argument, where given, over the options' (default bytes).
    settings = opts.values(**({} if args.roles is None else {"roles": args.roles}))
    layout: Layout = (Thd.of(args.cu_seqlens, args.cu_seqlens_padded, cp_size, q)
                      if args.packed else Sbhd())
    layout.check(q, k, v, args.causal, cp_size)
    scale = check_scale(args.softmax_scale, q.shape[-1])
    check_backend(opts, q)
    if args.tag is not None and not isinstance(args.tag, str):
        raise TypeError(f"cp_attention: tag must be a string or None, got "
                        f"{type(args.tag).__name__}")
    offset = check_softmax_offset(args.softmax_offset, q, layout.heads(q, k)[2])
    # The ranks agree on the offset's values (a digest read on the host), not only its shape:
    # read only where the agreement runs (not at CP size 1, nor with check="off", which CUDA
    # graph capture needs).
    agreed = offset is not None and cp_size > 1 and opts.checked
    values = offset_values(args.softmax_offset) if agreed else None
    # The window as it acts (windows of one mask are one value): what runs and is agreed on.
    window = effective_window(check_window(args.window_size), bool(args.causal),
                              layout.span(q, cp_size))
    if opts.auto_tune is not None and opts.auto_tune_file is not None:
        # Read at its first use, before the agreement: the picks digest covers what it read.
        auto_tune.use_file(opts.auto_tune_file)
    return CallRequest(TensorDesc.of(q), TensorDesc.of(k), TensorDesc.of(v), layout, args.algo,
                       args.topology, bool(args.causal), scale, opts, settings, args.tag,
                       offset, window, softmax_offset_values=values)


def prepare(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, group: dist.ProcessGroup | None,
            args: CallArgs) -> Call:
    """The prepared call of ``cp_attention(q, k, v, group=group, **args)`` (see module
    docstring); raises what ``cp_attention`` documents, on every rank alike."""
    cp_size = dist.get_world_size(group)
    request, cluster, error = None, None, None
    try:  # this rank's own checks; the verdict is shared by the agreement below
        request = build_request(q, k, v, cp_size, args)
        cluster = model_cluster(request.options)  # a profile this rank cannot read fails all
    except (TypeError, ValueError, NotImplementedError) as exc:
        error = exc
    opts = request.options if request is not None else CPOptions()
    try:
        sg = stream_groups(group, opts.timeout_s)
    except Exception:
        if cp_size > 1:
            streams.count_call_without_groups(group)
        raise
    checked = cp_size > 1 and opts.checked
    seq = agreement.open_call(sg, opts.timeout_s) if checked else _count(sg)
    if checked:
        fields = request.fields(Direction.FORWARD, seq, cluster) if request is not None else ()
        sig = agreement.Signature(fields, f"{type(error).__name__}: {error}" if error else "")
        agreement.agree(sg, sig, seq, False, opts.timeout_s, error)
    elif error is not None:
        raise error
    assert request is not None
    resolved = resolve_call(request, group, cp_size, cluster)
    return Call(group, request, resolved, seq, cluster)


def tune_call(call: Call, run, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
              offset: torch.Tensor | None) -> Call:
    """``call`` after its ``auto`` measured its shortlist (ops/auto_tune.py), resolved again
    to run the measured pick: ``run(algo, q, k, v, offset)`` is one call of a candidate."""
    assert call.resolved.tune is not None
    sg = stream_groups(call.group, call.options.timeout_s)
    auto_tune.tune(call.resolved.tune, run, (q, k, v, offset), sg, call.options)
    cp_size = dist.get_world_size(call.group)
    return replace(call, resolved=resolve_call(call.request, call.group, cp_size, call.cluster))


def _count(sg: StreamGroups) -> int:
    seq = sg.calls
    sg.calls += 1
    return seq
