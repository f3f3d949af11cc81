"""Experiment configs: the YAML schema, the loader and the checks (see ``docs/configs.md``).

A config file describes one model (``model``, ``tokenizer``, ``data``, ``training``,
``optimizer``, ``parallel``, ``system``, ``logging`` sections) and, under ``runs:``, named runs
that override some of its settings with *flat* leaf keys (``seq_length: 8192``)::

    cfg = load_config("gpt-350m", run="scale-s4096-gb8", overrides={"DATA_PATH": "/d/x"})
    cfg["seq_length"], cfg.world_size, cfg.data_parallel_size

The schema is a set of pydantic v2 models (:mod:`charm_megatron.launch.schema`: one per section,
:class:`RunSettings`, :class:`ConfigFile` for the whole file). This module adds what
pydantic does not know: the key path of a value that a run or ``--set`` overrode (provenance),
"did you mean" for unknown keys, ``${VARIABLE}`` substitution, and the cross-key checks a job
would otherwise only fail at Megatron start-up, after waiting in the SLURM queue.

Every leaf key has one home section, so a leaf name is unique in the whole schema; ``--set``
accepts ``seq_length=4096`` and ``training.seq_length=4096`` alike, and an UPPER_CASE name
(``--set DATA_PATH=...``) sets a ``${VARIABLE}``. Precedence, lowest first: schema default,
section value, run value, override. Every error is a :class:`ConfigError` whose message starts
with the path of the key responsible (``runs.scale-s2048-gb16.seq_length: ...``).

No torch or Megatron: the ``args`` subcommand and the SLURM scripts use it on login nodes.
"""

from __future__ import annotations

import difflib
import os
import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from importlib import resources
from pathlib import Path
from typing import Any

import yaml
from pydantic import BaseModel, ValidationError

from charm_megatron.launch.schema import (
    RUN_KEYS,
    SCHEMA,
    SECTION_MODELS,
    SECTIONS,
    TOKENIZER_KEYS,
    TOP_KEYS,
    ConfigFile,
    Leaf,
    RunSettings,
    describe,
)
from charm_megatron.topology.core import Topology

__all__ = [
    "SCHEMA",
    "SECTIONS",
    "ConfigError",
    "ConfigFile",
    "Leaf",
    "ResolvedRun",
    "RunSettings",
    "config_path",
    "list_runs",
    "load_config",
    "packaged_configs",
    "parse_set",
]

_BY_NAME: dict[str, Leaf] = {f.name: f for f in SCHEMA}
_TOPOLOGY_LEVELS = ("auto", "node", "numa", "flat")


class ConfigError(ValueError):
    """A config file, run or override is invalid; the message starts with the key's path."""


# --------------------------------------------------------------------------- pydantic errors
def _path(loc: Sequence[Any]) -> str:
    return ".".join(str(p) for p in loc if p != "[key]")


def _unknown(path: str, key: str, known: Sequence[str], hint: str = "") -> ConfigError:
    near = [] if hint else difflib.get_close_matches(key, list(known), n=1)
    did = f"; did you mean '{near[0]}'?" if near else ""
    return ConfigError(f"{path}: unknown key{did}{hint}")


def _unknown_key(loc: tuple[Any, ...]) -> ConfigError:
    key, path = str(loc[-1]), _path(loc)
    home = _BY_NAME.get(key)
    if len(loc) == 1:
        hint = f" ('{key}' belongs in section '{home.section}')" if home else ""
        return _unknown(path, key, [*TOP_KEYS, *SECTIONS], hint)
    if loc[0] == "runs":
        hint = (" (run settings are flat leaf keys, e.g. 'seq_length: 4096', not sections)"
                if key in SECTIONS else "")
        return _unknown(path, key, [*_BY_NAME, *RUN_KEYS], hint)
    hint = f" ('{key}' belongs in section '{home.section}')" if home else ""
    return _unknown(path, key, list(SECTION_MODELS[loc[0]].model_fields), hint)


