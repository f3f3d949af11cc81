"""Peak memory of RM+ and CHARM+ against ring (issue 12, item 8: at most 1.1x ring's).

Two views of the same rule (buffers live from their first write to their last use,
plan/lifetimes.py):

* the plan-level model (plan/memory.py) over a grid of groupings, head ratios, masks, role
  mixes and both directions, with no processes;
* the measured peak growth of torch's CPU allocator over real gloo calls
  (lab/bench/memory.py, what ``charm-megatron bench`` reports), forward and forward+backward.

Memory is deterministic up to a few per cent (allocation order does not depend on timing), so
a ratio bound is a fair test; it is not a timing test.
"""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from charm_megatron.algorithms.charm.entry import CharmVariant
from charm_megatron.lab.bench.memory import call_peaks
from charm_megatron.local_ranks import run_ranks
from charm_megatron.plan.cost import Problem
from charm_megatron.plan.entries import assemble
from charm_megatron.plan.lifetimes import lifetimes
from charm_megatron.plan.memory import plan_peak
from charm_megatron.plan.registry import build_plan, get
from charm_megatron.plan.roles import ROLE_MIXES, RoleChoice, RoleShape
from charm_megatron.plan.validate import validate

BOUND = 1.1
HQ, D = 8, 32


def _groups(topology: str) -> tuple[tuple[int, ...], ...]:
    g, m = map(int, topology.split("x"))
    return tuple(tuple(range(i * m, (i + 1) * m)) for i in range(g))


def _model_ratio(algo: str, topology: str, hkv: int, causal: bool, roles: str,
                 direction: str) -> float:
    groups = _groups(topology)
    n = sum(map(len, groups))
    problem = Problem(b=2, s=256 * n, hq=HQ, hkv=hkv, d=D, elem=4)
    flat = (tuple(range(n)),)
    ring = build_plan("ring", direction, flat, causal)
    plan = build_plan(algo, direction, groups if algo == "charm" else flat, causal, roles=roles,
                      shape=RoleShape(HQ, hkv, D, 4))
    return (max(p.bytes for p in plan_peak(plan, problem))
            / max(p.bytes for p in plan_peak(ring, problem)))


# Points of the grid still above the bound (docs/performance.md, "Memory", says why: the
# paper's pass-q holds the counterpart's q block and its accumulator, h_q/h_kv times the kv
# blocks ring holds, lean or not). strict: a point that starts passing must leave this list.
OVER = {("charm", t, 2, c, "paper", d) for t in ("2x2", "2x4") for c in (True, False)
        for d in ("forward", "backward")}

GRID = [(algo, topo, hkv, causal, roles, direction)
        for algo in ("rmplus", "charm") for topo in ("2x2", "2x4") for hkv in (8, 2)
        for causal in (True, False) for roles in ("bytes", "paper")
        for direction in ("forward", "backward")]


@pytest.mark.parametrize("case", GRID, ids=lambda c: "-".join(map(str, c)))
def test_model_peak_within_bound_of_ring(case):
    ratio = _model_ratio(*case)
    if case in OVER:
        if ratio <= BOUND:
            pytest.fail(f"{case} now meets the bound ({ratio:.2f}): remove it from OVER")
        pytest.xfail(f"known over the bound: {ratio:.2f}")
    assert ratio <= BOUND, f"{case}: peak {ratio:.2f}x ring's"


def test_lean_plans_only_where_the_bound_needs_them():
    shape = lambda hkv: RoleShape(HQ, hkv, D, 4)  # noqa: E731
    # The default roles with the causal mask (the bench grid) keep the prefetching plans.
    for topo in ("2x2", "2x4"):
        for hkv in (8, 2):
            for direction in ("forward", "backward"):
                plan = build_plan("charm", direction, _groups(topo), True, shape=shape(hkv))
                assert not plan.lean, (topo, hkv, direction)
    # Full attention on 2x4 needs them (1.34x / 1.17x ring prefetching, 1.01x / 1.00x lean).
    for hkv in (8, 2):
        assert build_plan("charm", "forward", _groups("2x4"), False, shape=shape(hkv)).lean
    # Without a shape there is nothing to size: the paper's plans as they are.
    assert not build_plan("charm", "forward", _groups("2x4"), False).lean


