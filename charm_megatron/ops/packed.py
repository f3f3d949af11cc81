"""Packed sequences (THD) under every CP algorithm: ``cp_attention(..., cu_seqlens=...)``
(the :class:`~charm_megatron.ops.layouts.Thd` layout of a call).

The plans are not changed. The trick is a permutation at the edge:

* Megatron's THD layout gives rank ``r`` chunks ``r`` and ``2n-1-r`` of every document,
  document after document (``[d0.c_r, d0.c_2n-1-r, d1.c_r, ...]``).
* Internally a rank's rows are reordered to ``[first chunks of all documents | second chunks
  of all documents]``. The first chunks of all documents play the role of the "first half" of
  a block and the second chunks the "second half", so every plan's half-block messages are
  contiguous row ranges and half-sized exactly as without packing.
* Each tile then runs by document (:mod:`charm_megatron.kernels.varlen`): the tile's rows are
  split into documents, padding rows are left out, and the per-tile rule of
  :func:`charm_megatron.plan.core.tile_spec` is applied inside every document (why that is
  exact is in docs/algorithm.md, "Packed sequences").

Every document's chunk size ``c_i = P_i / 2n`` (``P_i`` its padded length) is the same on every
rank, so a half of any rank's block has the same document boundaries; only which rows are real
tokens depends on the rank (the chunk index).
"""

from __future__ import annotations

import functools
import hashlib
from dataclasses import dataclass

import torch

from charm_megatron.kernels.varlen import (
    Segments,
    lse_dtype,
    segmented_backward,
    segmented_forward,
    window_masks,
)
from charm_megatron.ops.executor import BlockShape, Executor
from charm_megatron.ops.failsafe import GuardedBackend
from charm_megatron.plan.core import Half, TileSpec
from charm_megatron.plan.head_stage import HeadStage