def _explain(err: Mapping[str, Any], path: str | None = None) -> ConfigError:
    """One pydantic error as a :class:`ConfigError` in this module's words."""
    loc, kind, value = tuple(err["loc"]), err["type"], err.get("input")
    where = path or _path(loc)
    if kind == "extra_forbidden":
        return _unknown_key(loc) if path is None else _unknown(where, str(loc[-1]), list(_BY_NAME))
    if "[key]" in loc:
        if loc[0] == "variables":
            return ConfigError(f"{where}: variable names are UPPER_CASE (letters, digits, '_')")
        return ConfigError(f"{where}: a run name must start with a letter or digit and hold only "
                           "letters, digits, '.', '_' and '-' (it names a directory)")
    if loc == ("name",) and kind == "string_pattern_mismatch":
        return ConfigError("name: must start with a letter or digit and hold only letters, "
                           "digits, '.', '_' and '-' (it names a directory)")
    if loc == ("runs",):
        if kind == "missing":
            return ConfigError("runs: missing required key (a mapping of run name -> settings)")
        return ConfigError(f"runs: expected a non-empty mapping of run name -> settings, "
                           f"got {describe(value)}")
    if kind == "model_type":
        what = "settings" if loc[0] == "runs" else "keys"
        return ConfigError(f"{where}: expected a mapping of {what}, got {describe(value)}")
    if kind in ("strs_type", "args_type", "variable_type"):  # ours: the message says it all
        return ConfigError(f"{where}: {err['msg']}")
    f = _BY_NAME.get(str(loc[-1])) if loc else None
    if value is None and f is not None and not f.nullable:
        use = ("it is required" if f.required else
               f"omit the key to use the default {f.default!r}")
        return ConfigError(f"{where}: must not be null (expected {f.kind}; {use})")
    ctx = err.get("ctx") or {}
    text = {
        "int_type": "expected an integer", "bool_type": "expected true or false",
        "float_type": "expected a number", "string_type": "expected a string",
        "dict_type": "expected a mapping",
    }.get(kind)
    if text is not None:
        return ConfigError(f"{where}: {text}, got {describe(value)}")
    if kind == "finite_number":
        return ConfigError(f"{where}: expected a finite number, got {value!r}")
    if kind == "literal_error" and f is not None and f.choices:
        return ConfigError(f"{where}: {value!r} is not one of {', '.join(map(str, f.choices))}")
    if kind == "greater_than_equal":
        return ConfigError(f"{where}: must be >= {ctx['ge']:g}, got {value!r}")
    return ConfigError(f"{where}: {err['msg']}")


def _validate(model: Any, data: Any, path: str | None = None) -> Any:
    try:
        return model.model_validate(data)
    except ValidationError as exc:
        raise _explain(exc.errors()[0], path) from None


# --------------------------------------------------------------------------- file lookup
def packaged_configs() -> dict[str, Path]:
    """The configs shipped in ``charm_megatron/configs``: name (file stem) -> path."""
    root = resources.files("charm_megatron") / "configs"
    out: dict[str, Path] = {}
    if root.is_dir():
        for entry in root.iterdir():
            if entry.name.endswith(".yaml"):
                out[entry.name[: -len(".yaml")]] = Path(str(entry))
    return dict(sorted(out.items()))


def config_path(config: str | os.PathLike[str]) -> Path:
    """A config file's path: an existing file, else a packaged config by name (``gpt-350m``)."""
    p = Path(config)
    if p.is_file():
        return p
    shipped = packaged_configs()
    name = p.name[: -len(".yaml")] if p.name.endswith(".yaml") else p.name
    if p.parent == Path(".") and name in shipped:
        return shipped[name]
    raise ConfigError(
        f"{config}: no such config file, and not a packaged config "
        f"(packaged: {', '.join(shipped) or 'none'})"
    )


