"""``h100-paper-measured``: ``h100-paper`` with the kernel measured on one H200 (the paper's
runs used FlashAttention-2 on the same SMs; :mod:`.h200`'s measurement) and the merge rate of
PyTorch elementwise ops measured there (what a merge written in PyTorch, as
ring-flash-attention's and presumably the paper's, runs at); its per-op cost stays Table 4's."""

from __future__ import annotations

from dataclasses import replace

from charm_megatron.lab.calibration.refit import rnd
from charm_megatron.lab.devices.h200 import (
    MEASURED_FIELDS,
    kernel_text,
    measured_terms,
    measurement_file,
)
from charm_megatron.lab.devices.inputs import Inputs
from charm_megatron.model.cluster import Profile


def recipe(built: dict[str, Profile], inputs: Inputs) -> Profile:
    terms, fit = measured_terms()
    paper, h100, rel = built["h100-paper"].cluster, built["h100"].fit, measurement_file()
    unfused = rnd(fit["overheads"]["merge_unfused_gbps"])
    kernel = {f: terms[f] for f in MEASURED_FIELDS if f not in ("op_overhead_us", "merge_gbps")}
    return Profile(
        "h100-paper-measured", replace(paper, merge_gbps=unfused, **kernel), "2x8",
        f"the h100-paper profile (the paper's implementation: {paper.op_overhead_us:g} us per "
        f"compute op from Table 4's ring column) with the kernel measured on one "
        f"{fit['device']} ({kernel_text(terms, fit['device'])}) and merges at {unfused:g} GB/s, "
        "the rate of PyTorch elementwise ops measured there (assumed the paper's merge; an H100 "
        "has 0.7x the H200's memory bandwidth); no CHARM+ column used",
        {**h100, "method": h100["method"] + "; op_overhead_us from h20-table4 (Table 4 ring "
                                            f"column); kernel and merge measured ({rel})",
         "inputs": {"paper Table 5": "ring", "paper Table 4": "ring"},
         "measured": {"file": rel, "device": fit["device"],
                      "fields": [*kernel, "merge_gbps (PyTorch ops)"]}})
