"""What a ``cp_attention`` call checks, agrees on and resolves before any plan runs; shared by
the sbhd entry point (ops/attention.py) and the packed one (ops/packed.py).

* :func:`check_scale`, :func:`check_backend`, :func:`model_cluster`: this rank's own checks
  (their verdict reaches every rank through the agreement check);
* :func:`signature`: the fields the ranks must agree on;
* :func:`default_topology`: the topology a call runs on when it names none;
* :func:`algo_and_groups`: the algorithm to run (``auto``: the model's choice) and its groups;
* :func:`needs_cluster`, :func:`split_choice`, :func:`split_q_choice`: whether the call
  predicts with the model, whether CHARM+'s visiting kv crosses in row halves
  (``split_visiting``), and whether pass-q's counterpart q does (``split_counterpart_q``);
  :func:`split_modes`: the same settings as ``auto`` weighs charm with.
"""

from __future__ import annotations

import hashlib
import math

import torch

import charm_megatron
from charm_megatron.ops.agreement import Signature
from charm_megatron.ops.options import CPOptions
from charm_megatron.plan.cost import Problem
from charm_megatron.plan.registry import uses_topology


def check_scale(softmax_scale, head_dim: int) -> float:
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


def model_cluster(opts: CPOptions):
    """The cluster of ``opts.model_profile`` (``None``: generic); ValueError names the option."""
    from charm_megatron.model import auto_cluster

    return auto_cluster(opts.model_profile,
                        where="model_profile (CPOptions.model_profile / CHARM_MODEL_PROFILE)")


def signature(direction: str, seq: int, q, k, v, algo: str, topology, causal: bool, scale,
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
            ("split visiting kv (CHARM_SPLIT_VISITING)", opts.split_visiting),
            ("split counterpart q (CHARM_SPLIT_COUNTERPART_Q)", opts.split_counterpart_q),
            ("kernel backend", opts.backend_name),
            ("default topology (CHARM_TOPOLOGY)", opts.topology),
            ("ablation", opts.ablation),
            ("model profile (CHARM_MODEL_PROFILE)", (opts.model_profile,
                                                     _cluster_desc(cluster))),
        )
    # The role mix picks the plans of rmplus / charm as much as the algorithm does.
    fields += (("roles", roles),) + tuple(extra)
    return Signature(fields, f"{type(error).__name__}: {error}" if error is not None else "")


def default_topology(topology, algo: str, opts: CPOptions):
    """``topology``, or for an algorithm that uses one and was given none the options' default
    (``CHARM_TOPOLOGY``) or the probe (``"auto"``), passed on explicitly so that the topology code
    never reads the environment behind the options' back."""
    if topology is None and uses_topology(algo):
        return opts.topology or "auto"
    return topology


def algo_and_groups(algo: str, topology, group, cp_size: int, q: torch.Tensor, k: torch.Tensor,
                 causal: bool, cluster=None, roles: str = "paper",
                 opts: CPOptions | None = None) -> tuple[str, tuple[tuple[int, ...], ...]]:
    """The algorithm to run and its groups (one flat group for ring and rmplus); ``auto``
    predicts with ``cluster`` (``None``: the generic one for the topology), weighing charm
    with the splits it would then run (:func:`split_modes` of ``opts``)."""
    flat = (tuple(range(cp_size)),)
    if algo == "ring":
        return algo, flat
    from charm_megatron.topology import resolve_topology

    topo = resolve_topology(topology, group, algo, cp_size)
    groups = tuple(tuple(g) for g in topo.groups)
    if algo == "auto":
        from charm_megatron.model import choose_algo_cached

        # A pure function of shapes and topology: every rank picks the same algorithm.
        visiting, counterpart_q = split_modes(opts, cluster)
        algo = choose_algo_cached(groups, _problem(q, k, cp_size), cluster, causal=causal,
                                  roles=roles, split_visiting=visiting,
                                  split_counterpart_q=counterpart_q)
    return algo, (groups if uses_topology(algo) else flat)


def _problem(q: torch.Tensor, k: torch.Tensor, cp_size: int) -> Problem:
    """The model's problem of a call (sbhd shapes of one rank's shard)."""
    return Problem(q.shape[1], q.shape[0] * cp_size, q.shape[2], k.shape[2], q.shape[3],
                   q.element_size())


def split_modes(opts: CPOptions | None, cluster) -> tuple[str, str]:
    """The split modes (visiting kv, counterpart q) that :func:`split_choice` and
    :func:`split_q_choice` will apply, for the model to weigh charm with before ``auto``
    picks: ``auto`` stays the model's pick only where the call has a profile to predict with
    (without one charm runs whole blocks)."""
    if opts is None:
        return "off", "off"
    profiled = opts.model_profile is not None and cluster is not None

    def mode(m: str) -> str:
        return "off" if m == "auto" and not profiled else m

    return mode(opts.split_visiting), mode(opts.split_counterpart_q)


def needs_cluster(algo: str, opts: CPOptions) -> bool:
    """Whether the call predicts with the performance model (so reads ``model_profile``)."""
    return algo == "auto" or (algo == "charm" and opts.model_profile is not None
                              and "auto" in (opts.split_visiting, opts.split_counterpart_q))


def split_choice(opts: CPOptions, algo: str, groups: tuple[tuple[int, ...], ...], causal: bool,
                 roles: str, q: torch.Tensor, k: torch.Tensor, cp_size: int,
                 cluster=None) -> tuple[bool, bool]:
    """Whether CHARM+'s visiting kv crosses in two row halves, forward and backward: forced by
    ``opts.split_visiting``, else the model's pick on the cluster of ``opts.model_profile``.
    Without a profile, whole blocks: the split pays only where a slow link is shared (one NIC
    per node), which the generic cluster cannot know, and the GPU profiles predict it slower.
    A pure function of what the ranks agreed on, so every rank builds the same plans."""
    return _split(0, opts, algo, groups, causal, roles, q, k, cp_size, cluster)


def split_q_choice(opts: CPOptions, algo: str, groups: tuple[tuple[int, ...], ...],
                   causal: bool, roles: str, q: torch.Tensor, k: torch.Tensor, cp_size: int,
                   cluster=None) -> tuple[bool, bool]:
    """:func:`split_choice` for pass-q's counterpart q (``opts.split_counterpart_q``; the
    model's :func:`~charm_megatron.model.choose_split_counterpart_q`): whole blocks without
    a profile (the GPU profiles predict the split slower: it fetches the group's kv blocks
    once per half)."""
    return _split(1, opts, algo, groups, causal, roles, q, k, cp_size, cluster)


def _split(which: int, opts: CPOptions, algo: str, groups, causal: bool, roles: str,
           q: torch.Tensor, k: torch.Tensor, cp_size: int, cluster) -> tuple[bool, bool]:
    """Forward and backward of split ``which`` (0: visiting kv, 1: counterpart q): the rule
    ``auto`` weighs charm with (:func:`split_modes`, :func:`~charm_megatron.model.charm_splits`),
    so what runs is what was predicted."""
    if algo != "charm":
        return False, False
    from charm_megatron.model import charm_splits

    visiting, counterpart_q = split_modes(opts, cluster)
    forward, backward = charm_splits(groups, _problem(q, k, cp_size), cluster, causal=causal,
                                     roles=roles, split_visiting=visiting,
                                     split_counterpart_q=counterpart_q)
    return forward[which], backward[which]
