"""Topology value, string syntax, pure grouping logic and resolution (no processes)."""

from __future__ import annotations

import dataclasses
import math
import random

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from charm_megatron.topology import (
    ENV_VAR,
    RankFacts,
    Topology,
    group_facts,
    resolve_topology,
)
from charm_megatron.topology.cli import _first_host, check_measurement, launcher_env
from charm_megatron.topology.probing import cpu_numa_node

# --------------------------------------------------------------------------- Topology value


def test_gxm_and_properties():
    t = Topology.parse("2x4")
    assert t.groups == ((0, 1, 2, 3), (4, 5, 6, 7))
    assert (t.size, t.num_groups, t.group_size) == (8, 2, 4)
    assert t.group_of(5) == 1 and t.local_index(5) == 1 and t.rank_at(1, 1) == 5
    assert t.counterparts(1) == (5,) and t.counterparts(6) == (2,)
    assert str(t) == "2x4" and repr(t) == "Topology('2x4')"
    assert not t.is_flat and t.is_contiguous


def test_counterparts_in_group_order():
    t = Topology.parse("4x2")
    assert t.counterparts(3) == (1, 5, 7)
    assert t.counterparts(0) == (2, 4, 6)


def test_flat_prints_as_1xn_and_round_trips():
    t = Topology.flat(8)
    assert str(t) == "1x8" and t.is_flat and t.counterparts(3) == ()
    assert Topology.parse("1x8") == t == Topology.parse("flat", cp_size=8) == Topology.parse("0-7")
    assert Topology.parse("flat", cp_size=1).size == 1


@pytest.mark.parametrize(
    "text, groups",
    [
        ("0-3,4-7", [[0, 1, 2, 3], [4, 5, 6, 7]]),
        ("0,2,4,6/1,3,5,7", [[0, 2, 4, 6], [1, 3, 5, 7]]),
        ("0,2,4,6;1,3,5,7", [[0, 2, 4, 6], [1, 3, 5, 7]]),
        (" 0-1, 4-5 / 2-3 ,6-7 ", [[0, 1, 4, 5], [2, 3, 6, 7]]),
        ("4-7,0-3", [[0, 1, 2, 3], [4, 5, 6, 7]]),
        ("0/1/2/3", [[0], [1], [2], [3]]),
        ("0-1,2,3-4", None),  # a single rank may be a whole group next to ranges... if sizes match
        ("2X2", [[0, 1], [2, 3]]),
        ("2×2", [[0, 1], [2, 3]]),
    ],
)
def test_parse_forms(text, groups):
    if groups is None:
        with pytest.raises(ValueError, match="same size"):
            Topology.parse(text)
        return
    assert Topology.parse(text) == Topology.from_groups(groups)


def test_explicit_form_printed_for_non_contiguous():
    t = Topology.from_groups([[1, 3, 5, 7], [6, 4, 2, 0]])
    assert t.groups == ((0, 2, 4, 6), (1, 3, 5, 7))  # normalised
    assert str(t) == "0,2,4,6/1,3,5,7"
    assert Topology.from_groups([[0, 1, 4, 5], [2, 3, 6, 7]]).__str__() == "0-1,4-5/2-3,6-7"


def test_immutable_and_hashable():
    t = Topology.parse("2x2")
    with pytest.raises(dataclasses.FrozenInstanceError):
        t.groups = ((0, 1, 2, 3),)  # type: ignore[misc]
    assert {t: 1}[Topology.parse("0-1,2-3")] == 1
    assert len({t, Topology.from_groups([[2, 3], [1, 0]]), Topology.flat(4)}) == 2


