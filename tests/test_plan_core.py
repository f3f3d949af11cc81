"""The plan vocabulary, the block table and its users, the op dispatch, batch matching, and the
validator's named checks on hand-broken plans."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from charm_megatron.ops.executor import BlockShape, Executor
from charm_megatron.plan.batches import BatchMismatch, closed_matching, messages_between
from charm_megatron.plan.core import (
    Comm,
    Half,
    Kind,
    Loc,
    Merge,
    OpInterpreter,
    Plan,
    Reset,
    Stream,
    Tile,
    TileBwd,
    Wait,
    Xfer,
    format_op,
)
from charm_megatron.plan.cost import Problem
from charm_megatron.plan.registry import build_plan
from charm_megatron.plan.validate import PlanError, validate
from charm_megatron.plan.vocab import BLOCKS, Direction, Side

KV0 = Loc.own(Kind.KV)


# ------------------------------------------------------------------------------ vocabulary
def test_enums_print_and_compare_as_their_strings() -> None:
    assert Kind.KV == "kv" and f"{Kind.QGRAD}" == "qgrad" and str(Stream.CROSS) == "cross"
    assert {"kv": 1}[Stream.KV] == 1  # hash as the string: str-keyed tables keep working
    # Plain strings are normalised: a hand-written plan is the same values as a typed one.
    assert Xfer(1, "own.kv", "kv", 0, Half.FULL) == Xfer(1, KV0, Kind.KV, 0, Half.FULL)
    assert Merge("acc.dkv", "toy.dkvin") == Merge(Plan.DKV, Loc("toy.dkvin"))
    assert Reset("acc.out", "out", 0).loc == Plan.OUT
    assert Comm(0, "q").stream is Stream.Q
    assert Plan("x", "backward", 1, ((0,),), False).direction is Direction.BACKWARD
    with pytest.raises(ValueError):
        Kind("qq")
    with pytest.raises(ValueError, match="no own location"):
        Loc.own(Kind.DQ)


def test_locations_print_as_before() -> None:
    assert str(Loc("q.ret").at(0, 1)) == "q.ret0.1"
    assert str(Loc("kv.rx").at(1)) == "kv.rx1"
    assert str(Loc.own(Kind.QGRAD)) == "own.qgrad" and str(Plan.OUT) == "acc.out"
    assert Loc("q.ret").at(0, 1) == Loc("q.ret", 0, 1) != Loc("q.ret", 1, 0)


def test_direction_names_its_q_side() -> None:
    assert (Direction.FORWARD.query, Direction.FORWARD.query_partial) == (Kind.Q, Kind.OUT)
    assert (Direction.BACKWARD.query, Direction.BACKWARD.query_partial) == (Kind.QGRAD, Kind.DQ)


# ------------------------------------------------------------------------------ block table
def test_block_bytes_are_the_documented_layouts() -> None:
    # Written out independently of BLOCKS (docs/design.md's table): rows = s / n.
    b, s, hq, hkv, d, e, n = 2, 64, 6, 2, 8, 2, 4
    rows = s / n
    want = {
        "q": rows * b * hq * d * e,
        "kv": rows * 2 * b * hkv * d * e,
        "out": rows * b * hq * (d * e + 4),  # out in the input dtype + fp32 lse
        "qgrad": rows * b * hq * (2 * d * e + 2 * 4),  # q, dout + fp32 (lse, delta)
        "dq": rows * b * hq * d * e,
        "dkv": rows * 2 * b * hkv * d * e,
    }
    p = Problem(b, s, hq, hkv, d, e)
    assert {k: p.block_bytes(k, n) for k in want} == want
    x = Xfer(1, KV0, Kind.KV, 0, Half.SECOND)
    assert p.xfer_bytes(x, n) == want["kv"] / 2


def _executor(dtype: torch.dtype = torch.bfloat16) -> Executor:
    # Buffers and op interpretation need no process group.
    return Executor(None, None, BlockShape(8, 2, 6, 2, 4, dtype, torch.device("cpu")), 1.0)


@pytest.mark.parametrize("kind", list(Kind))
def test_executor_buffers_follow_the_table(kind: Kind) -> None:
    ex = _executor()
    sh = ex.shape
    wire = ex._alloc(kind, wire=True)
    acc = ex._alloc(kind, wire=False)
    # The executor's receive buffers hold exactly the bytes the cost model charges.
    nbytes = sum(t.numel() * t.element_size() for t in wire)
    problem = Problem(sh.b, sh.s * 4, sh.hq, sh.hkv, sh.d, elem=2)
    assert nbytes == problem.block_bytes(kind, 4)
    assert all(t.shape[0] == sh.s for t in wire)  # rows first: a half is a slice
    spec = BLOCKS[kind]
    for w, a in zip(wire, acc):
        assert w.shape == a.shape
        if spec.partial and w.dim() == 4 and w.shape[-1] == sh.d:
            assert (w.dtype, a.dtype) == (torch.bfloat16, torch.float32)  # the wire rule
        elif w.dim() < 4 or w.shape[-1] == 2:
            assert w.dtype == a.dtype == torch.float32  # lse / (lse, delta): fp32 always
        else:
            assert w.dtype == a.dtype == torch.bfloat16


def test_reset_empties_and_partials_travel_in_the_input_dtype() -> None:
    ex = _executor()
    ex.interpret(Reset(Plan.OUT, Kind.OUT, 0))
    out, lse = ex.result(Plan.OUT)
    assert out.dtype == torch.float32 and bool((out == 0).all())
    assert bool(torch.isinf(lse).all()) and bool((lse < 0).all())
    ex.interpret(Reset(Plan.DKV, Kind.DKV, 0))
    assert all(bool((t == 0).all()) for t in ex.result(Plan.DKV))
    sent = ex._to_wire(Kind.OUT, (out + 1.5, torch.randn(lse.shape)))
    assert sent[0].dtype == torch.bfloat16 and sent[1].dtype == torch.float32
    assert ex._to_wire(Kind.DKV, ex.result(Plan.DKV))[1].dtype == torch.bfloat16


def test_merge_rule_comes_from_the_table() -> None:
    ex = _executor(torch.float32)
    for loc, kind in ((Plan.OUT, Kind.OUT), (Plan.DQ, Kind.DQ)):
        ex.interpret(Reset(loc, kind, 0))
    src, src_out = Loc("rx"), Loc("rx.out")
    (dq,) = ex._buffer(src, Kind.DQ, wire=True).tensors  # a receive buffer, as _post makes it
    dq.copy_(torch.randn(dq.shape))
    ex.interpret(Merge(Plan.DQ, src))
    assert torch.equal(ex.result(Plan.DQ)[0], dq)  # sum into zeros
    o, lse = ex._buffer(src_out, Kind.OUT, wire=True).tensors
    o.copy_(torch.randn(o.shape))
    lse.copy_(torch.randn(lse.shape))
    ex.interpret(Merge(Plan.OUT, src_out))
    # lse-merge into an empty accumulator: the partial itself.
    assert torch.allclose(ex.result(Plan.OUT)[0], o) and torch.allclose(ex.result(Plan.OUT)[1], lse)
    assert BLOCKS[Kind.OUT].lse_merge and not BLOCKS[Kind.DQ].lse_merge
    assert BLOCKS[Kind.DKV].side is Side.KV and BLOCKS[Kind.DQ].side is Side.Q


# ------------------------------------------------------------------------------ dispatch
def test_an_interpreter_must_handle_every_op_type() -> None:
    class NoMerge(OpInterpreter[str]):
        def on_comm(self, op): return "c"
        def on_wait(self, op): return "w"
        def on_reset(self, op): return "r"
        def on_tile(self, op): return "t"
        def on_tile_bwd(self, op): return "b"

    with pytest.raises(TypeError, match="on_merge"):
        NoMerge()

    class All(NoMerge):
        def on_merge(self, op): return "m"
        def on_super_tile(self, op): return "s"

    ops = build_plan("charm", "backward", [[0, 1], [2, 3]], True)
    letters = "".join(All().interpret(op) for op in ops.ops[0])
    assert set(letters) == set("cwrbm")
    with pytest.raises(TypeError, match="unknown op"):
        All().interpret("post #0")


def test_printout_of_each_op() -> None:
    x = Xfer(2, Loc("q.rx").at(0, 1), Kind.QGRAD, 3, Half.SECOND)
    assert format_op(Comm(4, Stream.Q, (), (x,))) == "post #4 on q: recv qgrad[3].2nd<-2 into q.rx0.1"
    spec = build_plan("ring", "forward", [[0, 1]], True).ops[1][2].spec
    assert format_op(Tile(spec, Loc.own(Kind.Q), KV0, Plan.OUT, fresh=True)) == \
        "tile q[1].all x kv[1].all causal => acc.out"
    assert format_op(TileBwd(spec, Loc.own(Kind.QGRAD), KV0, Plan.DQ, Plan.DKV, fresh_dkv=True)) \
        == "tile-bwd q[1].all x kv[1].all causal dq -> acc.dq, dkv => acc.dkv"


# ------------------------------------------------------------------------------ batches
def _send(handle: int, stream: Stream, *peers: int) -> Comm:
    return Comm(handle, stream, tuple(Xfer(p, KV0, Kind.KV, 0, Half.FULL) for p in peers))


def _recv(handle: int, stream: Stream, *peers: int) -> Comm:
    return Comm(handle, stream, (), tuple(Xfer(p, Loc("rx").at(p), Kind.KV, p, Half.FULL)
                                          for p in peers))


def test_messages_pair_in_posted_order_and_counts_must_agree() -> None:
    a = Comm(0, Stream.KV, (Xfer(1, KV0, Kind.KV, 0, Half.FIRST),
                            Xfer(1, KV0, Kind.KV, 0, Half.SECOND)))
    b = _recv(0, Stream.KV, 0, 0)
    assert [(s.half, r.loc) for s, r in messages_between(0, a, 1, b)] == \
        [(Half.FIRST, Loc("rx", 0)), (Half.SECOND, Loc("rx", 0))]
    with pytest.raises(BatchMismatch, match="rank 0 sends 2 messages to rank 1, which expects 1"):
        messages_between(0, a, 1, _recv(0, Stream.KV, 0))


def test_closed_matching_needs_every_partner_at_its_head() -> None:
    kv = Stream.KV
    fan_out = _send(0, kv, 1, 2)
    heads = {(0, kv): fan_out, (1, kv): _recv(0, kv, 0), (2, kv): _send(0, kv, 1)}
    # Rank 2's head is another batch: 0 cannot complete, so neither can 1 (strict rule).
    assert closed_matching(heads) == set()
    heads[(2, kv)] = _recv(0, kv, 0)
    assert closed_matching(heads) == {(0, kv), (1, kv), (2, kv)}
    heads[(3, kv)] = _send(0, kv, 0)  # 0 expects nothing from 3: 3 can never complete
    assert closed_matching(heads) == {(0, kv), (1, kv), (2, kv)}


# ------------------------------------------------------------------------------ validator
def _replace(plan: Plan, rank: int, idx: int, *new) -> Plan:
    ops = list(plan.ops[rank])
    ops[idx:idx + 1] = list(new)
    plan.ops[rank] = ops
    return plan


def _first(plan: Plan, rank: int, cls: type) -> int:
    return next(i for i, op in enumerate(plan.ops[rank]) if type(op) is cls)


def test_validator_rejects_reading_a_receive_before_its_wait() -> None:
    rx = Loc("rx")
    got = Xfer(1, rx, Kind.KV, 1, Half.FULL)
    plan = Plan("hand", "forward", 2, ((0, 1),), False)
    plan.ops = [
        # #0 has arrived by the time #1 is waited, but is not waited itself when rx is sent on.
        [Comm(0, Stream.KV, (), (got,)), Comm(1, Stream.Q, (), (dataclasses.replace(
            got, loc=Loc("rx2")),)), Wait(1),
         Comm(2, Stream.CROSS, (Xfer(1, rx, Kind.KV, 1, Half.FULL),)), Wait(0), Wait(2)],
        [_send(0, Stream.KV, 0), _send(1, Stream.Q, 0), _recv(2, Stream.CROSS, 0), Wait(0),
         Wait(1), Wait(2)],
    ]
    plan.ops[1] = [dataclasses.replace(op, sends=tuple(dataclasses.replace(x, owner=1)
                                                        for x in op.sends))
                   if type(op) is Comm else op for op in plan.ops[1]]
    with pytest.raises(PlanError, match="reads rx before the receive into it was waited"):
        validate(plan)
    # Read before it even arrived: the same plan with the first wait removed.
    plan = build_plan("ring", "forward", [[0, 1, 2]], False)
    _replace(plan, 0, _first(plan, 0, Wait))
    with pytest.raises(PlanError, match="reads ring.kv0, which holds nothing"):
        validate(plan)


def test_validator_rejects_overwriting_a_buffer_in_flight() -> None:
    plan = build_plan("ring", "forward", [[0, 1]], False)
    i = _first(plan, 0, Comm)
    _replace(plan, 0, i, plan.ops[0][i], Reset(Loc("ring.kv", 0), Kind.OUT, 0))
    with pytest.raises(PlanError, match="writes ring.kv0 while a transfer"):
        validate(plan)


def test_validator_rejects_a_partial_sent_without_all_its_rows() -> None:
    plan = build_plan("rmplus", "forward", [[0, 1, 2, 3]], False)
    for i, op in enumerate(plan.ops[0]):
        if type(op) is Comm and op.sends and op.sends[0].kind is Kind.OUT:
            x = dataclasses.replace(op.sends[0], half=Half.FIRST)
            _replace(plan, 0, i, dataclasses.replace(op, sends=(x,) + op.sends[1:]))
            break
    else:
        raise AssertionError("no partial sent")
    with pytest.raises(PlanError, match=r"sends rows 1st of acc\.svc.* wrote rows outside them"):
        validate(plan)


def test_validator_rejects_batches_on_different_streams_as_deadlock() -> None:
    plan = Plan("hand", "forward", 2, ((0, 1),), False)
    plan.ops = [[_send(0, Stream.KV, 1), Wait(0)], [_recv(0, Stream.Q, 0), Wait(0)]]
    with pytest.raises(PlanError, match="deadlock"):
        validate(plan)


def test_validator_rejects_an_unwaited_batch() -> None:
    plan = build_plan("ring", "backward", [[0, 1]], False)
    assert type(plan.ops[1][-1]) is Wait  # the dkv coming home: nothing reads it in the plan
    _replace(plan, 1, len(plan.ops[1]) - 1)
    with pytest.raises(PlanError, match="never waited"):
        validate(plan)