def _read(path: Path) -> tuple[dict[str, Any], ConfigFile]:
    """The file's raw mapping (for provenance) and its validated model."""
    try:
        data = yaml.safe_load(path.read_text(encoding="utf-8"))
    except yaml.YAMLError as exc:
        raise ConfigError(f"{path}: not valid YAML: {exc}") from None
    if not isinstance(data, dict):
        raise ConfigError(f"{path}: the top level must be a mapping, got {type(data).__name__}")
    return data, _validate(ConfigFile, data)


def list_runs(config: str | os.PathLike[str]) -> list[str]:
    """The run names of a config, in file order (the file is validated, not a run's values)."""
    return list(_read(config_path(config))[1].runs)


def parse_set(items: Sequence[str]) -> dict[str, str]:
    """``["seq_length=4096", "DATA_PATH=/d/x"]`` -> a dict for ``load_config(overrides=...)``.

    Values stay text here; :func:`load_config` parses them per key type.
    """
    out: dict[str, str] = {}
    for item in items:
        key, sep, value = item.partition("=")
        if not sep or not key.strip():
            raise ConfigError(f"--set {item}: expected KEY=VALUE (e.g. seq_length=4096 or "
                              "DATA_PATH=/data/pile_text_document)")
        out[key.strip()] = value
    return out


# --------------------------------------------------------------------------- variables
# ${NAME} or ${NAME:-default}; $${ is a literal "${". Our own ~20 lines rather than OmegaConf:
# the configs need env/--set/variables: precedence, an error naming every unset variable with
# its key, and only values the command uses resolved - and no new dependency.
_VAR_REF = re.compile(r"\$\$\{|\$\{([A-Za-z_][A-Za-z0-9_]*)(?::-([^}]*))?\}")
_VAR_NAME = re.compile(r"^[A-Z_][A-Z0-9_]*$")


def _substitute(text: str, path: str, variables: Mapping[str, str | None],
                missing: list[tuple[str, str]]) -> str:
    """Fill ``${NAME}`` / ``${NAME:-default}``; unset names are appended to ``missing``."""

    def one(m: re.Match[str]) -> str:
        if m.group(0) == "$${":
            return "${"
        value = variables.get(m.group(1))
        if value is None or value == "":
            if m.group(2) is not None:
                return m.group(2)
            missing.append((path, m.group(1)))
            return m.group(0)
        return value

    return _VAR_REF.sub(one, text)


def _missing_error(missing: Sequence[tuple[str, str]]) -> ConfigError:
    path, name = missing[0]
    names = list(dict.fromkeys(n for _, n in missing))
    also = "".join(f"; also ${{{n}}} ({p})" for p, n in missing[1:])
    how = " ".join(f"--set {n}=..." for n in names)
    return ConfigError(f"{path}: variable ${{{name}}} is not set{also}; export it or pass "
                       f"{how} (or give it a default under 'variables:')")


def _variables(cfg: ConfigFile, overrides: Mapping[str, Any]) -> dict[str, str | None]:
    # Lowest first: the config's defaults, the environment, --set.
    out: dict[str, str | None] = {
        name: None if value is None else str(value) for name, value in (cfg.variables or {}).items()
    }
    out.update(os.environ)
    for name, value in overrides.items():
        if _VAR_NAME.match(name) and name not in _BY_NAME:
            out[name] = None if value is None else str(value)
    return out


