"""Prove a plan correct before it runs, by executing it symbolically on every rank at once.

The simulation tracks, for every location of every rank, *what* it holds: a block (kind, owner,
rows) or a partial (kind, owner, the exact set of tiles merged into it). It checks:

* every tile is computed exactly once, with the rows the causal mask needs;
* every op reads data that is present and complete (a receive is waited before use, a tile's rows
  are inside the rows a buffer holds, a partial sent home holds every row it contributes to);
* no buffer is overwritten while a send from it or a receive into it is in flight;
* every send is matched by a receive of the same block and rows, in the same order, on the same
  stream — batches complete only together with their partners, as NCCL groups do on one
  communicator's serial stream, so a plan that could deadlock there is rejected;
* at the end each rank's output (forward) or dq and dkv (backward) hold exactly the tiles of
  the full attention.

It also measures the plan: dependent communication steps on the critical path, messages and
blocks sent per rank. Byte counts for a concrete shape are in :mod:`charm_megatron.plan.cost`.
"""

from __future__ import annotations

from collections import defaultdict, deque
from dataclasses import dataclass, field

from charm_megatron.plan.core import (
    Comm,
    Half,
    Merge,
    Plan,
    Reset,
    Tile,
    TileBwd,
    TileSpec,
    Wait,
    Xfer,
    tile_spec,
)

PARTIAL_KINDS = ("out", "dq", "dkv")


class PlanError(ValueError):
    """A plan is wrong: it would compute a wrong answer, read missing data, or deadlock."""


@dataclass
class _Content:
    kind: str
    owner: int
    half: Half
    tiles: frozenset[TileSpec] = frozenset()  # partials only
    depth: int = 0  # dependent communication steps behind this data


@dataclass
class _Batch:
    rank: int
    op: Comm
    posted_depths: list[int] = field(default_factory=list)
    payload: list[_Content] = field(default_factory=list)
    done: bool = False


@dataclass
class PlanStats:
    """What a plan costs, independent of tensor sizes."""

    critical_path: int  # longest chain of data-dependent messages
    messages: list[int]  # messages sent per rank
    tiles: list[int]  # tiles computed per rank


def _rows_of_contribution(kind: str, t: TileSpec) -> Half:
    return t.kv_half if kind == "dkv" else t.q_half


