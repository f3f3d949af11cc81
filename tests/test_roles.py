"""Roles by bytes (issue 12): the rule, the forced mixes, pass-kv across groups, and the
validator on every grouping up to 64 ranks under every role mix."""

import contextlib
import math

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from charm_megatron.model.cluster import default_cluster_for
from charm_megatron.model.predict import choose_algo, predict
from charm_megatron.plan.core import Comm, Kind, Stream
from charm_megatron.plan.cost import Problem
from charm_megatron.plan.registry import build_plan
from charm_megatron.plan.roles import ROLE_MIXES, RoleShape, check_roles
from charm_megatron.plan.validate import validate
from charm_megatron.plan.vocab import Role

SHAPES = [RoleShape(8, h, 16, e) for h in (8, 4, 2, 1) for e in (2, 4)]


def _groups(G, M):
    return [list(range(g * M, (g + 1) * M)) for g in range(G)]


def _divisor_groupings(n):
    return [(G, n // G) for G in range(1, n + 1) if n % G == 0]


# 24 derandomized examples (the suite's profile has 60): the validator of plans up to 64
# ranks is the suite's slowest test, and the time budget of a CI stop is shared.
@settings(max_examples=24)
@given(st.integers(min_value=1, max_value=64).flatmap(
    lambda n: st.tuples(st.just(n), st.sampled_from(_divisor_groupings(n)))),
    st.booleans(), st.sampled_from(["forward", "backward"]), st.sampled_from(ROLE_MIXES),
    st.sampled_from(SHAPES), st.sampled_from(["split", "joint"]), st.booleans(), st.booleans())
def test_every_role_mix_validates(n_and_grouping, causal, direction, roles, shape, order,
                                  split_visiting, split_counterpart_q):
    """Tile coverage and causal halves, buffer hazards, send/receive matching and deadlock
    freedom under NCCL stream semantics (the validator), for rmplus and charm, with and
    without split visiting kv (pass-kv) and split counterpart q (pass-q)."""
    n, (G, M) = n_and_grouping
    for algo in ("rmplus", "charm"):
        plan = build_plan(algo, direction, _groups(G, M), causal, pass_order=order, roles=roles,
                          shape=shape, split_visiting=split_visiting,
                          split_counterpart_q=split_counterpart_q)
        stats = validate(plan)
        assert sum(stats.tiles) == n * n
        assert all(t == n for t in stats.tiles)  # compute stays balanced


def _cross(plan, rank):
    group_of = {r: gi for gi, g in enumerate(plan.groups) for r in g}
    return [x for op in plan.comms(rank) for x in op.sends if group_of[x.peer] != group_of[rank]]


@pytest.mark.parametrize("direction", ["forward", "backward"])
@pytest.mark.parametrize("G,M", [(2, 4), (3, 2), (4, 2), (3, 3)])
def test_pass_kv_moves_kv_there_and_only_dkv_back(direction, G, M):
    plan = build_plan("charm", direction, _groups(G, M), True, roles="kv")
    validate(plan)
    want = {Kind.KV} if direction == "forward" else {Kind.KV, Kind.DKV}
    for r in range(plan.n):
        kinds = {x.kind for x in _cross(plan, r)}
        assert kinds == want, (r, kinds)  # forward: nothing comes back across the slow link
        assert all(d.role is Role.KV for d in plan.decisions[r])


@pytest.mark.parametrize("direction", ["forward", "backward"])
def test_forced_q_is_pass_q_and_q_pairs(direction):
    plan = build_plan("charm", direction, _groups(2, 4), True, roles="q")
    validate(plan)
    for r in range(plan.n):
        assert {x.kind for x in _cross(plan, r)} == {Kind(direction == "forward" and "q"
                                                          or "qgrad"),
                                                     Kind(direction == "forward" and "out"
                                                          or "dq")}
        assert all(d.role is Role.Q for d in plan.decisions[r])


@pytest.mark.parametrize("roles", ["kv", "q", "bytes"])
def test_both_streams_busy_whatever_the_roles(roles):
    plan = build_plan("rmplus", "forward", _groups(1, 8), True, roles=roles,
                      shape=RoleShape(8, 2, 64))
    for r in range(plan.n):
        streams = {op.stream for op in plan.ops[r] if type(op) is Comm}
        assert {Stream.KV, Stream.Q} <= streams


def test_buffers_do_not_grow_with_n_or_g():
    def locs(G, M):
        plan = build_plan("charm", "backward", _groups(G, M), True, roles="kv")
        return {loc for ops in plan.ops for op in ops for loc in _op_locs(op)}
    base = locs(4, 4)  # G > 2: the cross buffers alternate between two copies
    assert locs(4, 16) == base and locs(16, 4) == base
    assert locs(2, 4) <= base and locs(2, 16) == locs(2, 4)


def _op_locs(op):
    if type(op) is Comm:
        return [x.loc for x in op.sends + op.recvs]
    return [v for v in vars(op).values() if type(v).__name__ == "Loc"]


def _decisions(direction, shape, causal=False, G=2, M=2, mix="bytes"):
    plan = build_plan("charm", direction, _groups(G, M), causal, roles=mix, shape=shape)
    validate(plan)
    return plan.decisions


def test_bytes_follow_the_block_table():
    """Full mask, one q block per pass: the per-token bytes of docs/algorithm.md, *Roles by bytes* (both ways)."""
    hq, hkv, d, e = 8, 2, 16, 2
    shape = RoleShape(hq, hkv, d, e)
    fwd = _decisions("forward", shape)[0]
    bwd = _decisions("backward", shape)[0]
    assert fwd[0].where == "cross"
    assert fwd[0].kv_bytes == 2 * (2 * hkv * d * e)
    assert fwd[0].q_bytes == 2 * (2 * hq * d * e + 4 * hq)
    assert bwd[0].kv_bytes == 2 * (4 * hkv * d * e)
    assert bwd[0].q_bytes == 2 * (3 * hq * d * e + 8 * hq)


@pytest.mark.parametrize("causal", [True, False])
@pytest.mark.parametrize("hkv", [4, 2, 1])
def test_gqa_passes_kv_everywhere(hkv, causal):
    for direction in ("forward", "backward"):
        for per_rank in _decisions(direction, RoleShape(8, hkv, 64, 2), causal, 2, 4):
            cross = [d for d in per_rank if d.where == "cross"]
            assert cross and all(d.role is Role.KV for d in cross)


@pytest.mark.parametrize("causal", [True, False])
def test_mha_keeps_the_papers_cross_role(causal):
    """MHA forward: the roles tie up to the lse (the paper's pass-q kept); backward pass-q is
    cheaper (the paper's choice)."""
    for direction in ("forward", "backward"):
        for per_rank in _decisions(direction, RoleShape(8, 8, 64, 2), causal, 2, 4):
            assert all(d.role is Role.Q for d in per_rank if d.where == "cross")


def test_mha_rmplus_forward_is_the_paper():
    shape = RoleShape(32, 32, 128, 2)
    for causal in (True, False):
        a = build_plan("rmplus", "forward", _groups(1, 8), causal, roles="bytes", shape=shape)
        b = build_plan("rmplus", "forward", _groups(1, 8), causal)
        # The paper's roles; the schedule may be a memory variant (plan/memory.py's bound),
        # which a shape-free plan never is.
        assert [[d.role for d in ds] for ds in a.decisions] == \
            [[d.role for d in ds] for ds in b.decisions]
        assert a.ops == b.ops or a.lean or a.early_returns


def test_every_decision_is_the_cheaper_or_a_tie():
    for shape in SHAPES:
        for direction in ("forward", "backward"):
            for per_rank in _decisions(direction, shape, True, 2, 4):
                for d in per_rank:
                    mine, other = ((d.kv_bytes, d.q_bytes) if d.role is Role.KV
                                   else (d.q_bytes, d.kv_bytes))
                    assert mine <= other or mine < other / 0.95


def test_unknown_roles_is_a_clear_error():
    with pytest.raises(ValueError, match=r"roles='fastest'.*bytes, paper, kv, q"):
        build_plan("charm", "forward", _groups(2, 2), True, roles="fastest")
    # bytes without a shape is the paper's rule (what shape-free plans are), not an error
    assert build_plan("charm", "forward", _groups(2, 2), True, roles="bytes").ops == \
        build_plan("charm", "forward", _groups(2, 2), True, roles="paper").ops
    with pytest.raises(ValueError, match="cp_attention roles"):
        check_roles("Q", "cp_attention roles")


def test_cp_attention_rejects_unknown_roles_before_communicating():
    import torch

    from charm_megatron import cp_attention

    q = torch.randn(4, 1, 2, 8)
    # A one-rank gloo group: the error must come from the roles check, not from a missing group.
    with _one_rank_group(), pytest.raises(
            ValueError, match=r"roles='pairs'.*choose one of bytes, paper, kv, q"):
        cp_attention(q, q, q, algo="charm", roles="pairs")


@contextlib.contextmanager
def _one_rank_group():
    import torch.distributed as dist

    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        yield
    finally:
        dist.destroy_process_group()


@pytest.mark.parametrize("roles", ROLE_MIXES)
def test_model_replays_every_role_mix(roles):
    groups = _groups(2, 4)
    problem = Problem(b=1, s=32768, hq=32, hkv=8, d=128, elem=2)
    cluster = default_cluster_for(tuple(map(tuple, groups)))
    for algo in ("rmplus", "charm"):
        p = predict(algo, groups, problem, cluster, True, roles=roles)
        assert math.isfinite(p.total_s) and p.total_s > 0
    assert choose_algo(groups, problem, cluster, roles=roles,
                       algos=("ring", "rmplus", "charm")) in ("ring", "rmplus", "charm")


def test_model_prefers_kv_roles_for_gqa():
    groups = _groups(2, 8)
    problem = Problem(b=1, s=32768, hq=32, hkv=4, d=128, elem=2)
    cluster = default_cluster_for(tuple(map(tuple, groups)))
    by_bytes = predict("charm", groups, problem, cluster, True, roles="bytes").total_s
    paper = predict("charm", groups, problem, cluster, True, roles="paper").total_s
    assert by_bytes < paper


def test_the_byte_rule_counts_fp32_partials_when_they_travel_so() -> None:
    """``RoleShape(wide=True)`` (CPOptions(partials="fp32")): partial outputs and gradient
    partials weigh their fp32 bytes in the byte rule, inputs do not change."""
    from charm_megatron.plan.roles import RoleShape, row_bytes
    from charm_megatron.plan.vocab import Kind

    narrow, wide = RoleShape(32, 8, 128, 2), RoleShape(32, 8, 128, 2, wide=True)
    for kind in (Kind.Q, Kind.KV, Kind.DOUT):
        assert row_bytes(kind, wide) == row_bytes(kind, narrow)
    for kind in (Kind.DQ, Kind.DKV):
        assert row_bytes(kind, wide) == 2 * row_bytes(kind, narrow)
    lse = 32 * 4  # fp32 either way
    assert row_bytes(Kind.OUT, wide) - lse == 2 * (row_bytes(Kind.OUT, narrow) - lse)
