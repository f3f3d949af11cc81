"""``h200``: this package on H200 nodes of 8: the compute terms ``scripts/gpu_check.py``
measured on one H200 (:data:`H200_MEASUREMENT`: kernel curve, head dims, backward factor,
per-op cost, the fused merge's rate) on the ``h100`` profile's links (HGX H200 nodes have the
H100's NVLink 4 and NICs). ``h100`` reads the same measurement (:func:`measured_terms`; its
merge scaled to the H100's memory bandwidth), so the two differ only in the merge rate."""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

from charm_megatron.devices import MEASUREMENTS_DIR, load_profile
from charm_megatron.lab.devices.hopper_kernels import OWN_KERNEL, assumed_curves, own_curve
from charm_megatron.lab.devices.inputs import Inputs
from charm_megatron.model.cluster import Profile

# One H200's measurement by scripts/gpu_check.py (2026-12-04, torch 2.11.0+cu130; the run's
# logs: docs/performance/gpu-check/). A profile file whose fit holds the kernel table and the
# overheads it measured.
H200_MEASUREMENT = MEASUREMENTS_DIR / "h200-gpu-check.json"

# The compute terms a gpu_check run measures (everything else of its profile is its base's).
MEASURED_FIELDS = ("tflops", "kernel_q_rows", "kernel_k_rows", "head_dim_factors", "bwd_factor",
                   "op_overhead_us", "merge_gbps")


def measured_terms(path: Path = H200_MEASUREMENT) -> tuple[dict[str, object], dict]:
    """(cluster fields of :data:`MEASURED_FIELDS`, the run's fit record) of a gpu_check
    profile file."""
    prof = load_profile(path)
    if not prof.fit.get("checks_ok"):
        raise ValueError(f"{path}: its correctness checks failed; a measured profile needs a "
                         "run whose kernels were right")
    return {f: getattr(prof.cluster, f) for f in MEASURED_FIELDS}, prof.fit


def measurement_file(path: Path = H200_MEASUREMENT) -> str:
    """``path`` as the profiles record it: relative to the package (``devices/...``)."""
    return str(path.relative_to(path.parents[2]))


def kernel_text(terms: dict[str, object], device: str) -> str:
    """What a measured kernel is, for a profile's source."""
    return (f"FlashAttention-2 (aten) measured on one {device}: {terms['tflops']:g} TFLOP/s "
            f"long-tile forward at head dim 128, {terms['kernel_q_rows']:g} rows of fixed cost "
            f"per tile side, backward x{terms['bwd_factor']:g}")


def recipe(built: dict[str, Profile], inputs: Inputs) -> Profile:
    terms, fit = measured_terms()
    h100, rel = built["h100"], measurement_file()
    cluster = replace(h100.cluster, **terms)
    own = own_curve(cluster, "measured", f"measured: {kernel_text(terms, fit['device'])} "
                    f"({rel})")
    return Profile(
        "h200", cluster, "2x8",
        f"this package on H200 nodes of 8: the h100 profile's links (NVLink 4, one RDMA NIC per "
        f"GPU, cross rate fitted on Table 5's ring forward) with compute measured by "
        f"scripts/gpu_check.py: {kernel_text(terms, fit['device'])}; "
        f"{terms['op_overhead_us']:g} us per compute op (a tiny tile issued back to back); "
        f"merges fused ({fit['overheads']['merge_path']}) at {terms['merge_gbps']:g} GB/s of "
        "partial",
        {**h100.fit, "method": "charm_megatron.lab.calibration.refit: cross_gbps by log error "
                               "on Table 5 ring forward (8 numbers; the h100 profile's); links "
                               f"from Table 2; compute terms measured ({rel})",
         "measured": {"file": rel, "device": fit["device"], "fields": list(MEASURED_FIELDS)}},
        kernel=OWN_KERNEL, kernels=(own, *assumed_curves(own)))