# --------------------------------------------------------------------------- resolved run
@dataclass(frozen=True)
class ResolvedRun:
    """One run of a config with every key merged, variables substituted and checks passed.

    ``values`` holds every leaf key of :data:`SCHEMA` (``None`` where unset and optional);
    ``sources`` says where each value came from (``training.seq_length``,
    ``runs.<run>.seq_length``, ``--set seq_length`` or ``default``).
    """

    config_name: str
    run_name: str
    path: Path | None
    values: Mapping[str, Any]
    sources: Mapping[str, str]
    extra_args: tuple[str, ...] = ()
    description: str = ""
    run_names: tuple[str, ...] = field(default=())

    def __getitem__(self, key: str) -> Any:
        return self.values[key]

    @property
    def world_size(self) -> int:
        """``nodes x gpus_per_node``: the number of ranks."""
        return int(self["nodes"]) * int(self["gpus_per_node"])

    @property
    def model_parallel_size(self) -> int:
        """``TP x PP x CP``."""
        return (int(self["tensor_model_parallel_size"]) * int(self["pipeline_model_parallel_size"])
                * int(self["context_parallel_size"]))

    @property
    def data_parallel_size(self) -> int:
        """``world_size / (TP x PP x CP)``, as Megatron computes it."""
        return self.world_size // self.model_parallel_size

    def summary(self) -> dict[str, Any]:
        """The facts a launcher needs, JSON-ready (used by ``args --format json`` / ``env``)."""
        return {
            "config": self.config_name,
            "run": self.run_name,
            "config_path": str(self.path) if self.path else None,
            "nodes": self["nodes"],
            "gpus_per_node": self["gpus_per_node"],
            "world_size": self.world_size,
            "tp": self["tensor_model_parallel_size"],
            "pp": self["pipeline_model_parallel_size"],
            "cp": self["context_parallel_size"],
            "dp": self.data_parallel_size,
            "seq_length": self["seq_length"],
            "global_batch_size": self["global_batch_size"],
            "micro_batch_size": self["micro_batch_size"],
            "charm_topology": self["charm_topology"],
        }


# --------------------------------------------------------------------------- cross-key checks
def _rank(source: str) -> int:
    """How specific a value's source is: --set 3, a run 2, a section 1, the default 0."""
    if source.startswith("--set"):
        return 3
    if source.startswith("runs."):
        return 2
    return 0 if source == "default" else 1


