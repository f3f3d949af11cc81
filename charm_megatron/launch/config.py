"""Experiment configs: the YAML schema, the loader and the checks (see ``docs/configs.md``).

A config file describes one model (``model``, ``tokenizer``, ``data``, ``training``,
``optimizer``, ``parallel``, ``system``, ``logging`` sections) and, under ``runs:``, named runs
that override some of its settings with *flat* leaf keys (``seq_length: 8192``)::

    cfg = load_config("gpt-350m", run="scale-s4096-gb8", overrides={"DATA_PATH": "/d/x"})
    cfg["seq_length"], cfg.world_size, cfg.data_parallel_size

Every leaf key has one home section, so a leaf name is unique in the whole schema; ``--set``
accepts ``seq_length=4096`` and ``training.seq_length=4096`` alike, and an UPPER_CASE name
(``--set DATA_PATH=...``) sets a ``${VARIABLE}``. Precedence, lowest first: schema default,
section value, run value, override. Every error is a :class:`ConfigError` whose message starts
with the path of the key responsible (``runs.scale-s2048-gb16.seq_length: ...``).

Pure Python plus PyYAML: the ``args`` subcommand and the SLURM scripts use it on login nodes
without torch or Megatron.
"""

from __future__ import annotations

import difflib
import math
import os
import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from importlib import resources
from pathlib import Path
from typing import Any

import yaml

__all__ = [
    "SCHEMA",
    "SECTIONS",
    "ConfigError",
    "Field",
    "ResolvedRun",
    "config_path",
    "list_runs",
    "load_config",
    "packaged_configs",
    "parse_set",
]


class ConfigError(ValueError):
    """A config file, run or override is invalid; the message starts with the key's path."""


@dataclass(frozen=True)
class Field:
    """One leaf key of the schema.

    ``kind`` is one of ``int``, ``float``, ``str``, ``bool``, ``strs`` (a string or a list of
    strings). ``flag`` is the Megatron-LM option the key maps to one-to-one (``None`` when the
    argv builder treats the key specially). ``minimum`` bounds numbers from below.
    """

    name: str
    section: str
    kind: str
    default: Any = None
    required: bool = False
    nullable: bool = True
    choices: tuple[Any, ...] | None = None
    minimum: float | None = None
    flag: str | None = None
    help: str = ""

    @property
    def path(self) -> str:
        """``section.name``, the key's path in a config file."""
        return f"{self.section}.{self.name}"


def _f(section: str, name: str, kind: str, **kw: Any) -> Field:
    # Optional keys (not required, default None) may be null; keys with a real default may not,
    # so a stray ``key:`` with no value in YAML is reported instead of silently dropping a flag.
    if "nullable" not in kw:
        kw["nullable"] = kw.get("default") is None and not kw.get("required", False)
    return Field(name=name, section=section, kind=kind, **kw)


# Megatron-LM's tokenizer choices (megatron/training/arguments.py, --tokenizer-type).
_TOKENIZERS = (
    "GPT2BPETokenizer", "NullTokenizer", "HuggingFaceTokenizer", "SentencePieceTokenizer",
    "GPTSentencePieceTokenizer", "Llama2Tokenizer", "TikTokenizer",
)

