"""The algorithm registry: every list derives from it, and the "Adding an algorithm" recipe of
docs/design.md (one builder + one registry entry) is enough for a new algorithm to be listed,
validated, modelled and run for real on gloo ranks."""

from __future__ import annotations

import argparse

import pytest

import toy_algorithm
from charm_megatron.cli import main as cli_main
from charm_megatron.commands import plan as plan_cli
from charm_megatron.lab.bench import config as bench_config
from charm_megatron.launch import args_cli, compare
from charm_megatron.local_ranks import run_ranks
from charm_megatron.megatron import args as megatron_args
from charm_megatron.model import choose_algo, predict
from charm_megatron.model.cluster import default_cluster_for
from charm_megatron.ops import attention
from charm_megatron.ops.options import CPOptions
from charm_megatron.plan import registry
from charm_megatron.plan.cost import Problem
from charm_megatron.plan.validate import validate

BUILT_IN = ("ring", "rmplus", "charm", "allgather", "a2a", "a2a+p2p")
#: Served under their own --cp-comm-type in Megatron: the built-ins less the TE-named peers.
MEGATRON_OURS = ("ring", "rmplus", "charm")
TOY = toy_algorithm.NAME


@pytest.fixture
def toy():
    toy_algorithm.ensure_registered()
    try:
        yield TOY
    finally:
        registry.unregister(TOY)


def _lists() -> dict[str, tuple[str, ...]]:
    parser = argparse.ArgumentParser()
    plan_cli.register(parser)
    (algo_action,) = [a for a in parser._actions if "--algo" in a.option_strings]
    return {
        "registry.names": tuple(registry.names()),
        "cp_attention ALGOS": tuple(attention.ALGOS),
        "megatron CHARM_COMM_TYPES": tuple(megatron_args.CHARM_COMM_TYPES),
        "args CHARM_COMM_TYPES": tuple(args_cli.CHARM_COMM_TYPES),
        "args COMM_TYPES": tuple(args_cli.COMM_TYPES),
        "compare COMM_ORDER": tuple(compare.COMM_ORDER),
        "bench ALGOS": tuple(bench_config.ALGOS),
        "plan --algo": tuple(algo_action.choices),
    }


def test_built_in_lists_are_the_registry():
    lists = _lists()
    assert lists["registry.names"] == BUILT_IN
    assert lists["cp_attention ALGOS"] == (*BUILT_IN, "auto")
    for name in ("megatron CHARM_COMM_TYPES", "args CHARM_COMM_TYPES"):
        assert lists[name] == (*MEGATRON_OURS, "auto"), name
    assert lists["args COMM_TYPES"] == ("p2p", "a2a", "allgather", *MEGATRON_OURS, "auto")
    assert lists["compare COMM_ORDER"] == lists["args COMM_TYPES"]
    assert lists["bench ALGOS"] == (*BUILT_IN, "torch")
    assert lists["plan --algo"] == BUILT_IN
    assert registry.uses_topology("charm") and registry.uses_topology("auto")
    assert not registry.uses_topology("ring") and not registry.uses_topology("rmplus")
    assert not registry.uses_topology("allgather") and not registry.uses_topology("a2a")
    assert registry.uses_topology("a2a+p2p")  # its all-to-all groups are the topology's


def test_auto_is_accepted_by_the_args_cli(capsys):
    """docs/megatron.md lists --cp-comm-type auto; the args CLI (and so launch.sh) takes it."""
    assert cli_main(["args", "gpt-tiny-cpu", "--run", "demo-s512-gb1", "--cp-comm-type", "auto",
                     "--format", "lines"]) == 0
    argv = capsys.readouterr().out.splitlines()
    i = argv.index("--cp-comm-type")
    assert argv[i + 1] == "auto" and "--charm-topology" in argv


def test_registry_rejects_bad_entries():
    entry = registry.get("ring")
    with pytest.raises(ValueError, match="already registered"):
        registry.register(entry)
    with pytest.raises(ValueError, match="reserved"):
        registry.register(registry.Algorithm("auto", entry.build_rank, False, "x"))
    with pytest.raises(ValueError, match="unknown algo 'nope'; choose one of ring, rmplus, charm"):
        registry.build_plan("nope", "forward", [[0, 1]], True)
    with pytest.raises(ValueError, match="resolved to one of them by the performance model"):
        registry.get("auto")


def test_a_registered_algorithm_is_listed_everywhere(toy, capsys):
    lists = _lists()
    for name, names in lists.items():
        assert TOY in names, f"{TOY} missing from {name}: {names}"
    assert CPOptions().topology_for(TOY, "2x2") is None  # uses_topology=False: flat
    assert megatron_args.charm_comm_types([TOY]) == (TOY,)  # --cp-comm-type toygather: CHARM+
    assert cli_main(["args", "--list-comm-types"]) == 0
    assert TOY in capsys.readouterr().out.split()
    assert TOY in registry.describe_choices()
    # a plan CLI printout of the toy's schedule, and its row in the cost table
    assert cli_main(["plan", "--cp", "4", "--algo", TOY, "--rank", "1", "--causal"]) == 0
    out = capsys.readouterr().out
    assert "recv kv[0].all<-0 into toy.kv" in out and f"\n{TOY:8} forward" in out


@pytest.mark.parametrize("n", [1, 2, 3, 4, 6])
@pytest.mark.parametrize("causal", [True, False])
def test_a_registered_algorithm_is_validated(toy, n, causal):
    for direction in ("forward", "backward"):
        plan = registry.build_plan(toy, direction, [list(range(n))], causal)
        assert plan.groups == (tuple(range(n)),)
        stats = validate(plan)
        assert stats.tiles == [n] * n
        # every message carries own data or one tile's partial: chains of 1 (2 in backward)
        hops = 2 if direction == "backward" else 1
        assert stats.critical_path == (hops if n > 1 else 0)
        assert stats.messages == [hops * (n - 1)] * n


def test_a_broken_registered_builder_is_rejected(toy):
    """The validator really checks a registered builder: drop the last tile -> PlanError."""
    from charm_megatron.plan.validate import PlanError

    plan = registry.build_plan(toy, "forward", [[0, 1, 2]], True)
    plan.ops[2] = plan.ops[2][:-1]
    with pytest.raises(PlanError):
        validate(plan)


def test_a_registered_algorithm_is_modelled(toy):
    groups = [[0, 1], [2, 3]]
    problem = Problem(1, 4096, 8, 8, 64, 2)
    cluster = default_cluster_for(groups)
    assert predict(toy, groups, problem, cluster, True).total_s > 0
    # auto chooses among registry entries: the toy (no overlap) never beats ring
    assert choose_algo(groups, problem, cluster, causal=True) != TOY


@pytest.mark.parametrize("causal", [True, False])
def test_a_registered_algorithm_runs_against_float64(causal):
    """4 gloo ranks that register the toy themselves; out, lse, dq, dk, dv vs float64."""
    per_rank = run_ranks(toy_algorithm.run_attention_registered, 4, TOY, None, causal, "fp32",
                         32, 2, 4, 2, 16, timeout_s=300)
    for rank, errs in enumerate(per_rank):
        for name, err in errs.items():
            assert err < 1e-5, f"rank {rank}: {name} rel err {err:.3g}"
