"""Prune a plan to the tiles a sliding window needs, and to the messages those tiles need.

Any algorithm's full-attention plan becomes a windowed plan here, so every builder serves
windows without knowing of them (docs/algorithm.md, *Sliding windows*):

1. **Tiles.** Each tile (or half sub-tile) is narrowed to the halves its pair needs
   (:class:`~charm_megatron.plan.tile_rule.TileRule`) or dropped.
2. **Partials.** A partial output or gradient whose every tile was dropped is empty: it is not
   sent, received or merged. One that keeps some tiles is sent with only the rows they write.
3. **Blocks.** A q, kv or q-gradient block is sent only where a kept tile (or a kept send
   onward) reads it, and with only the rows they read; this is found backwards through every
   forwarding hop, to a fixpoint.
4. **Batches.** A batch left without messages is not posted (nor waited).

The data flow comes from the validator's symbolic run of the full plan (which rank's message
meets which receive, which buffer instance each op reads), so the pruning is exact for every
plan the validator accepts, and the pruned plan is validated again before use. An algorithm
whose messages mirror a collective that moves everything (``allgather``: TE gathers all of k and
v) keeps its messages: ``messages=False`` prunes tiles only.

Plan layer: no torch.
"""

from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass, replace

from charm_megatron.plan.core import (
    Comm,
    Half,
    Kind,
    Loc,
    Merge,
    Op,
    Plan,
    Reset,
    SuperTile,
    Tile,
    TileBwd,
    TileSpec,
    Wait,
    Xfer,
)
from charm_megatron.plan.fuse import unfuse_ops
from charm_megatron.plan.tile_rule import TileRule
from charm_megatron.plan.validate import _Batch, _Content, _SymbolicRun, check_all_completed
from charm_megatron.plan.vocab import RESULT, Side

__all__ = ["prune"]

_Key = tuple[int, int, int]  # (rank, op index, message index in the batch's sends / recvs)
_RESULTS = frozenset(RESULT.values())


def prune(plan: Plan, rule: TileRule, *, messages: bool = True) -> Plan:
    """``plan`` (of the full attention) reduced to ``rule``'s tiles; with ``messages``, also
    to the messages and rows those tiles need (see the module docstring)."""
    if not rule.windowed:
        return plan
    # A window masks each cut tile by itself: a super-tile is pruned as its members.
    plan = replace(plan, ops=[unfuse_ops(ops) for ops in plan.ops])
    trace = _Trace(plan)
    trace.execute()
    check_all_completed(trace)
    flow = _Flow(trace, rule, messages)
    ops = [flow.rewrite(r) for r in range(plan.n)]
    return replace(plan, ops=ops, tiles=rule)


def _cap(h: Half, cap: Half) -> Half | None:
    """Rows ``h`` within ``cap`` (``None``: none)."""
    if cap.covers(h):
        return h
    if h.covers(cap):
        return cap
    return None


def _narrow(spec: TileSpec, rule: TileRule) -> TileSpec | None:
    """``spec`` (a tile or half sub-tile of the full attention) within its pair's needed
    tile, or ``None`` where the pair needs none of it."""
    want = rule.want(spec.q_owner, spec.kv_owner)
    if want is None:
        return None
    q, kv = _cap(spec.q_half, want.q_half), _cap(spec.kv_half, want.kv_half)
    if q is None or kv is None:
        return None
    return TileSpec(spec.q_owner, spec.kv_owner, q, kv, spec.causal)


def _rows(kind: Kind, t: TileSpec) -> Half:
    return t.kv_half if kind.spec.side is Side.KV else t.q_half


def _union(halves) -> Half | None:
    out = None
    for h in halves:
        out = h if out is None else out.union(h)
    return out


@dataclass
class _Reads:
    """What one op touched in the symbolic run: content instances, by role."""

    q: _Content | None = None
    kv: _Content | None = None
    accs: tuple[_Content | None, ...] = ()  # a tile's accumulators (forward: out; dq, dkv)
    src: _Content | None = None  # a merge's source
    src_tiles: frozenset[TileSpec] = frozenset()  # ... and its tiles then
    sends: tuple[_Content | None, ...] = ()  # a batch's send sources, in order
    send_tiles: tuple[frozenset[TileSpec], ...] = ()  # ... and their tiles then (partials)


