"""``CharmDotProductAttention``: CHARM+ context-parallel attention as a megatron-core core attention.

megatron-core's ``SelfAttention`` builds its core attention from the spec slot
``submodules.core_attention`` with the keyword arguments ``config, layer_number, attn_mask_type,
attention_type, cp_comm_type, softmax_scale, pg_collection`` and calls it as
``forward(query, key, value, attention_mask, *, attn_mask_type, attention_bias,
packed_seq_params)`` with ``query [s/cp, b, heads/tp, d]``, ``key, value [s/cp, b, groups/tp, d]``
in the load-balanced CP layout; it expects ``[s/cp, b, heads/tp * d]`` back. This module serves
that contract with :func:`charm_megatron.cp_attention`, so ``--cp-comm-type charm`` (or
``rmplus``, ``ring``, ``auto``) selects CHARM+ instead of Transformer Engine's CP attention.

What is not supported raises ``NotImplementedError`` naming the Megatron option, at construction
when the config says so, otherwise at the first forward call that uses it.
"""

from __future__ import annotations

import math
from typing import Any

import torch
from megatron.core import parallel_state
from megatron.core.process_groups_config import ProcessGroupCollection
from megatron.core.transformer.enums import AttnMaskType
from megatron.core.transformer.module import MegatronModule
from megatron.core.transformer.transformer_config import TransformerConfig
from megatron.core.transformer.utils import is_layer_window_attention
from torch import Tensor

# ``--cp-comm-type`` values served here (cp_attention's algos); defined in the torch-free args.
from charm_megatron.megatron.args import CHARM_COMM_TYPES
from charm_megatron.topology import resolve_topology

__all__ = [
    "CHARM_COMM_TYPES",
    "DEFAULT_COMM_TYPE",
    "CharmDotProductAttention",
    "get_topology",
    "set_topology",
]

#: Used when Megatron passes no ``cp_comm_type``: megatron-core's ``TransformerLayer`` only
#: forwards it when ``context_parallel_size > 1`` (CP size 1 makes the choice irrelevant), and
#: a bare ``TransformerConfig`` defaults it to ``None``. Whoever installed this module asked for
#: CHARM+, so that is the default.
DEFAULT_COMM_TYPE = "charm"

# Topology set by the launcher (``--charm-topology``); ``None`` defers to ``CHARM_TOPOLOGY`` and
# then to the probe, as charm_megatron.topology.resolve_topology decides.
_TOPOLOGY: str | None = None

# (algo, topology, CP group ranks) already announced: one line per process, not one per layer.
_LOGGED: set[tuple[str, str, tuple[int, ...]]] = set()


def set_topology(topology: str | None) -> None:
    """Set the CP topology used by every :class:`CharmDotProductAttention` built afterwards.

    ``topology`` is a string accepted by :func:`charm_megatron.cp_attention` (``auto``, ``node``,
    ``numa``, ``flat``, ``2x8``, ``0-7,8-15`` ...) or ``None``: then ``CHARM_TOPOLOGY`` applies,
    else the probe (``ring`` and ``rmplus`` treat an unset topology as flat). The launcher calls
    this with ``--charm-topology``.
    """
    global _TOPOLOGY
    if topology is not None and not str(topology).strip():
        raise ValueError("charm-megatron: empty topology; use e.g. 'auto', 'flat' or '2x4'")
    _TOPOLOGY = None if topology is None else str(topology).strip()


def get_topology() -> str | None:
    """The topology set by :func:`set_topology` (``None``: ``CHARM_TOPOLOGY``, then the probe)."""
    return _TOPOLOGY


def _group_ranks(group: Any) -> tuple[int, ...]:
    if group is None:
        return ()
    return tuple(torch.distributed.get_process_group_ranks(group))


def _unsupported(option: str, why: str) -> NotImplementedError:
    return NotImplementedError(f"CharmDotProductAttention (CHARM+ CP attention): {option} {why}")


