"""Prove a plan correct before it runs, by executing it symbolically on every rank at once.

The simulation tracks, for every location of every rank, *what* it holds: a block (kind, owner,
rows) or a partial (kind, owner, the exact set of tiles merged into it). The checks, each a
named function or method below:

* **tiles and causal halves** (:meth:`_SymbolicRun.check_tile_halves`, :func:`check_tiles_once`,
  :func:`check_results`): every tile is computed exactly once, with the rows the causal mask
  needs, and at the end each rank's output (forward) or dq and dkv (backward) hold exactly the
  tiles of the full attention; a super-tile (one kernel call over several kv blocks) counts
  as exactly its member tiles, and its shape is checked (:func:`super_tile_refusal`). An unmasked tile that needs all rows of one side may instead
  be computed as the *sub-tiles* of one partition of that side (:func:`sub_tiles`): its two
  halves or its four quarters, e.g. kv rows 1st and 2nd with the tile's q rows (a split
  visiting pass of pass-kv; kv quarters where it crosses in four pieces), or q rows 1st and
  2nd with its kv rows (a split counterpart pass of pass-q). Then every piece must be
  computed exactly once, never with the whole tile, a piece of the side's other partition,
  or a crossing sub-tile of the other side, and a result holds the tile when it holds all
  pieces of one partition (every (q row, kv row) pair still counted exactly once). A causal
  diagonal tile may be computed as its three sub-tiles (``split_diagonal``), each once;
* **buffer hazards** (:meth:`_SymbolicRun.read`, :meth:`~_SymbolicRun.check_no_transfer`,
  :meth:`~_SymbolicRun.check_partial_send`, :meth:`~_SymbolicRun.free`): every op reads data
  that is present and complete (a receive is waited before use, a tile's rows are inside the
  rows a buffer holds, a partial sent home holds every row it contributes to), no buffer is
  overwritten while a send from it or a receive into it is in flight, and the executor's
  buffer lifetimes (:mod:`charm_megatron.plan.lifetimes`) are safe: each buffer is freed where
  the executor frees it, and accumulators hold only the rows it allocates them with, so a read
  after a free or outside those rows is an error here;
* **send/receive matching** (:meth:`~_SymbolicRun.check_message`): every send meets a receive
  of the same block and rows, in the same order, on the same stream;
* **deadlock under NCCL's serial streams** (:meth:`~_SymbolicRun.check_progress`,
  :func:`check_all_completed`): batches complete only together with their partners
  (:func:`charm_megatron.plan.batches.closed_matching`), so a plan that could deadlock there
  is rejected.

It also measures the plan: dependent communication steps on the critical path, messages and
tiles per rank. Byte counts for a concrete shape are in :mod:`charm_megatron.plan.cost`.
"""

from __future__ import annotations

import functools
from collections import defaultdict
from dataclasses import dataclass, field, replace

from charm_megatron.plan.batches import StreamQueues, closed_matching, messages_between
from charm_megatron.plan.core import (
    Comm,
    Half,
    Kind,
    Loc,
    Merge,
    OpInterpreter,
    Plan,
    Reset,
    SuperTile,
    Tile,
    TileBwd,
    TileSpec,
    Wait,
    Xfer,
    diagonal_sub_tiles,
    format_op,
    super_tile_refusal,
)
from charm_megatron.plan.lifetimes import lifetimes
from charm_megatron.plan.tile_rule import TileRule, full_rule
from charm_megatron.plan.vocab import Direction, Side, Stream


class PlanError(ValueError):
    """A plan is wrong: it would compute a wrong answer, read missing data, or deadlock."""


@dataclass
class _Content:
    kind: Kind
    owner: int
    half: Half
    tiles: frozenset[TileSpec] = frozenset()  # partials only
    depth: int = 0  # dependent communication steps behind this data


@dataclass
class _Batch:
    rank: int
    op: Comm
    to_peer: dict[int, list[_Content]] = field(default_factory=lambda: defaultdict(list))
    done: bool = False
    index: int = -1  # the Comm's position in its rank's op list


@dataclass
class PlanStats:
    """What a plan costs, independent of tensor sizes."""

    critical_path: int  # longest chain of data-dependent messages
    messages: list[int]  # messages sent per rank
    tiles: list[float]  # tile work per rank, in tiles (a half sub-tile counts one half,
    # a quarter one quarter)


