"""The Hopper kernels we have not measured, as ``assumed`` rate curves on a profile.

Our tiles' kernel on a GPU is FlashAttention-2 through torch (``aten-flash``); its curve is the
profile's cluster (measured on one H200 for ``h200``; FA-2's published H100 bars for ``h100``).
cuDNN's fused attention (what TransformerEngine runs on Hopper, and what our ``cudnn`` backend
reaches through torch's SDPA operators) and FlashAttention-3 are that curve times the ratio of
their published rates to FA-2's on the same chart (:data:`~charm_megatron.lab.calibration.paper.
HOPPER_KERNELS`): forward at head dim 128 for the long-tile rate, backward at head dim 128 for
the backward factor, forward per head dim for the head-dim factors. The fixed rows per tile
side stay the measured ones: no published source gives them. Every table that uses these
curves says they are assumed.
"""

from __future__ import annotations

from charm_megatron.lab.calibration import paper
from charm_megatron.model.cluster import Cluster
from charm_megatron.model.kernel_rates import KernelRates, scaled

#: Our tiles' kernel on a GPU (the profile cluster's curve).
OWN_KERNEL = "aten-flash"
_LABELS = {"cudnn": "cuDNN fused attention (TransformerEngine's kernel on Hopper; torch's SDPA "
                    "cuDNN operators)",
           "fa3": "FlashAttention-3"}


def own_curve(cluster: Cluster, status: str, source: str) -> KernelRates:
    """The curve ``cluster`` prices tiles with, as our kernel's."""
    return KernelRates.of_cluster(OWN_KERNEL, cluster, status, source)


def assumed_curves(base: KernelRates) -> tuple[KernelRates, ...]:
    """cuDNN's and FlashAttention-3's curves on ``base``'s device (see the module)."""
    fa2 = paper.HOPPER_KERNELS["fa2"]
    out = []
    for name, label in _LABELS.items():
        k = paper.HOPPER_KERNELS[name]
        fwd = k["fwd"][128] / fa2["fwd"][128]
        bwd = k["bwd"][128] / fa2["bwd"][128]
        dims = {float(d): (k["fwd"][d] / fa2["fwd"][d]) / fwd for d in k["fwd"]}
        source = (f"assumed: {label}, {base.name}'s curve times the FA-3 paper's H100 ratios "
                  f"to FA-2 (forward {fwd:.3f}x at head dim 128, causal, 16k; backward "
                  f"{bwd:.3f}x, non-causal; head dims " +
                  ", ".join(f"{d:g}: {r:.3f}" for d, r in sorted(dims.items())) +
                  " of that); fixed rows per tile side as measured")
        curve = scaled(base, name, source, fwd_ratio=fwd, bwd_ratio=bwd, head_dim_ratios=dims)
        out.append(_rounded(curve))
    return tuple(out)


def _rounded(k: KernelRates) -> KernelRates:
    r = lambda x: float(f"{x:.4g}")  # noqa: E731 - the 4 digits a shipped profile keeps
    return KernelRates(k.name, k.status, k.source, r(k.tflops), r(k.bwd_factor),
                       k.kernel_q_rows, k.kernel_k_rows,
                       tuple((d, r(f)) for d, f in k.head_dim_factors))
