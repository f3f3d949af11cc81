"""cp_attention on real gloo ranks against the float64 full-sequence reference.

One process group per world size runs the whole matrix of algorithms, topologies, masks, GQA
ratios and dtypes (starting processes dominates the cost of these small problems).
"""

import itertools

import pytest

import dist_cases
from charm_megatron.local_ranks import run_ranks
from charm_megatron.plan import registry

TOL = {"fp32": 1e-5, "bf16": 2e-2}

# world size -> (algo, topology) pairs run there
SETUPS = {
    1: [("ring", None), ("rmplus", None), ("charm", None), ("allgather", None)],
    2: [("ring", None), ("rmplus", None), ("charm", "2x1"), ("allgather", None)],
    3: [("ring", None), ("rmplus", None), ("allgather", None)],
    4: [("ring", None), ("rmplus", None), ("charm", "2x2"), ("allgather", None)],
    6: [("ring", None), ("rmplus", None), ("charm", "2x3"), ("charm", "3x2"), ("allgather", None)],
    8: [("ring", None), ("rmplus", None), ("charm", "2x4"), ("charm", "4x2"), ("allgather", None)],
}


# Forced role mixes (issue 12) on top of the default (roles="bytes": pass-kv and kv pairs for
# h_kv < h_q, pass-q for MHA): h_q = 8 with h_kv in {8, 4, 2, 1}, pass-kv and pass-q cross
# phases in both directions, G = 2, 3 and 4. Same process groups as the matrix above.
ROLE_SETUPS = {
    4: [("rmplus", None), ("charm", "2x2")],
    6: [("charm", "3x2")],
    8: [("charm", "4x2"), ("charm", "2x4")],
}


def _role_cases(world):
    return [
        (algo, topo, causal, dtype, hkv, roles)
        for (algo, topo) in ROLE_SETUPS.get(world, [])
        for roles in ("paper", "kv", "q")
        for causal in (True, False)
        for dtype, hkvs in (("fp32", (8, 4, 2, 1)), ("bf16", (2,)))
        for hkv in hkvs
    ]


@pytest.mark.parametrize("world", sorted(SETUPS))
def test_matrix_against_float64_reference(world):
    cases = [
        (algo, topo, causal, dtype, hkv)
        for (algo, topo), causal, dtype, hkv in itertools.product(
            SETUPS[world], (True, False), ("fp32", "bf16"), (8, 4, 2, 1))
    ]
    cases += _role_cases(world)
    _assert_all_within_tolerance(cases, run_ranks(dist_cases.run_matrix, world, cases,
                                                  timeout_s=600))


def _assert_all_within_tolerance(cases: list[tuple], per_rank: list[dict]) -> None:
    """Every error of every case on every rank below its dtype's tolerance, all failures
    listed."""
    failures = []
    for case in cases:
        tol = TOL[case[3]]
        for rank, res in enumerate(per_rank):
            for name, err in res[case].items():
                if not err < tol:  # also catches NaN
                    failures.append(f"{case} rank {rank}: {name} rel err {err:.3g} >= {tol}")
    assert not failures, "\n".join(failures)


def test_long_blocks_against_float64_reference():
    """192 rows per rank, head dim 32: every rank's own causal tile is cut into pieces by the
    CPU forward and backward kernels (kernels/causal_split.py); every algorithm still
    matches."""
    cases = [(algo, topo, True, dtype, hkv)
             for algo, topo in (("ring", None), ("rmplus", None), ("charm", "2x2"))
             for dtype, hkv in (("fp32", 2), ("bf16", 1))]
    _assert_all_within_tolerance(cases, run_ranks(dist_cases.run_matrix, 4, cases, 192, 32,
                                                  timeout_s=600))


@pytest.mark.parametrize("algo,topology", [("ring", None), ("charm", "2x2")])
def test_bitwise_deterministic(algo, topology):
    assert all(run_ranks(dist_cases.run_twice_bitwise, 4, algo, topology, True))


