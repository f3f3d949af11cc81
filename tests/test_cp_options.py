"""CPOptions: every setting of a cp_attention call in one value, read from the environment once
at the API edge and kept in the autograd context (issue 10 item 5)."""

import dist_failure_cases as cases
import pytest

from charm_megatron.local_ranks import run_ranks
from charm_megatron.ops import executor
from charm_megatron.ops.options import ENV_VARS, CPOptions


def test_from_env_reads_every_listed_variable():
    env = {"CHARM_PASS_ORDER": "joint", "CHARM_COMM_TIMEOUT_S": "7.5",
           "CHARM_ATTN_BACKEND": "reference", "CHARM_TOPOLOGY": "2x4", "CHARM_CHECK": "off",
           "CHARM_MODEL_PROFILE": "h100", "CHARM_SPLIT_VISITING": "on",
           "CHARM_SPLIT_COUNTERPART_Q": "off", "CHARM_AUTO_ALGOS": "ring, charm,a2a+p2p",
           "CHARM_PARTIALS": "fp32", "CHARM_AUTO_TUNE": "1.25",
           "CHARM_AUTO_TUNE_FILE": "runs/picks.json", "CHARM_TRANSPORT": "torch",
           "CHARM_HEAD_PARALLEL": "4", "CHARM_SUPER_TILES": "on", "CHARM_SPLIT_DIAGONAL": "on"}
    assert set(env) == set(ENV_VARS)
    o = CPOptions.from_env(env)
    assert (o.pass_order, o.timeout_s, o.backend, o.topology, o.check, o.model_profile,
            o.split_visiting, o.split_counterpart_q) == ("joint", 7.5, "reference", "2x4", "off",
                                                         "h100", "on", "off")
    assert o.auto_algos == ("ring", "charm", "a2a+p2p")
    assert o.head_parallel == "4" and CPOptions().head_parallel == "auto"
    assert o.super_tiles == "on" and CPOptions().super_tiles == "off"
    assert o.split_diagonal == "on" and CPOptions().split_diagonal == "auto"
    assert o.partials == "fp32" and o.wide_partials and not CPOptions().wide_partials
    assert o.auto_tune == 1.25 and CPOptions().auto_tune is None
    assert o.auto_tune_file == "runs/picks.json" and CPOptions().auto_tune_file is None
    assert o.transport == "torch" and CPOptions().transport is None
    assert o.transport_name == CPOptions().transport_name == "torch"
    assert CPOptions.from_env({}) == CPOptions()
    assert CPOptions.from_env(env, pass_order="split").pass_order == "split"


@pytest.mark.parametrize("env,match", [
    ({"CHARM_PASS_ORDER": "sideways"}, "CHARM_PASS_ORDER"),
    ({"CHARM_COMM_TIMEOUT_S": "soon"}, "CHARM_COMM_TIMEOUT_S"),
    ({"CHARM_COMM_TIMEOUT_S": "-1"}, "CHARM_COMM_TIMEOUT_S"),
    ({"CHARM_CHECK": "sometimes"}, "CHARM_CHECK"),
    ({"CHARM_SPLIT_VISITING": "yes"}, "CHARM_SPLIT_VISITING"),
    ({"CHARM_SPLIT_COUNTERPART_Q": "yes"}, "CHARM_SPLIT_COUNTERPART_Q"),
    ({"CHARM_SUPER_TILES": "yes"}, "CHARM_SUPER_TILES"),
    ({"CHARM_AUTO_ALGOS": "ring,spiral"}, "CHARM_AUTO_ALGOS.*unknown 'spiral'"),
    ({"CHARM_AUTO_ALGOS": " , "}, "CHARM_AUTO_ALGOS.*empty"),
    ({"CHARM_PARTIALS": "fp16"}, "partials='fp16' \\(CHARM_PARTIALS\\); choose one of input, fp32"),
    ({"CHARM_TRANSPORT": "pigeon"}, "transport='pigeon' \\(CHARM_TRANSPORT\\) is not "
                                     "registered.*registered: torch"),
])
def test_bad_values_name_the_variable(env, match):
    with pytest.raises(ValueError, match=match):
        CPOptions.from_env(env)


def test_no_module_level_switch():
    assert not hasattr(executor, "_ENABLED")
    assert CPOptions(ablation="compute_only").comm is False
    assert CPOptions(ablation="comm_only").compute is False


def test_backward_uses_the_forwards_options():
    (order, shape, ablation), *_ = run_ranks(cases.options_in_ctx, 4, timeout_s=90)
    assert order == "joint"  # auto honours the pass order, and backward kept it
    assert shape == (16, 1, 2, 8)
    assert ablation == "compute_only"  # explicit options, kept for the backward


def test_every_variable_is_documented():
    """docs/api.md's tables of environment variables list every CPOptions variable and every
    other CHARM_* name the package's code spells out."""
    import re
    from pathlib import Path

    root = Path(__file__).resolve().parents[1]
    text = (root / "docs" / "api.md").read_text()
    for var in ENV_VARS:
        assert f"| `{var}` |" in text, var
    spelled = {m for f in (root / "charm_megatron").rglob("*.py")
               for m in re.findall(r"[\"'](CHARM_[A-Z0-9_]+)[\"']", f.read_text())}
    spelled -= {"CHARM_COMM_TYPES"}  # a Python constant (megatron.args), not a variable
    assert spelled >= set(ENV_VARS) | {"CHARM_BENCH_LINKS"}  # else the scan could not fail
    assert {v for v in spelled if f"`{v}`" not in text} == set()


def test_auto_predicts_with_the_options_profile():
    """algo="auto" picks what choose_algo predicts on options.model_profile's cluster (here
    a profile under which ring wins and the generic cluster, under which charm wins), and a
    profile one rank cannot read fails every rank before any data moves."""
    from charm_megatron.model import auto_cluster, choose_algo_cached
    from charm_megatron.plan.cost import Problem

    groups, problem = ((0, 1), (2, 3)), Problem(1, 64, 2, 2, 8, 4)
    expected = {p: choose_algo_cached(groups, problem, auto_cluster(p), causal=True,
                                      roles="paper")
                for p in (None, "l20-pcie")}
    assert expected[None] != expected["l20-pcie"]  # else the test could not fail
    res = run_ranks(cases.auto_with_profile, 4, timeout_s=120)
    for rank, (algos, bad) in enumerate(res):
        assert algos == expected
        kind, msg = bad
        assert kind in ("ValueError", "CPMismatchError", "CPAttentionError"), bad
        if rank == 1:
            assert kind == "ValueError" and "CHARM_MODEL_PROFILE" in msg, bad