#: Schema order is also the order of the generated Megatron arguments.
SCHEMA: tuple[Field, ...] = (
    # ---- model: the GPT shape
    _f("model", "num_layers", "int", required=True, minimum=1, flag="--num-layers",
       help="transformer layers"),
    _f("model", "hidden_size", "int", required=True, minimum=1, flag="--hidden-size",
       help="model width"),
    _f("model", "ffn_hidden_size", "int", minimum=1, flag="--ffn-hidden-size",
       help="MLP width; default 4 x hidden_size"),
    _f("model", "num_attention_heads", "int", required=True, minimum=1,
       flag="--num-attention-heads", help="query heads"),
    _f("model", "num_query_groups", "int", minimum=1,
       help="key/value heads (grouped-query attention); null = multi-head attention"),
    _f("model", "max_position_embeddings", "int", minimum=1, flag="--max-position-embeddings",
       help="default seq_length"),
    _f("model", "position_embedding_type", "str", default="rope",
       choices=("rope", "learned_absolute"), flag="--position-embedding-type",
       help="position embedding"),
    _f("model", "rotary_base", "int", minimum=1, flag="--rotary-base",
       help="RoPE base; null = Megatron's default"),
    _f("model", "normalization", "str", default="LayerNorm", choices=("LayerNorm", "RMSNorm"),
       flag="--normalization", help="layer norm kind"),
    _f("model", "swiglu", "bool", default=False, flag="--swiglu", help="SwiGLU MLP"),
    _f("model", "untie_embeddings_and_output_weights", "bool", default=False,
       flag="--untie-embeddings-and-output-weights", help="separate output layer"),
    _f("model", "disable_bias_linear", "bool", default=False, flag="--disable-bias-linear",
       help="no biases in linear layers"),
    # Dropout defaults to 0: the CHARM+ attention has no dropout (it refuses to train with
    # attention dropout), and ring vs CHARM+ comparisons need identical models.
    _f("model", "attention_dropout", "float", default=0.0, minimum=0.0,
       flag="--attention-dropout", help="attention-probability dropout"),
    _f("model", "hidden_dropout", "float", default=0.0, minimum=0.0, flag="--hidden-dropout",
       help="residual dropout"),
    _f("model", "init_method_std", "float", default=0.02, minimum=0.0, flag="--init-method-std",
       help="weight init standard deviation"),
    # ---- parallel: the world and how it splits
    _f("parallel", "nodes", "int", default=1, minimum=1, help="nodes (SLURM --nodes)"),
    _f("parallel", "gpus_per_node", "int", default=8, minimum=1,
       help="ranks per node (GPUs; CPU processes for the CPU demo)"),
    _f("parallel", "tensor_model_parallel_size", "int", default=1, minimum=1,
       flag="--tensor-model-parallel-size", help="TP"),
    _f("parallel", "pipeline_model_parallel_size", "int", default=1, minimum=1,
       flag="--pipeline-model-parallel-size", help="PP"),
    _f("parallel", "context_parallel_size", "int", required=True, minimum=1,
       flag="--context-parallel-size", help="CP"),
    _f("parallel", "charm_topology", "str", default="auto",
       help="--charm-topology for ring/rmplus/charm: auto|node|numa|flat|GxM|0-7,8-15"),
    _f("parallel", "sequence_parallel", "bool", default=False, flag="--sequence-parallel",
       help="Megatron sequence parallelism (with TP > 1)"),
    _f("parallel", "use_distributed_optimizer", "bool", default=False,
       flag="--use-distributed-optimizer", help="ZeRO-1 style optimizer sharding"),
    # ---- training
    _f("training", "micro_batch_size", "int", default=1, minimum=1, flag="--micro-batch-size",
       help="sequences per micro batch"),
    _f("training", "global_batch_size", "int", required=True, minimum=1,
       flag="--global-batch-size", help="sequences per iteration"),
    _f("training", "seq_length", "int", required=True, minimum=1, flag="--seq-length",
       help="tokens per sequence"),
    _f("training", "train_iters", "int", required=True, minimum=1, flag="--train-iters",
       help="iterations"),
    _f("training", "precision", "str", default="bf16", choices=("bf16", "fp16", "fp32"),
       help="--bf16, --fp16 or neither"),
    _f("training", "seed", "int", minimum=0, flag="--seed", help="random seed"),
    _f("training", "eval_interval", "int", minimum=1, flag="--eval-interval",
       help="iterations between evaluations"),
    _f("training", "eval_iters", "int", minimum=0, flag="--eval-iters",
       help="evaluation iterations (0 = no evaluation)"),
    # ---- optimizer (Adam) and learning-rate schedule
    _f("optimizer", "lr", "float", required=True, minimum=0.0, flag="--lr", help="peak LR"),
    _f("optimizer", "min_lr", "float", default=0.0, minimum=0.0, flag="--min-lr",
       help="final LR"),
    _f("optimizer", "lr_decay_style", "str", default="cosine",
       choices=("constant", "linear", "cosine", "inverse-square-root", "WSD"),
       flag="--lr-decay-style", help="LR decay"),
    _f("optimizer", "lr_warmup_fraction", "float", minimum=0.0, flag="--lr-warmup-fraction",
       help="warm-up as a fraction of the decay iterations"),
    _f("optimizer", "lr_warmup_iters", "int", minimum=0, flag="--lr-warmup-iters",
       help="warm-up iterations"),
    _f("optimizer", "lr_decay_iters", "int", minimum=1, flag="--lr-decay-iters",
       help="decay iterations; null = train_iters"),
    _f("optimizer", "weight_decay", "float", default=0.1, minimum=0.0, flag="--weight-decay",
       help="AdamW weight decay"),
    _f("optimizer", "adam_beta1", "float", default=0.9, minimum=0.0, flag="--adam-beta1",
       help="Adam beta1"),
    _f("optimizer", "adam_beta2", "float", default=0.95, minimum=0.0, flag="--adam-beta2",
       help="Adam beta2"),
    _f("optimizer", "adam_eps", "float", default=1e-8, minimum=0.0, flag="--adam-eps",
       help="Adam epsilon"),
    _f("optimizer", "clip_grad", "float", default=1.0, minimum=0.0, flag="--clip-grad",
       help="gradient-norm clipping"),
    # ---- data
    _f("data", "mock_data", "bool", default=False,
       help="Megatron's --mock-data (synthetic tokens); data_path is then not used"),
    _f("data", "data_path", "strs",
       help="--data-path: a prefix, or a list (weights and prefixes, as Megatron blends)"),
    _f("data", "split", "str", default="949,50,1", flag="--split",
       help="train,valid,test split"),
    _f("data", "num_workers", "int", minimum=0, flag="--num-workers",
       help="data-loader workers"),
    # ---- tokenizer
    _f("tokenizer", "tokenizer_type", "str", required=True, choices=_TOKENIZERS,
       flag="--tokenizer-type", help="Megatron tokenizer"),
    _f("tokenizer", "vocab_file", "str", flag="--vocab-file", help="GPT-2 vocab.json"),
    _f("tokenizer", "merge_file", "str", flag="--merge-file", help="GPT-2 merges.txt"),
    _f("tokenizer", "tokenizer_model", "str", flag="--tokenizer-model",
       help="model path/name for HuggingFace / SentencePiece / TikToken tokenizers"),
    _f("tokenizer", "vocab_size", "int", minimum=1, flag="--vocab-size",
       help="vocabulary size (needed by NullTokenizer)"),
    # ---- system: implementation choices
    _f("system", "transformer_impl", "str", default="transformer_engine",
       choices=("transformer_engine", "local"), flag="--transformer-impl",
       help="Megatron layer implementation"),
    _f("system", "attention_backend", "str", default="auto",
       choices=("auto", "flash", "fused", "unfused"), flag="--attention-backend",
       help="attention kernels of Megatron / Transformer Engine (p2p, a2a, allgather)"),
    _f("system", "use_flash_attn", "bool", default=False, flag="--use-flash-attn",
       help="legacy flash-attention switch"),
    _f("system", "distributed_backend", "str", default="nccl", choices=("nccl", "gloo"),
       flag="--distributed-backend", help="torch.distributed backend"),
    _f("system", "fused_kernels", "bool", default=True,
       help="false adds Megatron's --no-*-fusion flags (CPU runs have no fused CUDA kernels)"),
    _f("system", "use_cpu_initialization", "bool", default=False,
       flag="--use-cpu-initialization", help="initialise weights on the CPU"),
    # ---- logging
    _f("logging", "log_interval", "int", default=1, minimum=1, flag="--log-interval",
       help="iterations per log line (1: every iteration, what `compare` wants)"),
    _f("logging", "log_throughput", "bool", default=True, flag="--log-throughput",
       help="TFLOP/s/GPU in the log lines"),
    _f("logging", "timing_log_level", "int", choices=(0, 1, 2), flag="--timing-log-level",
       help="Megatron timer detail"),
    _f("logging", "tensorboard_dir", "str", flag="--tensorboard-dir", help="TensorBoard output"),
)

