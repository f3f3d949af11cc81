"""``h100``: H100 SXM nodes of 8. Table 2's links; FlashAttention-2's H100 kernel curve
(:mod:`~charm_megatron.lab.calibration.paper`) for the kernel rate against tile size and head
dim; the overlap slowdown of Lee et al.; the cross rate *fitted on the ring columns of Table 5*
(forward; never on its CHARM+ columns)."""

from __future__ import annotations

import math
from dataclasses import replace

from charm_megatron.lab.calibration import paper
from charm_megatron.lab.calibration.calibrate import coordinate_descent
from charm_megatron.lab.calibration.refit import (
    TABLE5_FIT_PASSES,
    kernel_shape,
    kernel_source,
    kernel_terms,
    rnd,
    table5_ring_error,
)
from charm_megatron.lab.devices.hopper_kernels import OWN_KERNEL, assumed_curves, own_curve
from charm_megatron.lab.devices.inputs import Inputs
from charm_megatron.model.cluster import Cluster, Profile


def recipe(built: dict[str, Profile], inputs: Inputs) -> Profile:
    _, cross, intra = paper.TABLE2["H100"]
    start = Cluster(intra_gbps=intra, cross_gbps=cross,
                    tflops=float(kernel_terms()["long_tile_tflops_h100"]), nic="rank",
                    latency_us=10.0, merge_gbps=800.0, op_overhead_us=10.0,
                    intra_port_gbps=450.0, comm_slowdown=paper.OVERLAP_COMPUTE_SLOWDOWN,
                    **kernel_shape())
    fitted, err = coordinate_descent(start, ("cross_gbps",), table5_ring_error, step=1.5,
                                     min_step=1.005)
    h100 = replace(fitted, cross_gbps=rnd(fitted.cross_gbps))
    eff = h100.cross_gbps / cross
    fit = {"method": "charm_megatron.lab.calibration.refit: cross_gbps by log error on Table 5 "
                     "ring forward (8 numbers); everything else from published sources",
           "inputs": {"paper Table 5": "ring"}, "fit_algos": ["ring"],
           "passes": list(TABLE5_FIT_PASSES), "rms_log_error": round(math.sqrt(err), 4),
           "cross_fraction_of_table2": round(eff, 4)}
    own = own_curve(h100, "assumed", "assumed: FlashAttention-2 on H100, the FA-3 paper's "
                    "forward bars and FA-2's utilisation (the cluster's kernel terms)")
    return Profile(
        "h100", h100, "2x8",
        f"H100 SXM nodes of 8: NVLink {intra} GB/s per message (Table 2), 450 GB/s per port "
        f"(NVLink4); one RDMA NIC per GPU, Table 2 says {cross} GB/s, the ring columns of "
        f"Table 5 (forward) give {h100.cross_gbps:g} GB/s ({eff:.0%}; fitted, CHARM+ columns "
        "unused); " + kernel_source(), fit, kernel=OWN_KERNEL,
        kernels=(own, *assumed_curves(own)))


def nic_fraction(built: dict[str, Profile]) -> float:
    """The fraction of Table 2's cross rate the fitted ``h100`` ring reached."""
    return built["h100"].cluster.cross_gbps / paper.TABLE2["H100"][1]
