"""Packed sequences (THD) under every CP algorithm: ``cp_attention(..., cu_seqlens=...)``.

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

import datetime
import functools
from dataclasses import dataclass

import torch
import torch.distributed as dist

from charm_megatron.kernels.base import check_qkv
from charm_megatron.kernels.varlen import Segments, segmented_backward, segmented_forward
from charm_megatron.ops.executor import BlockShape, Executor, delta_exponent
from charm_megatron.ops.options import CPOptions, kernel_backend
from charm_megatron.ops.streams import stream_groups
from charm_megatron.plan.core import Half, Plan, TileSpec
from charm_megatron.plan.registry import uses_topology


# --------------------------------------------------------------------------------- layout
@dataclass(frozen=True)
class THDLayout:
    """The document structure of a packed sequence under CP size ``cp``."""

    cp: int
    real: tuple[int, ...]  # real length of each document
    padded: tuple[int, ...]  # padded length (a multiple of 2·cp)

    @property
    def chunks(self) -> tuple[int, ...]:
        return tuple(p // (2 * self.cp) for p in self.padded)

    @property
    def half_rows(self) -> int:
        return sum(self.chunks)

    @property
    def t_local(self) -> int:
        return 2 * self.half_rows

    def real_in_chunk(self, doc: int, chunk: int) -> int:
        """Real tokens at the start of chunk ``chunk`` of document ``doc``."""
        c = self.chunks[doc]
        return max(0, min(c, self.real[doc] - chunk * c))

    def doc_rows(self, owner: int, half: Half) -> list[list[int]]:
        """Per document, the real rows of ``owner``'s block in the view of rows ``half``
        (internal order), in position order."""
        halves = (0, 1) if half is Half.FULL else ((0,) if half is Half.FIRST else (1,))
        offsets = [0]
        for c in self.chunks:
            offsets.append(offsets[-1] + c)
        rows: list[list[int]] = []
        for i in range(len(self.chunks)):
            doc: list[int] = []
            for h in halves:
                chunk = owner if h == 0 else 2 * self.cp - 1 - owner
                base = offsets[i] + (self.half_rows if (h == 1 and half is Half.FULL) else 0)
                doc.extend(range(base, base + self.real_in_chunk(i, chunk)))
            rows.append(doc)
        return rows

    def permutation(self) -> list[int]:
        """Internal row ``j`` is THD-local row ``perm[j]`` (``[first chunks | second chunks]``;
        the same on every rank)."""
        first, second, start = [], [], 0
        for c in self.chunks:
            first.extend(range(start, start + c))
            second.extend(range(start + c, start + 2 * c))
            start += 2 * c
        return first + second


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


def _agree(layout: THDLayout | None, error: str | None, group, device: torch.device,
           timeout_s: float) -> None:
    """Every rank learns whether any rank's cu_seqlens were invalid or differ from the others'
    (one small all-reduce, before the attention's own communication); all raise together."""
    fp = hash((layout.real, layout.padded)) if layout is not None else 0
    fp &= (1 << 62) - 1
    dev = device if device.type == "cuda" else torch.device("cpu")
    t = torch.tensor([fp, -fp, 1 if error else 0], dtype=torch.int64, device=dev)
    work = dist.all_reduce(t, op=dist.ReduceOp.MAX, group=group, async_op=True)
    if dev.type == "cuda":
        work.wait()
    else:
        work.wait(datetime.timedelta(seconds=timeout_s))
    hi, neg_lo, any_bad = t.tolist()
    if error:
        raise ValueError(error)
    if any_bad:
        raise ValueError("cp_attention: another CP rank's cu_seqlens / cu_seqlens_padded are "
                         "invalid (its error names the problem)")
    if hi != -neg_lo:
        raise ValueError("cp_attention: cu_seqlens / cu_seqlens_padded differ between CP ranks; "
                         "they are the global cumulative lengths and must be identical on every "
                         "rank of the CP group")


# ------------------------------------------------------------------------------ running
class PackedExecutor(Executor):
    """The plan executor with tiles computed by document (everything else unchanged)."""

    def __init__(self, streams, backend, shape: BlockShape, scale: float,
                 layout: THDLayout, *, varlen: bool = True, **options) -> None:
        super().__init__(streams, backend, shape, scale, **options)
        self.layout = layout
        self.varlen = varlen  # False: a forced backend runs every document (kernels.varlen)

    def _segments(self, spec: TileSpec) -> Segments:
        return tile_segments(self.layout, spec, self.shape.device)

    def _kernel_forward(self, spec, q, k, v):
        return segmented_forward(self.backend, q, k, v, self._segments(spec), self.scale,
                                 varlen=self.varlen)

    def _kernel_backward(self, spec, dout, q, k, v, out, lse):
        return segmented_backward(self.backend, dout, q, k, v, out, lse, self._segments(spec),
                                  self.scale, varlen=self.varlen)


def _make_executor(group, q, k, scale: float, layout: THDLayout,
                   opts: CPOptions) -> PackedExecutor:
    shape = BlockShape(q.shape[0], 1, q.shape[2], k.shape[2], q.shape[3], q.dtype, q.device)
    return PackedExecutor(stream_groups(group, opts.timeout_s),
                          kernel_backend(opts, q.device, q.dtype), shape, scale, layout,
                          varlen=opts.backend is None, compute=opts.compute, comm=opts.comm,
                          timeout_s=opts.timeout_s)


class _PackedCPAttention(torch.autograd.Function):
    """Internal-order tensors ``[t, 1, h, d]``; the same plans as the unpacked operator."""

    @staticmethod
    def forward(ctx, q, k, v, group, algo, groups, causal, scale, layout, opts):
        from charm_megatron.ops.attention import _plans

        fwd, _ = _plans(algo, groups, causal, opts.pass_order)
        rank = dist.get_rank(group)
        ex = _make_executor(group, q, k, scale, layout, opts)
        ex.set_own("own.q", "q", q)
        ex.set_own("own.kv", "kv", k, v)
        ex.run(fwd.ops[rank])
        acc_out, acc_lse = ex.result(Plan.OUT)
        out = acc_out.to(q.dtype)
        ctx.save_for_backward(q, k, v, out, acc_lse)
        ctx.cfg = (group, algo, groups, causal, scale, layout, opts)
        lse = acc_lse[:, 0, :].t().contiguous()  # [h, t]
        ctx.mark_non_differentiable(lse)
        return out, lse

    @staticmethod
    def backward(ctx, dout, _dlse):
        from charm_megatron.ops.attention import _plans

        q, k, v, out, lse_sbh = ctx.saved_tensors
        group, algo, groups, causal, scale, layout, opts = ctx.cfg
        _, bwd = _plans(algo, groups, causal, opts.pass_order)
        rank = dist.get_rank(group)
        ex = _make_executor(group, q, k, scale, layout, opts)
        dout = dout.to(q.dtype).contiguous()
        # delta scaled by the row's 2**-e, as executor._out_with_delta expects (ops/attention).
        e = delta_exponent(dout)
        delta = torch.ldexp((dout.double() * out.double()).sum(-1), -e.double())
        ex.set_own("own.qgrad", "qgrad", q, dout,
                   torch.stack([lse_sbh, delta.to(lse_sbh.dtype)], -1))
        ex.set_own("own.kv", "kv", k, v)
        ex.run(bwd.ops[rank])
        (dq,) = ex.result(Plan.DQ)
        dk, dv = ex.result(Plan.DKV)
        return (dq.to(q.dtype), dk.to(k.dtype), dv.to(v.dtype),
                None, None, None, None, None, None, None)


class _LocalPacked(torch.autograd.Function):
    """CP size 1: every document attended in place (one segmented tile, no plan)."""

    @staticmethod
    def forward(ctx, q, k, v, seg, scale, opts):
        backend = kernel_backend(opts, q.device, q.dtype)
        out, lse = segmented_forward(backend, q, k, v, seg, scale, varlen=opts.backend is None)
        ctx.save_for_backward(q, k, v, out, lse)
        ctx.cfg = (seg, scale, opts)
        lse_ht = lse[0].contiguous()
        ctx.mark_non_differentiable(lse_ht)
        return out, lse_ht

    @staticmethod
    def backward(ctx, dout, _dlse):
        q, k, v, out, lse = ctx.saved_tensors
        seg, scale, opts = ctx.cfg
        backend = kernel_backend(opts, q.device, q.dtype)
        dq, dk, dv = segmented_backward(backend, dout.to(q.dtype).contiguous(), q, k, v, out,
                                        lse, seg, scale, varlen=opts.backend is None)
        return dq, dk, dv, None, None, None


@functools.lru_cache(maxsize=64)
def _local_segments(layout: THDLayout, causal: bool, device: str) -> Segments:
    rows, cu = [], [0]
    start = 0
    for n, p in zip(layout.real, layout.padded):
        if n:
            rows.extend(range(start, start + n))
            cu.append(len(rows))
        start += p
    idx = torch.tensor(rows, dtype=torch.long, device=device)
    cu_t = torch.tensor(cu, dtype=torch.int32, device=device)
    return Segments(idx, idx, tuple(cu), tuple(cu), causal, cu_t, cu_t)


@functools.lru_cache(maxsize=64)
def _permutation(layout: THDLayout, device: str) -> tuple[torch.Tensor, torch.Tensor]:
    """(THD-local -> internal, internal -> THD-local) row indices on ``device``."""
    perm = torch.tensor(layout.permutation(), dtype=torch.long)
    inv = torch.empty_like(perm)
    inv[perm] = torch.arange(perm.numel())
    return perm.to(device), inv.to(device)


def packed_cp_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *, cu_seqlens,
                        cu_seqlens_padded, group, algo: str, topology, causal: bool,
                        softmax_scale: float | None, return_lse: bool,
                        options: CPOptions | None = None):
    """:func:`charm_megatron.cp_attention` for packed THD tensors (see its docstring)."""
    from charm_megatron.ops.attention import _auto_cluster, _check_scale, _resolve

    opts = options if options is not None else CPOptions.from_env()

    cp_size = dist.get_world_size(group)
    check_qkv(q, k, v, causal=causal, equal_lengths=True, who="cp_attention", layout="thd")
    if cu_seqlens is None:
        raise ValueError("cp_attention: cu_seqlens_padded given without cu_seqlens; pass both "
                         "(cu_seqlens are the real document lengths)")
    layout, error = None, None
    try:
        layout = make_layout(cu_seqlens, cu_seqlens_padded, cp_size, q.shape[0])
    except (ValueError, TypeError) as exc:
        if cp_size == 1:
            raise
        error = str(exc)
    if cp_size > 1:
        _agree(layout, error, group, q.device, opts.timeout_s)
    assert layout is not None
    scale = _check_scale(softmax_scale, q.shape[-1])
    if cp_size == 1:
        seg = _local_segments(layout, causal, str(q.device))
        out, lse = _LocalPacked.apply(q.unsqueeze(1), k.unsqueeze(1), v.unsqueeze(1), seg,
                                      float(scale), opts)
        out = out.squeeze(1)
        return (out, lse) if return_lse else out
    q4 = q.unsqueeze(1)
    if topology is None and uses_topology(algo):
        topology = opts.topology or "auto"  # the options' default, as in cp_attention
    cluster = _auto_cluster(opts) if algo == "auto" else None
    algo, groups = _resolve(algo, topology, group, cp_size, q4, k.unsqueeze(1), causal, cluster)
    perm, inv = _permutation(layout, str(q.device))
    qi, ki, vi = (t.index_select(0, perm).unsqueeze(1) for t in (q, k, v))
    out, lse = _PackedCPAttention.apply(qi, ki, vi, group, algo, groups, causal, float(scale),
                                        layout, opts)
    out = out.squeeze(1).index_select(0, inv)
    if not return_lse:
        return out
    return out, lse.index_select(1, inv)