SECTIONS: tuple[str, ...] = tuple(dict.fromkeys(f.section for f in SCHEMA))
_BY_NAME: dict[str, Field] = {f.name: f for f in SCHEMA}
assert len(_BY_NAME) == len(SCHEMA), "leaf names must be unique across sections"

#: Keys allowed at the top level besides the sections.
_TOP_KEYS = ("name", "description", "variables", "extra_args", "runs")
#: Keys allowed inside a run besides the leaf keys.
_RUN_KEYS = ("description", "extra_args")

_RUN_NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]*$")
_VAR_NAME = re.compile(r"^[A-Z_][A-Z0-9_]*$")
# ${NAME} or ${NAME:-default}; $${ is a literal "${".
_VAR_REF = re.compile(r"\$\$\{|\$\{([A-Za-z_][A-Za-z0-9_]*)(?::-([^}]*))?\}")
_TOPOLOGY_LEVELS = ("auto", "node", "numa", "flat")
# Tokenizer keys each tokenizer type reads; the others are dropped (neither resolved nor
# emitted), so e.g. --set tokenizer_type=NullTokenizer needs no vocabulary files.
_TOKENIZER_KEYS = {
    "GPT2BPETokenizer": ("vocab_file", "merge_file"),
    "NullTokenizer": ("vocab_size",),
    "HuggingFaceTokenizer": ("tokenizer_model", "vocab_file", "merge_file"),
    "SentencePieceTokenizer": ("tokenizer_model",),
    "GPTSentencePieceTokenizer": ("tokenizer_model",),
    "Llama2Tokenizer": ("tokenizer_model",),
    "TikTokenizer": ("tokenizer_model", "vocab_size"),
}
assert set(_TOKENIZER_KEYS) == set(_TOKENIZERS)


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


