"""Every setting of a ``cp_attention`` call in one value, resolved once at the API edge.

``cp_attention(options=None)`` builds :class:`CPOptions` from the environment
(:meth:`CPOptions.from_env`); this is the only place in the package's attention path that reads
environment variables. An explicit ``options=CPOptions(...)`` is used as given and no variable is
read. The value is stored in the autograd context, so a call's backward runs with exactly the
settings of its forward (pass order, timeout, kernel, checks), whatever the environment says by
then.
"""

from __future__ import annotations

import math
import os
from collections.abc import Mapping
from dataclasses import dataclass, replace

import torch

from charm_megatron.kernels.base import AttentionBackend

PASS_ORDERS = ("split", "joint")
SPLIT_VISITING = ("auto", "off", "on")
SPLIT_COUNTERPART_Q = SPLIT_VISITING
CHECKS = ("every_call", "off")
ABLATIONS = ("none", "compute_only", "comm_only")

# variable -> (CPOptions field, what it sets); docs/api.md lists the same table.
ENV_VARS = {
    "CHARM_PASS_ORDER": ("pass_order", "CHARM+/RM+ pass order: split (default) or joint"),
    "CHARM_COMM_TIMEOUT_S": ("timeout_s", "bound on every blocking wait, seconds (default 600)"),
    "CHARM_ATTN_BACKEND": ("backend", "kernel backend: torch, flash_attn or reference"),
    "CHARM_TOPOLOGY": ("topology", "topology for algo charm/auto when the argument is None"),
    "CHARM_CHECK": ("check", "agreement/status checks: every_call (default) or off"),
    "CHARM_MODEL_PROFILE": ("model_profile", "performance-model profile for algo auto: a "
                            "built-in name or a profile file (default: a generic cluster)"),
    "CHARM_SPLIT_VISITING": ("split_visiting", "CHARM+ pass-kv visiting kv in two row halves: "
                             "auto (default: where the model predicts it faster), off or on"),
    "CHARM_SPLIT_COUNTERPART_Q": ("split_counterpart_q", "CHARM+ pass-q counterpart q in two "
                                  "row halves, partials home per half: auto (default: where "
                                  "the model predicts it faster), off or on"),
}