def _check_values(v: Mapping[str, Any], src: Mapping[str, str], run: str) -> None:
    """What must fail before a job is queued: required keys, the world / parallel-size /
    batch / head divisibility that Megatron would only reject at start-up, the data and
    tokenizer files, and the CP topology. Each error names the key most likely at fault."""

    def at(key: str) -> str:
        s = src[key]
        return _BY_NAME[key].path + " (default)" if s == "default" else s

    def where(key: str) -> str:
        return _BY_NAME[key].path if src[key] == "default" else src[key]

    def blame(*keys: str) -> str:  # the most specifically set of keys (ties: the first)
        return max(keys, key=lambda k: _rank(src[k]))

    for f in SCHEMA:
        if f.required and v[f.name] is None:
            raise ConfigError(f"{f.path}: missing required key ({f.help}); set it under "
                              f"'{f.section}:' or in runs.{run}")
    tp, pp, cp = (v["tensor_model_parallel_size"], v["pipeline_model_parallel_size"],
                  v["context_parallel_size"])
    nodes, per_node = v["nodes"], v["gpus_per_node"]
    world = nodes * per_node
    seq, heads, groups = v["seq_length"], v["num_attention_heads"], v["num_query_groups"]
    mbs, gbs = v["micro_batch_size"], v["global_batch_size"]
    dp = world // (tp * pp * cp) if world % (tp * pp * cp) == 0 else 0
    maxpos = v["max_position_embeddings"]
    # (failed?, key to blame, message), checked in order; later rules may assume earlier ones.
    rules: list[tuple[Any, str, Any]] = [
        (seq % (2 * cp), "seq_length", lambda: (
            f"{seq} is not divisible by 2·CP = {2 * cp} (context_parallel_size {cp} from "
            f"{where('context_parallel_size')}): each CP rank holds two sequence chunks, "
            "Megatron's causal load balancing")),
        (world % cp, blame("context_parallel_size", "nodes", "gpus_per_node"), lambda: (
            f"CP {cp} does not divide the GPU count nodes × gpus_per_node = {nodes} × "
            f"{per_node} = {world}")),
        (world % (tp * pp * cp), blame("tensor_model_parallel_size",
                                       "pipeline_model_parallel_size", "context_parallel_size"),
         lambda: (f"TP·PP·CP = {tp}·{pp}·{cp} = {tp * pp * cp} does not divide the world size "
                  f"nodes × gpus_per_node = {world}")),
        (dp and gbs % (mbs * dp), "global_batch_size", lambda: (
            f"{gbs} is not divisible by micro_batch_size × DP = {mbs} × {dp} = {mbs * dp} "
            f"(DP = world {world} / (TP·PP·CP {tp * pp * cp}))")),
        (heads % tp, "num_attention_heads", lambda: (
            f"{heads} heads are not divisible by tensor_model_parallel_size {tp}")),
        (groups is not None and heads % groups, "num_query_groups", lambda: (
            f"num_attention_heads {heads} is not divisible by num_query_groups {groups}")),
        (groups is not None and groups % tp, "num_query_groups", lambda: (
            f"{groups} query groups are not divisible by tensor_model_parallel_size {tp}")),
        (v["hidden_size"] % heads, "hidden_size", lambda: (
            f"{v['hidden_size']} is not divisible by num_attention_heads {heads}")),
        (v["num_layers"] % pp, "num_layers", lambda: (
            f"{v['num_layers']} layers are not divisible by pipeline_model_parallel_size {pp}")),
        (maxpos is not None and maxpos < seq, "max_position_embeddings", lambda: (
            f"{maxpos} is less than seq_length {seq}")),
        (v["min_lr"] > v["lr"], "min_lr", lambda: (
            f"{v['min_lr']!r} is greater than lr {v['lr']!r}")),
        (v["lr_warmup_fraction"] is not None and v["lr_warmup_iters"] not in (None, 0),
         "lr_warmup_iters", lambda: "set lr_warmup_fraction or lr_warmup_iters, not both"),
        (v["sequence_parallel"] and tp > 1 and seq % tp, "seq_length", lambda: (
            f"{seq} is not divisible by tensor_model_parallel_size {tp} (needed by "
            "sequence_parallel)")),
    ]
    for failed, key, message in rules:
        if failed:
            raise ConfigError(f"{at(key)}: {message()}")
    if not v["mock_data"] and v["data_path"] is None:
        raise ConfigError("data.data_path: missing; give a data prefix (e.g. '${DATA_PATH}') "
                          "or set mock_data: true")
    tok = v["tokenizer_type"]
    needs = {"GPT2BPETokenizer": ("vocab_file", "merge_file"),
             "NullTokenizer": ("vocab_size",)}.get(tok, ("tokenizer_model",))
    for key in needs:
        if v[key] is None:
            example = " (e.g. '${VOCAB_FILE}')" if tok == "GPT2BPETokenizer" else ""
            raise ConfigError(f"{_BY_NAME[key].path}: required with tokenizer_type {tok}"
                              f"{example}")
    topology = v["charm_topology"]
    if topology.strip().lower() not in _TOPOLOGY_LEVELS:
        try:  # the runtime's own parser, so a config never passes here and fails at start-up
            Topology.parse(topology, cp_size=cp)
        except ValueError as exc:
            raise ConfigError(f"{at('charm_topology')}: {exc}") from None


# --------------------------------------------------------------------------- entry point
def _given(model: BaseModel | None) -> dict[str, Any]:
    """The keys a section or run set explicitly (pydantic's ``model_fields_set``)."""
    if model is None:
        return {}
    return {k: getattr(model, k) for k in model.model_fields_set if k in _BY_NAME}


def _override(key: str, value: Any) -> tuple[str, Any] | None:
    """``--set key=value`` as (leaf name, checked value); ``None`` for a ``${VARIABLE}``."""
    section, dot, rest = key.partition(".")
    name = rest if dot and section in SECTIONS else key
    f = _BY_NAME.get(name)
    if f is None or (dot and f.section != section):
        if not dot and _VAR_NAME.match(key):
            return None
        raise _unknown(f"--set {key}", name, list(_BY_NAME))
    # Text from the command line is YAML for non-string keys ("4096" -> 4096), so
    # --set split=98,2,0 stays the string it looks like.
    if isinstance(value, str) and f.kind not in ("str", "strs"):
        try:
            value = yaml.safe_load(value) if value.strip() else None
        except yaml.YAMLError:
            pass  # reported as the wrong type
    return name, getattr(_validate(RunSettings, {name: value}, f"--set {key}"), name)


