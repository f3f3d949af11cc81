"""``h100``: this package on H100 SXM nodes of 8, the profile the README's GPU claims rest on.
Table 2's links; the cross rate *fitted on the ring columns of Table 5* (forward; never on its
CHARM+ columns); compute *measured*: the kernel curve, head dims, backward factor and per-op
cost ``scripts/gpu_check.py`` measured on one H200 (:mod:`.h200`'s measurement; the H200 is the
same GH100 die, 132 SMs at the same clocks, so the same FlashAttention-2 kernel and host path),
the fused merge at that measurement's rate scaled to the H100's memory bandwidth (a merge is
memory-bound; :func:`~charm_megatron.lab.calibration.paper.bandwidth_scaled`, below
:func:`~charm_megatron.lab.calibration.paper.merge_bound_gbps`); the overlap slowdown of Lee et
al."""

from __future__ import annotations

import math
from dataclasses import replace

from charm_megatron.lab.calibration import paper
from charm_megatron.lab.calibration.calibrate import coordinate_descent
from charm_megatron.lab.calibration.refit import TABLE5_FIT_PASSES, rnd, table5_ring_error
from charm_megatron.lab.devices.h200 import (
    MEASURED_FIELDS,
    kernel_text,
    measured_terms,
    measurement_file,
)
from charm_megatron.lab.devices.hopper_kernels import OWN_KERNEL, assumed_curves, own_curve
from charm_megatron.lab.devices.inputs import Inputs
from charm_megatron.model.cluster import Cluster, Profile

#: The GPU the measurement ran on (paper.MEMORY_GBPS's key).
MEASURED_ON = "H200"


def scaled_merge(gpu: str) -> float:
    """The fused merge rate measured on the H200 as it runs on ``gpu``: scaled by memory
    bandwidth (a merge is memory-bound), never above ``gpu``'s bound."""
    measured = float(measured_terms()[0]["merge_gbps"])
    return rnd(min(paper.bandwidth_scaled(measured, MEASURED_ON, gpu),
                   paper.merge_bound_gbps(gpu)))


def recipe(built: dict[str, Profile], inputs: Inputs) -> Profile:
    _, cross, intra = paper.TABLE2["H100"]
    terms, mfit = measured_terms()
    rel, device = measurement_file(), mfit["device"]
    merge = scaled_merge("H100")
    compute = {f: terms[f] for f in MEASURED_FIELDS if f != "merge_gbps"}
    start = Cluster(intra_gbps=intra, cross_gbps=cross, nic="rank", latency_us=10.0,
                    merge_gbps=merge, intra_port_gbps=450.0,
                    comm_slowdown=paper.OVERLAP_COMPUTE_SLOWDOWN, **compute)
    fitted, err = coordinate_descent(start, ("cross_gbps",), table5_ring_error, step=1.5,
                                     min_step=1.005)
    h100 = replace(fitted, cross_gbps=rnd(fitted.cross_gbps))
    eff = h100.cross_gbps / cross
    fit = {"method": "charm_megatron.lab.calibration.refit: cross_gbps by log error on Table 5 "
                     "ring forward (8 numbers); links from Table 2; compute terms measured on "
                     f"one {device} ({rel}), the merge rate scaled to the H100's memory "
                     "bandwidth",
           "inputs": {"paper Table 5": "ring"}, "fit_algos": ["ring"],
           "passes": list(TABLE5_FIT_PASSES), "rms_log_error": round(math.sqrt(err), 4),
           "cross_fraction_of_table2": round(eff, 4),
           "fitted": ["cross_gbps"],
           "measured": {"file": rel, "device": device,
                        "fields": [*compute, "merge_gbps (x H100 / H200 memory bandwidth)"]}}
    own = own_curve(h100, "measured", f"measured: {kernel_text(terms, device)} ({rel}; the "
                    "H100 is the same GH100 die at the same clocks)")
    bw, hb = paper.MEMORY_GBPS, paper.MEMORY_GBPS[MEASURED_ON]
    return Profile(
        "h100", h100, "2x8",
        f"this package on H100 SXM nodes of 8: NVLink {intra} GB/s per message (Table 2), "
        f"450 GB/s per port (NVLink4); one RDMA NIC per GPU, Table 2 says {cross} GB/s, the "
        f"ring columns of Table 5 (forward) give {h100.cross_gbps:g} GB/s ({eff:.0%}; fitted, "
        f"CHARM+ columns unused); compute measured by scripts/gpu_check.py on one {device} "
        f"(the same GH100 die and clocks; its kernel rate, not FA-2's published H100 bars, "
        f"because it is the kernel this package calls, timed with the tile fixed cost it "
        f"was fitted with): {kernel_text(terms, device)}; {terms['op_overhead_us']:g} us per "
        f"compute op; merges fused at {merge:g} GB/s of partial (the {terms['merge_gbps']:g} "
        f"GB/s measured x {bw['H100']:g} / {hb:g} GB/s of memory bandwidth; an H100's "
        f"bound is {paper.merge_bound_gbps('H100'):g}); compute +18.9 % while messages move "
        "(Lee et al. 2025)", fit, kernel=OWN_KERNEL,
        kernels=(own, *assumed_curves(own)))


def nic_fraction(built: dict[str, Profile]) -> float:
    """The fraction of Table 2's cross rate the fitted ``h100`` ring reached."""
    return built["h100"].cluster.cross_gbps / paper.TABLE2["H100"][1]