@settings(deadline=None, max_examples=12)
@given(st.integers(min_value=1, max_value=64).flatmap(
    lambda n: st.tuples(st.just(n), st.sampled_from([(g, n // g) for g in range(1, n + 1)
                                                     if n % g == 0]))),
    st.booleans(), st.sampled_from(["forward", "backward"]), st.sampled_from(ROLE_MIXES),
    st.sampled_from([8, 2, 1]), st.sampled_from(["split", "joint"]))
def test_every_memory_variant_validates(n_and_grouping, causal, direction, roles, hkv, order):
    """The lean and the early-returns variants (forced here, wherever build_plan would pick
    them or not) pass the validator: tiles, halves, hazards with the executor's frees
    replayed, matching, deadlock."""
    n, (g, m) = n_and_grouping
    groups = tuple(tuple(range(i * m, (i + 1) * m)) for i in range(g))
    choice = RoleChoice(roles, RoleShape(HQ, hkv, D, 2))
    for algo in ("rmplus", "charm"):
        grp = groups if algo == "charm" else (tuple(range(n)),)
        for flags in ({"lean": True}, {"early_returns": True}):
            plan = assemble(algo, get(algo).build_rank, direction, grp, causal,
                            CharmVariant(order, choice, **flags))
            stats = validate(plan)
            assert all(t == n for t in stats.tiles)


def test_backward_returns_stay_in_flight_where_the_bound_allows():
    """A backward plan completes a unit's returns before the next unit's tiles
    (``early_returns``) only where leaving them in flight would exceed the bound, as the
    forward does: at the bench's 8 q / 2 kv point (fp32, causal, 2x4) the returns in flight
    hold 1.16x ring's peak; with multi-head attention they fit (0.89x) and stay in flight."""
    groups = _groups("2x4")
    gqa = build_plan("charm", "backward", groups, True, shape=RoleShape(8, 2, 64, 4))
    mha = build_plan("charm", "backward", groups, True, shape=RoleShape(8, 8, 64, 4))
    assert gqa.early_returns and not gqa.lean
    assert not mha.early_returns and not mha.lean
    # The variant left out is the one that breaks the bound, not just another plan.
    problem = Problem(b=2, s=256 * 8, hq=8, hkv=2, d=64, elem=4)
    ring = max(p.bytes for p in plan_peak(build_plan("ring", "backward", ((*range(8),),),
                                                     True), problem))
    plain = assemble("charm", get("charm").build_rank, "backward", groups, True,
                     CharmVariant(roles=RoleChoice("bytes", RoleShape(8, 2, 64, 4))))
    assert max(p.bytes for p in plan_peak(plain, problem)) > BOUND * ring
    assert plain.ops != gqa.ops


@pytest.mark.parametrize("n", [2, 4, 8, 16, 64])
def test_lifetimes_free_every_receive_buffer_and_keep_the_results(n):
    # Every buffer but the caller's inputs and the results is freed by the end of the plan.
    groups = _groups(f"2x{n // 2}")
    for algo, grp in (("ring", (tuple(range(n)),)), ("charm", groups)):
        for direction in ("forward", "backward"):
            plan = build_plan(algo, direction, grp, True, shape=RoleShape(8, 2, 64))
            for ops in plan.ops[:4]:
                life = lifetimes(ops)
                freed = [loc for locs in life.free_after.values() for loc in locs]
                born = {loc for (_, loc) in life.rows}
                assert not {plan.OUT, plan.DQ, plan.DKV} & set(freed)
                assert born - {plan.OUT, plan.DQ, plan.DKV} <= set(freed)


# Measured on 4 gloo ranks (2x2): the default roles, MHA and GQA, causal and full.
MEASURED = [(algo, topo, causal, hkv, "bytes")
            for hkv in (8, 2) for causal in (True, False)
            for algo, topo in (("ring", None), ("rmplus", None), ("charm", "2x2"))]


def test_measured_peak_within_bound_of_ring():
    per_rank = run_ranks(call_peaks, 4, MEASURED, 1024, 2, HQ, D,
                         timeout_s=600)
    worst = {case: {ph: max(r[case][ph] for r in per_rank) for ph in ("fwd", "fwdbwd")}
             for case in MEASURED}
    failures = []
    for algo, topo, causal, hkv, roles in MEASURED:
        if algo == "ring":
            continue
        ring = worst[("ring", None, causal, hkv, roles)]
        got = worst[(algo, topo, causal, hkv, roles)]
        for ph in ("fwd", "fwdbwd"):
            ratio = got[ph] / ring[ph]
            if not ratio <= BOUND:
                failures.append(f"{algo} {topo} causal={causal} hkv={hkv} {ph}: "
                                f"{ratio:.2f}x ring ({got[ph] / 1e6:.2f} vs "
                                f"{ring[ph] / 1e6:.2f} MB)")
    assert not failures, "\n".join(failures)


def test_memory_bound_sizes_partials_at_their_wire_dtype():
    """Under fp32 partials (``RoleShape.wide``) the bound is judged on the buffers the
    executor allocates then (fp32 returns and dK, dV in flight, for ring as for CHARM+): on
    4x8 with Table 5's heads the plain backward holds more than the bound, so it completes
    returns early and stays within it (sized as if partials were bf16 it was built lean
    here, and with the model's split choices left plain, over the bound)."""
    groups = _groups("4x8")
    flat = (tuple(range(32)),)
    wide = RoleShape(12, 12, 192, 2, wide=True)
    plan = build_plan("charm", "backward", groups, False, shape=wide)
    problem = Problem(b=1, s=2 * 32, hq=12, hkv=12, d=192, elem=2, wide_partials=True)
    ring = max(p.bytes for p in plan_peak(build_plan("ring", "backward", flat, False), problem))
    assert max(p.bytes for p in plan_peak(plan, problem)) <= BOUND * ring
    assert plan.early_returns and not plan.lean
    plain = assemble("charm", get("charm").build_rank, "backward", groups, False,
                     CharmVariant(roles=RoleChoice("bytes", wide)))
    assert max(p.bytes for p in plan_peak(plain, problem)) > BOUND * ring