BAD = {
    "odd_seq": "divisible by 2\\*cp_size",
    "dtype": "dtypes differ",
    "batch": "batch sizes differ",
    "head_dim": "head dims differ",
    "gqa": "not a multiple of h_kv",
    "not_4d": "must be 4-D",
    "algo": "unknown algo",
    "topology_size": "",
    "topology_unequal": "",
    "scale_zero": "softmax_scale=0.0 must be a finite number > 0",
    "scale_negative": "softmax_scale=-0.125 must be a finite number > 0",
    "scale_nan": "softmax_scale=nan must be a finite number > 0",
    "scale_inf": "softmax_scale=inf must be a finite number > 0",
    "scale_string": "softmax_scale must be a number",
    "backend_flash_on_cpu": "flash_attn backend runs fp16/bf16 on CUDA only",
    "offset_shape": "softmax_offset has shape \\(5,\\); it must be \\[h_q\\] = \\[4\\]",
    "offset_int": "softmax_offset must be a floating tensor",
    "window_negative": "each side must be >= 0, or -1 for unbounded",
    "window_type": "window_size must be \\(left, right\\) ints or None",
    "a2a_heads": "ValueError: .*a2a.* kv heads 1 does not divide by 2.*or choose a2a\\+p2p",
}


@pytest.mark.parametrize("case", sorted(BAD))
def test_bad_input_raises_on_every_rank(case):
    errors = run_ranks(dist_cases.bad_input, 2, case, timeout_s=120)
    assert all(e is not None for e in errors), errors
    assert len(set(errors)) == 1, errors  # the same message everywhere
    if BAD[case]:
        assert any(__import__("re").search(BAD[case], e) for e in errors), errors


def test_no_process_group_is_a_clear_error():
    import torch

    from charm_megatron import cp_attention

    x = torch.randn(4, 1, 2, 8)
    with pytest.raises(RuntimeError, match="not initialised"):
        cp_attention(x, x, x)


def test_missing_peer_gives_an_error_not_a_hang():
    res = run_ranks(dist_cases.peer_goes_missing, 2, timeout_s=120,
                    env={"CHARM_COMM_TIMEOUT_S": "3"})
    name, seconds = res[0]
    assert name != "no error"
    assert seconds < 15


def test_auto_picks_one_algorithm_everywhere_and_is_correct():
    res = run_ranks(dist_cases.run_auto, 4, "2x2")
    assert len({c for c, _ in res}) == 1 and res[0][0] in registry.names()
    assert all(err < 1e-5 for _, err in res)


@pytest.mark.parametrize("world,topology", [(4, "2x2"), (6, "3x2")])
def test_joint_pass_order_against_float64_reference(world, topology):
    cases = [("charm", topology, causal, dtype, hkv)
             for causal in (True, False) for dtype in ("fp32", "bf16") for hkv in (8, 1)]
    per_rank = run_ranks(dist_cases.run_matrix, world, cases, timeout_s=600,
                         env={"CHARM_PASS_ORDER": "joint"})
    for case in cases:
        for res in per_rank:
            assert max(res[case].values()) < TOL[case[3]], (case, res[case])


def _check_split_references(world, topology, cases, flag, env, is_split_tile):
    """The float64 reference matrix for ``cases`` with one split forced on (``env``), after
    asserting that every case's forward and backward plans really split (``flag`` to
    build_plan; ``is_split_tile(spec, causal)`` recognises a sub-tile of that split)."""
    from charm_megatron.plan.core import Tile, TileBwd
    from charm_megatron.plan.registry import build_plan
    from charm_megatron.plan.roles import RoleShape
    from charm_megatron.topology import Topology

    groups = [list(g) for g in Topology.parse(topology, cp_size=world).groups]
    for _, _, causal, dtype, hkv, roles in cases:  # the plans these cases run do split
        for d in ("forward", "backward"):
            plan = build_plan("charm", d, groups, causal, roles=roles,
                              shape=RoleShape(8, hkv, 16, 4 if dtype == "fp32" else 2),
                              **{flag: True})
            assert any(type(op) in (Tile, TileBwd) and is_split_tile(op.spec, causal)
                       for ops in plan.ops for op in ops), (causal, hkv, roles, d)
    per_rank = run_ranks(dist_cases.run_matrix, world, cases, timeout_s=600, env=env)
    for case in cases:
        for res in per_rank:
            assert max(res[case].values()) < TOL[case[3]], (case, res[case])


