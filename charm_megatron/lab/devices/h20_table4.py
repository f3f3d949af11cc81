"""``h20-table4``: H20 as the paper's Table 4 ring ran on it (its implementation included): one
problem shape from the paper's grid and the ``h20`` device's rate, cross rate and per-op cost
fitted on *the ring column* of Table 4 (``l20-pcie`` unchanged on its L20 rows; RM+ and CHARM+
columns never used)."""

from __future__ import annotations

from charm_megatron.lab.calibration.refit import TABLE4_FIT_FIELDS, fit_table4
from charm_megatron.lab.devices.inputs import Inputs
from charm_megatron.model.cluster import Profile


def recipe(built: dict[str, Profile], inputs: Inputs) -> Profile:
    (b, h, d), h20, err = fit_table4(built["l20-pcie"].cluster, built["h20"].cluster)
    return Profile(
        "h20-table4", h20, "2x8",
        f"2 nodes x 8 H20 as the paper's Table 4 ring ran on them (its implementation included): "
        f"the h20 profile with attention at {h20.tflops:g} TFLOP/s, {h20.cross_gbps:g} GB/s "
        f"cross and {h20.op_overhead_us:g} us per compute op, fitted on Table 4's ring column "
        f"with its shape assumed B={b}, {h} heads x {d} (fitted too: the table states only S); "
        "RM+ and CHARM+ columns unused",
        {"method": "charm_megatron.lab.calibration.refit.fit_table4: shape from the paper's grid "
                   f"and {', '.join(TABLE4_FIT_FIELDS)} by log error on Table 4's ring column "
                   "(10 numbers; the L20 rows on l20-pcie as shipped)",
         "inputs": {"paper Table 4": "ring"}, "fit_algos": ["ring"], "passes": ["fwd"],
         "shape": {"batch": b, "heads": h, "head_dim": d}, "rms_log_error": round(err, 4)})
