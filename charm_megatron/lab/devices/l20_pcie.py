"""``l20-pcie``: 8 L20 in one dual-NUMA PCIe node. Table 2's links (no ring measurement to fit
on); attention rate assumed (no published curve)."""

from __future__ import annotations

from charm_megatron.lab.calibration import paper
from charm_megatron.lab.calibration.refit import kernel_shape, rnd
from charm_megatron.lab.devices.inputs import Inputs
from charm_megatron.model.cluster import Cluster, Profile


def recipe(built: dict[str, Profile], inputs: Inputs) -> Profile:
    peak, cross, intra = paper.TABLE2["L20"]
    l20 = Cluster(intra_gbps=intra, cross_gbps=cross, tflops=rnd(0.5 * peak), nic="node",
                  latency_us=10.0, cross_via_intra=True, merge_gbps=200.0, op_overhead_us=10.0,
                  comm_slowdown=paper.OVERLAP_COMPUTE_SLOWDOWN, **kernel_shape())
    return Profile(
        "l20-pcie", l20, "2x4",
        f"8x L20 in one dual-NUMA PCIe node (Table 2: {intra} GB/s intra-NUMA, {cross} GB/s "
        "cross-NUMA); cross traffic shares the inter-socket path (nic=node) and each GPU's x16 "
        f"link; attention assumed 50 % of the {peak} TFLOP/s peak (no published curve)",
        {"method": "no fit: Table 2 (no L20 ring data with a stated problem size)"})
