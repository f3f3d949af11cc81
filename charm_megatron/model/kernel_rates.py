"""Rate curves of attention kernel backends, one per backend a device profile knows.

A profile's cluster prices every tile with one kernel: the one this package's tiles run on that
device by default (its ``kernel``, e.g. ``aten-flash``, FlashAttention-2 through torch). Other
kernels run on the same GPU at other rates: cuDNN's fused attention (what TransformerEngine
runs, and what :mod:`charm_megatron.kernels.cudnn_backend` reaches through torch's own SDPA
operators), FlashAttention-3. A profile lists them in ``kernels``: each one's long-tile rate,
backward factor, fixed rows per tile side and head-dim factors (the :class:`Cluster` terms a
kernel decides), and whether they were ``measured`` (``scripts/gpu_check.py`` on the device) or
``assumed`` (published figures scaled onto the measured curve; every table that uses an
assumed curve says so).

:func:`cluster_on` is the profile's cluster with one kernel's terms: links, overheads and merges
stay the device's.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

from charm_megatron.model.cluster import Cluster, Profile

#: How a curve's numbers were obtained.
STATUSES = ("measured", "assumed")
#: The :class:`Cluster` fields a kernel decides.
KERNEL_FIELDS = ("tflops", "bwd_factor", "kernel_q_rows", "kernel_k_rows", "head_dim_factors")


@dataclass(frozen=True)
class KernelRates:
    """One kernel backend's rate curve on one device (the :class:`Cluster` terms of
    :data:`KERNEL_FIELDS`), with where it comes from."""

    name: str
    status: str
    source: str
    tflops: float
    bwd_factor: float
    kernel_q_rows: float = 0.0
    kernel_k_rows: float = 0.0
    head_dim_factors: tuple[tuple[float, float], ...] = ()

    def __post_init__(self) -> None:
        if self.status not in STATUSES:
            raise ValueError(f"kernel {self.name!r}: status must be one of {STATUSES}, got "
                             f"{self.status!r}")
        if not (self.tflops > 0 and self.bwd_factor > 0):
            raise ValueError(f"kernel {self.name!r}: tflops and bwd_factor must be > 0")
        factors = tuple((float(d), float(f)) for d, f in self.head_dim_factors)
        object.__setattr__(self, "head_dim_factors", factors)

    @property
    def assumed(self) -> bool:
        return self.status == "assumed"

    def terms(self) -> dict[str, object]:
        """The :class:`Cluster` fields this curve sets."""
        return {f: getattr(self, f) for f in KERNEL_FIELDS}

    def to_dict(self) -> dict[str, object]:
        out: dict[str, object] = {"status": self.status, "source": self.source}
        out.update(self.terms())
        out["head_dim_factors"] = [list(p) for p in self.head_dim_factors]
        return out

    @classmethod
    def from_dict(cls, name: str, data: Mapping[str, object]) -> KernelRates:
        unknown = sorted(set(data) - {"status", "source", *KERNEL_FIELDS})
        if unknown:
            raise ValueError(f"kernel {name!r}: unknown fields {unknown}; known: status, "
                             f"source, {', '.join(KERNEL_FIELDS)}")
        return cls(name, **{k: v for k, v in data.items()})  # type: ignore[arg-type]

    @classmethod
    def of_cluster(cls, name: str, cluster: Cluster, status: str, source: str) -> KernelRates:
        """The curve ``cluster`` prices tiles with."""
        return cls(name, status, source, **{f: getattr(cluster, f) for f in KERNEL_FIELDS})


def scaled(base: KernelRates, name: str, source: str, *, fwd_ratio: float, bwd_ratio: float,
           head_dim_ratios: Mapping[float, float] | None = None) -> KernelRates:
    """An ``assumed`` curve: ``base`` (a measured one) with its long-tile forward rate times
    ``fwd_ratio``, its backward rate times ``bwd_ratio`` (so its backward factor times
    ``fwd_ratio / bwd_ratio``) and, per head dim, its factor times ``head_dim_ratios[d]`` (the
    published ratio of the two kernels there over the ratio at head dim 128); the fixed rows per
    tile side stay the measured ones (no published source gives them)."""
    factors = base.head_dim_factors
    if head_dim_ratios:
        factors = tuple((d, f * head_dim_ratios.get(d, 1.0)) for d, f in factors)
    return KernelRates(name, "assumed", source, base.tflops * fwd_ratio,
                       base.bwd_factor * fwd_ratio / bwd_ratio, base.kernel_q_rows,
                       base.kernel_k_rows, factors)


def kernels_of(profile: Profile) -> dict[str, KernelRates]:
    """The kernels ``profile`` knows by name: its ``kernels``, and its cluster's own curve
    under ``profile.kernel`` (``default`` when the profile names none) where ``kernels`` does
    not list it (marked ``assumed``: a profile that says nothing of its kernel's origin)."""
    out = {k.name: k for k in profile.kernels}
    own = profile.kernel or "default"
    if own not in out:
        out[own] = KernelRates.of_cluster(own, profile.cluster, "assumed", profile.source)
    return out


def cluster_on(profile: Profile, kernel: str) -> Cluster:
    """``profile``'s cluster with ``kernel``'s terms (:class:`ValueError` naming the profile's
    kernels when it has no such curve)."""
    known = kernels_of(profile)
    try:
        rates = known[kernel]
    except KeyError:
        raise ValueError(f"profile {profile.name!r} has no rate curve for kernel {kernel!r}; "
                         f"it has: {', '.join(sorted(known))}") from None
    return profile.cluster.with_(**rates.terms())
