"""CHARM+ with head parallelism (``head_parallel``): a head all-to-all in sub-groups of ``d``
ranks of each topology group, then CHARM+ over the super-blocks. Its plans, its refusals, the
model's pick of ``d``, and real gloo ranks against the float64 full-sequence reference at
every degree: both layouts, GQA, bf16, windows, sinks and MLA head dims."""

from __future__ import annotations

import pytest

import dist_cases
import mla_cases
import packed_cases
import sink_cases
import window_cases
from charm_megatron import CPOptions
from charm_megatron.local_ranks import RankFailure, run_ranks
from charm_megatron.model import get_profile
from charm_megatron.model.predict import predict, variants
from charm_megatron.plan import registry
from charm_megatron.plan.cost import Problem, traffic
from charm_megatron.plan.roles import RoleShape
from charm_megatron.plan.validate import validate
from charm_megatron.plan.vocab import HeadParallel


def _groups(g: int, m: int) -> tuple[tuple[int, ...], ...]:
    return tuple(tuple(range(i * m, (i + 1) * m)) for i in range(g))


GQA = RoleShape(32, 8, 128)


# ------------------------------------------------------------------------------ plans
@pytest.mark.parametrize("g,m", [(2, 2), (2, 4), (4, 2), (3, 4), (2, 8), (4, 8)])
@pytest.mark.parametrize("causal", [True, False])
def test_plans_validate_at_every_degree(g: int, m: int, causal: bool) -> None:
    groups = _groups(g, m)
    for d in (x for x in (2, 4, 8) if m % x == 0):
        for plan in registry.plans("charm", groups, causal, shape=GQA, head_parallel=d):
            assert plan.head_group == d
            validate(plan)  # the lane rule: every tile pairs ranks of one lane
            for ops in plan.ops:
                for op in ops:
                    if hasattr(op, "spec"):
                        assert op.spec.q_owner % d == op.spec.kv_owner % d


def test_degree_one_is_the_charm_of_the_paper() -> None:
    """``head_parallel=1`` and ``auto`` without a model build exactly today's plans."""
    groups = _groups(2, 4)
    base = registry.plans("charm", groups, True, shape=GQA, head_parallel=1)
    auto = registry.plans("charm", groups, True, shape=GQA)
    assert [p.ops for p in base] == [p.ops for p in auto]
    assert all(p.head_group == 1 for p in base)


def test_whole_group_degree_on_two_groups_moves_what_a2a_p2p_moves() -> None:
    """``d`` equal to the group size with two groups: the same forward bytes inside the
    groups as TE's hierarchical a2a+p2p, and across them no more (CHARM+'s cross exchange
    passes the cheaper block of each causal pair; the ring passes every kv block)."""
    groups = _groups(2, 4)
    p = Problem(1, 8192, 32, 8, 128)
    ours, _ = registry.plans("charm", groups, True, shape=GQA, head_parallel=4)
    theirs, _ = registry.plans("a2a+p2p", groups, True)
    a, b = traffic(ours, p, groups), traffic(theirs, p, groups)
    assert a.intra == pytest.approx(b.intra)
    assert sum(a.cross) <= sum(b.cross) and max(a.cross) == pytest.approx(max(b.cross))


def test_refusals_name_the_setting_and_the_fix() -> None:
    g = _groups(2, 4)
    with pytest.raises(ValueError, match=r"head_parallel=4 splits the heads 4 ways, but q heads "
                                         r"6 and kv heads 6 do not divide.*1 or auto"):
        registry.plans("charm", g, True, shape=RoleShape(6, 6, 64), head_parallel=4)
    with pytest.raises(NotImplementedError, match="the 2 kv heads shared.*not implemented yet"):
        registry.plans("charm", g, True, shape=RoleShape(8, 2, 64), head_parallel=4)
    with pytest.raises(ValueError, match="consecutive ranks whose count divides by 2"):
        registry.plans("charm", ((0, 2), (1, 3)), True, shape=GQA, head_parallel=2)
    with pytest.raises(ValueError, match="consecutive ranks whose count divides by 8"):
        registry.plans("charm", g, True, head_parallel=8)  # shape-free: groups only
    with pytest.raises(ValueError, match="head_parallel=5.*choose one of auto, 1, 2"):
        registry.plans("charm", g, True, head_parallel=5)


def test_the_setting_reaches_options_env_and_parses_numbers() -> None:
    assert CPOptions(head_parallel=4).head_parallel is HeadParallel.D4
    assert CPOptions.from_env({"CHARM_HEAD_PARALLEL": "2"}).head_parallel is HeadParallel.D2
    assert CPOptions().head_parallel is HeadParallel.AUTO
    with pytest.raises(ValueError, match="CHARM_HEAD_PARALLEL"):
        CPOptions.from_env({"CHARM_HEAD_PARALLEL": "7"})
    with pytest.raises(ValueError, match="head_parallel=True"):
        CPOptions(head_parallel=True)  # not a number
    # RM+ over one flat group has no head all-to-all of its own (that is a2a+p2p's job).
    assert "head_parallel" not in {s.name for s in registry.get("rmplus").settings}