# --------------------------------------------------------------------------- loading
def _read_yaml(path: Path) -> dict[str, Any]:
    try:
        data = yaml.safe_load(path.read_text(encoding="utf-8"))
    except yaml.YAMLError as exc:
        raise ConfigError(f"{path}: not valid YAML: {exc}") from None
    if not isinstance(data, dict):
        raise ConfigError(f"{path}: the top level must be a mapping, got {type(data).__name__}")
    return data


def _unknown(path: str, key: Any, known: Sequence[str], hint: str = "") -> ConfigError:
    near = [] if hint else difflib.get_close_matches(str(key), list(known), n=1)
    did = f"; did you mean '{near[0]}'?" if near else ""
    return ConfigError(f"{path}: unknown key{did}{hint}")


def _join(prefix: str, key: str) -> str:
    return f"{prefix}.{key}" if prefix else key


def _check_extra_args(value: Any, path: str) -> tuple[str, ...]:
    if value is None:
        return ()
    if not isinstance(value, list) or not all(isinstance(a, str | int | float) for a in value):
        raise ConfigError(f"{path}: expected a list of strings (Megatron arguments), "
                          f"got {_describe(value)}")
    return tuple(str(a) for a in value)


def _describe(value: Any) -> str:
    text = repr(value)
    return f"{type(value).__name__} {text if len(text) <= 40 else text[:37] + '...'}"


