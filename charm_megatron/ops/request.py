"""One ``cp_attention`` call as a value: what it is, before anything is resolved or sent.

A :class:`CallRequest` holds the descriptions of the tensors (never the tensors), the layout,
the algorithm as asked for, the topology as given, the mask, the scale, the options and the
algorithm settings. Every rank builds it from its own arguments; its :meth:`fields` are what
the ranks agree on (ops/agreement.py), so agreeing on them is agreeing on the plans, which are
a pure function of them (and of the probe's all-gathered result).
"""

from __future__ import annotations

import hashlib
import math
from dataclasses import dataclass

import torch

import charm_megatron
from charm_megatron.ops.auto_tune import picks_digest
from charm_megatron.ops.layouts import Layout
from charm_megatron.ops.options import CPOptions
from charm_megatron.plan.settings import Values
from charm_megatron.plan.vocab import Direction


@dataclass(frozen=True)
class TensorDesc:
    """Shape, dtype and device type of one input (what a message's size depends on)."""

    shape: tuple[int, ...]
    dtype: torch.dtype
    device: str

    @classmethod
    def of(cls, t: torch.Tensor) -> TensorDesc:
        return cls(tuple(t.shape), t.dtype, t.device.type)

    def field(self) -> tuple:
        return (self.shape, str(self.dtype), self.device)

    @property
    def element_size(self) -> int:
        return torch.empty((), dtype=self.dtype).element_size()


def check_scale(softmax_scale, head_dim: int) -> float:
    """The softmax scale of a call (``None``: ``1/sqrt(head_dim)``)."""
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


def check_backend(opts: CPOptions, q: torch.Tensor) -> None:
    if opts.backend == "flash_attn" and (q.device.type != "cuda"
                                         or q.dtype not in (torch.float16, torch.bfloat16)):
        raise ValueError(f"cp_attention: the flash_attn backend runs fp16/bf16 on CUDA only, "
                         f"not {q.dtype} on {q.device.type}; choose backend 'torch' "
                         "(CHARM_ATTN_BACKEND / CPOptions.backend) or cast the inputs")


def check_softmax_offset(offset, q: torch.Tensor, heads: int) -> TensorDesc | None:
    """``softmax_offset``'s description: ``None``, or a floating tensor ``[h_q]`` on q's
    device (a sink per query head: learnable, or zeros for "off-by-one")."""
    if offset is None:
        return None
    if not isinstance(offset, torch.Tensor):
        raise TypeError(f"cp_attention: softmax_offset must be a tensor [h_q] or None, got "
                        f"{type(offset).__name__}")
    if not offset.is_floating_point():
        raise TypeError(f"cp_attention: softmax_offset must be a floating tensor, got "
                        f"{offset.dtype}")
    if tuple(offset.shape) != (heads,):
        raise ValueError(f"cp_attention: softmax_offset has shape {tuple(offset.shape)}; it "
                         f"must be [h_q] = [{heads}], one offset per query head of this rank")
    if offset.device != q.device:
        raise ValueError(f"cp_attention: softmax_offset is on {offset.device}, q on "
                         f"{q.device}; put them on one device")
    return TensorDesc.of(offset)


def offset_values(offset: torch.Tensor) -> str:
    """What the ranks agree on of ``softmax_offset``'s values: a digest of them, read on the
    host (one device-to-host copy of ``h_q`` numbers per call). This call's values: a learnable
    sink changes every step, identically on every rank after the gradient all-reduce.
    ``ValueError`` naming the heads where a value is NaN or infinite."""
    values = offset.detach().to("cpu", torch.float64)
    bad = (~torch.isfinite(values)).nonzero().flatten().tolist()
    if bad:
        shown = ", ".join(f"head {h}: {values[h].item()}" for h in bad[:8])
        more = f" and {len(bad) - 8} more" if len(bad) > 8 else ""
        raise ValueError(f"cp_attention: softmax_offset holds non-finite values ({shown}{more}); "
                         "every offset must be a finite number (an offset of -inf is no sink: "
                         "pass softmax_offset=None)")
    values = values + 0.0  # -0.0 and 0.0 are the same offset
    digest = hashlib.blake2b(values.numpy().tobytes(), digest_size=8).hexdigest()
    return f"{values.numel()} values, digest {digest}"