# --------------------------------------------------------------------------------- layout
@dataclass(frozen=True)
class THDLayout:
    """The document structure of a packed sequence under CP size ``cp``."""

    cp: int
    real: tuple[int, ...]  # real length of each document
    padded: tuple[int, ...]  # padded length (a multiple of 2·cp; any length at CP size 1)

    @property
    def parts(self) -> int:
        """Chunks of every document per rank: 2 under CP (Megatron's load balance), 1 at CP
        size 1 (the documents in place, any lengths: no half is ever asked for)."""
        return 2 if self.cp > 1 else 1

    @property
    def chunks(self) -> tuple[int, ...]:
        return tuple(p // (self.parts * self.cp) for p in self.padded)

    @property
    def half_rows(self) -> int:
        return sum(self.chunks)

    @property
    def t_local(self) -> int:
        return self.parts * self.half_rows

    def chunk_of(self, owner: int, part: int) -> int:
        """Which of a document's ``2 * cp`` chunks part ``part`` (0, 1) of ``owner``'s block
        holds (Megatron's load balance: ``owner`` and ``2*cp-1-owner``)."""
        return owner if part == 0 else 2 * self.cp - 1 - owner

    def real_in_chunk(self, doc: int, chunk: int) -> int:
        """Real tokens at the start of chunk ``chunk`` of document ``doc``."""
        c = self.chunks[doc]
        return max(0, min(c, self.real[doc] - chunk * c))

    def doc_rows(self, owner: int, half: Half) -> list[list[int]]:
        """Per document, the real rows of ``owner``'s block in the view of rows ``half``
        (internal order), in position order."""
        return [[r for r, _ in doc] for doc in self._doc_rows_positions(owner, half)]

    def doc_positions(self, owner: int, half: Half) -> list[list[int]]:
        """Per document, the positions *within the document* of :meth:`doc_rows`' rows (what a
        sliding window is measured in on packed sequences)."""
        return [[p for _, p in doc] for doc in self._doc_rows_positions(owner, half)]

    def _doc_rows_positions(self, owner: int, half: Half) -> list[list[tuple[int, int]]]:
        """Per document, (row in the view of rows ``half``, position in the document) of the
        real rows of ``owner``'s block. A half is one chunk of every document; a quarter is a
        contiguous range of its half's internal rows (:meth:`Half.span`), which cuts across
        documents: its rows are the half's rows inside that range, counted from its start."""
        parent = half.parent
        if parent is not None and parent is not Half.FULL:  # a quarter: cut its half's rows
            lo, hi = half.span(self.t_local)
            base = parent.span(self.t_local)[0]
            lo, hi = lo - base, hi - base
            return [[(r - lo, p) for r, p in doc if lo <= r < hi]
                    for doc in self._doc_rows_positions(owner, parent)]
        halves = (0, 1) if half is Half.FULL else ((0,) if half is Half.FIRST else (1,))
        offsets = [0]
        for c in self.chunks:
            offsets.append(offsets[-1] + c)
        out: list[list[tuple[int, int]]] = []
        for i, c in enumerate(self.chunks):
            doc: list[tuple[int, int]] = []
            for h in halves:
                chunk = self.chunk_of(owner, h)
                base = offsets[i] + (self.half_rows if (h == 1 and half is Half.FULL) else 0)
                doc.extend((base + t, chunk * c + t) for t in range(self.real_in_chunk(i, chunk)))
            out.append(doc)
        return out

    def lanes(self, a: int) -> THDLayout:
        """The layout a head all-to-all's lanes see (groups of ``a`` ranks): ``cp / a`` ranks,
        whose chunks are ``a`` of this layout's chunks in a row (plan/head_stage.py)."""
        return self if a == 1 else THDLayout(self.cp // a, self.real, self.padded)

    def where(self, owner: int) -> list[tuple[int, int]]:
        """``(document, position in it)`` of every internal row of ``owner``'s block, padding
        rows included (each document's padded positions are covered exactly once by the
        ranks)."""
        out: list[tuple[int, int]] = []
        for h in range(self.parts):
            chunk = self.chunk_of(owner, h)
            for i, c in enumerate(self.chunks):
                out.extend((i, chunk * c + t) for t in range(c))
        return out

    def permutation(self) -> list[int]:
        """Internal row ``j`` is THD-local row ``perm[j]`` (``[first chunks | second chunks]``;
        the same on every rank)."""
        first, second, start = [], [], 0
        for c in self.chunks:
            first.extend(range(start, start + c))
            if self.parts == 2:
                second.extend(range(start + c, start + 2 * c))
            start += self.parts * c
        return first + second


@functools.lru_cache(maxsize=64)
def lane_order(layout: THDLayout, stage: HeadStage, rank: int) -> tuple[int, ...]:
    """Rows of ``rank``'s super-block after the head all-to-all (members' internal rows placed
    by :meth:`HeadStage.pieces`: member by member, each ``[documents]``) in the internal order
    of the lanes' layout (``layout.lanes(a)``: document by document within each chunk):
    ``order[i]`` is the placed row that the lanes' internal row ``i`` holds. Found by matching
    each row's (document, position), so it holds for every placement the stage makes."""
    a, g = stage.a, rank // stage.a
    rows = layout.t_local
    placed: dict[tuple[int, int], int] = {}
    for j, member in enumerate(stage.members(rank)):
        where = layout.where(member)
        for local, sup in stage.pieces(j, rows):
            for offset, row in enumerate(range(sup.start, sup.stop)):
                placed[where[local.start + offset]] = row
    return tuple(placed[key] for key in layout.lanes(a).where(g))


@functools.lru_cache(maxsize=64)
def lane_permutation(layout: THDLayout, stage: HeadStage, rank: int,
                     device: str) -> tuple[torch.Tensor, torch.Tensor]:
    """(placed -> lanes' internal, lanes' internal -> placed) row indices on ``device``."""
    order = torch.tensor(lane_order(layout, stage, rank), dtype=torch.long)
    inv = torch.empty_like(order)
    inv[order] = torch.arange(order.numel())
    return order.to(device), inv.to(device)


@functools.lru_cache(maxsize=512)
def tile_positions(layout: THDLayout, spec: TileSpec) -> tuple[tuple[int, ...], tuple[int, ...]]:
    """The in-document positions of tile ``spec``'s gathered q rows and kv rows (aligned with
    its :class:`Segments`' ``q_index`` / ``k_index``)."""
    qp, kp = [], []
    for qd, kd in zip(layout.doc_positions(spec.q_owner, spec.q_half),
                      layout.doc_positions(spec.kv_owner, spec.kv_half)):
        if qd and kd:  # the documents _segment_lists keeps
            qp.extend(qd)
            kp.extend(kd)
    return tuple(qp), tuple(kp)


@functools.lru_cache(maxsize=512)
def _segment_lists(layout: THDLayout, spec: TileSpec):
    q_rows = layout.doc_rows(spec.q_owner, spec.q_half)
    k_rows = layout.doc_rows(spec.kv_owner, spec.kv_half)
    qi, ki, cu_q, cu_k = [], [], [0], [0]
    for qd, kd in zip(q_rows, k_rows):
        if not qd or not kd:
            continue  # nothing to attend to (or nobody asking): rows stay empty
        if spec.causal and qd != kd:
            raise AssertionError("a causal tile must see the same positions on both sides")
        qi.extend(qd)
        ki.extend(kd)
        cu_q.append(len(qi))
        cu_k.append(len(ki))
    return tuple(qi), tuple(ki), tuple(cu_q), tuple(cu_k)


def tile_segments(layout: THDLayout, spec: TileSpec, device: torch.device) -> Segments:
    """The :class:`Segments` of tile ``spec`` (per document, real rows only); cached, so the
    index tensors are built (and copied to the GPU) once per layout, not once per call."""
    return _tile_segments(layout, spec, str(device))


@functools.lru_cache(maxsize=1024)
def _tile_segments(layout: THDLayout, spec: TileSpec, device: str) -> Segments:
    qi, ki, cu_q, cu_k = _segment_lists(layout, spec)

    def dev(x, dtype):
        return torch.tensor(x, dtype=dtype, device=device)

    return Segments(dev(qi, torch.long), dev(ki, torch.long), cu_q, cu_k, spec.causal,
                    dev(cu_q, torch.int32), dev(cu_k, torch.int32))


# ----------------------------------------------------------------------------- checking
def _as_list(x, name: str) -> list[int]:
    if not isinstance(x, torch.Tensor):
        try:
            x = torch.as_tensor(x)
        except Exception as exc:  # noqa: BLE001 - reported as the user's input error
            raise TypeError(f"cp_attention: {name} must be an int32 tensor, got "
                            f"{type(x).__name__}") from exc
    if x.dim() != 1 or x.numel() < 2:
        raise ValueError(f"cp_attention: {name} must be 1-D with N+1 >= 2 entries (N "
                         f"documents), got shape {tuple(x.shape)}")
    if x.dtype not in (torch.int32, torch.int64):
        raise TypeError(f"cp_attention: {name} must be int32 (Megatron's cu_seqlens), got "
                        f"{x.dtype}")
    return [int(v) for v in x.tolist()]  # one host sync on CUDA


def make_layout(cu_seqlens, cu_seqlens_padded, cp_size: int, t_local: int) -> THDLayout:
    """Check the cumulative lengths and return the layout (ValueError / TypeError).

    Padded lengths must be multiples of ``2*cp_size``, except at ``cp_size == 1`` (no CP: the
    documents are attended in place, any lengths)."""
    unit = 2 * cp_size if cp_size > 1 else 1
    cu = _as_list(cu_seqlens, "cu_seqlens")
    explicit = cu_seqlens_padded is not None
    cup = _as_list(cu_seqlens_padded, "cu_seqlens_padded") if explicit else cu
    for name, c in (("cu_seqlens", cu), ("cu_seqlens_padded", cup)):
        if c[0] != 0:
            raise ValueError(f"cp_attention: {name} must start at 0, got {c[0]}")
        bad = [i for i in range(1, len(c)) if c[i] < c[i - 1]]
        if bad:
            i = bad[0]
            raise ValueError(f"cp_attention: {name} is not increasing: entry {i} is {c[i]} "
                             f"after {c[i - 1]}; it must be the cumulative document lengths")
    if len(cu) != len(cup):
        raise ValueError(f"cp_attention: cu_seqlens has {len(cu)} entries but "
                         f"cu_seqlens_padded {len(cup)}; both describe the same N documents")
    real = tuple(b - a for a, b in zip(cu, cu[1:]))
    padded = tuple(b - a for a, b in zip(cup, cup[1:]))
    for i, (n, p) in enumerate(zip(real, padded)):
        if p < n:
            raise ValueError(f"cp_attention: document {i} has {n} tokens but padded length "
                             f"{p}; cu_seqlens_padded lengths must be >= cu_seqlens lengths")
        if p % unit:
            what = "padded length" if explicit else "length (no cu_seqlens_padded given)"
            raise ValueError(
                f"cp_attention: document {i} has {what} {p}, not a multiple of 2*cp_size="
                f"{unit}; pad every document to a multiple of 2*cp_size and pass "
                "cu_seqlens_padded (Megatron: --context-parallel-size with padded packing)")
    if cup[-1] != t_local * cp_size:
        raise ValueError(f"cp_attention: cu_seqlens_padded[-1]={cup[-1]} but the tensors hold "
                         f"{t_local} tokens per rank x cp_size {cp_size} = {t_local * cp_size}; "
                         "q, k, v must be this rank's THD shard of the packed sequence")
    return THDLayout(cp_size, real, padded)


def layout_fields(layout: THDLayout | None) -> tuple[tuple[str, object], ...]:
    """The agreement check's extra fields for packed calls (ops/call_setup.signature): the real
    and padded document lengths, each as count, total and a digest (bounded size however many
    documents; ``None`` where this rank's own cu_seqlens were invalid, its error says why)."""
    def desc(lengths: tuple[int, ...]) -> str:
        digest = hashlib.blake2b(repr(lengths).encode(), digest_size=6).hexdigest()
        return f"{len(lengths)} documents, {sum(lengths)} tokens, lengths digest {digest}"

    if layout is None:
        return (("cu_seqlens (real document lengths)", None),
                ("cu_seqlens_padded (padded document lengths)", None))
    return (("cu_seqlens (real document lengths)", desc(layout.real)),
            ("cu_seqlens_padded (padded document lengths)", desc(layout.padded)))


# ------------------------------------------------------------------------------ running
class PackedExecutor(Executor):
    """The plan executor with tiles computed by document (everything else unchanged).

    With a :class:`GuardedBackend` a failing tile is recorded and returns an empty partial,
    also on the one-call CUDA varlen path that does not go through the backend, so that every
    transfer of the plan still completes (ops/failsafe.py).

    ``head_group`` ``a > 1``: the blocks are a head all-to-all's super-blocks in the lanes'
    order (:func:`lane_order`); tiles name CP ranks, whose super-block is ``rank // a`` of
    the lanes' layout (``layout.lanes(a)``)."""

    # A packed tile is cut by its documents: a super-tile's kv blocks hold other documents'
    # rows each, so its members run one by one.
    fuses_super_tiles = False

    def __init__(self, streams, backend, shape: BlockShape, scale: float,
                 layout: THDLayout, *, varlen: bool = True, head_group: int = 1,
                 **options) -> None:
        super().__init__(streams, backend, shape, scale, **options)
        self.layout = layout.lanes(head_group)
        self.head_group = head_group
        self.varlen = varlen  # False: a forced backend runs every document (kernels.varlen)

    def _inner(self, spec: TileSpec) -> TileSpec:
        """``spec`` on the lanes' layout (its owners' super-blocks)."""
        a = self.head_group
        if a == 1:
            return spec
        return TileSpec(spec.q_owner // a, spec.kv_owner // a, spec.q_half, spec.kv_half,
                        spec.causal)

    def _segments(self, spec: TileSpec) -> Segments:
        return tile_segments(self.layout, self._inner(spec), self.shape.device)

    def _failed(self, exc: Exception | None = None) -> bool:
        guard = self.backend if isinstance(self.backend, GuardedBackend) else None
        if guard is None:
            if exc is not None:
                raise exc
            return False
        if exc is not None and guard.error is None:
            guard.error = exc
        return guard.error is not None

    def _forward_cut(self, spec, q, k):
        return None  # a packed tile is cut by its documents (segmented_forward), not so

    def _masks(self, spec: TileSpec, device: torch.device) -> list[torch.Tensor] | None:
        """Under a sliding window, each document's pairs it keeps, in the document's own
        positions; ``None`` without one."""
        w = self.window
        if w is None:
            return None
        qp, kp = tile_positions(self.layout, self._inner(spec))
        return window_masks(self._segments(spec), torch.tensor(qp, device=device),
                            torch.tensor(kp, device=device), w.causal, w.left, w.right)

    def _kernel_forward(self, spec, q, k, v):
        if not self._failed():
            try:
                return segmented_forward(self.backend, q, k, v, self._segments(spec),
                                         self.scale, varlen=self.varlen,
                                         masks=self._masks(spec, q.device))
            except Exception as exc:  # noqa: BLE001 - reported after the plan, on every rank
                self._failed(exc)
        lse = torch.full((1, q.shape[2], q.shape[0]), float("-inf"),
                         dtype=lse_dtype(q.dtype), device=q.device)
        return q.new_zeros((*q.shape[:-1], v.shape[-1])), lse  # out has v's head dim

    def _kernel_backward(self, spec, dout, q, k, v, out, lse):
        if not self._failed():
            try:
                return segmented_backward(self.backend, dout, q, k, v, out, lse,
                                          self._segments(spec), self.scale, varlen=self.varlen,
                                          masks=self._masks(spec, q.device))
            except Exception as exc:  # noqa: BLE001 - reported after the plan, on every rank
                self._failed(exc)
        return torch.zeros_like(q), torch.zeros_like(k), torch.zeros_like(v)


@functools.lru_cache(maxsize=64)
def permutation(layout: THDLayout, device: str) -> tuple[torch.Tensor, torch.Tensor]:
    """(THD-local -> internal, internal -> THD-local) row indices on ``device``."""
    perm = torch.tensor(layout.permutation(), dtype=torch.long)
    inv = torch.empty_like(perm)
    inv[perm] = torch.arange(perm.numel())
    return perm.to(device), inv.to(device)
