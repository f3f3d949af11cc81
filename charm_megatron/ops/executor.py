"""Runs any plan with real communication and a kernel backend.

The executor knows nothing of rings or levels: it interprets a rank's op list. Buffers are named
locations; each *lifetime* of a location (from a receive, reset or fresh tile into it to its
last use, :mod:`charm_megatron.plan.lifetimes`) is allocated when it begins, with only the rows
it uses, and freed after its last use. So the peak is the largest set of buffers alive at one
time, not the sum of every location, and memory does not grow with the CP size. A buffer of
half a block holds that half in its own (half-sized) rows; ``_Buf.held`` remembers which.

Tensor layouts and dtypes (in a message and in an accumulator) are those of
:data:`charm_megatron.plan.vocab.BLOCKS`: rows are the local sequence, the first dim, so a half
is a contiguous slice; kv blocks are two tensors (k, v) and so two messages.
Own blocks are the caller's tensors themselves (no packing copies).

Bytes move only through the executor's transport (:mod:`charm_megatron.ops.transport`): one
``post`` per ``Comm`` batch, whose handles a ``Wait`` waits on.
"""

from __future__ import annotations

import datetime
from dataclasses import dataclass

import torch
import torch.distributed as dist

from charm_megatron.kernels.base import AttentionBackend
from charm_megatron.kernels.merge import merge_into
from charm_megatron.kernels.window import Window, masked_backward, masked_forward
from charm_megatron.ops.joint import JointKv
from charm_megatron.ops.row_delta import out_with_delta
from charm_megatron.ops.streams import StreamGroups
from charm_megatron.ops.transport import P2P, TorchTransport, Transport
from charm_megatron.plan.core import (
    Comm,
    Half,
    Kind,
    Loc,
    Merge,
    Op,
    OpInterpreter,
    Reset,
    SuperTile,
    Tile,
    TileBwd,
    Wait,
)
from charm_megatron.plan.lifetimes import Lifetimes, lifetimes
from charm_megatron.plan.vocab import BLOCKS, Dtype, as_loc, block_sizes


class CommError(RuntimeError):
    """A transfer of a plan did not complete (timed out, or its peer went away)."""


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
    dv: int = 0  # v / output head dim; 0: as d


@dataclass(frozen=True)
class ExecOptions:
    """How an executor runs its plans (one call's, from its ``CPOptions``).

    ``compute`` / ``comm`` False: an ablated run (``CPOptions.ablation``, timing a plan's
    parts; results meaningless). ``timeout_s``: the bound on every wait. ``what`` names the
    call in errors, e.g. ``"cp_attention(algo=charm, backward)"``. ``wide_partials``: partials
    travel in fp32 (``CPOptions.partials``)."""

    compute: bool = True
    comm: bool = True
    timeout_s: float = 600.0
    what: str = "cp_attention"
    wide_partials: bool = False


@dataclass
class _Buf:
    tensors: tuple[torch.Tensor, ...]
    held: Half = Half.FULL
    kind: Kind | None = None


def _rows(half: Half, s: int) -> slice:
    """Where rows ``half`` of an ``s``-row block are (:meth:`Half.span`: a half is the first
    ``s // 2`` rows or the rest, a quarter its half's cut alike; an odd part's second piece
    is one row longer; ``plan/tile_rule.py`` splits alike)."""
    return slice(*half.span(s))


def _n_rows(half: Half, s: int) -> int:
    """How many rows ``half`` of an ``s``-row block has (a buffer holding only that half)."""
    sl = _rows(half, s)
    return sl.stop - sl.start


# Lifetimes per op list, computed once: the plans are cached (ops/attention.py), so the same
# list objects come back call after call. The list is kept in the value so its id stays valid.
_LIFETIMES: dict[int, tuple[list[Op], Lifetimes]] = {}
_LIFETIMES_MAX = 1024


def _nbytes(tensors) -> int:
    """The bytes of ``tensors`` together (what a timed device is told was moved or copied)."""
    return sum(t.numel() * t.element_size() for t in tensors)