@pytest.mark.parametrize(
    "text, needle",
    [
        ("0-3,4-6", "same size"),
        ("0,1/1,2", "exactly one group"),
        ("0-1/0-1", "rank 0 appears"),
        ("0-3,5-8", "missing 4"),
        ("1-4,5-8", "missing 0"),
        ("0-3/4-7/", "empty group"),
        ("a-b", "cannot read"),
        ("0,2,4,6,1,3,5,7", "ambiguous"),
        ("0,1,2,3", "'4x1' if you mean that"),
        ("3-1,4-6", "runs backwards"),
        ("2x0", ">= 1"),
        ("", "empty topology"),
        ("flat", "needs the CP size"),
        ("node", "probe level"),
        ("auto", "probe level"),
    ],
)
def test_parse_errors_name_the_problem(text, needle):
    with pytest.raises(ValueError, match=needle):
        Topology.parse(text)


def test_from_groups_errors():
    with pytest.raises(ValueError, match="same size"):
        Topology.from_groups([[0, 1, 2], [3, 4, 5, 6, 7]])
    with pytest.raises(ValueError, match="not global ranks"):
        Topology.from_groups([[4, 5], [6, 7]])
    with pytest.raises(ValueError, match="at least one group"):
        Topology.from_groups([])
    with pytest.raises(ValueError, match="must not be empty"):
        Topology.from_groups([[], []])
    with pytest.raises(ValueError, match="n >= 1"):
        Topology.flat(0)


def test_check_size_message():
    t = Topology.parse("2x4")
    t.check_size(8)
    with pytest.raises(ValueError) as info:
        t.check_size(6)
    msg = str(info.value)
    assert "topology 2x4 has 8 ranks but the CP group has 6" in msg
    assert "CHARM_TOPOLOGY" in msg and "--charm-topology" in msg and "2x3" in msg
    with pytest.raises(ValueError, match="CP group has 6"):
        Topology.parse("2x4", cp_size=6)


def test_rank_lookup_errors():
    t = Topology.parse("2x2")
    for bad in (-1, 4, 1.0, True):
        with pytest.raises(ValueError, match="not a CP-local rank"):
            t.group_of(bad)


@st.composite
def topologies(draw):
    g = draw(st.integers(1, 6))
    m = draw(st.integers(1, 6))
    perm = draw(st.permutations(list(range(g * m))))
    return [perm[i * m:(i + 1) * m] for i in range(g)]


@settings(max_examples=200, deadline=None)
@given(topologies())
def test_round_trip_and_invariants(groups):
    t = Topology.from_groups(groups)
    again = Topology.parse(str(t))
    assert again == t and hash(again) == hash(t) and str(again) == str(t)
    assert t.size == sum(len(g) for g in groups)
    assert t.num_groups * t.group_size == t.size
    for r in range(t.size):
        g, li = t.group_of(r), t.local_index(r)
        assert t.rank_at(g, li) == r
        assert set(groups[[r in grp for grp in groups].index(True)]) == set(t.groups[g])
        cps = t.counterparts(r)
        assert len(cps) == t.num_groups - 1
        assert all(t.local_index(c) == li for c in cps)
        assert [t.group_of(c) for c in cps] == sorted(t.group_of(c) for c in cps)


@settings(max_examples=100, deadline=None)
@given(st.lists(st.lists(st.integers(-2, 12), max_size=5), max_size=4))
def test_invalid_groups_raise_value_error_only(groups):
    try:
        t = Topology.from_groups(groups)
    except ValueError:
        return
    assert sorted(r for g in t.groups for r in g) == list(range(t.size))


# --------------------------------------------------------------------------- grouping logic


def facts(hosts, numas=None, launcher=None):
    numas = numas or [0] * len(hosts)
    return [RankFacts(rank=i, host=h, numa=numas[i], global_rank=i,
                      launcher=tuple((launcher or {}).get(i, {}).items()))
            for i, h in enumerate(hosts)]


def test_two_hosts_contiguous():
    r = group_facts(facts(["a"] * 4 + ["b"] * 4))
    assert r.topology == Topology.parse("2x4") and r.level == "node" and r.warning is None
    assert "2 nodes" in r.reason


def test_strided_hosts():
    r = group_facts(facts(["a", "b"] * 4))
    assert r.topology.groups == ((0, 2, 4, 6), (1, 3, 5, 7))