def _coerce(f: Field, value: Any, path: str, *, from_text: bool = False) -> Any:
    """Check ``value`` against ``f``; return it normalised (ints as int, floats as float).

    ``from_text``: the value came from ``--set`` as text; parse it as YAML first unless the
    key is a string key (so ``--set split=98,2,0`` stays the string it looks like).
    """
    if from_text and isinstance(value, str) and f.kind != "str":
        try:
            value = yaml.safe_load(value) if value.strip() else None
        except yaml.YAMLError:
            pass  # reported below as the wrong type
    if value is None:
        if f.nullable:
            return None
        raise ConfigError(f"{path}: must not be null (expected {f.kind}; omit the key to use "
                          f"the default {f.default!r})")
    if f.kind == "bool":
        if not isinstance(value, bool):
            raise ConfigError(f"{path}: expected true or false, got {_describe(value)}")
    elif f.kind == "int":
        if isinstance(value, bool) or not isinstance(value, int):
            raise ConfigError(f"{path}: expected an integer, got {_describe(value)}")
    elif f.kind == "float":
        # PyYAML reads 1e-4 (no dot) as a string; accept any text float() reads as finite.
        if isinstance(value, str):
            try:
                number = float(value)
            except ValueError:
                raise ConfigError(f"{path}: expected a number, got {_describe(value)}") from None
            value = number
        if isinstance(value, bool) or not isinstance(value, int | float):
            raise ConfigError(f"{path}: expected a number, got {_describe(value)}")
        value = float(value)
        if not math.isfinite(value):
            raise ConfigError(f"{path}: expected a finite number, got {value!r}")
    elif f.kind == "str":
        if not isinstance(value, str):
            raise ConfigError(f"{path}: expected a string, got {_describe(value)}")
    elif f.kind == "strs":
        if isinstance(value, list):
            if not value or not all(isinstance(v, str | int | float) and not isinstance(v, bool)
                                    for v in value):
                raise ConfigError(f"{path}: expected a string or a non-empty list of strings, "
                                  f"got {_describe(value)}")
            value = [str(v) for v in value]
        elif not isinstance(value, str):
            raise ConfigError(f"{path}: expected a string or a list of strings, "
                              f"got {_describe(value)}")
    if f.choices is not None and value not in f.choices:
        raise ConfigError(f"{path}: {value!r} is not one of {', '.join(map(str, f.choices))}")
    if f.minimum is not None and value < f.minimum:
        raise ConfigError(f"{path}: must be >= {f.minimum:g}, got {value!r}")
    return value


def _section_values(data: Mapping[str, Any]) -> dict[str, tuple[Any, str]]:
    """Leaf values of the top-level sections: name -> (value, path)."""
    out: dict[str, tuple[Any, str]] = {}
    for section in SECTIONS:
        body = data.get(section)
        if body is None:
            continue
        if not isinstance(body, dict):
            raise ConfigError(f"{section}: expected a mapping of keys, got {_describe(body)}")
        for key, value in body.items():
            path = _join(section, str(key))
            f = _BY_NAME.get(str(key))
            if f is None or f.section != section:
                hint = f" ('{key}' belongs in section '{f.section}')" if f else ""
                raise _unknown(path, key, [x.name for x in SCHEMA if x.section == section], hint)
            out[f.name] = (_coerce(f, value, path), path)
    return out


def _run_values(runs: Mapping[str, Any], name: str) -> tuple[dict[str, tuple[Any, str]], dict[str, Any]]:
    body = runs[name]
    prefix = f"runs.{name}"
    if body is None:
        body = {}
    if not isinstance(body, dict):
        raise ConfigError(f"{prefix}: expected a mapping of settings, got {_describe(body)}")
    values: dict[str, tuple[Any, str]] = {}
    meta: dict[str, Any] = {}
    for key, value in body.items():
        path = _join(prefix, str(key))
        if key in _RUN_KEYS:
            meta[key] = value
            continue
        f = _BY_NAME.get(str(key))
        if f is None:
            hint = (" (run settings are flat leaf keys, e.g. 'seq_length: 4096', not sections)"
                    if key in SECTIONS else "")
            raise _unknown(path, key, [x.name for x in SCHEMA] + list(_RUN_KEYS), hint)
        values[f.name] = (_coerce(f, value, path), path)
    if "description" in meta and not isinstance(meta["description"], str):
        raise ConfigError(f"{prefix}.description: expected a string, "
                          f"got {_describe(meta['description'])}")
    meta["extra_args"] = _check_extra_args(meta.get("extra_args"), f"{prefix}.extra_args")
    return values, meta


