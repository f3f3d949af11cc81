"""``CharmDotProductAttention``: CHARM+ context-parallel attention as a megatron-core core attention.

megatron-core's ``SelfAttention`` builds its core attention from the spec slot
``submodules.core_attention`` with the keyword arguments ``config, layer_number, attn_mask_type,
attention_type, cp_comm_type, softmax_scale, pg_collection`` and calls it as
``forward(query, key, value, attention_mask, *, attn_mask_type, attention_bias,
packed_seq_params)`` with ``query [s/cp, b, heads/tp, d]``, ``key, value [s/cp, b, groups/tp, d]``
in the load-balanced CP layout; it expects ``[s/cp, b, heads/tp * d]`` back. This module serves
that contract with :func:`charm_megatron.cp_attention`, so ``--cp-comm-type charm`` (or
``rmplus``, ``ring``, ``auto``) selects CHARM+ instead of Transformer Engine's CP attention.

The module keeps all its state itself: the topology it was given (``topology=``, which
``use_charm(spec, topology=...)`` puts into the spec), the CP group, and the topologies it
resolved, one per CP group it has run on (dynamic CP hands it other groups per micro-batch).

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

from charm_megatron.kernels import check_qkv
from charm_megatron.megatron.args import TE_COMM_TYPES, our_comm_types, stand_in
from charm_megatron.megatron.comm_types import is_ours, layer_comm_type
from charm_megatron.megatron.local_attention import local_attention
from charm_megatron.ops.options import CPOptions
from charm_megatron.ops.streams import create_stream_groups
from charm_megatron.topology import Topology, resolve_topology

__all__ = [
    "DEFAULT_COMM_TYPE",
    "CharmDotProductAttention",
]

#: Used when Megatron passes no ``cp_comm_type``: megatron-core's ``TransformerLayer`` only
#: forwards it when ``context_parallel_size > 1`` (CP size 1 makes the choice irrelevant), and
#: a bare ``TransformerConfig`` defaults it to ``None``. Whoever installed this module asked for
#: CHARM+, so that is the default.
DEFAULT_COMM_TYPE = "charm"


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
      (performance model picks); ``None`` means :data:`DEFAULT_COMM_TYPE`. When
      ``config.cp_comm_type`` is a per-layer list, this layer's entry is read from it
      (entry ``layer_number - 1``, :func:`charm_megatron.megatron.comm_types.layer_comm_type`),
      whatever megatron-core passed (0.16.1 passes the next layer's entry).
    * ``topology``: a topology string (``auto``, ``node``, ``numa``, ``flat``, ``2x8``,
      ``0-7,8-15`` ...) or ``None`` (``CHARM_TOPOLOGY``, else the probe; ``ring`` / ``rmplus``:
      flat).
    * Settings: :class:`~charm_megatron.ops.options.CPOptions` built from the ``CHARM_*``
      variables once, at construction (``self.options``), and passed to every ``cp_attention``
      call; the CP group's stream communicators are created at construction too
      (:func:`~charm_megatron.ops.streams.create_stream_groups`).
    * CP group: ``pg_collection.cp``, else ``parallel_state.get_context_parallel_group()``;
      its size must equal ``config.context_parallel_size``. CP size 1 is local attention.
      Dynamic CP: ``packed_seq_params.cp_group`` / ``local_cp_size`` replace it for one call
      (:func:`call_group`).
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
        topology: str | None = None,
        k_channels: int | None = None,
        v_channels: int | None = None,
        **unsupported: Any,
    ) -> None:
        super().__init__(config=config)
        self.config: TransformerConfig = config
        self.layer_number = max(1, int(layer_number))
        self.attn_mask_type = attn_mask_type
        self.attention_type = attention_type

        if unsupported:
            # e.g. TE-only arguments (num_splits) from a spec
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
        self.algo = self._check_comm_type(
            layer_comm_type(getattr(config, "cp_comm_type", None), self.layer_number, cp_comm_type),
            self.layer_number,
        )
        self._check_config(config, attn_mask_type)
        # Sliding window on this layer (megatron-core's rule: window_size unless
        # window_attn_skip_freq makes this layer a full one); cp_attention applies it.
        window = getattr(config, "window_size", None)
        self.window_size: tuple[int, int] | None = (
            (int(window[0]), int(window[1])) if window is not None and is_layer_window_attention(
                window, getattr(config, "window_attn_skip_freq", None), self.layer_number)
            else None)

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
        # Every setting of the cp_attention calls (pass order, timeout, kernel backend, checks,
        # default topology), read from the CHARM_* variables once, here, so that a bad value
        # fails at model build on every rank and all micro-batches run with the same settings.
        self.options: CPOptions = CPOptions.from_env()

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
        # Multi-latent attention passes its own head dims (q / k 192, v 128): kept as given
        # (cp_attention takes v at its own width).
        self.k_channels = int(k_channels) if k_channels is not None else None
        self.v_channels = int(v_channels) if v_channels is not None else None
        self.hidden_size_per_attention_head = self.k_channels or config.kv_channels
        self.hidden_size_per_partition = (
            self.num_attention_heads_per_partition * self.hidden_size_per_attention_head
        )

        self._init_softmax_offset(config)

        if softmax_scale is None:
            softmax_scale = 1.0 / math.sqrt(self.hidden_size_per_attention_head)
        self.qk_layer_scaling_coeff = (
            float(self.layer_number) if config.apply_query_key_layer_scaling else None
        )
        self.softmax_scale = float(softmax_scale)

        if topology is not None and not str(topology).strip():
            raise ValueError("CharmDotProductAttention: empty topology; use e.g. 'auto', 'flat' "
                             "or '2x4' (or None: CHARM_TOPOLOGY, else the probe)")
        self.topology_spec: str | None = None if topology is None else str(topology).strip()
        sizes = getattr(config, "hierarchical_context_parallel_sizes", None)
        if self.topology_spec is None and self.algo == "a2a+p2p" and sizes and len(sizes) == 2:
            # Megatron's --hierarchical-context-parallel-sizes A P: all-to-all groups of A
            # consecutive CP ranks, P of them; an explicit topology= still wins.
            self.topology_spec = f"{int(sizes[1])}x{int(sizes[0])}"
        # Topologies resolved so far, per CP group (keyed by its global ranks: the topology is a
        # property of which processes take part, so a re-created group with the same ranks
        # rightly shares it; no id(), which a new object can reuse).
        self._topologies: dict[tuple[int, ...], Topology] = {}
        # Resolved now so that a CP group / topology mismatch fails at model build on every
        # rank, not in the first collective of the first step. resolve_topology is the
        # operator's own rule (explicit, CHARM_TOPOLOGY, probe); the probe is one all-gather
        # over the CP group, which every CP rank reaches here.
        self.topology = self._topology_for(self.cp_group, self.cp_size)
        if self.cp_group is not None:
            # The CP group's stream and control communicators, made here where every rank
            # builds the model (a collective of the CP group alone, named by an id its first
            # rank broadcasts), so they never depend on the order of later calls; the layers
            # of a model share them (cached per CP group). Dynamic CP groups
            # (packed_seq_params.cp_group) get theirs at their first cp_attention call.
            create_stream_groups(self.cp_group, self.options.timeout_s)

    def _init_softmax_offset(self, config: TransformerConfig) -> None:
        """``softmax_offset`` as megatron-core's ``DotProductAttention`` keeps it (same name,
        shape ``[heads / tp]``, dtype and initialisation), so checkpoints load either way:
        ``None`` (vanilla), a zero tensor (off-by-one, not a parameter) or a parameter
        (learnable, gpt-oss's sinks)."""
        softmax_type = getattr(config, "softmax_type", "vanilla")
        device = torch.cuda.current_device() if torch.cuda.is_available() else "cpu"
        shape, dtype = (self.num_attention_heads_per_partition,), config.params_dtype
        if softmax_type == "off-by-one":
            self.softmax_offset = torch.zeros(shape, device=device, dtype=dtype)
        elif softmax_type == "learnable":
            self.register_parameter(
                "softmax_offset",
                torch.nn.Parameter(torch.empty(shape, device=device, dtype=dtype)))
            if config.perform_initialization:
                self.softmax_offset = config.init_method(self.softmax_offset)
        else:
            self.softmax_offset = None

    # ------------------------------------------------------------------ checks
    @staticmethod
    def _check_comm_type(cp_comm_type: str | None, layer_number: int) -> str:
        """The algorithm layer ``layer_number`` runs: ours by name, or the stand-in for
        TransformerEngine's ``p2p`` / ``allgather`` (this layer serves them only where TE's
        core attention is not the spec's: ``PerLayerCoreAttention``)."""
        if cp_comm_type is None:
            return DEFAULT_COMM_TYPE
        if isinstance(cp_comm_type, str) and is_ours(cp_comm_type):
            return cp_comm_type
        served = stand_in(cp_comm_type) if isinstance(cp_comm_type, str) else None
        if served is not None:
            return served
        if cp_comm_type in TE_COMM_TYPES:
            raise NotImplementedError(
                f"CharmDotProductAttention: layer {layer_number} has cp_comm_type "
                f"{cp_comm_type!r}, TransformerEngine's, which charm-megatron does not implement "
                f"yet (it serves {', '.join(our_comm_types())} and TE's "
                f"{', '.join(t for t in TE_COMM_TYPES if stand_in(t))}): keep TE's core attention "
                "for such layers (charm_megatron.megatron.use_charm does) or pick one of ours"
            )
        raise ValueError(
            f"CharmDotProductAttention: layer {layer_number} has cp_comm_type "
            f"{cp_comm_type!r}, which CHARM+ does not serve (unknown cp_comm_type; ours: "
            f"{', '.join(our_comm_types())}; TE's {', '.join(TE_COMM_TYPES)} belong to "
            "TEDotProductAttention: build the spec with charm_megatron.megatron.use_charm, which "
            "keeps the spec's own core attention for such layers)"
        )

    @staticmethod
    def _check_config(config: TransformerConfig, attn_mask_type: AttnMaskType) -> None:
        if attn_mask_type not in (AttnMaskType.causal, AttnMaskType.no_mask):
            raise _unsupported(
                f"attn_mask_type={attn_mask_type.name}",
                "is not supported (only causal and no_mask; padding and arbitrary masks are not)",
            )
        softmax_type = getattr(config, "softmax_type", "vanilla")
        if softmax_type not in ("vanilla", "off-by-one", "learnable"):
            raise _unsupported(
                f"softmax_type={softmax_type!r} (--softmax-type)",
                "is not supported; use vanilla, off-by-one or learnable",
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

    def _topology_for(self, group: Any, cp_size: int) -> Topology:
        """The topology of ``group`` (``cp_size`` ranks), resolved once per group and kept."""
        key = _group_ranks(group) or (0,)
        topo = self._topologies.get(key)
        if topo is None:
            # The options' rule (CHARM_TOPOLOGY, read once at build, else the probe; flat for
            # an algorithm that does not use the topology), as in every cp_attention call.
            spec = self.options.topology_for(self.algo, self.topology_spec)
            try:
                topo = (Topology.flat(cp_size) if spec is None
                        else resolve_topology(spec[0], group, cp_size, source=spec[1]))
            except ValueError as exc:
                if group is self.cp_group:
                    raise
                raise ValueError(
                    f"CharmDotProductAttention (layer {self.layer_number}): dynamic CP group "
                    f"{list(key)} ({cp_size} ranks): {exc}. With dynamic context parallelism "
                    "give a size-free topology (--charm-topology auto, node, numa or flat)"
                ) from None
            self._topologies[key] = topo
        return topo

    @property
    def _tag(self) -> str:
        # Every rank of a CP group runs the same layer at a time; a rank one layer ahead or
        # behind (a skipped call) then fails the agreement by name instead of pairing layers.
        return f"layer {self.layer_number}"

    def describe(self) -> dict[str, Any]:
        """What this layer runs: layer number, algo, CP size, topology, its CP-local groups and
        the global ranks of its CP group (for start-up logs; see
        :func:`charm_megatron.megatron.describe_model`)."""
        return {
            "layer": self.layer_number,
            "cp_comm_type": self.algo,
            "cp_size": self.cp_size,
            "topology": str(self.topology),
            "groups": tuple(tuple(g) for g in self.topology.groups),
            "cp_ranks": _group_ranks(self.cp_group),
        }

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
        if getattr(packed_seq_params, "qkv_format", None) == "thd":
            return self._forward_thd(query, key, value, packed_seq_params, mask_type)
        group, cp_size = self.call_group(packed_seq_params)
        causal = mask_type == AttnMaskType.causal
        if (isinstance(query, Tensor) and isinstance(key, Tensor) and query.dim() == 4
                and key.dim() == 4 and query.shape[0] != key.shape[0]):
            # Layer-specific: in Megatron a shorter query than key means a KV cache.
            raise _unsupported(
                f"query length {query.shape[0]} != key length {key.shape[0]} (inference with a "
                "KV cache)",
                "is not supported",
            )
        check_qkv(query, key, value, causal=causal, equal_lengths=True,
                  who="CharmDotProductAttention")
        if query.shape[2] != self.num_attention_heads_per_partition:
            raise ValueError(
                f"CharmDotProductAttention: query has {query.shape[2]} heads, expected "
                f"{self.num_attention_heads_per_partition} (num_attention_heads / tp)"
            )

        if group is None and cp_size == 1:
            # Dynamic CP switched off for this micro-batch (local_cp_size=1, no group).
            out = local_attention(query, key, value, causal, self.softmax_scale,
                                   self._offset_for(query), self.window_size)
        else:
            out = cp_attention(
                query,
                key,
                value,
                group=group,
                algo=self.algo,
                topology=self._topology_for(group, cp_size),
                causal=causal,
                softmax_scale=self.softmax_scale,
                options=self.options,
                tag=self._tag,
                softmax_offset=self._offset_for(query),
                window_size=self.window_size,
            )
        # [s, b, h, d] -> [s, b, h*d]: the layout linear_proj consumes.
        return out.reshape(out.shape[0], out.shape[1], -1)

    # ------------------------------------------------------------------ packed_seq_params
    def call_group(self, packed_seq_params: Any) -> tuple[Any, int]:
        """The CP group and its size for one forward call, from ``packed_seq_params``.

        All of the module's ``packed_seq_params`` handling lives here.

        * ``None``: the module's CP group.
        * Dynamic / hybrid CP (megatron-core sets these per micro-batch, e.g.
          ``get_batch_on_this_hybrid_cp_rank``): ``cp_group`` replaces the module's group for
          this call (the sequence is split over it in the same load-balanced layout);
          ``local_cp_size`` without ``cp_group`` must be 1 and means no CP for this call (local
          attention), as for TransformerEngine's attention. ``local_cp_size`` with ``cp_group``
          must equal the group's size.
        * ``qkv_format`` ``sbhd`` (or unset): one unpadded sequence per batch entry, so
          ``cu_seqlens_*`` and ``max_seqlen_*`` are not read. Packed ``thd`` sequences go to
          :meth:`_forward_thd` before this; any other format raises ``NotImplementedError``.
        """
        if packed_seq_params is None:
            return self.cp_group, self.cp_size
        qkv_format = getattr(packed_seq_params, "qkv_format", None)
        if qkv_format not in (None, "sbhd"):
            raise _unsupported(
                f"packed_seq_params with qkv_format={qkv_format!r}",
                "is not supported; use 'sbhd' (dynamic CP) or 'thd' (packed sequences)",
            )
        group = getattr(packed_seq_params, "cp_group", None)
        local = getattr(packed_seq_params, "local_cp_size", None)
        if group is None:
            if local is None:
                return self.cp_group, self.cp_size
            if int(local) != 1:
                raise ValueError(
                    f"CharmDotProductAttention: packed_seq_params.local_cp_size={local} without "
                    "a cp_group; dynamic CP needs packed_seq_params.cp_group for a CP size > 1 "
                    "(local_cp_size 1 alone turns CP off for the micro-batch)"
                )
            return None, 1
        size = group.size()
        if local is not None and int(local) != size:
            raise ValueError(
                f"CharmDotProductAttention: packed_seq_params.local_cp_size={local} but its "
                f"cp_group has {size} ranks; they must agree"
            )
        return group, size

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
        check_qkv(query, key, value, causal=mask_type == AttnMaskType.causal,
                  equal_lengths=True, who="CharmDotProductAttention (qkv_format='thd')",
                  layout="thd")
        if query.shape[1] != self.num_attention_heads_per_partition:
            raise ValueError(
                f"CharmDotProductAttention: query has {query.shape[1]} heads, expected "
                f"{self.num_attention_heads_per_partition} (num_attention_heads / tp)"
            )
        out = cp_attention(
            query, key, value, group=self.cp_group, algo=self.algo, topology=self.topology,
            causal=mask_type == AttnMaskType.causal, softmax_scale=self.softmax_scale,
            cu_seqlens=psp.cu_seqlens_q, cu_seqlens_padded=psp.cu_seqlens_q_padded,
            options=self.options, tag=self._tag, softmax_offset=self._offset_for(query),
            window_size=self.window_size,
        )
        return out.reshape(out.shape[0], -1)

    def _offset_for(self, query: Tensor) -> Tensor | None:
        """The softmax offset on the query's device (megatron-core moves it there too)."""
        offset = self.softmax_offset
        return None if offset is None else offset.to(query.device)

    def sharded_state_dict(
        self, prefix: str = "", sharded_offsets: tuple = (), metadata: dict | None = None
    ) -> dict:
        """Nothing to checkpoint but a learnable softmax offset, sharded over TP along its
        heads exactly as megatron-core's ``DotProductAttention`` shards it (so a checkpoint
        moves between this layer, megatron-core's and any of our algorithms)."""
        if getattr(self.config, "softmax_type", "vanilla") != "learnable":
            return {}
        from megatron.core.transformer.utils import make_sharded_tensors_for_checkpoint

        return make_sharded_tensors_for_checkpoint(
            self.state_dict(prefix="", keep_vars=True), prefix, {"softmax_offset": 0},
            sharded_offsets, tp_group=self.tp_group,
            dp_cp_group=(metadata or {}).get("dp_cp_group"))

    def extra_repr(self) -> str:
        return (
            f"cp_comm_type={self.algo}, cp_size={self.cp_size}, topology={self.topology}, "
            f"heads={self.num_attention_heads_per_partition}, "
            f"kv_groups={self.num_query_groups_per_partition}, scale={self.softmax_scale:.6g}"
        )