class _Trace(_SymbolicRun):
    """The validator's run of every rank, recording the data flow."""

    def __init__(self, plan: Plan) -> None:
        super().__init__(plan)
        self.reads: dict[tuple[int, int], _Reads] = {}
        self.match: dict[_Key, _Key] = {}  # receive -> its send
        self.received: dict[_Key, _Content] = {}  # receive -> what it delivered
        self.written: dict[tuple[int, int], _Content] = {}  # a reset's new instance

    def _here(self) -> tuple[int, int]:
        return self.r, self.pc[self.r]

    def _at(self, loc: Loc) -> _Content | None:
        return self.state[self.r].get(loc)

    def on_comm(self, op: Comm) -> bool:
        # Partials are accumulated in place: their tiles are taken as they are sent.
        sources = tuple(self._at(x.loc) for x in op.sends)
        self.reads[self._here()] = _Reads(
            sends=sources, send_tiles=tuple(frozenset() if c is None else c.tiles
                                            for c in sources))
        return super().on_comm(op)

    def on_tile(self, op: Tile) -> bool:
        q, kv = self._at(op.q_loc), self._at(op.kv_loc)
        done = super().on_tile(op)
        self.reads[self._here()] = _Reads(q=q, kv=kv, accs=(self._at(op.acc),))
        return done

    def on_tile_bwd(self, op: TileBwd) -> bool:
        q, kv = self._at(op.q_loc), self._at(op.kv_loc)
        done = super().on_tile_bwd(op)
        self.reads[self._here()] = _Reads(q=q, kv=kv,
                                          accs=(self._at(op.dq_acc), self._at(op.dkv_acc)))
        return done

    def on_super_tile(self, op: SuperTile) -> bool:  # pragma: no cover - unfused before
        raise AssertionError("prune traces plans without super-tiles (unfuse_ops)")

    def on_merge(self, op: Merge) -> bool:
        src, acc = self._at(op.src), self._at(op.acc)
        done = super().on_merge(op)
        self.reads[self._here()] = _Reads(src=src, accs=(acc,),
                                          src_tiles=frozenset() if src is None else src.tiles)
        return done

    def on_reset(self, op: Reset) -> bool:
        done = super().on_reset(op)
        self.written[self._here()] = self._at(op.loc)
        return done

    def delivered(self, sender: _Batch, sx: Xfer, receiver: _Batch, rx: Xfer,
                  content: _Content) -> None:
        skey = (sender.rank, sender.index, _position(sender.op.sends, sx))
        rkey = (receiver.rank, receiver.index, _position(receiver.op.recvs, rx))
        self.match[rkey] = skey
        self.received[rkey] = content


def _position(xfers: tuple[Xfer, ...], x: Xfer) -> int:
    return next(i for i, y in enumerate(xfers) if y is x)


