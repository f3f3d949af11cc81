"""``l20-pcie``: 8 L20 in one dual-NUMA PCIe node. Table 2's links (no ring measurement to fit
on); attention rate assumed (no published curve); merges at the fraction of memory bandwidth
the fused merge reached on the H200 (assumed; below the L20's bound)."""

from __future__ import annotations

from charm_megatron.lab.calibration import paper
from charm_megatron.lab.calibration.refit import kernel_shape, rnd
from charm_megatron.lab.devices.h100 import scaled_merge
from charm_megatron.lab.devices.inputs import Inputs
from charm_megatron.model.cluster import Cluster, Profile


def recipe(built: dict[str, Profile], inputs: Inputs) -> Profile:
    peak, cross, intra = paper.TABLE2["L20"]
    merge = scaled_merge("L20")
    l20 = Cluster(intra_gbps=intra, cross_gbps=cross, tflops=rnd(0.5 * peak), nic="node",
                  latency_us=10.0, cross_via_intra=True, merge_gbps=merge, op_overhead_us=10.0,
                  comm_slowdown=paper.OVERLAP_COMPUTE_SLOWDOWN, **kernel_shape())
    return Profile(
        "l20-pcie", l20, "2x4",
        f"8x L20 in one dual-NUMA PCIe node (Table 2: {intra} GB/s intra-NUMA, {cross} GB/s "
        "cross-NUMA); cross traffic shares the inter-socket path (nic=node) and each GPU's x16 "
        f"link; attention assumed 50 % of the {peak} TFLOP/s peak (no published curve); merges "
        f"assumed at {merge:g} GB/s of partial (the H200's measured fused merge x "
        f"{paper.MEMORY_GBPS['L20']:g} / {paper.MEMORY_GBPS['H200']:g} GB/s of memory "
        f"bandwidth; the L20's bound is {paper.merge_bound_gbps('L20'):g})",
        {"method": "no fit: Table 2 (no L20 ring data with a stated problem size)"})