def validate(plan: Plan) -> PlanStats:
    """Raise :class:`PlanError` if ``plan`` is wrong; return its :class:`PlanStats`."""
    run = _SymbolicRun(plan)
    run.execute()
    check_all_completed(run)
    check_tiles_once(plan, run.tile_count)
    check_results(plan, run.state)
    # In quarters internally; whole numbers print as before.
    tiles = [w // 4 if w % 4 == 0 else w / 4 for w in run.work_done]
    return PlanStats(run.max_depth, run.messages, tiles)


def _partitions(h: Half) -> tuple[tuple[Half, ...], ...]:
    """The ways a tile that needs rows ``h`` of a side may cut that side: a whole side into
    its two halves or its four quarters, a half into its two quarters (a tile that a window
    narrowed to one half of a side cut in quarters); none for a quarter."""
    if h is Half.FULL:
        return Half.pieces(2), Half.pieces(4)
    return tuple(p for p in (Half.pieces(4)[:2], Half.pieces(4)[2:]) if p[0].parent is h)


def _overlap(a: Half, b: Half) -> bool:
    return a.covers(b) or b.covers(a)


# Pure functions of a tile, asked at every tile op. 65,536 entries: the n^2 tiles of 64 ranks
# and their sub-tiles fit (4,096 did not, and a cache smaller than what a plan asks thrashes).
@functools.lru_cache(maxsize=1 << 16)
def sub_tiles(want: TileSpec) -> tuple[tuple[TileSpec, ...], ...]:
    """The ways tile ``want`` may be computed as sub-tiles: along each side (q or kv) whose
    rows it needs whole, the pieces of one partition of that side (its two halves, or its
    four quarters), in row order, the other side as the tile's. A causal diagonal tile has
    one partition of its own, its three sub-tiles (:func:`diagonal_sub_tiles`: two causal
    squares and the unmasked block between them); any other masked tile none."""
    if want.causal:
        diagonal = diagonal_sub_tiles(want)
        return () if diagonal is None else (diagonal,)
    out = [tuple(replace(want, q_half=h) for h in part) for part in _partitions(want.q_half)]
    out += [tuple(replace(want, kv_half=h) for h in part) for part in _partitions(want.kv_half)]
    return tuple(out)


@functools.lru_cache(maxsize=1 << 16)
def _variants(want: TileSpec) -> tuple[TileSpec, ...]:
    """The specs a plan may compute of the tile ``want`` of a block pair: the tile, or one of
    its sub-tiles (:func:`sub_tiles`)."""
    return (want,) + tuple(t for part in sub_tiles(want) for t in part)


def _is_sub_tile(s: TileSpec, want: TileSpec) -> bool:
    """``s`` is one sub-tile of the tile ``want`` (a piece of q or of kv)."""
    return s != want and s in _variants(want)


def _partition_of(t: TileSpec, want: TileSpec) -> tuple[TileSpec, ...]:
    """The sub-tiles of the partition sub-tile ``t`` is a piece of (each piece is in one)."""
    return next(part for part in sub_tiles(want) if t in part)


def _work(t: TileSpec, want: TileSpec) -> int:
    """Tile work of ``t`` in quarters of the tile ``want``, by the (q row, kv row) pairs it
    computes: a half sub-tile 2, a quarter 1; of a causal diagonal, its causal squares 1 each
    and the unmasked block between them 2."""
    return round(4 * _pairs(t) / _pairs(want))


def _pairs(t: TileSpec) -> float:
    """The share of a block pair's (q row, kv row) pairs tile ``t`` computes."""
    return t.q_half.fraction * t.kv_half.fraction * (0.5 if t.causal else 1.0)


@functools.lru_cache(maxsize=1 << 16)  # asked for every tile merged into an accumulator
def _rivals(t: TileSpec, want: TileSpec) -> frozenset[TileSpec]:
    """The other specs of ``t``'s block pair that share (q row, kv row) pairs with it: a
    whole tile's sub-tiles, a sub-tile's whole tile and the other side's sub-tiles that cross
    it (the only specs that pass :meth:`_SymbolicRun.check_tile_halves` for one block
    pair). A set: the validator asks whether an accumulator holds any of them."""
    return frozenset(u for u in _variants(want) if u != t
                     and _overlap(u.q_half, t.q_half) and _overlap(u.kv_half, t.kv_half))


def _as_rule(rule: TileRule | bool, tiles) -> TileRule:
    """A rule, or for a bool (``causal``) the full attention's on as many ranks as ``tiles``
    name."""
    if isinstance(rule, TileRule):
        return rule
    n = 1 + max((max(t.q_owner, t.kv_owner) for t in tiles), default=0)
    return full_rule(n, bool(rule))


def covered(tiles: frozenset[TileSpec] | set[TileSpec], rule: TileRule | bool) -> set[TileSpec]:
    """The whole tiles in ``tiles`` (``rule``: the call's :class:`TileRule`, or ``causal``
    for the full attention's): a tile, or every sub-tile of one partition; a sub-tile whose
    partition is incomplete stays as it is (and so matches no tile the rule needs)."""
    rule = _as_rule(rule, tiles)
    out = set()
    for t in tiles:
        want = rule.want(t.q_owner, t.kv_owner)
        if want is not None and _is_sub_tile(t, want) and all(
                u in tiles for u in _partition_of(t, want)):
            out.add(want)
        else:
            out.add(t)
    return out


def _rows_written(kind: Kind, t: TileSpec) -> Half:
    """The rows of a ``kind`` partial that tile ``t`` contributes to."""
    return t.kv_half if kind.spec.side is Side.KV else t.q_half


class _SymbolicRun(OpInterpreter[bool]):
    """All ranks' programs run on symbolic contents. ``on_*`` interpret one op of rank
    :attr:`r` and return False when it must wait (its batch is not complete yet)."""

    def __init__(self, plan: Plan) -> None:
        self.plan = plan
        self.rule = plan.rule
        n = plan.n
        query = plan.direction.query
        self.state: list[dict[Loc, _Content]] = [
            {Loc.own(Kind.KV): _Content(Kind.KV, r, Half.FULL),
             Loc.own(query): _Content(query, r, Half.FULL)} for r in range(n)]
        self.busy: list[dict[Loc, int]] = [defaultdict(int) for _ in range(n)]  # transfers
        self.receiving: list[dict[Loc, int]] = [defaultdict(int) for _ in range(n)]  # receives
        self.batches: dict[tuple[int, int], _Batch] = {}  # (rank, handle) -> posted, unwaited
        self.queues: StreamQueues[_Batch] = StreamQueues()
        self.pc = [0] * n
        # (q owner, kv owner) -> the spec of each tile (or sub-tile) computed for it
        self.tile_count: dict[tuple[int, int], list[TileSpec]] = defaultdict(list)
        self.messages = [0] * n
        self.work_done = [0] * n  # tile work per rank, in quarters of a tile
        self.max_depth = 0
        self.r = 0  # the rank whose op is being interpreted
        try:  # the executor's buffer lifetimes, replayed (frees, accumulator rows)
            self.lives = [lifetimes(ops) for ops in plan.ops]
        except ValueError as exc:
            raise PlanError(f"{plan.algo} {plan.direction}: {exc}") from None

    # ------------------------------------------------------------------ driving all ranks
    def execute(self) -> None:
        plan = self.plan
        while True:
            progressed = False
            for r in range(plan.n):
                progressed |= self._step(r)
            progressed |= self._complete_batches()
            if all(self.pc[r] == len(plan.ops[r]) for r in range(plan.n)):
                return
            self.check_progress(progressed)

    def _step(self, r: int) -> bool:
        """Run rank ``r`` until it blocks; return True if it made progress."""
        self.r = r
        ops = self.plan.ops[r]
        progressed = False
        while self.pc[r] < len(ops):
            if not self.interpret(ops[self.pc[r]]):
                break
            self.free(self.lives[r].free_after.get(self.pc[r], ()))
            self.pc[r] += 1
            progressed = True
        return progressed

    def fail(self, msg: str) -> None:
        r, plan = self.r, self.plan
        op = plan.ops[r][self.pc[r]] if self.pc[r] < len(plan.ops[r]) else None
        where = "end" if op is None else format_op(op)
        raise PlanError(f"{plan.algo} {plan.direction}, rank {r}, op {self.pc[r]} ({where}): "
                        f"{msg}")

    # ------------------------------------------------------------------ buffer hazards
    def check_waited(self, loc: Loc, what: str) -> None:
        if self.receiving[self.r].get(loc, 0):
            self.fail(f"{what} {loc} before the receive into it was waited")

    def check_no_transfer(self, loc: Loc) -> None:
        if self.busy[self.r].get(loc, 0):
            self.fail(f"writes {loc} while a transfer from or into it is in flight")

    def read(self, loc: Loc, kind: Kind, owner: int, half: Half) -> _Content:
        """What ``loc`` holds, which must be rows ``half`` of block ``kind[owner]``, received."""
        c = self.state[self.r].get(loc)
        if c is None:
            self.fail(f"reads {loc}, which holds nothing")
        self.check_waited(loc, "reads")
        if c.kind != kind or c.owner != owner:
            self.fail(f"expects {kind}[{owner}] in {loc}, finds {c.kind}[{c.owner}]")
        if not c.half.covers(half):
            self.fail(f"needs rows {half} of {loc}, which holds rows {c.half}")
        return c

    def check_partial_send(self, x: Xfer) -> _Content:
        """A partial sent on must be the one named and hold no rows outside those sent."""
        c = self.state[self.r].get(x.loc)
        if c is None or c.kind != x.kind or c.owner != x.owner:
            self.fail(f"sends {x.loc} as {x.kind}[{x.owner}] but it holds "
                      f"{None if c is None else (c.kind, c.owner)}")
        self.check_waited(x.loc, "sends")
        if not c.half.covers(x.half):
            self.fail(f"sends rows {x.half} of {x.loc}, which holds rows {c.half}")
        for t in c.tiles:
            if not x.half.covers(_rows_written(x.kind, t)):
                self.fail(f"sends rows {x.half} of {x.loc} but tile {_tile_name(t)} wrote rows "
                          "outside them")
        return c

    def free(self, locs) -> None:
        """The executor frees ``locs`` after the current op: nothing may still move data from
        or into them, and a later read finds nothing."""
        for loc in locs:
            if self.busy[self.r].get(loc, 0):
                self.fail(f"frees {loc} while a transfer from or into it is in flight")
            self.state[self.r].pop(loc, None)

    def write(self, loc: Loc, content: _Content) -> None:
        self.check_no_transfer(loc)
        self.state[self.r][loc] = content

    def accumulate(self, acc: Loc, kind: Kind, owner: int, new: frozenset[TileSpec],
                   depth: int, rows: Half) -> None:
        c = self.state[self.r].get(acc)
        if c is None or c.kind != kind or c.owner != owner:
            self.fail(f"accumulates into {acc}, which is not a reset {kind}[{owner}] accumulator")
        if not c.half.covers(rows):
            self.fail(f"accumulates rows {rows} into {acc}, which holds rows {c.half}")
        self.check_no_transfer(acc)
        rule = self.rule
        dup = (c.tiles & new) | {t for t in new if not c.tiles.isdisjoint(
            _rivals(t, rule.want(t.q_owner, t.kv_owner)))}
        if dup:
            self.fail(f"merges tiles {sorted(map(_tile_name, dup))} into {acc} twice")
        c.tiles = c.tiles | new
        c.depth = max(c.depth, depth)

    # ------------------------------------------------------------------ tiles
    def check_tile_halves(self, s: TileSpec) -> TileSpec:
        """``s`` is the tile its pair needs, or a sub-tile of it; returns that tile."""
        want = self.rule.want(s.q_owner, s.kv_owner)
        if want is None:
            self.fail(f"tile {_tile_name(s)} is computed but the call needs none of its pairs "
                      "(outside the window, or across lanes of a head all-to-all)")
        if s not in _variants(want):
            self.fail(f"tile {_tile_name(s)} rows q.{s.q_half} x kv.{s.kv_half} should be "
                      f"{_rows_name(want)}")
        return want

    def _tile_inputs(self, op: Tile | TileBwd) -> int:
        """Check a tile's shape and inputs, count it; return the depth of its inputs."""
        s = op.spec
        want = self.check_tile_halves(s)
        qc = self.read(op.q_loc, self.plan.direction.query, s.q_owner, s.q_half)
        kc = self.read(op.kv_loc, Kind.KV, s.kv_owner, s.kv_half)
        self.tile_count[(s.q_owner, s.kv_owner)].append(s)
        self.work_done[self.r] += _work(s, want)
        return max(qc.depth, kc.depth)

    def _result(self, loc: Loc, fresh: bool, kind: Kind, owner: int, half: Half,
                s: TileSpec, depth: int) -> None:
        if fresh:
            self.write(loc, _Content(kind, owner, half, frozenset([s]), depth))
        else:
            self.accumulate(loc, kind, owner, frozenset([s]), depth, half)

    # ------------------------------------------------------------------ the ops
    def on_comm(self, op: Comm) -> bool:
        r, n = self.r, self.plan.n
        b = _Batch(r, op, index=self.pc[r])
        for x in op.sends:
            if x.peer == r or not 0 <= x.peer < n:
                self.fail(f"sends to invalid peer {x.peer}")
            if x.kind.partial:
                c = self.check_partial_send(x)
                payload = _Content(x.kind, x.owner, x.half, c.tiles, c.depth)
            else:
                c = self.read(x.loc, x.kind, x.owner, x.half)
                payload = _Content(x.kind, x.owner, x.half, depth=c.depth)
            b.to_peer[x.peer].append(payload)
            self.busy[r][x.loc] += 1
            self.messages[r] += 1
        for x in op.recvs:
            self.check_no_transfer(x.loc)
            self.busy[r][x.loc] += 1
            self.receiving[r][x.loc] += 1
        if (r, op.handle) in self.batches:
            self.fail(f"reuses handle {op.handle}")
        self.batches[(r, op.handle)] = b
        self.queues.post(r, op.stream, b)
        return True

    def on_wait(self, op: Wait) -> bool:
        r = self.r
        b = self.batches.get((r, op.handle))
        if b is None:
            self.fail(f"waits for unknown handle {op.handle}")
        if not b.done:
            return False
        for x in b.op.sends:
            self.busy[r][x.loc] -= 1
        for x in b.op.recvs:
            self.busy[r][x.loc] -= 1
            self.receiving[r][x.loc] -= 1
        del self.batches[(r, op.handle)]
        return True

    def on_reset(self, op: Reset) -> bool:
        rows = self.lives[self.r].rows.get((self.pc[self.r], op.loc), Half.FULL)
        self.write(op.loc, _Content(op.kind, op.owner, rows, frozenset()))
        return True

    def on_tile(self, op: Tile) -> bool:
        s = op.spec
        depth = self._tile_inputs(op)
        self._result(op.acc, op.fresh, Kind.OUT, s.q_owner, s.q_half, s, depth)
        return True

    def on_tile_bwd(self, op: TileBwd) -> bool:
        s = op.spec
        depth = self._tile_inputs(op)
        self._result(op.dq_acc, op.fresh_dq, Kind.DQ, s.q_owner, s.q_half, s, depth)
        self._result(op.dkv_acc, op.fresh_dkv, Kind.DKV, s.kv_owner, s.kv_half, s, depth)
        return True

    def on_super_tile(self, op: SuperTile) -> bool:
        """Exactly its members' tiles, in order (each checked as a tile); the shape of a
        super-tile checked again (a plan's ops may have been edited after they were made);
        none under a window, whose cut tiles are masked one by one."""
        why = super_tile_refusal(op.members)
        if why is not None:
            self.fail(f"is not a super-tile: {why}")
        if self.plan.tiles is not None and self.plan.tiles.windowed:
            self.fail("a super-tile in a windowed plan (its tiles are masked one by one)")
        for m in op.members:
            self.interpret(m)
        return True

    def on_merge(self, op: Merge) -> bool:
        src = self.state[self.r].get(op.src)
        if src is None:
            self.fail(f"merges {op.src}, which holds nothing")
        self.check_waited(op.src, "merges")
        acc = self.state[self.r].get(op.acc)
        if acc is None or src.kind != acc.kind or src.owner != acc.owner:
            self.fail(f"merges {op.src} into {op.acc} of a different kind or owner")
        self.accumulate(op.acc, acc.kind, acc.owner, src.tiles, src.depth, src.half)
        return True

    # ------------------------------------------------------------------ matching, deadlock
    def _complete_batches(self) -> bool:
        """Complete every closed set of head batches whose sends and receives match."""
        heads = self.queues.heads()
        ready = closed_matching({key: b.op for key, b in heads.items()})
        if not ready:
            return False
        for key in ready:  # deliver the payloads
            b = heads[key]
            r, stream = key
            for peer in dict.fromkeys(x.peer for x in b.op.recvs):
                sender = heads[(peer, stream)]
                pairs = messages_between(peer, sender.op, r, b.op)
                for (sx, rx), content in zip(pairs, sender.to_peer[r]):
                    self.check_message(stream, peer, sx, r, rx)
                    depth = content.depth + 1
                    self.max_depth = max(self.max_depth, depth)
                    got = _Content(content.kind, content.owner, content.half, content.tiles,
                                   depth)
                    self.state[r][rx.loc] = got
                    self.delivered(sender, sx, b, rx, got)
        for key in ready:
            heads[key].done = True
            self.queues.pop(*key)
        return True

    def delivered(self, sender: _Batch, sx: Xfer, receiver: _Batch, rx: Xfer,
                  content: _Content) -> None:
        """Message ``sx`` of ``sender`` arrived as ``rx`` of ``receiver``, holding ``content``
        (a hook for :mod:`charm_megatron.plan.prune`, which traces the data flow)."""

    def check_message(self, stream: Stream, src: int, sx: Xfer, dst: int, rx: Xfer) -> None:
        if (rx.kind, rx.owner, rx.half) != (sx.kind, sx.owner, sx.half):
            raise PlanError(
                f"{self.plan.algo} {self.plan.direction}, stream {stream}: rank {src} sends "
                f"{sx.kind}[{sx.owner}].{sx.half} but rank {dst} expects "
                f"{rx.kind}[{rx.owner}].{rx.half}")

    def check_progress(self, progressed: bool) -> None:
        """No rank moved and no batch completed, yet some rank has ops left: a deadlock."""
        if progressed:
            return
        plan = self.plan
        stuck = {r: format_op(plan.ops[r][self.pc[r]]) for r in range(plan.n)
                 if self.pc[r] < len(plan.ops[r])}
        pending = {f"{r}/{stream}": k for (r, stream), k in self.queues.pending().items()}
        raise PlanError(f"{plan.algo} {plan.direction}: deadlock; blocked ranks {stuck}; "
                        f"posted but unmatched batches {pending}")


# ---------------------------------------------------------------------- checks at the end
def check_all_completed(run: _SymbolicRun) -> None:
    """Every batch was matched and waited."""
    leftover = set(run.queues.pending()) | set(run.batches)
    if leftover:
        raise PlanError(f"{run.plan.algo} {run.plan.direction}: batches never waited or "
                        f"matched: {sorted(leftover, key=str)}")


def check_tiles_once(plan: Plan, tile_count: dict[tuple[int, int], list[TileSpec]]) -> None:
    """Each tile computed once: whole, or as the pieces of one partition of one side (two
    halves, or four quarters), each once."""
    rule = plan.rule
    for (i, j), specs in tile_count.items():
        want = rule.want(i, j)
        if specs == [want]:
            continue
        if any(sorted(specs, key=_order) == list(part) for part in sub_tiles(want)):
            continue
        raise PlanError(f"{plan.algo} {plan.direction}: tile ({i}, {j}) computed "
                        f"{len(specs)} times (rows {', '.join(map(_rows_name, specs))})")


def _order(t: TileSpec) -> tuple[float, float, float, float]:
    """Sub-tiles in row order (a partition's pieces sort as :func:`sub_tiles` lists them)."""
    return (t.q_half.start_fraction, t.q_half.fraction, t.kv_half.start_fraction,
            t.kv_half.fraction)


def _rows_name(t: TileSpec) -> str:
    return f"q.{t.q_half} x kv.{t.kv_half}"


def check_results(plan: Plan, state: list[dict[Loc, _Content]]) -> None:
    """Each rank's results hold exactly the tiles of its rows (forward: out; backward: dq of
    its q rows and dkv of its kv rows)."""
    n, rule = plan.n, plan.rule

    def needed(pairs) -> set[TileSpec]:
        return {w for w in (rule.want(i, j) for i, j in pairs) if w is not None}

    for r in range(n):
        if plan.direction is Direction.BACKWARD:
            _expect(plan, r, state[r].get(Plan.DQ), Kind.DQ, needed((r, j) for j in range(n)))
            _expect(plan, r, state[r].get(Plan.DKV), Kind.DKV,
                    needed((i, r) for i in range(n)))
        else:
            _expect(plan, r, state[r].get(Plan.OUT), Kind.OUT, needed((r, j) for j in range(n)))


def _expect(plan: Plan, r: int, c: _Content | None, kind: Kind, want: set[TileSpec]) -> None:
    if c is None or c.kind != kind or c.owner != r:
        raise PlanError(f"{plan.algo} {plan.direction}: rank {r} ends without its {kind}")
    have = covered(c.tiles, plan.rule)
    if have != want:
        missing = sorted(map(_tile_name, want - have))
        extra = sorted(map(_tile_name, have - want))
        raise PlanError(f"{plan.algo} {plan.direction}: rank {r}'s {kind} is missing tiles "
                        f"{missing} and has extra {extra}")


def _tile_name(t: TileSpec) -> str:
    return f"({t.q_owner},{t.kv_owner})"