def validate(plan: Plan) -> PlanStats:
    """Raise :class:`PlanError` if ``plan`` is wrong; return its :class:`PlanStats`."""
    n = plan.n
    bwd = plan.direction == "backward"
    state: list[dict[str, _Content]] = []
    for r in range(n):
        own = {"own.kv": _Content("kv", r, Half.FULL)}
        own["own.qgrad" if bwd else "own.q"] = _Content("qgrad" if bwd else "q", r, Half.FULL)
        state.append(own)
    busy: list[dict[str, int]] = [defaultdict(int) for _ in range(n)]  # loc -> in-flight comms
    batches: dict[tuple[int, int], _Batch] = {}
    queues: dict[tuple[int, str], deque[_Batch]] = defaultdict(deque)
    pc = [0] * n
    tile_count: dict[tuple[int, int], int] = defaultdict(int)
    messages = [0] * n
    tiles_done = [0] * n
    max_depth = 0

    def fail(r: int, msg: str) -> None:
        op = plan.ops[r][pc[r]] if pc[r] < len(plan.ops[r]) else None
        raise PlanError(f"{plan.algo} {plan.direction}, rank {r}, op {pc[r]} ({op}): {msg}")

    def read(r: int, loc: str, kind: str, owner: int, half: Half) -> _Content:
        c = state[r].get(loc)
        if c is None:
            fail(r, f"reads {loc}, which holds nothing")
        if busy[r].get(loc, 0) and loc in _recv_locs(r):
            fail(r, f"reads {loc} before the receive into it was waited")
        if c.kind != kind or c.owner != owner:
            fail(r, f"expects {kind}[{owner}] in {loc}, finds {c.kind}[{c.owner}]")
        if not c.half.covers(half):
            fail(r, f"needs rows {half} of {loc}, which holds rows {c.half}")
        return c

    recv_locs: list[dict[str, int]] = [defaultdict(int) for _ in range(n)]

    def _recv_locs(r: int) -> dict[str, int]:
        return {k: v for k, v in recv_locs[r].items() if v}

    def write_check(r: int, loc: str) -> None:
        if busy[r].get(loc, 0):
            fail(r, f"writes {loc} while a transfer from or into it is in flight")

    def add_tiles(r: int, acc: str, kind: str, owner: int, new: frozenset, depth: int) -> None:
        c = state[r].get(acc)
        if c is None or c.kind != kind or c.owner != owner:
            fail(r, f"accumulates into {acc}, which is not a reset {kind}[{owner}] accumulator")
        write_check(r, acc)
        dup = c.tiles & new
        if dup:
            fail(r, f"merges tiles {sorted(map(_tile_name, dup))} into {acc} twice")
        c.tiles = c.tiles | new
        c.depth = max(c.depth, depth)

    def step(r: int) -> bool:
        """Run rank ``r`` until it blocks; return True if it made progress."""
        nonlocal max_depth
        progressed = False
        ops = plan.ops[r]
        while pc[r] < len(ops):
            op = ops[pc[r]]
            if isinstance(op, Comm):
                b = _Batch(r, op)
                for x in op.sends:
                    if x.peer == r or not 0 <= x.peer < n:
                        fail(r, f"sends to invalid peer {x.peer}")
                    if x.kind in PARTIAL_KINDS:
                        c = state[r].get(x.loc)
                        if c is None or c.kind != x.kind or c.owner != x.owner:
                            fail(r, f"sends {x.loc} as {x.kind}[{x.owner}] but it holds "
                                    f"{None if c is None else (c.kind, c.owner)}")
                        if busy[r].get(x.loc, 0) and x.loc in _recv_locs(r):
                            fail(r, f"sends {x.loc} before the receive into it was waited")
                        for t in c.tiles:
                            if not x.half.covers(_rows_of_contribution(x.kind, t)):
                                fail(r, f"sends rows {x.half} of {x.loc} but tile "
                                        f"{_tile_name(t)} wrote rows outside them")
                        payload = _Content(x.kind, x.owner, x.half, c.tiles, c.depth)
                    else:
                        c = read(r, x.loc, x.kind, x.owner, x.half)
                        payload = _Content(x.kind, x.owner, x.half, depth=c.depth)
                    b.payload.append(payload)
                    busy[r][x.loc] += 1
                    messages[r] += 1
                for x in op.recvs:
                    write_check(r, x.loc)
                    busy[r][x.loc] += 1
                    recv_locs[r][x.loc] += 1
                key = (r, op.handle)
                if key in batches:
                    fail(r, f"reuses handle {op.handle}")
                batches[key] = b
                queues[(r, op.stream)].append(b)
            elif isinstance(op, Wait):
                b = batches.get((r, op.handle))
                if b is None:
                    fail(r, f"waits for unknown handle {op.handle}")
                if not b.done:
                    return progressed
                for x in b.op.sends:
                    busy[r][x.loc] -= 1
                for x in b.op.recvs:
                    busy[r][x.loc] -= 1
                    recv_locs[r][x.loc] -= 1
                del batches[(r, op.handle)]
            elif isinstance(op, Reset):
                write_check(r, op.loc)
                state[r][op.loc] = _Content(op.kind, op.owner, Half.FULL, frozenset())
            elif isinstance(op, Tile | TileBwd):
                s = op.spec
                want = tile_spec(s.q_owner, s.kv_owner, plan.causal)
                if s != want:
                    fail(r, f"tile {_tile_name(s)} should be {_tile_name(want)}")
                qc = read(r, op.q_loc, "qgrad" if bwd else "q", s.q_owner, s.q_half)
                kc = read(r, op.kv_loc, "kv", s.kv_owner, s.kv_half)
                depth = max(qc.depth, kc.depth)
                tile_count[(s.q_owner, s.kv_owner)] += 1
                tiles_done[r] += 1
                if isinstance(op, Tile) and op.fresh:
                    write_check(r, op.acc)
                    state[r][op.acc] = _Content("out", s.q_owner, s.q_half, frozenset([s]), depth)
                elif isinstance(op, Tile):
                    add_tiles(r, op.acc, "out", s.q_owner, frozenset([s]), depth)
                else:
                    for fresh, loc, kind, owner, half in (
                        (op.fresh_dq, op.dq_acc, "dq", s.q_owner, s.q_half),
                        (op.fresh_dkv, op.dkv_acc, "dkv", s.kv_owner, s.kv_half),
                    ):
                        if fresh:
                            write_check(r, loc)
                            state[r][loc] = _Content(kind, owner, half, frozenset([s]), depth)
                        else:
                            add_tiles(r, loc, kind, owner, frozenset([s]), depth)
            elif isinstance(op, Merge):
                src = state[r].get(op.src)
                if src is None:
                    fail(r, f"merges {op.src}, which holds nothing")
                if busy[r].get(op.src, 0) and op.src in _recv_locs(r):
                    fail(r, f"merges {op.src} before the receive into it was waited")
                acc = state[r].get(op.acc)
                if acc is None or src.kind != acc.kind or src.owner != acc.owner:
                    fail(r, f"merges {op.src} into {op.acc} of a different kind or owner")
                add_tiles(r, op.acc, acc.kind, acc.owner, src.tiles, src.depth)
            else:
                fail(r, f"unknown op {op!r}")
            pc[r] += 1
            progressed = True
        return progressed

    def complete_batches() -> bool:
        """Complete every closed set of head batches whose sends and receives match."""
        nonlocal max_depth
        heads = {k: q[0] for k, q in queues.items() if q}
        alive = set(heads)
        changed = True
        while changed:
            changed = False
            for key in list(alive):
                b = heads[key]
                r, stream = key
                ok = True
                for peer in {x.peer for x in b.op.sends} | {x.peer for x in b.op.recvs}:
                    pk = (peer, stream)
                    if pk not in alive:
                        ok = False
                        break
                    other = heads[pk]
                    mine_out = [x for x in b.op.sends if x.peer == peer]
                    theirs_in = [x for x in other.op.recvs if x.peer == r]
                    if len(mine_out) != len(theirs_in):
                        ok = False
                        break
                if not ok:
                    alive.discard(key)
                    changed = True
        if not alive:
            return False
        # Matched: deliver payloads (checking block, owner and rows agree).
        for key in alive:
            b = heads[key]
            r, stream = key
            other_by_peer: dict[int, list[Xfer]] = defaultdict(list)
            for x in b.op.recvs:
                other_by_peer[x.peer].append(x)
            for peer, recvs in other_by_peer.items():
                sender = heads[(peer, stream)]
                sends = [(x, c) for x, c in zip(sender.op.sends, sender.payload) if x.peer == r]
                for rx, (sx, content) in zip(recvs, sends):
                    if (rx.kind, rx.owner, rx.half) != (sx.kind, sx.owner, sx.half):
                        raise PlanError(
                            f"{plan.algo} {plan.direction}, stream {stream}: rank {peer} sends "
                            f"{sx.kind}[{sx.owner}].{sx.half} but rank {r} expects "
                            f"{rx.kind}[{rx.owner}].{rx.half}"
                        )
                    depth = content.depth + 1
                    max_depth = max(max_depth, depth)
                    state[r][rx.loc] = _Content(content.kind, content.owner, content.half,
                                                content.tiles, depth)
        for key in alive:
            heads[key].done = True
            queues[key].popleft()
        return True

    while True:
        progressed = False
        for r in range(n):
            progressed |= step(r)
        progressed |= complete_batches()
        if all(pc[r] == len(plan.ops[r]) for r in range(n)):
            break
        if not progressed:
            stuck = {r: str(plan.ops[r][pc[r]]) for r in range(n) if pc[r] < len(plan.ops[r])}
            pending = {f"{k[0]}/{k[1]}": len(q) for k, q in queues.items() if q}
            raise PlanError(f"{plan.algo} {plan.direction}: deadlock; blocked ranks {stuck}; "
                            f"posted but unmatched batches {pending}")

    leftover = [k for k, q in queues.items() if q]
    if leftover or batches:
        raise PlanError(f"{plan.algo} {plan.direction}: batches never waited or matched: "
                        f"{sorted(set(leftover) | set(batches))}")
    for (i, j), count in tile_count.items():
        if count != 1:
            raise PlanError(f"{plan.algo} {plan.direction}: tile ({i}, {j}) computed {count} times")
    for r in range(n):
        if bwd:
            _expect(plan, r, state[r].get(Plan.DQ), "dq", {tile_spec(r, j, plan.causal)
                                                           for j in range(n)})
            _expect(plan, r, state[r].get(Plan.DKV), "dkv", {tile_spec(i, r, plan.causal)
                                                             for i in range(n)})
        else:
            _expect(plan, r, state[r].get(Plan.OUT), "out", {tile_spec(r, j, plan.causal)
                                                             for j in range(n)})
    return PlanStats(max_depth, messages, tiles_done)


def _expect(plan: Plan, r: int, c: _Content | None, kind: str, want: set[TileSpec]) -> None:
    if c is None or c.kind != kind or c.owner != r:
        raise PlanError(f"{plan.algo} {plan.direction}: rank {r} ends without its {kind}")
    if set(c.tiles) != want:
        missing = sorted(map(_tile_name, want - set(c.tiles)))
        extra = sorted(map(_tile_name, set(c.tiles) - want))
        raise PlanError(f"{plan.algo} {plan.direction}: rank {r}'s {kind} is missing tiles "
                        f"{missing} and has extra {extra}")


def _tile_name(t: TileSpec) -> str:
    return f"({t.q_owner},{t.kv_owner})"