def load_config(
    config: str | os.PathLike[str],
    run: str | None = None,
    overrides: Mapping[str, Any] | None = None,
) -> ResolvedRun:
    """Load ``config`` (a path or a packaged name), pick ``run``, apply ``overrides``, check.

    * ``run``: a name under ``runs:``; may be omitted when the config has exactly one run.
    * ``overrides``: leaf keys (``seq_length``), section paths (``training.seq_length``) or
      UPPER_CASE variable names (``DATA_PATH``) -> value; text values of non-string keys are
      parsed as YAML (``"4096"`` -> 4096, ``"true"`` -> True), as ``--set`` gives them.
    * ``${VAR}`` / ``${VAR:-default}`` in string values are filled from ``overrides``, then the
      environment, then the config's ``variables:``; only values that end up in the command
      are resolved (``data_path`` is not needed with ``mock_data``).

    Raises :class:`ConfigError` naming the key path on any problem.
    """
    path = config_path(config)
    _, cfg = _read(path)
    overrides = dict(overrides or {})
    name = cfg.name or path.name.removesuffix(".yaml")
    if run is None:
        if len(cfg.runs) != 1:
            raise ConfigError(f"runs: {path.name} has {len(cfg.runs)} runs; choose one with "
                              f"--run ({', '.join(cfg.runs)})")
        run = next(iter(cfg.runs))
    if run not in cfg.runs:
        near = difflib.get_close_matches(run, list(cfg.runs), n=1)
        did = f" (did you mean '{near[0]}'?)" if near else ""
        raise ConfigError(f"runs.{run}: no such run in {path.name}{did}; runs: "
                          f"{', '.join(cfg.runs)}")
    body = cfg.runs[run]

    values: dict[str, Any] = {f.name: None if f.required else f.default for f in SCHEMA}
    sources = {f.name: "default" for f in SCHEMA}
    for section in SECTIONS:
        for key, value in _given(getattr(cfg, section)).items():
            values[key], sources[key] = value, f"{section}.{key}"
    for key, value in _given(body).items():
        values[key], sources[key] = value, f"runs.{run}.{key}"
    for key, value in overrides.items():
        checked = _override(key, value)
        if checked is not None:
            values[checked[0]], sources[checked[0]] = checked[1], f"--set {key}"
    extra = [*(cfg.extra_args or ()), *((body.extra_args if body else None) or ())]

    # Drop what the command will not use, so its ${VARIABLES} need not be set.
    unused = {"data_path"} if values["mock_data"] else set()
    if values["tokenizer_type"] is not None:
        used = TOKENIZER_KEYS[values["tokenizer_type"]]
        unused |= {f.name for f in SCHEMA if f.section == "tokenizer"} - {"tokenizer_type", *used}
    for key in unused:
        values[key] = None
    variables = _variables(cfg, overrides)
    missing: list[tuple[str, str]] = []
    for key, value in values.items():
        p = sources[key] if sources[key] != "default" else _BY_NAME[key].path
        if isinstance(value, str):
            values[key] = _substitute(value, p, variables, missing)
        elif isinstance(value, list):
            values[key] = [_substitute(x, f"{p}[{i}]", variables, missing)
                           for i, x in enumerate(value)]
    extra_args = tuple(_substitute(str(a), "extra_args", variables, missing) for a in extra)
    if missing:
        raise _missing_error(missing)

    if values["ffn_hidden_size"] is None and values["hidden_size"]:
        values["ffn_hidden_size"] = 4 * values["hidden_size"]
    _check_values(values, sources, run)
    if values["max_position_embeddings"] is None:
        values["max_position_embeddings"] = values["seq_length"]
    desc = (body.description if body else None) or cfg.description or ""
    return ResolvedRun(config_name=str(name), run_name=run, path=path, values=values,
                       sources=sources, extra_args=extra_args, description=str(desc),
                       run_names=tuple(cfg.runs))