# ------------------------------------------------------------------ the model's choice
@pytest.mark.parametrize("g,hq,hkv,seq", [(2, 32, 8, 32768), (4, 28, 4, 32768),
                                          (2, 12, 12, 8192)])
def test_auto_is_the_fastest_degree_the_model_predicts(g: int, hq: int, hkv: int,
                                                       seq: int) -> None:
    """``auto`` picks, for forward and backward together, the degree whose plans the model
    predicts fastest among those that run; ``1`` where only it runs."""
    cl = get_profile("h200").cluster
    groups = _groups(g, 8)
    p = Problem(1, seq, hq, hkv, 128)
    fwd, bwd = variants("charm", groups, p, cl, causal=True)
    assert fwd.head_parallel == bwd.head_parallel  # the backward runs on the forward's lanes
    times = {d: predict("charm", groups, p, cl, True, tune=True, head_parallel=d).total_s
             for d in (1, 2, 4, 8) if hq % d == 0 and hkv % d == 0}
    assert fwd.head_parallel == min(times, key=times.get)
    assert predict("charm", groups, p, cl, True, tune=True).total_s == \
        pytest.approx(min(times.values()))
    one = variants("charm", groups, Problem(1, seq, hq, 1, 128), cl, causal=True)[0]
    assert one.head_parallel == 1  # MQA: one kv head cannot be split


# ------------------------------------------------------------- real ranks, float64
TOL = {"fp32": 1e-5, "bf16": 2e-2, "fp64": 1e-12}


# world -> (topology, degree, kv heads) with 8 query heads
DENSE = {4: [("2x2", 2, 4), ("2x2", 2, 2)],
         8: [("2x4", 2, 4), ("2x4", 4, 4), ("4x2", 2, 2)]}


@pytest.mark.parametrize("world", sorted(DENSE))
def test_dense_matches_float64_at_every_degree(world: int) -> None:
    cases = [("charm", topo, causal, dtype, hkv, (("head_parallel", d),))
             for topo, d, hkv in DENSE[world] for causal in (True, False)
             for dtype in ("fp32", "bf16") if dtype == "fp32" or hkv == 4]
    res = run_ranks(dist_cases.run_matrix, world, cases, 8, 16, 8, timeout_s=600)
    assert not dist_cases.over_tolerance(res, lambda c, n: TOL[c[3]])


_ENV = {"CHARM_HEAD_PARALLEL": "2"}  # the case modules' calls take no options: the variable


def test_windows_and_sinks_match_float64_after_the_head_all_to_all() -> None:
    windows = [("charm", "2x2", causal, dtype, 2, left, right)
               for causal, left, right in ((True, 2, 0), (True, 9, 0), (False, 3, 5))
               for dtype in ("fp64", "bf16")]
    res = run_ranks(window_cases.run_sbhd, 4, windows, timeout_s=300, env=_ENV)
    assert not dist_cases.over_tolerance(res, lambda c, n: window_cases.TOL[c[3]])
    sinks = [("charm", "2x2", causal, dtype, 2, True) for causal in (True, False)
             for dtype in ("fp32", "bf16")]
    res = run_ranks(sink_cases.run_sbhd, 4, sinks, timeout_s=300, env=_ENV)
    assert not dist_cases.over_tolerance(res, lambda c, n: 5e-2 if (n, c[3]) == ("doffset", "bf16")
                    else sink_cases.TOL[c[3]])


def test_packed_and_mla_match_float64_after_the_head_all_to_all() -> None:
    cases = [("charm", "2x2", causal, dtype, 2, docs)
             for causal in (True, False) for dtype, docs in (("fp32", "unequal"),
                                                             ("bf16", "short"))]
    res = run_ranks(packed_cases.run_packed_matrix, 4, cases, [], timeout_s=300, env=_ENV)
    bad = [f"{c} rank {r}" for r, per in enumerate(res) for c, (errs, zero) in per.items()
           if not zero or max(errs.values()) >= TOL[c[3]]]
    assert not bad, bad
    mla = [("charm", "2x2", causal, dtype, 2, 24, 16) for causal in (True, False)
           for dtype in ("fp64", "bf16")]
    res = run_ranks(mla_cases.run_sbhd, 4, mla, timeout_s=300, env=_ENV)
    assert not dist_cases.over_tolerance(res, lambda c, n: mla_cases.TOL[c[3]])


def test_a_degree_the_heads_refuse_fails_on_every_rank_before_data_moves() -> None:
    """With CHARM_HEAD_PARALLEL=2 and 3 heads every rank raises the same clear error (which
    also shows the variable reaches the plan)."""
    with pytest.raises(RankFailure) as info:
        run_ranks(dist_cases.run_matrix, 4, [("charm", "2x2", True, "fp32", 3)], 8, 16, 3,
                  timeout_s=120, env=_ENV)
    text = str(info.value)
    assert text.count("head_parallel=2 splits the heads 2 ways") >= 4, text