@dataclass(frozen=True)
class CPOptions:
    """Settings of one ``cp_attention`` call; every rank of the CP group must pass equal ones
    (the agreement check compares them, except ``timeout_s``).

    Attributes:
        pass_order: ``"split"`` or ``"joint"`` (docs/algorithm.md).
        timeout_s: bound on every blocking wait of the call, seconds.
        backend: kernel backend name (``torch``, ``flash_attn``, ``reference``), a backend
            object, or ``None`` for the automatic choice.
        topology: default topology string for ``algo`` ``charm``/``auto`` when the call's
            ``topology`` argument is ``None``; ``None`` means the probe.
        check: ``"every_call"``: the ranks agree on the call before any data moves and report
            their status after it (docs/api.md, failure model); ``"off"`` skips both (a
            mismatch is then undetected and a rank-local error leaves peers with garbage).
        ablation: ``"none"``; ``"compute_only"`` (no communication) or ``"comm_only"`` (no
            kernels) for timing a plan's parts; results are then meaningless.
        model_profile: the cluster ``algo="auto"`` predicts with: a built-in profile name or a
            profile file written by ``charm-megatron model --calibrate``
            (:func:`charm_megatron.model.auto_cluster`); ``None``: a generic cluster.
        split_visiting: ``"on"``: CHARM+ pass-kv sends a visiting kv block that every tile
            needs whole in two row halves and runs its pass per half (docs/algorithm.md,
            *Visiting kv in two halves*); ``"off"``: whole blocks; ``"auto"`` (default): per
            direction, the split where the performance model predicts it more than 5 %
            faster on the cluster of ``model_profile``, else whole blocks
            (:func:`charm_megatron.model.choose_split_visiting`).
        split_counterpart_q: the same for CHARM+ pass-q: ``"on"`` sends a counterpart's q
            block that every tile needs whole in two row halves, runs its pass per half and
            sends each half's partial home as soon as it is done (docs/algorithm.md,
            *Counterpart q in two halves*); ``"off"``: whole blocks; ``"auto"`` (default):
            per direction, the model's pick on ``model_profile``'s cluster
            (:func:`charm_megatron.model.choose_split_counterpart_q`).
    """

    pass_order: str = "split"
    timeout_s: float = 600.0
    backend: str | AttentionBackend | None = None
    topology: str | None = None
    check: str = "every_call"
    ablation: str = "none"
    model_profile: str | None = None
    split_visiting: str = "auto"
    split_counterpart_q: str = "auto"

    def __post_init__(self) -> None:
        if self.pass_order not in PASS_ORDERS:
            raise ValueError(f"cp_attention: pass_order={self.pass_order!r} (CHARM_PASS_ORDER); "
                             f"choose one of {', '.join(PASS_ORDERS)}")
        if not (isinstance(self.timeout_s, (int, float)) and math.isfinite(self.timeout_s)
                and self.timeout_s > 0):
            raise ValueError(f"cp_attention: timeout_s={self.timeout_s!r} (CHARM_COMM_TIMEOUT_S) "
                             "must be a positive number of seconds")
        if self.check not in CHECKS:
            raise ValueError(f"cp_attention: check={self.check!r} (CHARM_CHECK); choose one of "
                             f"{', '.join(CHECKS)}")
        if self.model_profile is not None and not (isinstance(self.model_profile, str)
                                                   and self.model_profile.strip()):
            raise ValueError(f"cp_attention: model_profile={self.model_profile!r} "
                             "(CHARM_MODEL_PROFILE) must be a profile name or file, or None")
        if self.split_visiting not in SPLIT_VISITING:
            raise ValueError(f"cp_attention: split_visiting={self.split_visiting!r} "
                             f"(CHARM_SPLIT_VISITING); choose one of {', '.join(SPLIT_VISITING)}")
        if self.split_counterpart_q not in SPLIT_COUNTERPART_Q:
            raise ValueError(f"cp_attention: split_counterpart_q={self.split_counterpart_q!r} "
                             "(CHARM_SPLIT_COUNTERPART_Q); choose one of "
                             f"{', '.join(SPLIT_COUNTERPART_Q)}")
        if self.ablation not in ABLATIONS:
            raise ValueError(f"cp_attention: ablation={self.ablation!r}; choose one of "
                             f"{', '.join(ABLATIONS)}")

    @classmethod
    def from_env(cls, environ: Mapping[str, str] | None = None, **overrides) -> CPOptions:
        """Defaults, then the ``CHARM_*`` variables of ``environ`` (``os.environ``), then
        ``overrides``."""
        env = os.environ if environ is None else environ
        values: dict = {}
        for var, (field, _) in ENV_VARS.items():
            raw = env.get(var, "").strip()
            if not raw:
                continue
            if field == "timeout_s":
                try:
                    values[field] = float(raw)
                except ValueError:
                    raise ValueError(f"cp_attention: {var}={raw!r} is not a number of "
                                     "seconds") from None
            else:
                values[field] = raw
        values.update(overrides)
        return cls(**values)

    def with_(self, **changes) -> CPOptions:
        """A copy with ``changes`` (e.g. ``opts.with_(ablation="compute_only")``)."""
        return replace(self, **changes)

    @property
    def compute(self) -> bool:
        return self.ablation != "comm_only"

    @property
    def comm(self) -> bool:
        return self.ablation != "compute_only"

    def topology_for(self, algo: str, topology) -> tuple[object, str] | None:
        """The topology spec a call of ``algo`` runs on and where it came from (for errors):
        ``None`` (one flat group) for an algorithm that does not use the topology, whatever was
        given; else ``topology``, or when that is ``None`` this value's default
        (``CHARM_TOPOLOGY``), else the probe (``"auto"``). The one statement of this rule (the
        Megatron layer and the benchmark call it too)."""
        from charm_megatron.plan.registry import uses_topology

        if not uses_topology(algo):
            return None
        if topology is not None:
            return topology, f"topology={str(topology)!r}"
        if self.topology:
            return self.topology, f"CHARM_TOPOLOGY={self.topology!r}"
        return "auto", "the probe (CHARM_TOPOLOGY unset)"

    @property
    def backend_name(self) -> str:
        """What the agreement check compares for the backend."""
        if self.backend is None or isinstance(self.backend, str):
            return self.backend or "auto"
        return str(getattr(self.backend, "name", type(self.backend).__name__))


def kernel_backend(options: CPOptions, device: torch.device,
                   dtype: torch.dtype) -> AttentionBackend:
    """The backend object for a call (an object in ``options.backend`` is used as is)."""
    from charm_megatron.kernels import get_backend

    if options.backend is not None and not isinstance(options.backend, str):
        return options.backend
    return get_backend(device, dtype, name=options.backend)


def resolve(options: CPOptions | None) -> CPOptions:
    """The options of one call: ``options`` as given, else :meth:`CPOptions.from_env`."""
    opts = options if options is not None else CPOptions.from_env()
    if not isinstance(opts, CPOptions):
        raise TypeError(f"cp_attention: options must be a CPOptions, got {type(opts).__name__}")
    return opts


def algorithm_settings(options: CPOptions, roles) -> tuple[tuple[str, object], ...]:
    """The algorithm settings of a call: ``roles`` (the cp_attention argument) and the options'."""
    from charm_megatron.plan.roles import check_roles

    check_roles(roles, "cp_attention roles")
    return (("pass_order", options.pass_order), ("roles", roles),
            ("split_visiting", options.split_visiting),
            ("split_counterpart_q", options.split_counterpart_q))


def setting_env(name: str) -> str | None:
    """The environment variable of setting ``name`` (``None``: none)."""
    return next((var for var, (field, _) in ENV_VARS.items() if field == name), None)
