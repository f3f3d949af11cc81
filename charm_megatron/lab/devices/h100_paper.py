"""``h100-paper``: the paper's implementation on H100: the per-op cost its ring shows on H20
(``h20-table4``; host-side work per kernel, taken as the software's, not the GPU's) on the
``h100`` profile. Table 5's ring is link-bound and hides it, so nothing on H100 can be fitted
to it; CHARM+ columns unused."""

from __future__ import annotations

from dataclasses import replace

from charm_megatron.lab.devices.inputs import Inputs
from charm_megatron.model.cluster import Profile


def recipe(built: dict[str, Profile], inputs: Inputs) -> Profile:
    h100, op_us = built["h100"], built["h20-table4"].cluster.op_overhead_us
    return Profile(
        "h100-paper", replace(h100.cluster, op_overhead_us=op_us), "2x8",
        f"the h100 profile with the paper's implementation's cost per compute op, {op_us:g} us, "
        "read off Table 4's ring column on H20 (profile h20-table4) and assumed host-side, so "
        "the same on H100; for predicting the paper's runs, not this package's",
        {**h100.fit, "method": h100.fit["method"] + "; op_overhead_us from h20-table4 (Table 4 "
                                                    "ring column)",
         "inputs": {"paper Table 5": "ring", "paper Table 4": "ring"}})
