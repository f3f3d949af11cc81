"""A call visits the registry once (issue 40): ops/resolution.resolve_call asks
plan/registry.resolve for the check, groups, variants and plans together, and ``auto``'s model
pick runs inside that visit (its chooser). Counted by wrapping every public function of the
registry module and counting the calls that come from outside it."""

from __future__ import annotations

import functools
import inspect

import pytest
import torch

from charm_megatron.ops.call import CallArgs
from charm_megatron.ops.options import CPOptions
from charm_megatron.ops.prepare import build_request
from charm_megatron.ops.resolution import resolve_call
from charm_megatron.plan import registry


@pytest.fixture
def visits(monkeypatch):
    """A list that grows by the name of each registry function called from outside it."""
    seen: list[str] = []
    depth = [0]

    def wrap(name, fn):
        @functools.wraps(fn)
        def counted(*args, **kwargs):
            if depth[0] == 0:
                seen.append(name)
            depth[0] += 1
            try:
                return fn(*args, **kwargs)
            finally:
                depth[0] -= 1
        return counted

    for name, fn in vars(registry).items():
        if (not name.startswith("_") and inspect.isfunction(fn)
                and fn.__module__ in (registry.__name__, "charm_megatron.plan.entries")):
            monkeypatch.setattr(registry, name, wrap(name, fn))
    return seen


@pytest.mark.parametrize("algo", ["ring", "rmplus", "charm", "a2a+p2p", "auto"])
def test_a_call_enters_the_registry_once(visits, algo):
    q = torch.empty(256, 1, 8, 64, dtype=torch.bfloat16, device="meta")
    k = torch.empty(256, 1, 4, 64, dtype=torch.bfloat16, device="meta")
    request = build_request(q, k, k, 4, CallArgs(algo=algo, topology="2x2",
                                                 options=CPOptions(model_profile="h100")))
    visits.clear()  # building the request reads the registry's names (the algo check)
    resolved = resolve_call(request, None, 4, None)
    assert visits == ["resolve"], visits
    assert resolved.algo in registry.names()
    fwd, bwd = resolved.plans
    assert fwd.algo == bwd.algo == resolved.algo


def test_the_counter_sees_a_second_visit(visits):
    """The fixture counts each outside call (so the test above can fail)."""
    traits = registry.CallTraits(((0, 1), (2, 3)), 8, 4)
    registry.check_call("charm", traits)
    registry.resolve(registry.PlanQuery("charm", 4, traits, True,
                                        hardware=lambda: ((0, 1), (2, 3))))
    assert visits == ["check_call", "resolve"]
