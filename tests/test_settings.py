"""Algorithms own their settings (issue 26): the declarations, one call's resolved values, and
what the registry does with them (an entry's own values, CHARM+'s variant rule and timer)."""

from __future__ import annotations

import enum
from dataclasses import dataclass

import pytest

from charm_megatron.algorithms.charm.entry import SPLIT_VISITING, CharmVariant
from charm_megatron.algorithms.ring import ring_rank
from charm_megatron.plan import registry
from charm_megatron.plan.core import Plan
from charm_megatron.plan.roles import RoleChoice
from charm_megatron.plan.settings import Setting, Values
from charm_megatron.plan.vocab import PassOrder, RoleMix, SplitMode

GROUPS_2X4 = ((0, 1, 2, 3), (4, 5, 6, 7))


class Flavour(str, enum.Enum):
    PLAIN = "plain"
    SPICY = "spicy"


def test_a_setting_parses_members_values_and_switch_bools():
    s = SPLIT_VISITING
    assert s.parse("on") is SplitMode.ON and s.parse(SplitMode.AUTO) is SplitMode.AUTO
    assert s.parse(True) is SplitMode.ON and s.parse(False) is SplitMode.OFF
    assert s.flag == "--split-visiting" and s.switch
    assert s.choices == ("auto", "off", "on", "home", "quarters")
    with pytest.raises(ValueError, match=r"^cp_attention: split_visiting='yes' "
                                         r"\(CHARM_SPLIT_VISITING\); choose one of auto, off, on, "
                                         r"home, quarters$"):
        s.parse("yes", "cp_attention")
    with pytest.raises(ValueError, match=r"pass_order=True \(CHARM_PASS_ORDER\); choose one "
                                         "of split, joint"):
        registry.all_settings()["pass_order"].parse(True)  # no on / off members: no bools


def test_settings_values_are_every_setting_resolved_and_hashable():
    v = registry.settings_values(roles="kv", split_visiting=True)
    assert v["roles"] is RoleMix.KV and v["split_visiting"] is SplitMode.ON
    assert v["pass_order"] is PassOrder.SPLIT and v.get("split_counterpart_q") is SplitMode.AUTO
    assert list(v) == sorted(registry.all_settings())
    same = registry.settings_values(split_visiting="on", roles=RoleMix.KV)
    assert v == same and hash(v) == hash(same) and v.as_dict() == dict(same)
    assert v.only(["roles"]) == Values((("roles", RoleMix.KV),))
    with pytest.raises(ValueError, match="unknown setting bogus; the registered settings are "
                                         "pass_order, roles, split_visiting, split_counterpart_q"):
        registry.settings_values(bogus=1)


def test_register_keeps_one_meaning_per_setting_name():
    ring = registry.get("ring").build_rank
    clash = Setting("roles", Flavour, Flavour.PLAIN, "a different roles")
    with pytest.raises(ValueError, match="setting 'roles' differs"):
        registry.register(registry.Algorithm("clash", ring, False, "x", settings=(clash,)))
    with pytest.raises(ValueError, match="'shape' is reserved"):
        registry.register(registry.Algorithm("clash", ring, False, "x",
                                             settings=(Setting("shape", Flavour, Flavour.PLAIN,
                                                               "x"),)))
    assert "clash" not in registry.names()
    # Sharing the declaration itself is how rmplus and charm share theirs.
    # (charm adds head_parallel: RM+ over one flat group runs no head all-to-all of its own)
    assert registry.get("charm").settings[:-1] == registry.get("rmplus").settings


def test_an_entry_without_a_variant_rule_gets_its_own_values():
    seen = []

    def builder(rank, groups, causal, direction, variant):
        seen.append(variant)
        return ring_rank(rank, groups, causal, direction)

    knob = Setting("flavour", Flavour, Flavour.PLAIN, "a test's own setting")
    registry.register(registry.Algorithm("knobbed", builder, False, "test", settings=(knob,)))
    try:
        assert "flavour" in registry.all_settings()
        plan = registry.build_plan("knobbed", "forward", [[0, 1]], True, flavour="spicy",
                                   roles="kv")
        assert plan.ops == registry.build_plan("ring", "forward", [[0, 1]], True).ops
        assert seen == [Values((("flavour", Flavour.SPICY),))] * 2  # one per rank
        assert registry.variants("knobbed", [[0, 1]], True) == (Values((("flavour",
                                                                         Flavour.PLAIN),)),) * 2
    finally:
        registry.unregister("knobbed")
    assert "flavour" not in registry.all_settings()


@dataclass(frozen=True)
class OpsTimer:
    """A stand-in clock: ``base ** ops``, so base < 1 favours plans with more ops (a split
    adds messages and merges) and base > 1 plans with fewer."""

    base: float

    def seconds(self, plan: Plan) -> float:
        return self.base ** sum(len(ops) for ops in plan.ops)


def test_auto_split_is_the_timers_pick_and_off_without_one():
    kw = {"roles": "kv", "split_visiting": "auto", "split_diagonal": "off"}
    whole = CharmVariant(roles=RoleChoice(RoleMix.KV))
    # The clock that favours more ops favours the most pieces: quarters (their returns on
    # the home stream, which adds no op).
    split = CharmVariant(roles=RoleChoice(RoleMix.KV), split_visiting=True, visiting_pieces=4,
                         home_stream=True)
    assert registry.variants("charm", GROUPS_2X4, True, **kw) == (whole, whole)
    assert registry.variants("charm", GROUPS_2X4, True, timer=OpsTimer(2.0), **kw) == \
        (whole, whole)
    assert registry.variants("charm", GROUPS_2X4, True, timer=OpsTimer(0.5), **kw) == \
        (split, split)
    fwd, _ = registry.plans("charm", GROUPS_2X4, True, timer=OpsTimer(0.5), **kw)
    assert fwd.ops == registry.build_plan("charm", "forward", GROUPS_2X4, True, roles="kv",
                                          split_visiting="quarters").ops
    # One group has no cross round to split, whatever the mode.
    assert registry.variants("rmplus", GROUPS_2X4, True, roles="kv", split_visiting="on") == \
        (whole, whole)


def test_plans_are_memoised_and_settings_override_values():
    values = registry.settings_values(pass_order="joint")
    a = registry.plans("charm", GROUPS_2X4, True, values=values)
    assert registry.plans("charm", GROUPS_2X4, True, values=values) is a
    assert registry.plans("charm", GROUPS_2X4, True, pass_order="joint") is a
    assert registry.plans("charm", GROUPS_2X4, True, values=values, pass_order="split") == \
        registry.plans("charm", GROUPS_2X4, True)