class CharmDotProductAttention(MegatronModule):
    """Core attention for megatron-core's ``SelfAttention`` backed by CHARM+ context parallelism.

    Drop-in for ``DotProductAttention`` / ``TEDotProductAttention`` in the spec slot
    ``submodules.self_attention.submodules.core_attention`` (see
    :func:`charm_megatron.megatron.use_charm`). Tensors are Megatron's sbhd: ``query
    [s/cp, b, heads/tp, d]``, ``key, value [s/cp, b, groups/tp, d]`` in the load-balanced CP
    layout (``get_batch_on_this_cp_rank``); the result is ``[s/cp, b, heads/tp * d]``.

    * ``cp_comm_type``: ``charm`` (topology-aware CHARM+), ``rmplus``, ``ring`` or ``auto``
      (performance model picks); ``None`` means :data:`DEFAULT_COMM_TYPE`.
    * CP group: ``pg_collection.cp``, else ``parallel_state.get_context_parallel_group()``;
      its size must equal ``config.context_parallel_size``. CP size 1 is local attention.
    * Causal from ``attn_mask_type`` (``causal``; ``no_mask`` is full attention). The
      ``attention_mask`` tensor is not read for these types (as Transformer Engine does).
    * GQA: key/value carry ``num_query_groups / tp`` heads and are not repeated.
    * ``softmax_scale`` (``None``: ``1/sqrt(d)``). ``apply_query_key_layer_scaling`` divides the
      scale by ``layer_number`` before ``q k^T`` and multiplies the scores back by it inside an
      fp32 softmax in Megatron's ``DotProductAttention``; the product is unchanged, and the
      CHARM+ kernels already keep scores and softmax statistics in fp32, so the effective scale
      passed on is ``softmax_scale`` (the coefficient is kept as ``qk_layer_scaling_coeff``).
    """

    def __init__(
        self,
        config: TransformerConfig,
        layer_number: int,
        attn_mask_type: AttnMaskType,
        attention_type: str,
        attention_dropout: float | None = None,
        softmax_scale: float | None = None,
        cp_comm_type: str | None = None,
        pg_collection: ProcessGroupCollection | None = None,
        **unsupported: Any,
    ) -> None:
        super().__init__(config=config)
        self.config: TransformerConfig = config
        self.layer_number = max(1, int(layer_number))
        self.attn_mask_type = attn_mask_type
        self.attention_type = attention_type

        if unsupported:
            # e.g. TE-only arguments (k_channels / v_channels for MLA, num_splits) from a spec
            # written for TEDotProductAttention.
            raise _unsupported(
                f"arguments {sorted(unsupported)}", "are not supported (they belong to another "
                "core attention; build the spec with charm_megatron.megatron.use_charm)"
            )
        if attention_type != "self":
            raise _unsupported(
                f"attention_type={attention_type!r}", "is not supported: CHARM+ serves causal "
                "self-attention over a CP-split sequence (use_charm leaves cross-attention alone)"
            )
        self.algo = self._check_comm_type(cp_comm_type)
        self._check_config(config, attn_mask_type)
        if getattr(config, "window_size", None) is not None and is_layer_window_attention(
            config.window_size, getattr(config, "window_attn_skip_freq", None), self.layer_number
        ):
            raise _unsupported(
                f"sliding window attention (window_size={config.window_size}, --window-size) "
                f"in layer {self.layer_number}",
                "is not supported",
            )

        # Dropout is only an error when it would act (training); see forward().
        self.attention_dropout_p = float(
            config.attention_dropout if attention_dropout is None else attention_dropout
        )

        # Process groups: explicit pg_collection first (megatron-core passes it), the global
        # parallel_state groups otherwise.
        tp_group = getattr(pg_collection, "tp", None) if pg_collection is not None else None
        if tp_group is None:
            tp_group = parallel_state.get_tensor_model_parallel_group(check_initialized=False)
        self.tp_group = tp_group
        cp_group = getattr(pg_collection, "cp", None) if pg_collection is not None else None
        if cp_group is None:
            cp_group = parallel_state.get_context_parallel_group(check_initialized=False)
        self.cp_group = cp_group
        self.cp_size = int(config.context_parallel_size)
        self._check_cp_group()

        # Heads per tensor-parallel partition, exactly as megatron-core's DotProductAttention
        # (Attention hands us a config whose num_query_groups is raised to the TP size when
        # there are fewer KV groups than TP ranks, so these divisions hold).
        tp_size = tp_group.size() if tp_group is not None else 1
        heads = config.num_attention_heads
        groups = config.num_query_groups or heads
        if heads % tp_size or groups % tp_size:
            raise ValueError(
                f"CharmDotProductAttention: num_attention_heads={heads} and num_query_groups="
                f"{groups} must be divisible by the tensor-parallel size {tp_size}"
            )
        self.num_attention_heads_per_partition = heads // tp_size
        self.num_query_groups_per_partition = groups // tp_size
        if self.num_attention_heads_per_partition % self.num_query_groups_per_partition:
            raise ValueError(
                f"CharmDotProductAttention: {self.num_attention_heads_per_partition} query heads "
                f"per partition are not a multiple of {self.num_query_groups_per_partition} "
                "key/value groups (GQA needs num_attention_heads % num_query_groups == 0)"
            )
        self.hidden_size_per_attention_head = config.kv_channels
        self.hidden_size_per_partition = (
            self.num_attention_heads_per_partition * self.hidden_size_per_attention_head
        )

        if softmax_scale is None:
            softmax_scale = 1.0 / math.sqrt(self.hidden_size_per_attention_head)
        self.qk_layer_scaling_coeff = (
            float(self.layer_number) if config.apply_query_key_layer_scaling else None
        )
        self.softmax_scale = float(softmax_scale)

        # Topology: resolved now so that a CP group / topology mismatch fails at model build on
        # every rank, not in the first collective of the first step.
        # resolve_topology is the operator's own rule (explicit, CHARM_TOPOLOGY, probe); the
        # probe is one cached all-gather over the CP group, which every CP rank reaches here.
        self.topology = resolve_topology(get_topology(), self.cp_group, self.algo, self.cp_size)
        self._log_once()

    # ------------------------------------------------------------------ checks
    @staticmethod
    def _check_comm_type(cp_comm_type: str | None) -> str:
        if cp_comm_type is None:
            return DEFAULT_COMM_TYPE
        if not isinstance(cp_comm_type, str) or cp_comm_type not in CHARM_COMM_TYPES:
            raise ValueError(
                f"CharmDotProductAttention: unknown cp_comm_type {cp_comm_type!r}; CHARM+ "
                f"serves {', '.join(CHARM_COMM_TYPES)} (--cp-comm-type charm). Megatron's own "
                "p2p / a2a / allgather / a2a+p2p belong to TEDotProductAttention: build the spec "
                "without use_charm for those"
            )
        return cp_comm_type

    @staticmethod
    def _check_config(config: TransformerConfig, attn_mask_type: AttnMaskType) -> None:
        if attn_mask_type not in (AttnMaskType.causal, AttnMaskType.no_mask):
            raise _unsupported(
                f"attn_mask_type={attn_mask_type.name}",
                "is not supported (only causal and no_mask; padding and arbitrary masks are not)",
            )
        softmax_type = getattr(config, "softmax_type", "vanilla")
        if softmax_type != "vanilla":
            raise _unsupported(
                f"softmax_type={softmax_type!r} (--softmax-type)", "is not supported; use vanilla"
            )
        for option, flag in (
            ("fp8_dot_product_attention", "--fp8-dot-product-attention"),
            ("fp8_multi_head_attention", "--fp8-multi-head-attention"),
        ):
            if getattr(config, option, False):
                raise _unsupported(
                    f"fp8 attention ({option}, {flag})",
                    "is not supported; fp8 linear layers (--fp8-format) are fine",
                )
        if getattr(config, "qk_clip", False) or getattr(config, "log_max_attention_logit", False):
            raise _unsupported(
                "qk_clip / log_max_attention_logit (--qk-clip, --log-max-attention-logit)",
                "are not supported (they need the per-head max attention logit)",
            )
        if getattr(config, "cuda_graph_impl", "none") not in (None, "none"):
            scopes = {
                str(getattr(x, "name", x)).lower() for x in (config.cuda_graph_scope or [])
            }
            # An empty scope list means the whole layer (megatron-core's "full").
            if not scopes or scopes & {"attn", "full", "full_iteration"}:
                raise _unsupported(
                    f"CUDA graphs over attention (cuda_graph_impl={config.cuda_graph_impl!r}, "
                    f"scope {sorted(scopes) or 'whole layer'}; --cuda-graph-impl / "
                    "--cuda-graph-scope)",
                    "are not supported: CP communication runs outside graph capture; "
                    "capture only mlp / moe scopes",
                )
        if getattr(config, "hybrid_context_parallel", False):
            raise _unsupported(
                "hybrid_context_parallel (--hybrid-context-parallel)",
                "is not supported (it uses packed THD sequences)",
            )

    def _check_cp_group(self) -> None:
        if self.cp_group is None:
            dist = torch.distributed
            world = dist.get_world_size() if dist.is_available() and dist.is_initialized() else 0
            # cp_attention(group=None) means the default group: only right when that group is
            # exactly this one rank (CP size 1 in a 1-process job).
            if self.cp_size > 1 or world != 1:
                raise RuntimeError(
                    f"CharmDotProductAttention: cp_comm_type={self.algo} with "
                    f"context_parallel_size={self.cp_size} needs a context-parallel process "
                    "group, but there is none: initialise torch.distributed and "
                    "megatron.core.parallel_state.initialize_model_parallel("
                    "context_parallel_size=...), or pass pg_collection with a .cp group"
                )
        if self.cp_group is not None:
            size = self.cp_group.size()
            if size != self.cp_size:
                raise RuntimeError(
                    f"CharmDotProductAttention: the CP process group has {size} ranks but "
                    f"config.context_parallel_size is {self.cp_size}; they must agree (the "
                    "sequence is split by the CP group size)"
                )

    def _log_once(self) -> None:
        ranks = _group_ranks(self.cp_group)
        key = (self.algo, str(self.topology), ranks)
        if key in _LOGGED:
            return
        _LOGGED.add(key)
        # Compact ("[[0,1],[2,3]]") so the line stays one grep-able token per field.
        groups = "[" + ",".join("[" + ",".join(map(str, g)) + "]" for g in self.topology.groups)
        line = (
            f"charm-megatron: cp_comm_type={self.algo} cp_size={self.cp_size} "
            f"topology={self.topology} groups={groups}]"
        )
        if not torch.distributed.is_initialized() or torch.distributed.get_rank() == 0:
            # One line from global rank 0, like Megatron's print_rank_0 (its CP group stands for
            # all: every CP group has the same size). Not logging.info: Megatron-LM sets the
            # root logger to INFO, which would repeat the line on every rank.
            print(f"{line} cp_ranks={','.join(map(str, ranks)) or '0'}", flush=True)

    # ------------------------------------------------------------------ forward
    def forward(
        self,
        query: Tensor,
        key: Tensor,
        value: Tensor,
        attention_mask: Tensor | None,
        attn_mask_type: AttnMaskType | None = None,
        attention_bias: Tensor | None = None,
        packed_seq_params: Any = None,
    ) -> Tensor:
        """Attention over the whole CP-split sequence; returns ``[s/cp, b, heads/tp * d]``.

        ``query [s/cp, b, heads/tp, d]``, ``key, value [s/cp, b, groups/tp, d]`` (sbhd, load-
        balanced CP layout). ``attention_mask`` is not read (causal / no_mask only).
        """
        from charm_megatron import cp_attention

        if packed_seq_params is not None and getattr(packed_seq_params, "qkv_format", None) != "thd":
            raise _unsupported(
                f"packed_seq_params with qkv_format="
                f"{getattr(packed_seq_params, 'qkv_format', None)!r}",
                "is not supported; packed sequences must use qkv_format='thd'",
            )
        if attention_bias is not None:
            raise _unsupported("attention_bias", "is not supported")
        if self.training and self.attention_dropout_p > 0.0:
            raise _unsupported(
                f"attention dropout in training (attention_dropout={self.attention_dropout_p}, "
                "--attention-dropout)",
                "is not supported; set --attention-dropout 0",
            )
        mask_type = self.attn_mask_type if attn_mask_type is None else attn_mask_type
        if mask_type not in (AttnMaskType.causal, AttnMaskType.no_mask):
            raise _unsupported(f"attn_mask_type={mask_type.name}", "is not supported")
        if packed_seq_params is not None:
            return self._forward_thd(query, key, value, packed_seq_params, mask_type)
        if query.dim() != 4 or key.dim() != 4 or value.dim() != 4:
            raise ValueError(
                "CharmDotProductAttention expects sbhd tensors [s, b, heads, d], got "
                f"query {tuple(query.shape)}, key {tuple(key.shape)}, value {tuple(value.shape)}"
            )
        if query.shape[0] != key.shape[0]:
            raise _unsupported(
                f"query length {query.shape[0]} != key length {key.shape[0]} (inference with a "
                "KV cache)",
                "is not supported",
            )
        if query.shape[2] != self.num_attention_heads_per_partition:
            raise ValueError(
                f"CharmDotProductAttention: query has {query.shape[2]} heads, expected "
                f"{self.num_attention_heads_per_partition} (num_attention_heads / tp)"
            )

        out = cp_attention(
            query,
            key,
            value,
            group=self.cp_group,
            algo=self.algo,
            topology=self.topology,
            causal=mask_type == AttnMaskType.causal,
            softmax_scale=self.softmax_scale,
        )
        # [s, b, h, d] -> [s, b, h*d]: the layout linear_proj consumes.
        return out.reshape(out.shape[0], out.shape[1], -1)

    def _forward_thd(self, query: Tensor, key: Tensor, value: Tensor, packed_seq_params: Any,
                     mask_type: AttnMaskType) -> Tensor:
        """Packed documents (``qkv_format="thd"``): ``query [t/cp, heads/tp, d]``, ``key, value
        [t/cp, groups/tp, d]`` in Megatron's THD CP layout; returns ``[t/cp, heads/tp * d]``.

        Reads ``cu_seqlens_q`` and ``cu_seqlens_q_padded`` (the kv ones must be the same:
        self-attention over one packed sequence); ``max_seqlen_*`` are not needed.
        """
        from charm_megatron import cp_attention

        psp = packed_seq_params

        def same(a: Any, b: Any) -> bool:
            if a is None or b is None:
                return a is None and b is None
            return a.shape == b.shape and bool(torch.equal(a.to(b.device), b))

        for q_name, kv_name in (("cu_seqlens_q", "cu_seqlens_kv"),
                                ("cu_seqlens_q_padded", "cu_seqlens_kv_padded")):
            if not same(getattr(psp, q_name, None), getattr(psp, kv_name, None)):
                raise _unsupported(
                    f"packed_seq_params.{q_name} != packed_seq_params.{kv_name}",
                    "is not supported: CHARM+ serves self-attention within each packed "
                    "document, so q and kv must have the same (padded) cumulative lengths",
                )
        if psp.cu_seqlens_q is None:
            raise ValueError("CharmDotProductAttention: packed_seq_params.cu_seqlens_q is None; "
                             "qkv_format='thd' needs the cumulative document lengths")
        if getattr(psp, "local_cp_size", None) not in (None, self.cp_size):
            raise _unsupported(
                f"packed_seq_params.local_cp_size={psp.local_cp_size} (hybrid context "
                "parallelism)", f"is not supported; the CP size is {self.cp_size}",
            )
        psp_group = getattr(psp, "cp_group", None)
        if psp_group is not None and _group_ranks(psp_group) != _group_ranks(self.cp_group):
            raise _unsupported(
                "packed_seq_params.cp_group differing from the layer's CP group (hybrid "
                "context parallelism)", "is not supported",
            )
        if query.dim() != 3 or key.dim() != 3 or value.dim() != 3:
            raise ValueError(
                "CharmDotProductAttention with qkv_format='thd' expects [t, heads, d] tensors, "
                f"got query {tuple(query.shape)}, key {tuple(key.shape)}"
            )
        if query.shape[1] != self.num_attention_heads_per_partition:
            raise ValueError(
                f"CharmDotProductAttention: query has {query.shape[1]} heads, expected "
                f"{self.num_attention_heads_per_partition} (num_attention_heads / tp)"
            )
        out = cp_attention(
            query, key, value, group=self.cp_group, algo=self.algo, topology=self.topology,
            causal=mask_type == AttnMaskType.causal, softmax_scale=self.softmax_scale,
            cu_seqlens=psp.cu_seqlens_q, cu_seqlens_padded=psp.cu_seqlens_q_padded,
        )
        return out.reshape(out.shape[0], -1)

    def sharded_state_dict(
        self, prefix: str = "", sharded_offsets: tuple = (), metadata: dict | None = None
    ) -> dict:
        """No parameters or buffers: nothing to checkpoint (so ring/rmplus/charm interchange)."""
        return {}

    def extra_repr(self) -> str:
        return (
            f"cp_comm_type={self.algo}, cp_size={self.cp_size}, topology={self.topology}, "
            f"heads={self.num_attention_heads_per_partition}, "
            f"kv_groups={self.num_query_groups_per_partition}, scale={self.softmax_scale:.6g}"
        )
