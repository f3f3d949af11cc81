"""Runs any plan with real communication and a kernel backend.

The executor knows nothing of rings or levels: it interprets a rank's op list. Buffers are named
locations, allocated once per call at full block size and reused, so memory does not grow with
the CP size. A message of half a block travels as the first rows of its buffer; ``_Buf.held``
remembers which rows it holds.

Tensor layouts (rows = the local sequence, first dim, so a half is a contiguous slice):

=====  ============================================================  ======================
kind   tensors (each ``[rows, ...]``, so a half is a contiguous slice)   dtype
=====  ============================================================  ======================
q      q ``[s, b, hq, d]``                                           input
kv     k, v ``[s, b, hkv, d]`` (two messages; own k, v sent as is)    input
qgrad  q, dout ``[s, b, hq, d]``; lse, delta ``[s, b, hq, 2]``        input; fp32
out    out ``[s, b, hq, d]``, lse ``[s, b, hq]``                      fp32 in accumulators,
                                                                     input dtype on the wire
dq     ``[s, b, hq, d]``                                             fp32 in accumulators,
                                                                     input dtype on the wire
dkv    dk, dv ``[s, b, hkv, d]``                                      same as dq
=====  ============================================================  ======================

Own blocks are the caller's tensors themselves (no packing copies).
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from dataclasses import dataclass

import torch
import torch.distributed as dist

from charm_megatron.kernels.base import AttentionBackend
from charm_megatron.ops.merge import merge_into
from charm_megatron.ops.streams import StreamGroups, comm_timeout
from charm_megatron.plan.core import Comm, Half, Merge, Op, Reset, Tile, TileBwd, Wait

_ENABLED = {"comm": True, "compute": True}


@contextlib.contextmanager
def ablate(comm: bool = True, compute: bool = True) -> Iterator[None]:
    """Run plans with communication or computation switched off (for measuring a plan's
    compute-only and communication-only time, e.g. the CCR of the benchmark).

    Results computed under ablation are meaningless; shapes and message sizes are unchanged.
    Every rank of a CP group must use the same setting.
    """
    saved = dict(_ENABLED)
    _ENABLED.update(comm=comm, compute=compute)
    try:
        yield
    finally:
        _ENABLED.update(saved)


@dataclass
class BlockShape:
    """Sizes of one rank's blocks."""

    s: int
    b: int
    hq: int
    hkv: int
    d: int
    dtype: torch.dtype
    device: torch.device


@dataclass
class _Buf:
    tensors: tuple[torch.Tensor, ...]
    held: Half = Half.FULL
    kind: str = ""


