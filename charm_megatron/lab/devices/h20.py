"""``h20``: 2 nodes x 8 H20. Table 2's links; the cross rate scaled by the fraction of Table
2's rate the ``h100`` ring reached (same RDMA NIC class, same test); attention rate assumed (no
published curve), tile and head-dim shape FA-2's published H100 curve's; merges at the fraction
of memory bandwidth the fused merge reached on the H200 (assumed; below the H20's bound)."""

from __future__ import annotations

from charm_megatron.lab.calibration import paper
from charm_megatron.lab.calibration.refit import kernel_shape, rnd
from charm_megatron.lab.devices.h100 import nic_fraction, scaled_merge
from charm_megatron.lab.devices.inputs import Inputs
from charm_megatron.model.cluster import Cluster, Profile


def recipe(built: dict[str, Profile], inputs: Inputs) -> Profile:
    peak, cross, intra = paper.TABLE2["H20"]
    eff = nic_fraction(built)
    merge = scaled_merge("H20")
    h20 = Cluster(intra_gbps=intra, cross_gbps=rnd(cross * eff), tflops=rnd(0.6 * peak),
                  nic="rank", latency_us=10.0, merge_gbps=merge, op_overhead_us=10.0,
                  intra_port_gbps=450.0, comm_slowdown=paper.OVERLAP_COMPUTE_SLOWDOWN,
                  **kernel_shape())
    return Profile(
        "h20", h20, "2x8",
        f"2 nodes x 8 H20: NVLink {intra} GB/s per message (Table 2), 450 GB/s per port; one "
        f"RDMA NIC per GPU at Table 2's {cross} GB/s x {eff:.2f} (the fraction the H100 ring "
        f"reached; no H20 ring data with a stated problem size); attention assumed 60 % of the "
        f"{peak} TFLOP/s peak (no published curve), tile and head-dim shape as FA-2's published "
        f"H100 curve; merges assumed at {merge:g} GB/s of partial (the H200's measured fused "
        f"merge x {paper.MEMORY_GBPS['H20']:g} / {paper.MEMORY_GBPS['H200']:g} GB/s of memory "
        f"bandwidth; the H20's bound is {paper.merge_bound_gbps('H20'):g})",
        {"method": "no fit: Table 2 and the H100 profile's ring-derived NIC fraction"})