def _check_top(data: Mapping[str, Any]) -> None:
    for key in data:
        if key not in _TOP_KEYS and key not in SECTIONS:
            hint = ""
            if str(key) in _BY_NAME:
                hint = f" ('{key}' belongs in section '{_BY_NAME[str(key)].section}')"
            raise _unknown(str(key), key, list(_TOP_KEYS) + list(SECTIONS), hint)
    for key in ("name", "description"):
        if key in data and not isinstance(data[key], str):
            raise ConfigError(f"{key}: expected a string, got {_describe(data[key])}")
    if "name" in data and not _RUN_NAME.match(data["name"]):
        raise ConfigError("name: must start with a letter or digit and hold only letters, "
                          "digits, '.', '_' and '-' (it names a directory)")
    runs = data.get("runs")
    if runs is None:
        raise ConfigError("runs: missing required key (a mapping of run name -> settings)")
    if not isinstance(runs, dict) or not runs:
        raise ConfigError(f"runs: expected a non-empty mapping of run name -> settings, "
                          f"got {_describe(runs)}")
    for name in runs:
        if not isinstance(name, str) or not _RUN_NAME.match(name):
            raise ConfigError(f"runs.{name}: a run name must start with a letter or digit and "
                              "hold only letters, digits, '.', '_' and '-' (it names a directory)")
    variables = data.get("variables")
    if variables is not None:
        if not isinstance(variables, dict):
            raise ConfigError(f"variables: expected a mapping NAME -> default, "
                              f"got {_describe(variables)}")
        for name, value in variables.items():
            if not isinstance(name, str) or not _VAR_NAME.match(name):
                raise ConfigError(f"variables.{name}: variable names are UPPER_CASE "
                                  "(letters, digits, '_')")
            if value is not None and not isinstance(value, str | int | float):
                raise ConfigError(f"variables.{name}: expected a string or null, "
                                  f"got {_describe(value)}")


def list_runs(config: str | os.PathLike[str]) -> list[str]:
    """The run names of a config, in file order (checks the file's structure, not the values)."""
    data = _read_yaml(config_path(config))
    _check_top(data)
    return list(data["runs"])


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
def _substitute(text: str, path: str, variables: Mapping[str, str | None],
                missing: list[tuple[str, str]]) -> str:
    """Fill ``${NAME}`` / ``${NAME:-default}``; unset names are appended to ``missing``."""

    def one(m: re.Match[str]) -> str:
        if m.group(0) == "$${":
            return "${"
        name, default = m.group(1), m.group(2)
        value = variables.get(name)
        if value is None or value == "":
            if default is not None:
                return default
            missing.append((path, name))
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


def _variables(data: Mapping[str, Any], overrides: Mapping[str, Any]) -> dict[str, str | None]:
    # Lowest first: the config's defaults, the environment, --set.
    out: dict[str, str | None] = {
        name: None if value is None else str(value)
        for name, value in (data.get("variables") or {}).items()
    }
    out.update(os.environ)
    for name, value in overrides.items():
        if _VAR_NAME.match(name) and name not in _BY_NAME:
            out[name] = None if value is None else str(value)
    return out


# --------------------------------------------------------------------------- checks
def _rank(source: str) -> int:
    """How specific a value's source is: --set 3, a run 2, a section 1, the default 0."""
    if source.startswith("--set"):
        return 3
    if source.startswith("runs."):
        return 2
    return 0 if source == "default" else 1