def _rows(half: Half, s: int) -> slice:
    if half is Half.FULL:
        return slice(0, s)
    return slice(0, s // 2) if half is Half.FIRST else slice(s // 2, s)


def _out_with_delta(dout: torch.Tensor, delta: torch.Tensor) -> torch.Tensor:
    """A stand-in for the attention output with the same ``rowsum(dout * out)``.

    Flash-attention backward uses the output only through ``delta = rowsum(dout * out)`` per
    row and head. Sending ``delta`` (one float per row and head) instead of ``out`` (``d``
    values) cuts a third of the backward q-side traffic; the receiver rebuilds an ``out`` with
    the right ``delta``: ``dout * delta / |dout|^2`` (zero where ``dout`` is zero, where
    ``delta`` is zero too).
    """
    d32 = dout.float()
    norm = d32.square().sum(-1, keepdim=True)
    coef = torch.where(norm > 0, delta.unsqueeze(-1) / norm, torch.zeros_like(norm))
    return (d32 * coef).to(dout.dtype)


class Executor:
    """Interprets plan ops for one rank."""

    def __init__(self, streams: StreamGroups, backend: AttentionBackend, shape: BlockShape,
                 scale: float) -> None:
        self.streams = streams
        self.backend = backend
        self.shape = shape
        self.scale = scale
        self.bufs: dict[str, _Buf] = {}
        self.pending: dict[int, tuple[list, list]] = {}  # handle -> (works, keep-alive tensors)

    # ---------------------------------------------------------------------------- buffers
    def _alloc(self, kind: str, wire: bool) -> tuple[torch.Tensor, ...]:
        return tuple(torch.empty(shape, dtype=dtype, device=self.shape.device)
                     for shape, dtype in self._alloc_shapes(kind, wire))

    def _buffer(self, loc: str, kind: str, wire: bool) -> _Buf:
        buf = self.bufs.get(loc)
        want = [(torch.Size(shape), dt) for shape, dt in self._alloc_shapes(kind, wire)]
        if buf is None or [(t.shape, t.dtype) for t in buf.tensors] != want:
            buf = _Buf(self._alloc(kind, wire))
            self.bufs[loc] = buf
        return buf

    def _alloc_shapes(self, kind: str, wire: bool) -> list:
        """(shape, dtype) of each tensor of a full block of ``kind``."""
        sh = self.shape
        f32 = torch.float32
        qs, kvs = (sh.s, sh.b, sh.hq, sh.d), (sh.s, sh.b, sh.hkv, sh.d)
        table = {
            "q": [(qs, sh.dtype)],
            "kv": [(kvs, sh.dtype), (kvs, sh.dtype)],
            "qgrad": [(qs, sh.dtype), (qs, sh.dtype), ((sh.s, sh.b, sh.hq, 2), f32)],
            "out": [(qs, sh.dtype if wire else f32), ((sh.s, sh.b, sh.hq), f32)],
            "dq": [(qs, sh.dtype if wire else f32)],
            "dkv": [(kvs, sh.dtype if wire else f32), (kvs, sh.dtype if wire else f32)],
        }
        if kind not in table:
            raise ValueError(f"unknown block kind {kind!r}")
        return table[kind]

    def _view(self, loc: str, half: Half) -> tuple[torch.Tensor, ...]:
        """Rows ``half`` of the block in ``loc`` (which may hold only some rows)."""
        buf = self.bufs[loc]
        s = self.shape.s
        if buf.held is Half.FULL:
            sl = _rows(half, s)
        else:
            if half is not buf.held:
                raise RuntimeError(f"{loc} holds rows {buf.held}, not {half}")
            sl = slice(0, s // 2)
        return tuple(t[sl] for t in buf.tensors)

    def set_own(self, loc: str, kind: str, *tensors: torch.Tensor) -> None:
        """Make the caller's tensors the block ``loc`` (no copy; they must be contiguous)."""
        self.bufs[loc] = _Buf(tuple(t if t.is_contiguous() else t.contiguous() for t in tensors),
                              kind=kind)

    def result(self, loc: str) -> tuple[torch.Tensor, ...]:
        return self.bufs[loc].tensors

    # -------------------------------------------------------------------------------- run
    def run(self, ops: list[Op]) -> None:
        for op in ops:
            if isinstance(op, Tile):
                self._tile(op)
            elif isinstance(op, TileBwd):
                self._tile_bwd(op)
            elif isinstance(op, Comm):
                self._post(op)
            elif isinstance(op, Wait):
                self._wait(op.handle)
            elif isinstance(op, Merge):
                self._merge(op)
            elif isinstance(op, Reset):
                self._reset(op)
            else:
                raise TypeError(f"unknown op {op!r}")
        if self.pending:
            raise RuntimeError(f"plan left transfers {sorted(self.pending)} unwaited")

    def _reset(self, op: Reset) -> None:
        buf = self._buffer(op.loc, op.kind, wire=False)
        buf.held = Half.FULL
        buf.kind = op.kind
        for t in buf.tensors:
            t.zero_()
        if op.kind == "out":
            buf.tensors[1].fill_(float("-inf"))

    # The kernel calls of a tile; ops/packed.py's PackedExecutor overrides them to compute a
    # packed (THD) tile document by document.
    def _kernel_forward(self, spec, q, k, v):
        return self.backend.forward(q, k, v, spec.causal, self.scale)

    def _kernel_backward(self, spec, dout, q, k, v, out, lse):
        return self.backend.backward(dout, q, k, v, out, lse, spec.causal, self.scale)

    def _tile(self, op: Tile) -> None:
        s = op.spec
        if not _ENABLED["compute"]:
            if op.fresh:  # something of the right size must still be there to send
                self._buffer(op.acc, "out", wire=True).held = s.q_half
            return
        (q,) = self._view(op.q_loc, s.q_half)
        k, v = self._view(op.kv_loc, s.kv_half)
        out, lse = self._kernel_forward(s, q, k, v)
        if op.fresh:
            # Kept as the kernel made it (input dtype, the tile's rows only): it is sent on.
            self.bufs[op.acc] = _Buf((out, lse.permute(2, 0, 1)), held=s.q_half, kind="out")
            return
        acc_o, acc_l = self.bufs[op.acc].tensors
        merge_into(acc_o, acc_l, out, lse.permute(2, 0, 1), _rows(s.q_half, self.shape.s))

    def _tile_bwd(self, op: TileBwd) -> None:
        s = op.spec
        if not _ENABLED["compute"]:
            # Something of the right size must still be there to send.
            if op.fresh_dq:
                self._buffer(op.dq_acc, "dq", wire=True).held = s.q_half
            if op.fresh_dkv:
                self._buffer(op.dkv_acc, "dkv", wire=True).held = s.kv_half
            return
        q, dout, stats = self._view(op.q_loc, s.q_half)
        k, v = self._view(op.kv_loc, s.kv_half)
        dq, dk, dv = self._kernel_backward(
            s, dout, q, k, v, _out_with_delta(dout, stats[..., 1]), stats[..., 0].permute(1, 2, 0)
        )
        qr, kr = _rows(s.q_half, self.shape.s), _rows(s.kv_half, self.shape.s)
        if op.fresh_dq:
            self.bufs[op.dq_acc] = _Buf((dq,), held=s.q_half, kind="dq")
        else:
            self.bufs[op.dq_acc].tensors[0][qr] += dq
        if op.fresh_dkv:
            self.bufs[op.dkv_acc] = _Buf((dk, dv), held=s.kv_half, kind="dkv")
        else:
            dk_acc, dv_acc = self.bufs[op.dkv_acc].tensors
            dk_acc[kr] += dk
            dv_acc[kr] += dv

    def _merge(self, op: Merge) -> None:
        src = self.bufs[op.src]
        rows = _rows(src.held, self.shape.s)
        n = rows.stop - rows.start
        acc = self.bufs[op.acc]
        if acc.kind == "out":  # a partial output: log-sum-exp merge
            merge_into(acc.tensors[0], acc.tensors[1], src.tensors[0][:n], src.tensors[1][:n],
                       rows)
        else:  # gradient partials: sum
            for a, t in zip(acc.tensors, src.tensors):
                a[rows] += t[:n]

    def _post(self, op: Comm) -> None:
        group = self.streams.groups[op.stream]
        ranks = self.streams.ranks
        p2p: list[dist.P2POp] = []
        keep: list[torch.Tensor] = []
        s = self.shape.s
        for x in op.sends:
            tensors = self._view(x.loc, x.half)
            if x.kind == "out" and tensors[0].dtype != self.shape.dtype:
                # Partial outputs travel in the input dtype (half the bytes for bf16); the
                # receiver merges them in fp32.
                tensors = (tensors[0].to(self.shape.dtype), tensors[1])
            elif x.kind in ("dq", "dkv"):
                # So do gradient partials (summed in fp32 on both sides: one rounding each).
                tensors = tuple(t.to(self.shape.dtype) for t in tensors)
            for t in tensors:
                t = t if t.is_contiguous() else t.contiguous()
                keep.append(t)
                p2p.append(dist.P2POp(dist.isend, t, ranks[x.peer], group))
        for x in op.recvs:
            buf = self._buffer(x.loc, x.kind, wire=True)
            buf.held = x.half
            buf.kind = x.kind
            n = s if x.half is Half.FULL else s // 2
            for t in buf.tensors:
                p2p.append(dist.P2POp(dist.irecv, t[:n], ranks[x.peer], group))
        if not _ENABLED["comm"]:
            p2p = []  # receive buffers keep whatever they held; only timing is meaningful
        works = dist.batch_isend_irecv(p2p) if p2p else []
        self.pending[op.handle] = (works, keep)

    def _wait(self, handle: int) -> None:
        works, _ = self.pending.pop(handle)
        timeout = comm_timeout()
        for w in works:
            if self.shape.device.type == "cuda":
                w.wait()  # NCCL: makes the current stream wait; no host synchronisation
            else:
                w.wait(timeout)