def _lifetimes_of(ops: list[Op]) -> Lifetimes:
    hit = _LIFETIMES.get(id(ops))
    if hit is not None and hit[0] is ops:
        return hit[1]
    life = lifetimes(ops)
    if len(_LIFETIMES) >= _LIFETIMES_MAX:
        _LIFETIMES.clear()
    _LIFETIMES[id(ops)] = (ops, life)
    return life


class Executor(OpInterpreter[None]):
    """Interprets plan ops for one rank; its bytes move through ``transport``
    (ops/transport.py; ``None``: torch.distributed)."""

    def __init__(self, streams: StreamGroups, backend: AttentionBackend, shape: BlockShape,
                 scale: float, options: ExecOptions = ExecOptions(), *,
                 window: Window | None = None, transport: Transport | None = None) -> None:
        self.streams = streams
        self.options = options
        self.transport = transport if transport is not None else TorchTransport()
        self.wide_partials = options.wide_partials  # partials travel in fp32
        self.window = window  # a sliding window: every tile masked by kernels/window.py
        self.backend = backend
        self.shape = shape
        self.scale = scale
        self.compute = options.compute  # False / comm False: ablated runs
        self.comm = options.comm
        self.timeout_s = options.timeout_s
        self.what = options.what  # names the call in errors
        self.bufs: dict[Loc, _Buf] = {}
        # handle -> (works, keep-alive tensors, stream, global peer ranks)
        self.pending: dict[int, tuple[list, list, str, list[int]]] = {}
        self._shapes: dict[tuple[Kind, bool], list[tuple[tuple[int, ...], torch.dtype]]] = {}
        self._life: Lifetimes | None = None  # of the op list being run
        self._joint = JointKv()  # super-tiles' kv received into one buffer (ops/joint.py)
        # (loc, its buffer, the real attention output of that q block): see set_own_output.
        self._own_out: tuple[Loc, _Buf, torch.Tensor] | None = None
        self._i = 0  # index of the op being interpreted
        # A timed device (lab/emulate/device.py) slows its compute while a transfer of this rank
        # is in flight (per stream: it is told each batch's) and prices the merges it is told
        # of; real kernels have no such hooks.
        self._posted = getattr(backend, "posted", None)
        self._waited = getattr(backend, "waited", None)
        self._merged = getattr(backend, "merged", None)
        self._copied = getattr(backend, "copied", None)
        self._stage_copied = getattr(backend, "stage_copied", None)
        # An asynchronous timed device queues its ops: the host waits for it before posting
        # messages (their sends may hold its results; a GPU's NCCL starts after the kernels
        # before it on the stream) and at the end of a call (synchronize).
        self._before_post = getattr(backend, "before_post", None)
        self._synchronize = getattr(backend, "synchronize", None)
        # An emulated GPU on links that serve in virtual start order must say when its call
        # has posted everything, so no rank's link wait waits on it during the status exchange.
        self._posts_done = getattr(backend, "posts_done", None)

    # ---------------------------------------------------------------------------- buffers
    def _alloc(self, kind: Kind, wire: bool, rows: Half = Half.FULL,
               n: int | None = None) -> tuple[torch.Tensor, ...]:
        n = _n_rows(rows, self.shape.s) if n is None else n  # n: that many rows instead
        return tuple(torch.empty((n, *shape[1:]), dtype=dtype, device=self.shape.device)
                     for shape, dtype in self._alloc_shapes(kind, wire))

    def _buffer(self, loc: Loc, kind: Kind, wire: bool, rows: Half = Half.FULL) -> _Buf:
        """A new buffer for ``loc`` holding rows ``rows`` of a ``kind`` block (replacing what
        ``loc`` held: a new lifetime)."""
        buf = _Buf(self._alloc(kind, wire, rows), held=rows, kind=Kind(kind))
        self.bufs[loc] = buf
        return buf

    def _new_rows(self, loc: Loc) -> Half:
        """The rows the lifetime that the current op starts in ``loc`` uses (all of them when
        an op is interpreted outside :meth:`run`)."""
        if self._life is None:
            return Half.FULL
        return self._life.rows.get((self._i, loc), Half.FULL)

    def _acc_rows(self, buf: _Buf, half: Half) -> slice:
        """Where rows ``half`` of a block are in ``buf`` (which may hold only some rows: a
        half, or a quarter; ``half`` must lie inside them)."""
        s = self.shape.s
        if buf.held is Half.FULL:
            return _rows(half, s)
        if not buf.held.covers(half):
            raise RuntimeError(f"{self.what}: a buffer holding rows {buf.held} is asked for rows "
                               f"{half} (the plan's lifetimes are wrong)")
        base = buf.held.span(s)[0]
        lo, hi = half.span(s)
        return slice(lo - base, hi - base)

    def _torch_dtype(self, dtype: Dtype) -> torch.dtype:
        # Accumulators and stats: fp32, or float64 for float64 inputs (float64 end to end).
        if dtype is Dtype.INPUT:
            return self.shape.dtype
        return torch.float64 if self.shape.dtype == torch.float64 else torch.float32

    def _alloc_shapes(self, kind: Kind, wire: bool) -> list[tuple[tuple[int, ...], torch.dtype]]:
        """(shape, dtype) of each tensor of a full block of ``kind``: in a receive buffer
        (``wire``) or in an accumulator."""
        key = (kind, wire)
        if key not in self._shapes:
            sh = self.shape
            sizes = block_sizes(sh.b, sh.hq, sh.hkv, sh.d, sh.dv, s=sh.s)
            self._shapes[key] = [(t.shape(sizes), self._torch_dtype(
                t.dtype(accumulator=not wire, wide=self.wide_partials)))
                for t in BLOCKS[Kind(kind)].tensors]
        return self._shapes[key]

    def _to_wire(self, kind: Kind, tensors: tuple[torch.Tensor, ...]) -> tuple[torch.Tensor, ...]:
        """``tensors`` of a ``kind`` block as they travel: in the dtypes of the receiver's
        buffer (:meth:`_alloc_shapes` ``wire=True``), so partials leave their fp32
        accumulators in the input dtype (the receiver merges them in fp32), or, with
        ``wide_partials``, every partial goes in fp32 (a fresh tile's, which the kernel made
        in the input dtype, widened)."""
        return tuple(t if t.dtype == dtype else t.to(dtype)
                     for t, (_, dtype) in zip(tensors, self._alloc_shapes(kind, True)))

    def _view(self, loc: Loc, half: Half) -> tuple[torch.Tensor, ...]:
        """Rows ``half`` of the block in ``loc`` (which may hold only some rows)."""
        buf = self.bufs.get(loc)
        if buf is None:
            raise RuntimeError(f"{self.what}: reads {loc}, which holds nothing (never written, "
                               "or freed: the plan's lifetimes are wrong)")
        sl = self._acc_rows(buf, half)
        return tuple(t[sl] for t in buf.tensors)

    def set_own(self, loc: Loc | str, kind: Kind | str, *tensors: torch.Tensor) -> None:
        """Make the caller's tensors the block ``loc`` (``Loc.own(kind)`` or its name, e.g.
        ``"own.q"``) in the layout of ``BLOCKS[kind]`` (no copy; they must be contiguous)."""
        self.bufs[as_loc(loc)] = _Buf(
            tuple(t if t.is_contiguous() else t.contiguous() for t in tensors), kind=Kind(kind))

    def set_own_output(self, loc: Loc | str, out: torch.Tensor) -> None:
        """The attention output of the caller's own q-side block ``loc`` (set by
        :meth:`set_own`): backward tiles on that block give it to the kernel as it is, instead
        of rebuilding a stand-in from the bundle's ``delta`` (:func:`.row_delta.out_with_delta`, six
        elementwise passes over the block, once per tile). Received blocks still carry only
        ``delta``; their stand-in is built per tile, so no q-sized tensor is held for them."""
        loc = as_loc(loc)
        self._own_out = (loc, self.bufs[loc], out)

    def _tile_output(self, loc: Loc, half: Half, dout: torch.Tensor,
                     stats: torch.Tensor) -> torch.Tensor:
        """What a backward tile on rows ``half`` of the q-side block in ``loc`` passes the
        kernel as the output: the real one for the own block, else the stand-in."""
        own = self._own_out
        if own is not None and own[0] == loc and self.bufs.get(loc) is own[1]:
            return own[2][self._acc_rows(own[1], half)]
        return out_with_delta(dout, stats[..., 1])

    def result(self, loc: Loc) -> tuple[torch.Tensor, ...]:
        return self.bufs[loc].tensors

    # -------------------------------------------------------------------------------- run
    def run(self, ops: list[Op]) -> None:
        """Interpret ``ops`` in order, each buffer allocated when its lifetime begins and
        freed after its last use (a send's lasts until its batch is waited)."""
        self._life = life = _lifetimes_of(ops)
        self._joint = JointKv(ops)
        free_after, bufs = life.free_after, self.bufs
        try:
            for i, op in enumerate(ops):
                self._i = i
                self.interpret(op)
                dead = free_after.get(i)
                if dead:
                    for loc in dead:
                        bufs.pop(loc, None)
        finally:
            self._life, self._joint = None, JointKv()
        if self.pending:
            raise RuntimeError(f"plan left transfers {sorted(self.pending)} unwaited")

    def on_comm(self, op: Comm) -> None:
        self._post(op)

    def on_wait(self, op: Wait) -> None:
        self._wait(op.handle)

    def on_reset(self, op: Reset) -> None:
        buf = self._buffer(op.loc, op.kind, wire=False, rows=self._new_rows(op.loc))
        for t, spec in zip(buf.tensors, BLOCKS[op.kind].tensors):
            if spec.empty:
                t.fill_(spec.empty)
            else:
                t.zero_()

    # The kernel calls of a tile; ops/packed.py's PackedExecutor overrides them to compute a
    # packed (THD) tile document by document.
    def _kernel_forward(self, spec, q, k, v):
        if self._masked(spec):
            allowed = self._allowed(spec, q.device)
            own = getattr(self.backend, "forward_masked", None)
            if own is not None:
                return own(q, k, v, allowed, self.scale, window=self.window, spec=spec)
            return masked_forward(q, k, v, allowed, self.scale)
        return self.backend.forward(q, k, v, spec.causal, self.scale)

    def _kernel_backward(self, spec, dout, q, k, v, out, lse):
        if self._masked(spec):
            allowed = self._allowed(spec, q.device)
            own = getattr(self.backend, "backward_masked", None)
            if own is not None:
                return own(dout, q, k, v, out, lse, allowed, self.scale, window=self.window,
                           spec=spec)
            return masked_backward(dout, q, k, v, out, lse, allowed, self.scale)
        return self.backend.backward(dout, q, k, v, out, lse, spec.causal, self.scale)

    def _masked(self, spec) -> bool:
        """The tile needs the window's mask (a tile it keeps whole runs the fused kernel)."""
        return self.window is not None and self.window.needs_mask(spec)

    def _allowed(self, spec, device: torch.device) -> torch.Tensor:
        return self.window.allowed(spec.q_owner, spec.q_half, spec.kv_owner, spec.kv_half,
                                   device)

    def _forward_cut(self, spec, q: torch.Tensor,
                     k: torch.Tensor) -> list[tuple[slice, slice, bool]] | None:
        """The pieces an accumulated forward tile is computed in (``None``: whole), as the
        backend asks (its optional ``forward_cut``: the CPU aten kernel cuts causal square
        blocks, whose masked half it would compute anyway). Each piece is merged into the
        accumulator as it comes, so the pieces never coexist with a whole-block output."""
        cut = getattr(self.backend, "forward_cut", None)
        if cut is None or self._masked(spec):  # a masked tile is one call
            return None
        return cut(q, k, spec.causal)

    def on_tile(self, op: Tile) -> None:
        s = op.spec
        if not self.compute:
            if op.fresh:  # something of the right size must still be there to send
                self._buffer(op.acc, Kind.OUT, wire=True, rows=s.q_half)
            return
        (q,) = self._view(op.q_loc, s.q_half)
        k, v = self._view(op.kv_loc, s.kv_half)
        if self._tile_into(op, q, k, v):
            return
        out, lse = self._kernel_forward(s, q, k, v)
        if op.fresh:
            # Kept as the kernel made it (input dtype, the tile's rows only): it is sent on.
            self.bufs[op.acc] = _Buf((out, lse.permute(2, 0, 1)), held=s.q_half, kind=Kind.OUT)
            return
        acc = self.bufs[op.acc]
        acc_o, acc_l = acc.tensors
        merge_into(acc_o, acc_l, out, lse.permute(2, 0, 1), self._acc_rows(acc, s.q_half))

    def _tile_into(self, op: Tile, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> bool:
        """Compute an accumulated tile in the pieces of :meth:`_forward_cut`, merging each
        into the accumulator; False (nothing done) where the tile is computed whole."""
        pieces = self._forward_cut(op.spec, q, k) if not op.fresh else None
        if pieces is None:
            return False
        acc = self.bufs[op.acc]
        acc_o, acc_l = acc.tensors
        base = self._acc_rows(acc, op.spec.q_half).start
        for rows, keys, causal in pieces:
            out, lse = self.backend.forward(q[rows], k[keys], v[keys], causal, self.scale)
            merge_into(acc_o, acc_l, out, lse.permute(2, 0, 1),
                       slice(base + rows.start, base + rows.stop))
        return True

    def on_tile_bwd(self, op: TileBwd) -> None:
        s = op.spec
        if not self.compute:
            # Something of the right size must still be there to send.
            if op.fresh_dq:
                self._buffer(op.dq_acc, Kind.DQ, wire=True, rows=s.q_half)
            if op.fresh_dkv:
                self._buffer(op.dkv_acc, Kind.DKV, wire=True, rows=s.kv_half)
            return
        q, dout, stats = self._view(op.q_loc, s.q_half)
        k, v = self._view(op.kv_loc, s.kv_half)
        dq, dk, dv = self._kernel_backward(
            s, dout, q, k, v, self._tile_output(op.q_loc, s.q_half, dout, stats),
            stats[..., 0].permute(1, 2, 0)
        )
        if op.fresh_dq:
            self.bufs[op.dq_acc] = _Buf((dq,), held=s.q_half, kind=Kind.DQ)
        else:
            acc = self.bufs[op.dq_acc]
            acc.tensors[0][self._acc_rows(acc, s.q_half)] += dq
        if op.fresh_dkv:
            self.bufs[op.dkv_acc] = _Buf((dk, dv), held=s.kv_half, kind=Kind.DKV)
        else:
            acc = self.bufs[op.dkv_acc]
            kr = self._acc_rows(acc, s.kv_half)
            dk_acc, dv_acc = acc.tensors
            dk_acc[kr] += dk
            dv_acc[kr] += dv

    # A subclass whose tiles are not one kernel call each (ops/packed.py cuts them by
    # document) runs a super-tile's members one by one.
    fuses_super_tiles = True

    def on_super_tile(self, op: SuperTile) -> None:
        """One kernel call over the members' kv rows, concatenated in order (plan/core.py,
        :class:`SuperTile`): forward, one partial merged once into the accumulator;
        backward, dq added once and dk, dv split back by rows into each member's dkv
        accumulator. Members a window cuts (each masked by itself) run one by one, and so do
        all without compute (an ablated run: only their results' sizes matter)."""
        if not (self.fuses_super_tiles and self.compute) or any(
                self._masked(m.spec) for m in op.members):
            for m in op.members:
                self.interpret(m)
            return
        first = op.first
        s = first.spec
        kvs = [self._view(m.kv_loc, m.spec.kv_half) for m in op.members]
        joint = self._joint.take(self._i, [self.bufs[m.kv_loc].tensors for m in op.members])
        if joint is not None:  # received into one buffer: read as it is
            k, v = joint
        else:
            k, v = (torch.cat([kv[t] for kv in kvs]) for t in (0, 1))
            self.copied([k, v], 1.0)  # a timed device charges it as the model does
        if not op.backward:
            (q,) = self._view(first.q_loc, s.q_half)
            out, lse = self.backend.forward(q, k, v, False, self.scale)
            acc = self.bufs[first.acc]
            acc_o, acc_l = acc.tensors
            merge_into(acc_o, acc_l, out, lse.permute(2, 0, 1), self._acc_rows(acc, s.q_half))
            return
        q, dout, stats = self._view(first.q_loc, s.q_half)
        dq, dk, dv = self.backend.backward(
            dout, q, k, v, self._tile_output(first.q_loc, s.q_half, dout, stats),
            stats[..., 0].permute(1, 2, 0), False, self.scale)
        acc = self.bufs[first.dq_acc]
        acc.tensors[0][self._acc_rows(acc, s.q_half)] += dq
        start = 0
        for m, (km, _) in zip(op.members, kvs):
            rows = slice(start, start + km.shape[0])
            start = rows.stop
            if m.fresh_dkv:
                self.bufs[m.dkv_acc] = _Buf((dk[rows], dv[rows]), held=m.spec.kv_half,
                                            kind=Kind.DKV)
            else:
                macc = self.bufs[m.dkv_acc]
                kr = self._acc_rows(macc, m.spec.kv_half)
                macc.tensors[0][kr] += dk[rows]
                macc.tensors[1][kr] += dv[rows]

    def on_merge(self, op: Merge) -> None:
        src = self.bufs[op.src]
        acc = self.bufs[op.acc]
        rows = self._acc_rows(acc, src.held)
        n = _n_rows(src.held, self.shape.s)
        if BLOCKS[acc.kind].lse_merge:  # a partial output: log-sum-exp merge
            merge_into(acc.tensors[0], acc.tensors[1], src.tensors[0][:n], src.tensors[1][:n],
                       rows)
        else:  # gradient partials: sum
            for a, t in zip(acc.tensors, src.tensors):
                a[rows] += t[:n]
        if self._merged is not None and self.compute:
            self._merged(sum(t[:n].numel() * t.element_size() for t in src.tensors))

    def _post(self, op: Comm) -> None:
        group = self.streams.groups.get(op.stream)
        if group is None:
            raise RuntimeError(
                f"{self.what}: the plan posts on stream {str(op.stream)!r}, which has no "
                f"process group here; ops.streams.ensure_streams(streams, plan) makes the "
                f"groups a plan needs (all ranks together, before its first op)")
        ranks = self.streams.ranks
        p2p: list[P2P] = []
        keep: list[torch.Tensor] = []
        peer_of: list[int] = []  # each transfer's CP peer (a timed device's contention)
        for x in op.sends:
            tensors = self._to_wire(x.kind, self._view(x.loc, x.half))
            for t in tensors:
                t = t if t.is_contiguous() else t.contiguous()
                keep.append(t)
                p2p.append(P2P(True, t, ranks[x.peer], group))
                peer_of.append(x.peer)
        for x in op.recvs:
            joint = self._joint.receive(self._i, x.loc, lambda h: _n_rows(h, self.shape.s),
                                        lambda n: self._alloc(Kind.KV, True, n=n))
            if joint is None:
                buf = self._buffer(x.loc, x.kind, wire=True, rows=x.half)
            else:
                buf = self.bufs[x.loc] = _Buf(joint, held=x.half, kind=Kind.KV)
            for t in buf.tensors:
                if not self.comm:
                    # Nothing arrives in a comm-off run, and uninitialised memory can hold
                    # NaNs or denormals, on which the CPU kernels run up to ~3x slower
                    # (a rank's compute-only forward measured 47-172 ms so, 39-50 ms with
                    # zeros): the ablated timing must not depend on stale bytes.
                    t.zero_()
                p2p.append(P2P(False, t, ranks[x.peer], group))
                peer_of.append(x.peer)
        if not self.comm:
            p2p = []  # only timing is meaningful in an ablated run
        peers = sorted({ranks[x.peer] for x in (*op.sends, *op.recvs)})
        if self._before_post is not None and p2p:
            self._before_post()
        try:
            works = list(self.transport.post(p2p)) if p2p else []
        except Exception as exc:  # noqa: BLE001 - re-raised with what it means
            raise CommError(self._comm_text(op.stream, peers, "could not post its transfers",
                                            exc)) from exc
        self.pending[op.handle] = (works, keep, op.stream, peers)
        if self._posted is not None and works:
            self._posted(op.handle, [(x.peer, _nbytes(self._view(x.loc, x.half)))
                                     for x in (*op.sends, *op.recvs)], op.stream,
                         works=list(zip(peer_of, works)))

    def posts_done(self) -> None:
        """This rank posts nothing more in this call (a timed device's hook; real kernels:
        nothing)."""
        if self._posts_done is not None:
            self._posts_done()

    def synchronize(self) -> None:
        """The host waits for the work this rank's device still has queued (a timed device's;
        real kernels: nothing, the caller synchronises its stream as it would without CP)."""
        if self._synchronize is not None:
            self._synchronize()

    def copied(self, tensors: list[torch.Tensor], passes: float) -> None:
        """The caller copied ``tensors`` ``passes`` times outside any op (a head all-to-all's
        packing and placing): a timed device charges the bytes as the model does; real
        devices did the work already."""
        if self._copied is not None:
            self._copied(passes * _nbytes(tensors))

    def stage_copied(self, tensors: list[torch.Tensor], a: int, *, home: bool) -> None:
        """A head all-to-all of ``a`` ranks (``home``: after the plan) copied ``tensors``: a timed
        device charges its profile's ``copy_passes`` (ours or TE's); real devices did the work."""
        if self._stage_copied is not None:
            self._stage_copied(_nbytes(tensors), a, home)

    def exchange(self, stream, sends: list[tuple[int, torch.Tensor]],
                 recvs: list[tuple[int, torch.Tensor]]) -> None:
        """One batch of sends and receives outside a plan (a head all-to-all,
        ops/head_stage.py): ``(CP rank, tensor)`` pairs, posted on ``stream``'s communicator
        as a plan's batch is and waited at once, under the same bound and errors."""
        group = self.streams.groups[stream]
        ranks = self.streams.ranks
        p2p = [P2P(True, t, ranks[p], group) for p, t in sends]
        p2p += [P2P(False, t, ranks[p], group) for p, t in recvs]
        if not self.comm:
            p2p = []  # an ablated run: only timing is meaningful
        peers = sorted({ranks[p] for p, _ in (*sends, *recvs)})
        if self._before_post is not None and p2p:
            self._before_post()
        try:
            works = list(self.transport.post(p2p)) if p2p else []
        except Exception as exc:  # noqa: BLE001 - re-raised with what it means
            raise CommError(self._comm_text(stream, peers, "could not post its transfers",
                                            exc)) from exc
        handle = -1 - len(self.pending)  # never a plan's (plans number from 0)
        self.pending[handle] = (works, [t for _, t in sends], stream, peers)
        if self._posted is not None and works:
            self._posted(handle, [(p, t.numel() * t.element_size()) for p, t in (*sends, *recvs)],
                         stream, works=list(zip([p for p, _ in (*sends, *recvs)], works)))
        self._wait(handle)

    def _wait(self, handle: int) -> None:
        works, _, stream, peers = self.pending.pop(handle)
        timeout = datetime.timedelta(seconds=self.timeout_s)
        for w in works:
            try:
                if self.shape.device.type == "cuda":
                    # NCCL: makes the current stream wait (no host synchronisation); the
                    # communicator's own timeout (the same timeout_s) bounds it.
                    w.wait()
                else:
                    w.wait(timeout)
            except Exception as exc:  # noqa: BLE001 - re-raised with what it means
                raise CommError(self._comm_text(stream, peers, "timed out or lost its peer",
                                                exc)) from exc
        if self._waited is not None and works:
            self._waited(handle)

    def _comm_text(self, stream, peers: list[int], what: str, exc: BaseException) -> str:
        me = dist.get_rank()
        name = getattr(stream, "value", stream)  # a Stream enum or its name
        via = getattr(self.transport, "name", type(self.transport).__name__)
        via = "" if via == "torch" else f" (transport {via!r})"
        return (f"{self.what}: a transfer on stream {name!r}{via} between global rank {me} and "
                f"peer rank(s) {peers} {what} (bound {self.timeout_s:g} s, CHARM_COMM_TIMEOUT_S "
                f"or CPOptions.timeout_s): {type(exc).__name__}: {exc}. Likely causes: the peer "
                "died or raised before reaching this transfer, the ranks disagree on the call "
                "(shapes, algo, topology, causal; the agreement check catches this unless "
                "check='off'), or the peer is still busy in a slow step; raise the timeout if "
                "the job is just slow")