def check_window(window_size) -> tuple[int, int] | None:
    """``window_size`` as ``(left, right)`` ints (``-1``: unbounded), or ``None`` (no window;
    also for ``(-1, -1)``). On packed THD calls it is measured inside each document. What a
    call runs and agrees on is :func:`effective_window` of it."""
    if window_size is None:
        return None
    if (not isinstance(window_size, (tuple, list)) or len(window_size) != 2
            or not all(isinstance(w, int) and not isinstance(w, bool) for w in window_size)):
        raise TypeError(f"cp_attention: window_size must be (left, right) ints or None, got "
                        f"{window_size!r}")
    left, right = window_size
    if left < -1 or right < -1:
        raise ValueError(f"cp_attention: window_size={tuple(window_size)}: each side must be "
                         ">= 0, or -1 for unbounded (flash-attn's convention)")
    if left == right == -1:
        return None
    return int(left), int(right)


def effective_window(window: tuple[int, int] | None, causal: bool,
                     span: int) -> tuple[int, int] | None:
    """The window a call runs, normalised so that windows of one mask are one value: a side
    that reaches ``span`` (the largest query - key distance there is: the sequence length - 1,
    on packed THD the longest document's) is unbounded (``-1``); under ``causal`` the right
    side is ``0`` (causal already hides every key right of the query); ``None`` where nothing
    is left of the window (``(-1, -1)``; ``(-1, 0)`` under ``causal``)."""
    if window is None:
        return None
    left, right = (-1 if w >= max(span, 0) else w for w in window)
    if causal:
        right = 0
    if left == -1 and right == (0 if causal else -1):
        return None
    return left, right


def _topology_desc(topology) -> str:
    groups = getattr(topology, "groups", None)
    return repr(tuple(tuple(g) for g in groups)) if groups is not None else repr(topology)


def cluster_digest(cluster) -> str | None:
    """A digest of the cluster the call predicts with (``None``: the generic one), so that ranks
    that read different profile files under one name disagree loudly instead of choosing
    different plans."""
    if cluster is None:
        return None
    return hashlib.sha256(repr(cluster).encode()).hexdigest()[:16]


@dataclass(frozen=True)
class CallRequest:
    """Everything one call is (see module docstring)."""

    q: TensorDesc
    k: TensorDesc
    v: TensorDesc
    layout: Layout
    algo: str
    topology: object  # a Topology, a topology string, or None (the options' default)
    causal: bool
    scale: float
    options: CPOptions
    settings: Values  # every registered algorithm setting's value for this call
    tag: str | None = None  # the caller's name for the call site (Megatron: the layer)
    softmax_offset: TensorDesc | None = None  # a sink per query head (None: vanilla softmax)
    window: tuple[int, int] | None = None  # sliding window (left, right), effective; None: none
    # a digest of softmax_offset's values (offset_values); None: no offset, or not read
    # (no agreement: CP size 1 or check="off")
    softmax_offset_values: str | None = None

    def fields(self, direction: Direction, call: int,
               cluster=None) -> tuple[tuple[str, object], ...]:
        """What the ranks must agree on for ``direction`` of call number ``call``."""
        opts = self.options
        return (
            ("charm_megatron version", charm_megatron.__version__),
            ("direction", str(direction)),
            ("call number on this CP group", call),
            ("layout", self.layout.name),
            ("q shape/dtype/device", self.q.field()),
            ("k shape/dtype/device", self.k.field()),
            ("v shape/dtype/device", self.v.field()),
            ("algo", self.algo),
            ("topology", _topology_desc(self.topology)),
            ("causal", bool(self.causal)),
            ("softmax_scale", self.scale),
            ("call tag", self.tag),
            ("window_size (effective)", self.window),
            ("softmax_offset shape/dtype/device",
             None if self.softmax_offset is None else self.softmax_offset.field()),
            ("softmax_offset values", self.softmax_offset_values),
            ("kernel backend", opts.backend_name),
            ("default topology (CHARM_TOPOLOGY)", opts.topology),
            ("ablation", str(opts.ablation)),
            ("model profile (CHARM_MODEL_PROFILE)", (opts.model_profile,
                                                     cluster_digest(cluster))),
            ("auto candidates (CHARM_AUTO_ALGOS)", opts.auto_algos),
            ("auto tuning (CHARM_AUTO_TUNE)", opts.auto_tune),
            # The measured picks this rank holds: a rank that lost them (restarted) would run
            # another plan than its peers; this names it instead (ops/auto_tune.py).
            ("auto-tune picks held", picks_digest() if opts.auto_tune is not None else None),
            ("partials on the wire (CHARM_PARTIALS)", str(opts.partials)),
            ("transport (CHARM_TRANSPORT)", opts.transport_name),
            *((f"{name}{_env_hint(name)}", str(value)) for name, value in
              self.settings.items()),
            *self.layout.fields(),
        )


def _env_hint(name: str) -> str:
    from charm_megatron.ops.options import setting_env

    env = setting_env(name)
    return f" ({env})" if env else ""