# Split visiting kv (CHARM_SPLIT_VISITING=on, docs/algorithm.md): the pass-kv cross phases of
# the byte rule (8 query heads, 2 or 1 kv heads) and forced pass-kv with MHA, on 2x2 and 2x4,
# causal (the earlier group splits) and full (both groups split), forward and backward.
@pytest.mark.parametrize("world,topology", [(4, "2x2"), (8, "2x4")])
def test_split_visiting_against_float64_reference(world, topology):
    from charm_megatron.plan.core import Half

    cases = [("charm", topology, causal, dtype, hkv, "bytes")
             for causal in (True, False) for dtype in ("fp32", "bf16") for hkv in (2, 1)]
    cases += [("charm", topology, causal, "fp32", 8, "kv") for causal in (True, False)]
    _check_split_references(
        world, topology, cases, "split_visiting", {"CHARM_SPLIT_VISITING": "on"},
        lambda spec, causal: spec.kv_half is not Half.FULL
        and (spec.q_half is Half.SECOND or not causal))


# Split counterpart q (CHARM_SPLIT_COUNTERPART_Q=on, docs/algorithm.md): the paper's pass-q
# cross phases with multi-head attention (at this head size the byte rule takes pass-kv), and
# forced pass-q with GQA, on 2x2 and 2x4, causal (the earlier group splits) and full (both
# groups split), forward and backward.
@pytest.mark.parametrize("world,topology", [(4, "2x2"), (8, "2x4")])
def test_split_counterpart_q_against_float64_reference(world, topology):
    from charm_megatron.plan.core import Half

    cases = [("charm", topology, causal, dtype, 8, "paper")
             for causal in (True, False) for dtype in ("fp32", "bf16")]
    cases += [("charm", topology, causal, "fp32", 2, "q") for causal in (True, False)]
    _check_split_references(
        world, topology, cases, "split_counterpart_q", {"CHARM_SPLIT_COUNTERPART_Q": "on"},
        lambda spec, causal: spec.q_half is not Half.FULL
        and (spec.kv_half is Half.FIRST or not causal))


# split_counterpart_q="home": the halves with every pass-q partial going home on the home
# streams (docs/algorithm.md); 2x2 (the plans: tests/test_plan.py), MHA under the paper's
# roles and GQA under forced pass-q, causal and full, forward and backward.
def test_split_counterpart_q_home_against_float64_reference():
    cases = [("charm", "2x2", causal, "fp32", 8, "paper") for causal in (True, False)]
    cases += [("charm", "2x2", True, "bf16", 8, "paper"), ("charm", "2x2", True, "fp32", 2, "q")]
    per_rank = run_ranks(dist_cases.run_matrix, 4, cases, timeout_s=600,
                         env={"CHARM_SPLIT_COUNTERPART_Q": "home"})
    for case in cases:
        for res in per_rank:
            assert max(res[case].values()) < TOL[case[3]], (case, res[case])


PARTIALS_CASES = [("ring", None, True), ("ring", None, False), ("rmplus", None, True),
                  ("charm", "2x2", True), ("allgather", None, True), ("a2a", None, True),
                  ("a2a+p2p", "2x2", True)]


def test_fp32_partials_are_correct_and_travel_in_fp32():
    """``CPOptions(partials="fp32")``: bf16 results within tolerance of float64 (and no worse
    than with bf16 partials); bf16 messages carry only inputs then, every partial goes in fp32
    (every partial byte that left bf16 comes back in fp32, twice as large)."""
    res = run_ranks(dist_cases.run_partials, 4, PARTIALS_CASES, timeout_s=600)
    for rank, per_case in enumerate(res):
        for algo, topo, causal in PARTIALS_CASES:
            narrow, n_sent = per_case[(algo, topo, causal, "input")]
            wide, w_sent = per_case[(algo, topo, causal, "fp32")]
            for name, err in wide.items():
                assert err < TOL["bf16"], (rank, algo, causal, name, err)
                assert err <= 1.5 * narrow[name] + 1e-3, (rank, algo, name, err, narrow[name])
            # Every partial byte that left bf16 arrives in fp32 twice as large; nothing else
            # changes dtype.
            moved = n_sent.get("bfloat16", 0) - w_sent.get("bfloat16", 0)
            grew = w_sent.get("float32", 0) - n_sent.get("float32", 0)
            assert grew == 2 * moved, (rank, algo, n_sent, w_sent)
            if algo in ("ring", "rmplus", "charm", "a2a+p2p"):  # partials cross ranks there
                assert moved > 0, (rank, algo, n_sent, w_sent)
