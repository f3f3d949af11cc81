"""Every setting of a ``cp_attention`` call in one value, resolved once at the API edge.

``cp_attention(options=None)`` builds :class:`CPOptions` from the environment
(:meth:`CPOptions.from_env`); this is the only place in the package's attention path that reads
environment variables. An explicit ``options=CPOptions(...)`` is used as given and no variable is
read. The value is stored in the autograd context, so a call's backward runs with exactly the
settings of its forward (timeout, kernel, checks, the algorithm's settings), whatever the
environment says by then.

Two kinds of settings live here: the call's own (timeout, kernel backend, default topology,
checks, ablation, model profile: fields of :class:`CPOptions`), and the algorithms' (CHARM+'s
pass order, role mix and splits, or any registered algorithm's: declared by its registry entry,
:mod:`charm_megatron.plan.settings`, and given here by name, ``CPOptions(pass_order="joint")``).
Their environment variables come from their declarations.
"""

from __future__ import annotations

import math
import os
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass, fields

import torch

from charm_megatron.kernels.base import AttentionBackend
from charm_megatron.ops.transport import Transport, check_transport, transport_name
from charm_megatron.plan import registry
from charm_megatron.plan.settings import Values
from charm_megatron.plan.vocab import Dtype, _Named


class Check(_Named):
    """Whether the ranks agree on every call and report its status after (docs/api.md)."""

    EVERY_CALL = "every_call"
    OFF = "off"


class Ablation(_Named):
    """Which side of a plan runs (timing a plan's parts; results are then meaningless)."""

    NONE = "none"
    COMPUTE_ONLY = "compute_only"
    COMM_ONLY = "comm_only"


# The call's own variables: variable -> (CPOptions field, what it sets). docs/api.md lists them
# with the algorithms' (ENV_VARS).
_OWN_VARS = {
    "CHARM_COMM_TIMEOUT_S": ("timeout_s", "bound on every blocking wait, seconds (default 600)"),
    "CHARM_ATTN_BACKEND": ("backend", "kernel backend: torch, flash_attn, cudnn or reference"),
    "CHARM_TOPOLOGY": ("topology", "topology for algorithms that use one (charm, auto) when "
                       "the argument is None"),
    "CHARM_CHECK": ("check", "agreement/status checks: every_call (default) or off"),
    "CHARM_MODEL_PROFILE": ("model_profile", "performance-model profile for algo auto and the "
                            "algorithms' auto settings: a device name (built in or on "
                            "CHARM_DEVICES) or a profile file (default: a generic cluster, "
                            "auto settings off)"),
    "CHARM_PARTIALS": ("partials", "dtype partial results (out, dq, dkv) travel in between "
                       "ranks: input (default; bf16 halves the bytes) or fp32 (as "
                       "ring-flash-attention and the paper's ring send them)"),
    "CHARM_AUTO_ALGOS": ("auto_algos", "comma-separated algorithms algo auto may pick, e.g. "
                         "ring,rmplus,charm (default: every registered one that can run the "
                         "call)"),
    "CHARM_AUTO_TUNE": ("auto_tune", "algo auto measures its shortlist once per shape: off "
                        "(default: the model's pick), on (margin 1.5), a margin >= 1 (time "
                        "every algorithm the model predicts within that factor of its "
                        "fastest) or all"),
    "CHARM_AUTO_TUNE_FILE": ("auto_tune_file", "a pick file for auto_tune: its picks run "
                             "without measuring, this run's picks are written to it (rank 0)"),
    "CHARM_TRANSPORT": ("transport", "how the executor moves bytes: a transport registered in "
                        "the process (ops/transport.py; default torch: torch.distributed)"),
}

#: The margin ``CHARM_AUTO_TUNE=on`` stands for: the model's speed-up errors on its measured
#: rows reach 1.3x (the CPU testbed's a2a / CHARM+ miss, docs/performance.md), so a shortlist
#: of predictions within 1.5x of the fastest holds the measured fastest there.
DEFAULT_TUNE_MARGIN = 1.5


class _EnvVars(Mapping[str, tuple[str, str]]):
    """Every variable :meth:`CPOptions.from_env` reads: the call's own, then each registered
    algorithm setting's (live: an algorithm registered later adds its own)."""

    def _table(self) -> dict[str, tuple[str, str]]:
        table = dict(_OWN_VARS)
        for s in registry.all_settings().values():
            if s.env:
                table[s.env] = (s.name, f"{s.help}; {', '.join(s.choices)} (default "
                                        f"{s.default.value})")
        return table

    def __getitem__(self, var: str) -> tuple[str, str]:
        return self._table()[var]

    def __iter__(self) -> Iterator[str]:
        return iter(self._table())

    def __len__(self) -> int:
        return len(self._table())

    def items(self):  # type: ignore[override]
        # One table for the walk (Mapping's items() would rebuild it per variable): from_env
        # runs on every cp_attention call without options.
        return self._table().items()