def test_numa_on_one_host():
    r = group_facts(facts(["a"] * 8, [0, 0, 0, 0, 1, 1, 1, 1]))
    assert r.level == "numa" and str(r.topology) == "2x4"
    # Explicit level node on one host: one group.
    assert group_facts(facts(["a"] * 8, [0] * 4 + [1] * 4), "node").topology.is_flat


def test_auto_prefers_nodes_over_numa():
    hosts = ["a"] * 4 + ["b"] * 4
    r = group_facts(facts(hosts, [0, 0, 1, 1] * 2))
    assert r.level == "node" and str(r.topology) == "2x4"
    r = group_facts(facts(hosts, [0, 0, 1, 1] * 2), "numa")
    assert r.level == "numa" and str(r.topology) == "4x2"


def test_one_host_one_numa_and_one_rank():
    r = group_facts(facts(["a"] * 4))
    assert r.level == "flat" and r.topology == Topology.flat(4) and r.warning is None
    r = group_facts(facts(["a"]))
    assert r.topology == Topology.flat(1) and "one rank" in r.reason


def test_flat_level_ignores_hosts():
    r = group_facts(facts(["a", "b"] * 2), "flat")
    assert r.topology.is_flat and r.level == "flat"


def test_unequal_without_equal_split_is_flat_with_warning():
    r = group_facts(facts(["a"] * 3 + ["b"] * 5))
    assert r.topology == Topology.flat(8) and r.level == "flat"
    assert r.warning and "different numbers of ranks" in r.warning and "CHARM_TOPOLOGY" in r.warning


def test_unequal_with_equal_split():
    r = group_facts(facts(["a"] * 4 + ["b"] * 2))
    assert r.topology.groups == ((0, 1), (2, 3), (4, 5))
    assert r.warning and "3 groups of 2" in r.warning


def test_unknown_numa_falls_back():
    r = group_facts(facts(["a"] * 4, [-1, 0, 1, 1]))
    assert r.topology.is_flat and "unknown" in r.reason and r.warning is None
    r = group_facts(facts(["a"] * 4, [-1, 0, 1, 1]), "numa")
    assert r.topology.is_flat and r.level == "node" and "NUMA node unknown" in r.warning


