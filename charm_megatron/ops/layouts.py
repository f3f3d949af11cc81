"""How a call's tensors are laid out: the two strategies one call preparation is given.

* :class:`Sbhd` - Megatron's ``[s, b, h, d]`` shard of one sequence (load-balanced under the
  causal mask, contiguous otherwise): the plans run on the tensors as they are.
* :class:`Thd` - packed documents ``[t, h, d]`` with ``cu_seqlens`` (Megatron's THD CP layout):
  rows are permuted at the edge into ``[first chunks | second chunks]`` of every document, so the
  same plans run on ``[t, 1, h, d]``, and each tile is computed document by document
  (:mod:`charm_megatron.ops.packed`).

A layout checks its inputs, adds its own fields to the agreement, maps tensors to and from the
internal ``[s, b, h, d]`` rows, and builds the executor of a call. Everything else about a call
is the same for both (ops/prepare.py).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from charm_megatron.kernels.base import check_qkv
from charm_megatron.ops.executor import BlockShape, Executor
from charm_megatron.ops.packed import (
    PackedExecutor,
    THDLayout,
    lane_permutation,
    layout_fields,
    make_layout,
    permutation,
)
from charm_megatron.plan.head_stage import HeadStage


@dataclass(frozen=True)
class Sbhd:
    """One sequence per batch entry, ``[s_local, b, h, d]``."""

    name = "sbhd"

    def check(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, causal: bool,
              cp_size: int) -> None:
        check_qkv(q, k, v, causal=causal, equal_lengths=True, who="cp_attention")
        s_local = q.shape[0]
        if s_local == 0:
            raise ValueError("cp_attention: empty sequence shard")
        if causal and s_local % 2:
            raise ValueError(
                f"cp_attention: causal attention needs the sequence length "
                f"({s_local}*{cp_size}={s_local * cp_size}) divisible by 2*cp_size="
                f"{2 * cp_size} (Megatron's load-balanced layout: 2 chunks per rank); pad the "
                "sequence or change --seq-length")

    def fields(self) -> tuple[tuple[str, object], ...]:
        return ()

    @staticmethod
    def span(q: torch.Tensor, cp_size: int) -> int:
        """The largest query - key distance of the call (a window side that reaches it is
        unbounded): the whole sequence's length - 1."""
        return q.shape[0] * cp_size - 1

    @staticmethod
    def heads(q: torch.Tensor, k: torch.Tensor) -> tuple[int, int, int, int, int]:
        """(rows, batch, q heads, kv heads, head dim) of the internal blocks."""
        return q.shape[0], q.shape[1], q.shape[2], k.shape[2], q.shape[3]

    def to_internal(self, *tensors: torch.Tensor) -> tuple[torch.Tensor, ...]:
        return tensors

    def out_from_internal(self, out: torch.Tensor,
                          lse_sbh: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return out, lse_sbh.permute(1, 2, 0).contiguous()  # lse [b, h, s]

    def executor(self, streams, backend, shape: BlockShape, scale: float, *,
                 forced_backend: bool, head_group: int = 1, **options) -> Executor:
        return Executor(streams, backend, shape, scale, **options)

    def lane_rows(self, stage: HeadStage, rank: int,
                  device: torch.device) -> tuple[torch.Tensor, torch.Tensor] | None:
        """How a head all-to-all's placed rows map to the lanes' blocks (``None``: as
        placed; plan/head_stage.py places them in the lanes' layout already)."""
        return None


@dataclass(frozen=True)
class Thd:
    """Packed documents, ``[t_local, h, d]`` (``docs``: their real and padded lengths)."""

    docs: THDLayout
    name = "thd"

    @classmethod
    def of(cls, cu_seqlens, cu_seqlens_padded, cp_size: int, q: torch.Tensor) -> Thd:
        """The layout of a packed call (ValueError / TypeError naming the argument)."""
        if cu_seqlens is None:
            raise ValueError("cp_attention: cu_seqlens_padded given without cu_seqlens; pass "
                             "both (cu_seqlens are the real document lengths)")
        if not isinstance(q, torch.Tensor) or q.dim() != 3:
            shape = tuple(q.shape) if isinstance(q, torch.Tensor) else type(q).__name__
            raise ValueError(f"cp_attention: with cu_seqlens q must be 3-D [t_local, heads, "
                             f"head_dim] (packed THD), got {shape}")
        return cls(make_layout(cu_seqlens, cu_seqlens_padded, cp_size, q.shape[0]))

    def check(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, causal: bool,
              cp_size: int) -> None:
        check_qkv(q, k, v, causal=causal, equal_lengths=True, who="cp_attention", layout="thd")

    def fields(self) -> tuple[tuple[str, object], ...]:
        return layout_fields(self.docs)

    def span(self, q: torch.Tensor, cp_size: int) -> int:
        """The largest query - key distance of the call: inside the longest document (a
        window is measured inside each)."""
        return max(self.docs.real, default=0) - 1

    @staticmethod
    def heads(q: torch.Tensor, k: torch.Tensor) -> tuple[int, int, int, int, int]:
        return q.shape[0], 1, q.shape[1], k.shape[1], q.shape[2]

    def to_internal(self, *tensors: torch.Tensor) -> tuple[torch.Tensor, ...]:
        perm, _ = permutation(self.docs, str(tensors[0].device))
        return tuple(t.index_select(0, perm).unsqueeze(1) for t in tensors)

    def out_from_internal(self, out: torch.Tensor,
                          lse_sbh: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        _, inv = permutation(self.docs, str(out.device))
        lse = lse_sbh[:, 0, :].t().index_select(1, inv).contiguous()  # [h, t]
        return out.squeeze(1).index_select(0, inv), lse

    def executor(self, streams, backend, shape: BlockShape, scale: float, *,
                 forced_backend: bool, head_group: int = 1, **options) -> Executor:
        # A forced backend runs every document itself; else the CUDA varlen kernel may.
        return PackedExecutor(streams, backend, shape, scale, self.docs,
                              varlen=not forced_backend, head_group=head_group, **options)

    def lane_rows(self, stage: HeadStage, rank: int,
                  device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
        """(placed -> lanes' internal, inverse) rows: the stage places each member's block
        whole, ``[documents]`` member after member, where the lanes' layout wants each
        document's chunks together (ops/packed.lane_order)."""
        return lane_permutation(self.docs, stage, rank, str(device))


Layout = Sbhd | Thd