#: variable -> (CPOptions field or setting name, what it sets).
ENV_VARS: Mapping[str, tuple[str, str]] = _EnvVars()


def setting_env(name: str) -> str | None:
    """The environment variable of algorithm setting ``name`` (``None``: none)."""
    s = registry.all_settings().get(name)
    return s.env if s is not None else None


@dataclass(frozen=True, init=False)
class CPOptions:
    """Settings of one ``cp_attention`` call; every rank of the CP group must pass equal ones
    (the agreement check compares them, except ``timeout_s``).

    Attributes:
        timeout_s: bound on every blocking wait of the call, seconds.
        backend: kernel backend name (``torch``, ``flash_attn``, ``cudnn``, ``reference``, or
            any registered one), a backend object, or ``None`` for the automatic choice.
        topology: default topology string for algorithms that use one (``charm``, ``auto``)
            when the call's ``topology`` argument is ``None``; ``None`` means the probe.
        check: :class:`Check`: ``every_call``: the ranks agree on the call before any data
            moves and report their status after it (docs/api.md, failure model); ``off``
            skips both: a mismatch is then undetected, a rank-local error leaves its peers with
            wrong results or waiting (in a forward + backward step, the others wait in the
            backward until their bound), and failed transfers leave the communicators as they
            are.
        ablation: :class:`Ablation`: ``none``; ``compute_only`` (no communication) or
            ``comm_only`` (no kernels) for timing a plan's parts; results are then meaningless.
        model_profile: the cluster the performance model predicts with, for ``algo="auto"``
            and for an algorithm setting left to the model (``auto``): a built-in profile name
            or a profile file written by ``charm-megatron model --calibrate``
            (:func:`charm_megatron.model.auto_cluster`); ``None``: a generic cluster for
            ``auto``, and the algorithms' ``auto`` settings off.
        partials: the wire dtype of partials, a :class:`~charm_megatron.plan.vocab.Dtype`:
            ``input`` (default) sends partial outputs and gradient
            partials in the input dtype; ``fp32`` in their fp32 accumulators (twice the bytes
            under bf16, one rounding less per hop; what ring-flash-attention's ring and the
            paper's send; ``CHARM_PARTIALS``).
        settings: the algorithm settings given, as sorted ``(name, value)`` pairs; pass them
            by name instead (``CPOptions(pass_order="joint", split_visiting="on")``, any
            setting of :func:`charm_megatron.plan.registry.all_settings`); the others take
            their declared defaults. Read one with ``opts.pass_order`` or :meth:`setting`.
        auto_algos: the algorithms ``algo="auto"`` may pick (a tuple of registered names, or a
            comma-separated string); ``None``: every registered algorithm that can run the
            call (an entry that refuses it, e.g. ``a2a`` with heads that do not divide by the
            CP size, never counts).
        auto_tune: ``None`` (default): ``algo="auto"`` runs the model's pick. A margin
            ``>= 1`` (``inf``: every candidate): the first ``auto`` call of each shape times
            every algorithm the model predicts within that factor of its fastest, forward and
            backward on the call's own inputs, the ranks share their times, and all run the
            one whose slowest rank was fastest from then on (ops/auto_tune.py). Dense (sbhd)
            calls only; packed ones take the model's pick.
        auto_tune_file: a pick file (JSON) for ``auto_tune``, ``None``: none. With
            ``auto_tune`` on, the first call reads it if it exists and runs its picks without
            measuring; rank 0 writes every pick it holds to it after each measurement (a later
            run passes it to run the same algorithms: bitwise the same results). Not compared
            by the agreement check (paths may differ); the picks held are. Ignored with
            ``auto_tune`` off.
        transport: how the executor moves bytes (:mod:`charm_megatron.ops.transport`):
            ``None`` (default): torch.distributed; a name registered with
            :func:`~charm_megatron.ops.transport.register_transport` in this process (e.g. the
            bench's software links, ``software_links``); or a transport object. The agreement
            check compares its name (``CHARM_TRANSPORT``).
    """

    timeout_s: float
    backend: str | AttentionBackend | None
    topology: str | None
    check: Check
    ablation: Ablation
    model_profile: str | None
    settings: tuple[tuple[str, object], ...]
    auto_algos: tuple[str, ...] | None
    partials: Dtype
    auto_tune: float | None
    auto_tune_file: str | None
    transport: str | Transport | None

    def __init__(self, *, timeout_s: float = 600.0,
                 backend: str | AttentionBackend | None = None, topology: str | None = None,
                 check: Check | str = Check.EVERY_CALL, ablation: Ablation | str = Ablation.NONE,
                 model_profile: str | None = None,
                 settings: tuple[tuple[str, object], ...] | Mapping[str, object] = (),
                 auto_algos: str | Sequence[str] | None = None,
                 partials: Dtype | str = Dtype.INPUT,
                 auto_tune: float | str | None = None,
                 auto_tune_file: str | os.PathLike | None = None,
                 transport: str | Transport | None = None,
                 **algorithm_settings: object) -> None:
        given = dict(settings.items() if isinstance(settings, Mapping) else settings)
        given.update(algorithm_settings)
        known = registry.all_settings()
        unknown = sorted(set(given) - set(known))
        if unknown:
            raise ValueError(f"cp_attention: unknown option(s) {', '.join(unknown)}; the "
                             f"options are {', '.join(f.name for f in fields(self))} and the "
                             f"algorithms' settings {', '.join(known) or '(none)'}")
        parsed = tuple(sorted((name, known[name].parse(value, "cp_attention"))
                              for name, value in given.items()))
        for name, value in (("timeout_s", timeout_s), ("backend", backend),
                            ("topology", topology), ("check", _enum(Check, check, "check",
                                                                    "CHARM_CHECK")),
                            ("ablation", _enum(Ablation, ablation, "ablation", None)),
                            ("model_profile", model_profile), ("settings", parsed),
                            ("auto_algos", _auto_algos(auto_algos)),
                            ("partials", _enum(Dtype, partials, "partials",
                                               "CHARM_PARTIALS")),
                            ("auto_tune", _auto_tune(auto_tune)),
                            ("auto_tune_file", _auto_tune_file(auto_tune_file)),
                            ("transport", check_transport(transport))):
            object.__setattr__(self, name, value)
        if not (isinstance(timeout_s, (int, float)) and not isinstance(timeout_s, bool)
                and math.isfinite(timeout_s) and timeout_s > 0):
            raise ValueError(f"cp_attention: timeout_s={timeout_s!r} (CHARM_COMM_TIMEOUT_S) "
                             "must be a positive number of seconds")
        if model_profile is not None and not (isinstance(model_profile, str)
                                              and model_profile.strip()):
            raise ValueError(f"cp_attention: model_profile={model_profile!r} "
                             "(CHARM_MODEL_PROFILE) must be a profile name or file, or None")

    def __getattr__(self, name: str):
        # An algorithm setting by name (opts.pass_order); only reached when no field matches.
        if name.startswith("__"):
            raise AttributeError(name)
        if name in registry.all_settings():
            return self.setting(name)
        raise AttributeError(f"'CPOptions' object has no attribute {name!r}")

    def setting(self, name: str):
        """The value of algorithm setting ``name``: as given, else its declared default."""
        given = dict(self.settings)
        if name in given:
            return given[name]
        return registry.all_settings()[name].default

    def values(self, **overrides: object) -> Values:
        """Every registered algorithm setting's value (``overrides`` first, then these
        options', then the defaults): what a call's plans are keyed on."""
        known = registry.all_settings()
        parsed = {name: known[name].parse(value, "cp_attention") if name in known else value
                  for name, value in overrides.items()}
        return registry.settings_values(**{**dict(self.settings), **parsed})

    @classmethod
    def from_env(cls, environ: Mapping[str, str] | None = None, **overrides) -> CPOptions:
        """Defaults, then the ``CHARM_*`` variables of ``environ`` (``os.environ``), then
        ``overrides``."""
        env = os.environ if environ is None else environ
        values: dict = {}
        for var, (name, _) in ENV_VARS.items():
            raw = env.get(var, "").strip()
            if not raw:
                continue
            if name == "timeout_s":
                try:
                    values[name] = float(raw)
                except ValueError:
                    raise ValueError(f"cp_attention: {var}={raw!r} is not a number of "
                                     "seconds") from None
            else:
                values[name] = raw
        values.update(overrides)
        return cls(**values)

    def with_(self, **changes) -> CPOptions:
        """A copy with ``changes`` (fields or algorithm settings by name, e.g.
        ``opts.with_(ablation="compute_only")``)."""
        own = {f.name: getattr(self, f.name) for f in fields(self) if f.name != "settings"}
        settings = dict(self.settings)
        for name, value in changes.items():
            (own if name in own else settings)[name] = value
        return CPOptions(**own, settings=settings)

    def topology_for(self, algo: str, topology) -> tuple[object, str] | None:
        """The topology spec a call of ``algo`` runs on and where it came from (for errors):
        ``None`` (one flat group) for an algorithm that does not use the topology, whatever was
        given; else ``topology``, or when that is ``None`` this value's default
        (``CHARM_TOPOLOGY``), else the probe (``"auto"``). The one statement of this rule (the
        Megatron layer and the benchmark call it too)."""
        if not registry.uses_topology(algo):
            return None
        return self.topology_spec(topology)

    def topology_spec(self, topology) -> tuple[object, str]:
        """The topology spec a call that runs on the topology uses, and where it came from:
        ``topology``, or when that is ``None`` this value's default (``CHARM_TOPOLOGY``), else
        the probe (``"auto"``)."""
        if topology is not None:
            return topology, f"topology={str(topology)!r}"
        if self.topology:
            return self.topology, f"CHARM_TOPOLOGY={self.topology!r}"
        return "auto", "the probe (CHARM_TOPOLOGY unset)"

    @property
    def compute(self) -> bool:
        return self.ablation is not Ablation.COMM_ONLY

    @property
    def comm(self) -> bool:
        return self.ablation is not Ablation.COMPUTE_ONLY

    @property
    def wide_partials(self) -> bool:
        return self.partials is Dtype.FP32

    @property
    def checked(self) -> bool:
        return self.check is not Check.OFF

    @property
    def backend_name(self) -> str:
        """What the agreement check compares for the backend."""
        if self.backend is None or isinstance(self.backend, str):
            return self.backend or "auto"
        return str(getattr(self.backend, "name", type(self.backend).__name__))

    @property
    def transport_name(self) -> str:
        """What the agreement check compares for the transport (``torch`` by default)."""
        return transport_name(self.transport)


