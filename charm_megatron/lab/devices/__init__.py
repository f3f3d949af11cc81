"""Recipes of the built-in device profiles: one short module per device, saying where each of
its numbers comes from (the paper's tables through :mod:`charm_megatron.lab.calibration.refit`'s
fits, a measurement in ``devices/measurements/``, the docs' bench runs).

A recipe is a function ``(built, inputs) -> Profile``: ``built`` holds the profiles the earlier
recipes made (by name: ``h20`` uses ``h100``'s fitted NIC fraction, ``h20-table4`` fits on
``l20-pcie`` and ``h20``, ...), ``inputs`` what the run was given (:class:`Inputs`).
``python -m charm_megatron.lab.calibration.refit`` runs :data:`RECIPES` in order and writes each
profile to ``charm_megatron/devices/data/<name>.json`` (``--check``: compares instead).

A device needs no recipe: a profile file in ``devices/data/`` (or in a directory on
``CHARM_DEVICES``) is a device. A recipe is how a shipped file stays reproducible.
"""

from __future__ import annotations

from collections.abc import Callable

from charm_megatron.lab.devices import (
    cpu_testbed,
    h20,
    h20_table4,
    h100,
    h100_paper,
    h100_paper_appendix,
    h100_paper_measured,
    h200,
    l20_pcie,
)
from charm_megatron.lab.devices.inputs import Inputs
from charm_megatron.model.cluster import Profile

Recipe = Callable[[dict[str, Profile], Inputs], Profile]

#: The recipes in dependency order (a recipe reads only profiles made before it).
RECIPES: tuple[Recipe, ...] = (
    h100.recipe,
    h20.recipe,
    l20_pcie.recipe,
    h20_table4.recipe,
    h100_paper.recipe,
    h200.recipe,
    h100_paper_measured.recipe,
    h100_paper_appendix.recipe,
    cpu_testbed.recipe,
)


def build_all(inputs: Inputs) -> dict[str, Profile]:
    """Every recipe's profile, by name, in :data:`RECIPES` order."""
    built: dict[str, Profile] = {}
    for recipe in RECIPES:
        prof = recipe(built, inputs)
        built[prof.name] = prof
    return built


__all__ = ["RECIPES", "Inputs", "Recipe", "build_all"]