def test_launcher_node_id_separates_identical_host_names():
    hints = {i: {"SLURM_NODEID": str(i // 2)} for i in range(4)}
    r = group_facts(facts(["localhost"] * 4, launcher=hints))
    assert str(r.topology) == "2x2" and r.level == "node"


def test_group_facts_input_errors():
    with pytest.raises(ValueError, match="level"):
        group_facts(facts(["a"]), "rack")
    with pytest.raises(ValueError, match="ranks 0..n-1"):
        group_facts([RankFacts(rank=1, host="a")])


@settings(max_examples=200, deadline=None)
@given(st.lists(st.sampled_from("abc"), min_size=1, max_size=12), st.randoms())
def test_grouping_never_mixes_hosts_unless_flat(hosts, rnd: random.Random):
    r = group_facts(facts(hosts))
    t = r.topology
    assert t.size == len(hosts)
    sizes = [hosts.count(h) for h in dict.fromkeys(hosts)]
    if len(sizes) > 1 and not t.is_flat:
        for grp in t.groups:
            assert len({hosts[i] for i in grp}) == 1  # never a slow link inside a group
    if len(set(sizes)) == 1:
        assert r.warning is None and t.num_groups == len(sizes)
    else:
        assert r.warning is not None
        assert t.is_flat == (math.gcd(*sizes) < 2)


def test_cpu_numa_node_from_fake_sysfs(tmp_path):
    for node, cpus in (("node0", "0-3"), ("node1", "4-7,12")):
        (tmp_path / node).mkdir()
        (tmp_path / node / "cpulist").write_text(cpus + "\n")
    (tmp_path / "possible").write_text("0-1\n")
    assert cpu_numa_node({1, 2}, str(tmp_path)) == 0
    assert cpu_numa_node({5, 12}, str(tmp_path)) == 1
    assert cpu_numa_node({3, 4}, str(tmp_path)) == -1  # not pinned to one node
    assert cpu_numa_node({1}, str(tmp_path / "missing")) == -1
    assert cpu_numa_node() >= -1  # this machine


# --------------------------------------------------------------------------- resolution


def _resolve(topology, algo: str, cp: int, env: dict | None = None):
    """What a cp_attention call resolves: the options' rule (argument, CHARM_TOPOLOGY, probe;
    flat for algorithms that do not use the topology), then the topology layer."""
    from charm_megatron.ops.options import CPOptions

    spec = CPOptions.from_env(env or {}).topology_for(algo, topology)
    return Topology.flat(cp) if spec is None else resolve_topology(spec[0], None, cp,
                                                                   source=spec[1])


def test_resolve_precedence():
    env = {ENV_VAR: "4x2"}
    assert _resolve("2x4", "charm", 8, env) == Topology.parse("2x4")  # argument wins
    assert _resolve(Topology.parse("0,2,4,6/1,3,5,7"), "charm", 8, env).groups[0] == (0, 2, 4, 6)
    assert _resolve(None, "charm", 8, env) == Topology.parse("4x2")  # env next
    assert _resolve(None, "ring", 8, env).is_flat  # ring / rmplus: flat
    assert _resolve("2x4", "rmplus", 8, env).is_flat
    assert _resolve(None, "charm", 8, {ENV_VAR: "flat"}) == Topology.flat(8)
    assert resolve_topology("flat", None, 3) == Topology.flat(3)


def test_resolve_errors():
    with pytest.raises(ValueError, match="CHARM_TOPOLOGY='2x4'.*has 8 ranks but the CP group has 6"):
        _resolve(None, "charm", 6, {ENV_VAR: "2x4"})
    with pytest.raises(ValueError, match="topology='3x3'"):
        resolve_topology("3x3", None, 8)
    with pytest.raises(ValueError, match="cannot read"):
        resolve_topology("two-by-four", None, 8)
    with pytest.raises(ValueError, match="cp_size"):
        resolve_topology("auto", None, 0)
    # Probing without torch.distributed: fine for one rank, an error otherwise.
    assert _resolve(None, "charm", 1) == Topology.flat(1)
    with pytest.raises(ValueError, match="initialised"):
        resolve_topology("node", None, 4)


# --------------------------------------------------------------------------- CLI helpers


def test_launcher_env_from_slurm():
    assert launcher_env({"RANK": "0", "WORLD_SIZE": "2", "SLURM_PROCID": "1"}) == {}
    assert launcher_env({}) == {}
    env = launcher_env({"SLURM_PROCID": "5", "SLURM_NTASKS": "8", "SLURM_LOCALID": "1",
                        "SLURM_JOB_NODELIST": "gpu[003-004,9]", "SLURM_JOB_ID": "12345"})
    assert env == {"RANK": "5", "WORLD_SIZE": "8", "LOCAL_RANK": "1", "MASTER_ADDR": "gpu003",
                   "MASTER_PORT": "29845"}
    env = launcher_env({"SLURM_PROCID": "0", "SLURM_NTASKS": "1", "MASTER_ADDR": "x",
                        "MASTER_PORT": "1"})
    assert env == {"RANK": "0", "WORLD_SIZE": "1"}
    assert _first_host("a1,b2") == "a1" and _first_host("n[1,3-5]") == "n1"


def test_check_measurement_flags_contradictions():
    t = Topology.parse("2x2")
    fast, slow = 2e9, 5e7
    good = {(i, j): (fast if t.group_of(i) == t.group_of(j) else slow)
            for i in range(4) for j in range(4) if i != j}
    lines, warns = check_measurement(t, good)
    assert not warns and "cross/intra = 0.03" in lines[0]
    wrong = Topology.parse("0,2/1,3")
    _, warns = check_measurement(wrong, good)
    assert warns and "contradicts" in warns[0]
    _, warns = check_measurement(Topology.flat(4), good)
    assert warns and "flat" in warns[0]
    _, warns = check_measurement(Topology.flat(4), {k: fast for k in good})
    assert not warns