def _auto_algos(value) -> tuple[str, ...] | None:
    """``auto_algos`` as a tuple of registered names (``None``: all); ValueError naming them."""
    if value is None:
        return None
    names = [v.strip() for v in value.split(",")] if isinstance(value, str) else list(value)
    names = [n for n in names if n]
    bad = [n for n in names if n not in registry.names()]
    if bad or not names:
        raise ValueError(f"cp_attention: auto_algos={value!r} (CHARM_AUTO_ALGOS): "
                         f"{'unknown ' + ', '.join(map(repr, bad)) if bad else 'empty'}; give "
                         f"some of {', '.join(registry.names())}, comma-separated")
    return tuple(dict.fromkeys(names))


def _auto_tune(value) -> float | None:
    """``auto_tune`` as a margin >= 1 (``inf``: all), or ``None`` (off); ValueError naming it."""
    if value is None or value is False:
        return None
    if value is True:
        return DEFAULT_TUNE_MARGIN
    if isinstance(value, str):
        word = value.strip().lower()
        if word in ("", "off", "0", "false", "no"):
            return None
        if word in ("on", "1", "true", "yes"):
            return DEFAULT_TUNE_MARGIN
        if word == "all":
            return math.inf
        try:
            value = float(word)
        except ValueError:
            value = math.nan
    if isinstance(value, (int, float)) and not math.isnan(value) and value >= 1:
        return float(value)
    raise ValueError(f"cp_attention: auto_tune={value!r} (CHARM_AUTO_TUNE): give off, on "
                     f"(margin {DEFAULT_TUNE_MARGIN}), a margin >= 1 such as 1.3, or all")


def _auto_tune_file(value) -> str | None:
    """``auto_tune_file`` as a path string (``None``: none); ValueError naming it."""
    if value is None:
        return None
    if isinstance(value, os.PathLike):
        value = os.fspath(value)
    if isinstance(value, str) and value.strip():
        return value.strip()
    raise ValueError(f"cp_attention: auto_tune_file={value!r} (CHARM_AUTO_TUNE_FILE) must be "
                     "a file path or None")


def _enum(kind, value, name: str, env: str | None):
    try:
        return kind(value)
    except ValueError:
        var = f" ({env})" if env else ""
        raise ValueError(f"cp_attention: {name}={value!r}{var}; choose one of "
                         f"{', '.join(m.value for m in kind)}") from None


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