def _check_values(v: Mapping[str, Any], src: Mapping[str, str], run: str) -> None:
    """Cross-key checks; each error names the key most likely to be at fault."""

    def where(key: str) -> str:
        s = src[key]
        return _BY_NAME[key].path if s == "default" else s

    def at(key: str) -> str:
        s = src[key]
        return _BY_NAME[key].path + " (default)" if s == "default" else s

    def fail(key: str, msg: str) -> ConfigError:
        return ConfigError(f"{at(key)}: {msg}")

    for f in SCHEMA:
        if f.required and v[f.name] is None:
            raise ConfigError(f"{f.path}: missing required key ({f.help}); set it under "
                              f"'{f.section}:' or in runs.{run}")

    tp, pp, cp = (v["tensor_model_parallel_size"], v["pipeline_model_parallel_size"],
                  v["context_parallel_size"])
    nodes, per_node = v["nodes"], v["gpus_per_node"]
    world = nodes * per_node
    seq, heads = v["seq_length"], v["num_attention_heads"]

    if seq % (2 * cp):
        raise fail("seq_length", f"{seq} is not divisible by 2·CP = {2 * cp} "
                   f"(context_parallel_size {cp} from {where('context_parallel_size')}): each CP "
                   "rank holds two sequence chunks, Megatron's causal load balancing")
    if world % cp:
        # Blame the most specifically set of CP / nodes / gpus_per_node (ties: CP).
        key = max(("context_parallel_size", "nodes", "gpus_per_node"), key=lambda k: _rank(src[k]))
        raise fail(key, f"CP {cp} does not divide the GPU count "
                   f"nodes × gpus_per_node = {nodes} × {per_node} = {world}")
    if world % (tp * pp * cp):
        # Blame the most specifically set of TP/PP/CP (--set, then a run, then a section).
        key = max(("tensor_model_parallel_size", "pipeline_model_parallel_size",
                   "context_parallel_size"), key=lambda k: _rank(src[k]))
        raise fail(key, f"TP·PP·CP = {tp}·{pp}·{cp} = {tp * pp * cp} does not divide the world "
                   f"size nodes × gpus_per_node = {world}")
    dp = world // (tp * pp * cp)
    mbs, gbs = v["micro_batch_size"], v["global_batch_size"]
    if gbs % (mbs * dp):
        raise fail("global_batch_size", f"{gbs} is not divisible by micro_batch_size × DP = "
                   f"{mbs} × {dp} = {mbs * dp} (DP = world {world} / (TP·PP·CP {tp * pp * cp}))")
    if heads % tp:
        raise fail("num_attention_heads", f"{heads} heads are not divisible by "
                   f"tensor_model_parallel_size {tp}")
    groups = v["num_query_groups"]
    if groups is not None:
        if heads % groups:
            raise fail("num_query_groups", f"num_attention_heads {heads} is not divisible by "
                       f"num_query_groups {groups}")
        if groups % tp:
            raise fail("num_query_groups", f"{groups} query groups are not divisible by "
                       f"tensor_model_parallel_size {tp}")
    if v["hidden_size"] % heads:
        raise fail("hidden_size", f"{v['hidden_size']} is not divisible by "
                   f"num_attention_heads {heads}")
    if v["num_layers"] % pp:
        raise fail("num_layers", f"{v['num_layers']} layers are not divisible by "
                   f"pipeline_model_parallel_size {pp}")
    if v["max_position_embeddings"] is not None and v["max_position_embeddings"] < seq:
        raise fail("max_position_embeddings", f"{v['max_position_embeddings']} is less than "
                   f"seq_length {seq}")
    if v["min_lr"] > v["lr"]:
        raise fail("min_lr", f"{v['min_lr']!r} is greater than lr {v['lr']!r}")
    if v["lr_warmup_fraction"] is not None and v["lr_warmup_iters"] not in (None, 0):
        raise fail("lr_warmup_iters", "set lr_warmup_fraction or lr_warmup_iters, not both")
    if v["sequence_parallel"] and tp > 1 and seq % tp:
        raise fail("seq_length", f"{seq} is not divisible by tensor_model_parallel_size {tp} "
                   "(needed by sequence_parallel)")
    if not v["mock_data"] and v["data_path"] is None:
        raise ConfigError("data.data_path: missing; give a data prefix (e.g. '${DATA_PATH}') "
                          "or set mock_data: true")
    tok = v["tokenizer_type"]
    if tok == "GPT2BPETokenizer":
        for key in ("vocab_file", "merge_file"):
            if v[key] is None:
                raise ConfigError(f"{_BY_NAME[key].path}: required with tokenizer_type "
                                  "GPT2BPETokenizer (e.g. '${VOCAB_FILE}')")
    elif tok == "NullTokenizer" and v["vocab_size"] is None:
        raise ConfigError("tokenizer.vocab_size: required with tokenizer_type NullTokenizer")
    elif tok in ("HuggingFaceTokenizer", "SentencePieceTokenizer", "GPTSentencePieceTokenizer",
                 "Llama2Tokenizer", "TikTokenizer") and v["tokenizer_model"] is None:
        raise ConfigError(f"tokenizer.tokenizer_model: required with tokenizer_type {tok}")
    _check_topology(v["charm_topology"], cp, at("charm_topology"))


