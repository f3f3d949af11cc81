"""Runs any plan with real communication and a kernel backend.

The executor knows nothing of rings or levels: it interprets a rank's op list. Buffers are named
locations, allocated once per call at full block size and reused, so memory does not grow with
the CP size. A message of half a block travels as the first rows of its buffer; ``_Buf.held``
remembers which rows it holds.

Tensor layouts (rows = the local sequence, first dim, so a half is a contiguous slice):

=========  ==============================================  =====================
kind       tensors                                         dtype
=========  ==============================================  =====================
q          ``[s, b, hq, d]``                               input
kv         ``[s, 2, b, hkv, d]`` (K, V packed)             input
qgrad      ``[s, 2, b, hq, d]`` (q, dout), ``[s, b, hq, 2]`` (lse, delta)   input, fp32
out        ``[s, b, hq, d]``, lse ``[s, b, hq]``            fp32 in accumulators, input dtype
                                                           on the wire; lse fp32
dq         ``[s, b, hq, d]``                               fp32
dkv        ``[s, 2, b, hkv, d]``                           fp32
=========  ==============================================  =====================
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
        sh = self.shape
        dt, f32, dev = sh.dtype, torch.float32, sh.device
        if kind == "q":
            return (torch.empty(sh.s, sh.b, sh.hq, sh.d, dtype=dt, device=dev),)
        if kind == "kv":
            return (torch.empty(sh.s, 2, sh.b, sh.hkv, sh.d, dtype=dt, device=dev),)
        if kind == "qgrad":
            return (torch.empty(sh.s, 2, sh.b, sh.hq, sh.d, dtype=dt, device=dev),
                    torch.empty(sh.s, sh.b, sh.hq, 2, dtype=f32, device=dev))
        if kind == "out":
            return (torch.empty(sh.s, sh.b, sh.hq, sh.d, dtype=dt if wire else f32, device=dev),
                    torch.empty(sh.s, sh.b, sh.hq, dtype=f32, device=dev))
        if kind == "dq":
            return (torch.empty(sh.s, sh.b, sh.hq, sh.d, dtype=f32, device=dev),)
        if kind == "dkv":
            return (torch.empty(sh.s, 2, sh.b, sh.hkv, sh.d, dtype=f32, device=dev),)
        raise ValueError(f"unknown block kind {kind!r}")

    def _buffer(self, loc: str, kind: str, wire: bool) -> _Buf:
        buf = self.bufs.get(loc)
        want = self._alloc_shapes(kind, wire)
        if buf is None or [(t.shape, t.dtype) for t in buf.tensors] != want:
            buf = _Buf(self._alloc(kind, wire))
            self.bufs[loc] = buf
        return buf

    def _alloc_shapes(self, kind: str, wire: bool) -> list:
        # Cheap signature of what _alloc would make, to decide on reuse without allocating.
        sh = self.shape
        f32 = torch.float32
        table = {
            "q": [((sh.s, sh.b, sh.hq, sh.d), sh.dtype)],
            "kv": [((sh.s, 2, sh.b, sh.hkv, sh.d), sh.dtype)],
            "qgrad": [((sh.s, 2, sh.b, sh.hq, sh.d), sh.dtype), ((sh.s, sh.b, sh.hq, 2), f32)],
            "out": [((sh.s, sh.b, sh.hq, sh.d), sh.dtype if wire else f32),
                    ((sh.s, sh.b, sh.hq), f32)],
            "dq": [((sh.s, sh.b, sh.hq, sh.d), f32)],
            "dkv": [((sh.s, 2, sh.b, sh.hkv, sh.d), f32)],
        }
        return [(torch.Size(s), d) for s, d in table[kind]]

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

    def set_own(self, loc: str, *tensors: torch.Tensor) -> None:
        self.bufs[loc] = _Buf(tuple(tensors))

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
        buf.tensors[0].zero_()
        if op.kind == "out":
            buf.tensors[1].fill_(float("-inf"))

    def _tile(self, op: Tile) -> None:
        s = op.spec
        if not _ENABLED["compute"]:
            if op.fresh:  # something of the right size must still be there to send
                self._buffer(op.acc, "out", wire=True).held = s.q_half
            return
        (q,) = self._view(op.q_loc, s.q_half)
        (kv,) = self._view(op.kv_loc, s.kv_half)
        out, lse = self.backend.forward(q, kv[:, 0], kv[:, 1], s.causal, self.scale)
        if op.fresh:
            # Kept as the kernel made it (input dtype, the tile's rows only): it is sent on.
            self.bufs[op.acc] = _Buf((out, lse.permute(2, 0, 1)), held=s.q_half)
            return
        acc_o, acc_l = self.bufs[op.acc].tensors
        merge_into(acc_o, acc_l, out, lse.permute(2, 0, 1), _rows(s.q_half, self.shape.s))

    def _tile_bwd(self, op: TileBwd) -> None:
        if not _ENABLED["compute"]:
            return
        s = op.spec
        pack, stats = self._view(op.q_loc, s.q_half)
        (kv,) = self._view(op.kv_loc, s.kv_half)
        q, dout = pack[:, 0], pack[:, 1]
        dq, dk, dv = self.backend.backward(
            dout, q, kv[:, 0], kv[:, 1], _out_with_delta(dout, stats[..., 1]),
            stats[..., 0].permute(1, 2, 0), s.causal, self.scale,
        )
        (dq_acc,) = self.bufs[op.dq_acc].tensors
        (dkv_acc,) = self.bufs[op.dkv_acc].tensors
        qr, kr = _rows(s.q_half, self.shape.s), _rows(s.kv_half, self.shape.s)
        dq_acc[qr] += dq
        dkv_acc[kr, 0] += dk
        dkv_acc[kr, 1] += dv

    def _merge(self, op: Merge) -> None:
        src = self.bufs[op.src]
        rows = _rows(src.held, self.shape.s)
        n = rows.stop - rows.start
        acc = self.bufs[op.acc].tensors
        if len(acc) == 2:  # a partial output: log-sum-exp merge
            merge_into(acc[0], acc[1], src.tensors[0][:n], src.tensors[1][:n], rows)
        else:  # a gradient partial: sum
            acc[0][rows] += src.tensors[0][:n]

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
            for t in tensors:
                t = t if t.is_contiguous() else t.contiguous()
                keep.append(t)
                p2p.append(dist.P2POp(dist.isend, t, ranks[x.peer], group))
        for x in op.recvs:
            buf = self._buffer(x.loc, x.kind, wire=True)
            buf.held = x.half
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