class _Flow:
    """The pruning decisions for a traced plan (module docstring, steps 1-3)."""

    def __init__(self, trace: _Trace, rule: TileRule, messages: bool) -> None:
        self.trace, self.rule, self.messages = trace, rule, messages
        self.plan = trace.plan
        self.narrowed: dict[tuple[int, int], TileSpec | None] = {}
        for (r, i), _ in trace.reads.items():
            op = self.plan.ops[r][i]
            if type(op) in (Tile, TileBwd):
                self.narrowed[(r, i)] = _narrow(op.spec, rule)
        self._live_tiles: dict[frozenset[TileSpec], frozenset[TileSpec]] = {}
        self.send_half: dict[_Key, Half | None] = {}  # a send's (and its receive's) rows
        if messages:
            self._blocks()
            self._partials()
        self._uses = self._kept_uses()

    # ---------------------------------------------------------------- partials
    def live(self, tiles: frozenset[TileSpec]) -> frozenset[TileSpec]:
        """The kept (narrowed) ones of a partial's ``tiles``."""
        hit = self._live_tiles.get(tiles)
        if hit is None:
            hit = frozenset(t for t in (_narrow(s, self.rule) for s in tiles) if t is not None)
            self._live_tiles[tiles] = hit
        return hit

    def _partials(self) -> None:
        for (r, i), reads in self.trace.reads.items():
            op = self.plan.ops[r][i]
            if type(op) is not Comm:
                continue
            for k, (x, tiles) in enumerate(zip(op.sends, reads.send_tiles)):
                if x.kind.partial:
                    rows = _union(_rows(x.kind, t) for t in self.live(tiles))
                    self.send_half[(r, i, k)] = None if rows is None else _cap(rows, x.half)

    # ---------------------------------------------------------------- blocks
    def _blocks(self) -> None:
        """The rows of every block instance that kept ops read, through forwarding sends."""
        need: dict[int, Half] = {}

        def add(c: _Content | None, h: Half | None) -> bool:
            if c is None or h is None:
                return False
            old = need.get(id(c))
            new = h if old is None else old.union(h)
            need[id(c)] = new
            return new is not old

        for key, spec in self.narrowed.items():
            if spec is not None:
                reads = self.trace.reads[key]
                add(reads.q, spec.q_half)
                add(reads.kv, spec.kv_half)
        # Block sends: (send key, its source instance, what its receive delivered).
        hops = []
        for rkey, skey in self.trace.match.items():
            r, i, k = skey
            x = self.plan.ops[r][i].sends[k]
            if not x.kind.partial:
                hops.append((skey, self.trace.reads[(r, i)].sends[k],
                             self.trace.received[rkey], x.half))
        changed = True
        while changed:
            changed = False
            for skey, src, dst, half in hops:
                h = need.get(id(dst))
                h = None if h is None else _cap(h, half)
                self.send_half[skey] = h
                changed |= add(src, h)

    # ---------------------------------------------------------------- what kept ops use
    def keeps_send(self, key: _Key) -> bool:
        return not self.messages or self.send_half.get(key) is not None

    def _kept_uses(self) -> dict[int, list[Half]]:
        """Per partial instance, the rows kept ops accumulate into it or send of it."""
        uses: dict[int, list[Half]] = defaultdict(list)
        for (r, i), reads in self.trace.reads.items():
            op = self.plan.ops[r][i]
            t = type(op)
            if t in (Tile, TileBwd):
                spec = self.narrowed[(r, i)]
                if spec is None:
                    continue
                fresh = (op.fresh,) if t is Tile else (op.fresh_dq, op.fresh_dkv)
                kinds = (Kind.OUT,) if t is Tile else (Kind.DQ, Kind.DKV)
                for acc, is_fresh, kind in zip(reads.accs, fresh, kinds):
                    if not is_fresh:
                        uses[id(acc)].append(_rows(kind, spec))
            elif t is Merge and self.keeps_merge(reads):
                uses[id(reads.accs[0])].append(reads.src.half)
            elif t is Comm:
                for k, (x, c) in enumerate(zip(op.sends, reads.sends)):
                    if x.kind.partial and self.keeps_send((r, i, k)):
                        uses[id(c)].append(self.send_half.get((r, i, k)) or x.half)
        return uses

    def keeps_merge(self, reads: _Reads) -> bool:
        return not self.messages or bool(self.live(reads.src_tiles))

    # ---------------------------------------------------------------- the new op lists
    def rewrite(self, r: int) -> list[Op]:
        out: list[Op] = []
        dropped: set[int] = set()  # handles of batches not posted
        for i, op in enumerate(self.plan.ops[r]):
            t = type(op)
            if t is Comm:
                comm = self._comm(r, i, op)
                if comm is None:
                    dropped.add(op.handle)
                else:
                    out.append(comm)
            elif t is Wait:
                if op.handle not in dropped:
                    out.append(op)
            elif t is Tile:
                out.extend(self._tile(r, i, op))
            elif t is TileBwd:
                out.extend(self._tile_bwd(r, i, op))
            elif t is Merge:
                if self.keeps_merge(self.trace.reads[(r, i)]):
                    out.append(op)
            elif t is Reset:
                c = self.trace.written[(r, i)]
                if op.loc in _RESULTS or self._uses.get(id(c)):
                    out.append(op)
            else:  # pragma: no cover - every op type is handled above
                raise TypeError(f"unknown op {op!r}")
        return out

    def _comm(self, r: int, i: int, op: Comm) -> Comm | None:
        if not self.messages:
            return op
        sends = tuple(replace(x, half=self.send_half[(r, i, k)])
                      for k, x in enumerate(op.sends) if self.send_half.get((r, i, k)))
        recvs = []
        for k, x in enumerate(op.recvs):
            half = self.send_half.get(self.trace.match[(r, i, k)])
            if half is not None:
                recvs.append(replace(x, half=half))
        if not sends and not recvs:
            return None
        return Comm(op.handle, op.stream, sends, tuple(recvs))

    def _result(self, acc: _Content | None, fresh: bool, rows: Half | None) -> str:
        """What becomes of a tile's result into ``acc``: ``"keep"`` (as it is), ``"reset"``
        (a dropped or narrowed fresh result that later ops still use: an empty accumulator
        first, then the tile accumulates) or ``"drop"``."""
        if not fresh:
            return "keep" if rows is not None else "drop"
        uses = self._uses.get(id(acc), [])
        if rows is None:
            return "reset" if uses else "drop"
        return "keep" if all(rows.covers(h) for h in uses) else "reset"

    def _tile(self, r: int, i: int, op: Tile) -> list[Op]:
        spec = self.narrowed[(r, i)]
        acc = self.trace.reads[(r, i)].accs[0]
        how = self._result(acc, op.fresh, None if spec is None else spec.q_half)
        ops: list[Op] = []
        if how == "reset":
            ops.append(Reset(op.acc, Kind.OUT, op.spec.q_owner))
        if spec is not None:
            ops.append(replace(op, spec=spec, fresh=op.fresh and how == "keep"))
        return ops

    def _tile_bwd(self, r: int, i: int, op: TileBwd) -> list[Op]:
        spec = self.narrowed[(r, i)]
        dq_acc, dkv_acc = self.trace.reads[(r, i)].accs
        dq = self._result(dq_acc, op.fresh_dq, None if spec is None else spec.q_half)
        dkv = self._result(dkv_acc, op.fresh_dkv, None if spec is None else spec.kv_half)
        ops: list[Op] = []
        if dq == "reset":
            ops.append(Reset(op.dq_acc, Kind.DQ, op.spec.q_owner))
        if dkv == "reset":
            ops.append(Reset(op.dkv_acc, Kind.DKV, op.spec.kv_owner))
        if spec is not None:
            ops.append(replace(op, spec=spec, fresh_dq=op.fresh_dq and dq == "keep",
                               fresh_dkv=op.fresh_dkv and dkv == "keep"))
        return ops