def _check_topology(text: str, cp: int, path: str) -> None:
    low = text.strip().lower()
    if low in _TOPOLOGY_LEVELS:
        return
    try:
        # The runtime's own parser, so a config never passes here and fails at start-up.
        from charm_megatron.topology.core import Topology
    except ImportError:  # pragma: no cover - the topology layer ships with the package
        if re.fullmatch(r"\s*\d+\s*[xX×]\s*\d+\s*|[\d\s,;/-]+", text):
            return
        raise ConfigError(f"{path}: cannot read topology {text!r}; use auto, node, numa, flat, "
                          "GxM (e.g. 2x8) or rank ranges (e.g. 0-7,8-15)") from None
    try:
        Topology.parse(text, cp_size=cp)
    except ValueError as exc:
        raise ConfigError(f"{path}: {exc}") from None


# --------------------------------------------------------------------------- entry point
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
    data = _read_yaml(path)
    _check_top(data)
    overrides = dict(overrides or {})
    name = data.get("name") or path.name.removesuffix(".yaml")
    runs: dict[str, Any] = data["runs"]
    if run is None:
        if len(runs) != 1:
            raise ConfigError(f"runs: {path.name} has {len(runs)} runs; choose one with --run "
                              f"({', '.join(runs)})")
        run = next(iter(runs))
    if run not in runs:
        near = difflib.get_close_matches(run, list(runs), n=1)
        did = f" (did you mean '{near[0]}'?)" if near else ""
        raise ConfigError(f"runs.{run}: no such run in {path.name}{did}; runs: {', '.join(runs)}")

    merged: dict[str, tuple[Any, str]] = {f.name: (f.default, "default") for f in SCHEMA}
    merged.update(_section_values(data))
    run_values, run_meta = _run_values(runs, run)
    merged.update(run_values)
    for key, value in overrides.items():
        section, dot, rest = key.partition(".")
        leaf = rest if dot and section in SECTIONS else key
        f = _BY_NAME.get(leaf)
        if f is None or (dot and f.section != section):
            if not dot and _VAR_NAME.match(key):
                continue  # a ${VARIABLE}; see _variables
            raise _unknown(f"--set {key}", leaf, [x.name for x in SCHEMA])
        merged[f.name] = (_coerce(f, value, f"--set {key}", from_text=True), f"--set {key}")

    values = {k: val for k, (val, _) in merged.items()}
    sources = {k: s for k, (_, s) in merged.items()}
    extra = _check_extra_args(data.get("extra_args"), "extra_args") + run_meta["extra_args"]

    # Variables: resolve only what the command will use.
    variables = _variables(data, overrides)
    # Drop what the command will not use, so its ${VARIABLES} need not be set.
    unused = {"data_path"} if values["mock_data"] else set()
    if values["tokenizer_type"] is not None:
        used = _TOKENIZER_KEYS[values["tokenizer_type"]]
        unused |= {f.name for f in SCHEMA if f.section == "tokenizer"} - {"tokenizer_type", *used}
    for key in unused:
        values[key] = None
    missing: list[tuple[str, str]] = []
    for key, value in values.items():
        if value is None:
            continue
        p = sources[key] if sources[key] != "default" else _BY_NAME[key].path
        if isinstance(value, str):
            values[key] = _substitute(value, p, variables, missing)
        elif isinstance(value, list):
            values[key] = [_substitute(x, f"{p}[{i}]", variables, missing)
                           for i, x in enumerate(value)]
    extra = tuple(_substitute(a, "extra_args", variables, missing) for a in extra)
    if missing:
        raise _missing_error(missing)

    if values["ffn_hidden_size"] is None:
        values["ffn_hidden_size"] = 4 * values["hidden_size"] if values["hidden_size"] else None
    _check_values(values, sources, run)
    if values["max_position_embeddings"] is None:
        values["max_position_embeddings"] = values["seq_length"]
    desc = run_meta.get("description") or data.get("description") or ""
    return ResolvedRun(config_name=str(name), run_name=run, path=path, values=values,
                       sources=sources, extra_args=extra, description=str(desc),
                       run_names=tuple(runs))
