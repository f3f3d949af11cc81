"""Experiment configs: the YAML schema, the loader and the checks (see ``docs/configs.md``).

A config file describes one model (``model``, ``tokenizer``, ``data``, ``training``,
``optimizer``, ``parallel``, ``system``, ``logging`` sections) and, under ``runs:``, named runs
that override some of its settings with *flat* leaf keys (``seq_length: 8192``)::

    cfg = load_config("gpt-350m", run="scale-s4096-gb8", overrides={"DATA_PATH": "/d/x"})
    cfg["seq_length"], cfg.world_size, cfg.data_parallel_size

The schema is a set of pydantic v2 models, one per section (strict types, ``Literal`` choices,
bounds, ``extra="forbid"``); :class:`ConfigFile` is the whole file. This module adds what
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
import types
import typing
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from importlib import resources
from pathlib import Path
from typing import Annotated, Any, Literal

import yaml
from pydantic import (
    BaseModel,
    BeforeValidator,
    ConfigDict,
    StringConstraints,
    ValidationError,
    create_model,
)
from pydantic import Field as PydanticField
from pydantic_core import PydanticCustomError

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


class ConfigError(ValueError):
    """A config file, run or override is invalid; the message starts with the key's path."""


# --------------------------------------------------------------------------- value types
def _describe(value: Any) -> str:
    text = repr(value)
    return f"{type(value).__name__} {text if len(text) <= 40 else text[:37] + '...'}"


def _is_text(value: Any) -> bool:
    """A YAML scalar that reads as text (numbers too, not booleans)."""
    return isinstance(value, str | int | float) and not isinstance(value, bool)


def _text_to_float(value: Any) -> Any:
    # PyYAML reads 1e-4 (no dot) as a string; a float key takes any text float() reads.
    if isinstance(value, str):
        try:
            return float(value)
        except ValueError:
            return value
    return value


def _strs(value: Any) -> Any:
    """A string, or a non-empty list of strings / numbers (Megatron's blend weights)."""
    if value is None or isinstance(value, str):
        return value
    if not isinstance(value, list):
        raise PydanticCustomError("strs_type", "expected a string or a list of strings, got "
                                  "{got}", {"got": _describe(value)})
    if value and all(map(_is_text, value)):
        return [str(v) for v in value]
    raise PydanticCustomError("strs_type", "expected a string or a non-empty list of strings, "
                              "got {got}", {"got": _describe(value)})


PosInt = Annotated[int, PydanticField(ge=1)]
NonNegInt = Annotated[int, PydanticField(ge=0)]
NonNegFloat = Annotated[float, BeforeValidator(_text_to_float),
                        PydanticField(ge=0.0, allow_inf_nan=False)]
Strs = Annotated[str | list[str], BeforeValidator(_strs)]
_NAME_PATTERN = r"^[A-Za-z0-9][A-Za-z0-9._-]*$"
Name = Annotated[str, StringConstraints(pattern=_NAME_PATTERN)]
VarName = Annotated[str, StringConstraints(pattern=r"^[A-Z_][A-Z0-9_]*$")]


def _args(value: Any) -> Any:
    if value is None or (isinstance(value, list) and all(map(_is_text, value))):
        return value and [str(a) for a in value]
    raise PydanticCustomError("args_type", "expected a list of strings (Megatron arguments), "
                              "got {got}", {"got": _describe(value)})


def _variable_default(value: Any) -> Any:
    if value is None or _is_text(value):
        return None if value is None else str(value)
    raise PydanticCustomError("variable_type", "expected a string or null, got {got}",
                              {"got": _describe(value)})


ExtraArgs = Annotated[list[str] | None, BeforeValidator(_args)]
VariableDefault = Annotated[str | None, BeforeValidator(_variable_default)]

# Megatron-LM's tokenizer choices (megatron/training/arguments.py, --tokenizer-type), each with
# the tokenizer keys it reads; the others are dropped (neither resolved nor emitted), so e.g.
# --set tokenizer_type=NullTokenizer needs no vocabulary files.
_TOKENIZER_KEYS = {
    "GPT2BPETokenizer": ("vocab_file", "merge_file"),
    "NullTokenizer": ("vocab_size",),
    "HuggingFaceTokenizer": ("tokenizer_model", "vocab_file", "merge_file"),
    "SentencePieceTokenizer": ("tokenizer_model",),
    "GPTSentencePieceTokenizer": ("tokenizer_model",),
    "Llama2Tokenizer": ("tokenizer_model",),
    "TikTokenizer": ("tokenizer_model", "vocab_size"),
}
Tokenizer = Literal["GPT2BPETokenizer", "NullTokenizer", "HuggingFaceTokenizer",
                    "SentencePieceTokenizer", "GPTSentencePieceTokenizer", "Llama2Tokenizer",
                    "TikTokenizer"]
assert set(typing.get_args(Tokenizer)) == set(_TOKENIZER_KEYS)

_REQUIRED = object()


def leaf(default: Any = None, *, flag: str | None = None, help: str = "") -> Any:
    """A leaf key: its schema default (``_REQUIRED`` for a required key), the Megatron-LM option
    it maps to one-to-one (``None`` when the argv builder treats it specially), and its help.

    The pydantic default is ``None`` for a required key and is never validated, so a section
    that omits the key passes and the merged run reports it missing. A key whose annotation
    has no ``None`` may not be null in a file (a stray ``key:`` is reported, not dropped)."""
    required = default is _REQUIRED
    return PydanticField(None if required else default, description=help,
                         json_schema_extra={"flag": flag, "required": required})


class _Section(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True, frozen=True)


# Schema order is also the order of the generated Megatron arguments.
class ModelSection(_Section):
    """The GPT shape."""

    num_layers: PosInt = leaf(_REQUIRED, flag="--num-layers", help="transformer layers")
    hidden_size: PosInt = leaf(_REQUIRED, flag="--hidden-size", help="model width")
    ffn_hidden_size: PosInt | None = leaf(flag="--ffn-hidden-size",
                                          help="MLP width; default 4 x hidden_size")
    num_attention_heads: PosInt = leaf(_REQUIRED, flag="--num-attention-heads",
                                       help="query heads")
    num_query_groups: PosInt | None = leaf(
        help="key/value heads (grouped-query attention); null = multi-head attention")
    max_position_embeddings: PosInt | None = leaf(flag="--max-position-embeddings",
                                                  help="default seq_length")
    position_embedding_type: Literal["rope", "learned_absolute"] = leaf(
        "rope", flag="--position-embedding-type", help="position embedding")
    rotary_base: PosInt | None = leaf(flag="--rotary-base",
                                      help="RoPE base; null = Megatron's default")
    normalization: Literal["LayerNorm", "RMSNorm"] = leaf("LayerNorm", flag="--normalization",
                                                          help="layer norm kind")
    swiglu: bool = leaf(False, flag="--swiglu", help="SwiGLU MLP")
    untie_embeddings_and_output_weights: bool = leaf(
        False, flag="--untie-embeddings-and-output-weights", help="separate output layer")
    disable_bias_linear: bool = leaf(False, flag="--disable-bias-linear",
                                     help="no biases in linear layers")
    # Dropout defaults to 0: the CHARM+ attention has no dropout (it refuses to train with
    # attention dropout), and ring vs CHARM+ comparisons need identical models.
    attention_dropout: NonNegFloat = leaf(0.0, flag="--attention-dropout",
                                          help="attention-probability dropout")
    hidden_dropout: NonNegFloat = leaf(0.0, flag="--hidden-dropout", help="residual dropout")
    init_method_std: NonNegFloat = leaf(0.02, flag="--init-method-std",
                                        help="weight init standard deviation")


class ParallelSection(_Section):
    """The world and how it splits."""

    nodes: PosInt = leaf(1, help="nodes (SLURM --nodes)")
    gpus_per_node: PosInt = leaf(8, help="ranks per node (GPUs; CPU processes for the CPU demo)")
    tensor_model_parallel_size: PosInt = leaf(1, flag="--tensor-model-parallel-size", help="TP")
    pipeline_model_parallel_size: PosInt = leaf(1, flag="--pipeline-model-parallel-size",
                                                help="PP")
    context_parallel_size: PosInt = leaf(_REQUIRED, flag="--context-parallel-size", help="CP")
    charm_topology: str = leaf("auto", help="--charm-topology for charm-megatron's comm types: "
                               "auto|node|numa|flat|GxM|0-7,8-15")
    sequence_parallel: bool = leaf(False, flag="--sequence-parallel",
                                   help="Megatron sequence parallelism (with TP > 1)")
    use_distributed_optimizer: bool = leaf(False, flag="--use-distributed-optimizer",
                                           help="ZeRO-1 style optimizer sharding")


class TrainingSection(_Section):
    micro_batch_size: PosInt = leaf(1, flag="--micro-batch-size",
                                    help="sequences per micro batch")
    global_batch_size: PosInt = leaf(_REQUIRED, flag="--global-batch-size",
                                     help="sequences per iteration")
    seq_length: PosInt = leaf(_REQUIRED, flag="--seq-length", help="tokens per sequence")
    train_iters: PosInt = leaf(_REQUIRED, flag="--train-iters", help="iterations")
    precision: Literal["bf16", "fp16", "fp32"] = leaf("bf16", help="--bf16, --fp16 or neither")
    seed: NonNegInt | None = leaf(flag="--seed", help="random seed")
    eval_interval: PosInt | None = leaf(flag="--eval-interval",
                                        help="iterations between evaluations")
    eval_iters: NonNegInt | None = leaf(flag="--eval-iters",
                                        help="evaluation iterations (0 = no evaluation)")


class OptimizerSection(_Section):
    """Adam and the learning-rate schedule."""

    lr: NonNegFloat = leaf(_REQUIRED, flag="--lr", help="peak LR")
    min_lr: NonNegFloat = leaf(0.0, flag="--min-lr", help="final LR")
    lr_decay_style: Literal["constant", "linear", "cosine", "inverse-square-root", "WSD"] = leaf(
        "cosine", flag="--lr-decay-style", help="LR decay")
    lr_warmup_fraction: NonNegFloat | None = leaf(
        flag="--lr-warmup-fraction", help="warm-up as a fraction of the decay iterations")
    lr_warmup_iters: NonNegInt | None = leaf(flag="--lr-warmup-iters", help="warm-up iterations")
    lr_decay_iters: PosInt | None = leaf(flag="--lr-decay-iters",
                                         help="decay iterations; null = train_iters")
    weight_decay: NonNegFloat = leaf(0.1, flag="--weight-decay", help="AdamW weight decay")
    adam_beta1: NonNegFloat = leaf(0.9, flag="--adam-beta1", help="Adam beta1")
    adam_beta2: NonNegFloat = leaf(0.95, flag="--adam-beta2", help="Adam beta2")
    adam_eps: NonNegFloat = leaf(1e-8, flag="--adam-eps", help="Adam epsilon")
    clip_grad: NonNegFloat = leaf(1.0, flag="--clip-grad", help="gradient-norm clipping")


class DataSection(_Section):
    mock_data: bool = leaf(False, help="Megatron's --mock-data (synthetic tokens); data_path is "
                           "then not used")
    data_path: Strs | None = leaf(help="--data-path: a prefix, or a list (weights and prefixes, "
                                  "as Megatron blends)")
    split: str = leaf("949,50,1", flag="--split", help="train,valid,test split")
    num_workers: NonNegInt | None = leaf(flag="--num-workers", help="data-loader workers")


class TokenizerSection(_Section):
    tokenizer_type: Tokenizer = leaf(_REQUIRED, flag="--tokenizer-type",
                                     help="Megatron tokenizer")
    vocab_file: str | None = leaf(flag="--vocab-file", help="GPT-2 vocab.json")
    merge_file: str | None = leaf(flag="--merge-file", help="GPT-2 merges.txt")
    tokenizer_model: str | None = leaf(
        flag="--tokenizer-model",
        help="model path/name for HuggingFace / SentencePiece / TikToken tokenizers")
    vocab_size: PosInt | None = leaf(flag="--vocab-size",
                                     help="vocabulary size (needed by NullTokenizer)")


class SystemSection(_Section):
    """Implementation choices."""

    transformer_impl: Literal["transformer_engine", "local"] = leaf(
        "transformer_engine", flag="--transformer-impl", help="Megatron layer implementation")
    attention_backend: Literal["auto", "flash", "fused", "unfused"] = leaf(
        "auto", flag="--attention-backend",
        help="attention kernels of Megatron / Transformer Engine (p2p, a2a, allgather)")
    use_flash_attn: bool = leaf(False, flag="--use-flash-attn",
                                help="legacy flash-attention switch")
    distributed_backend: Literal["nccl", "gloo"] = leaf("nccl", flag="--distributed-backend",
                                                        help="torch.distributed backend")
    fused_kernels: bool = leaf(True, help="false adds Megatron's --no-*-fusion flags (CPU runs "
                               "have no fused CUDA kernels)")
    use_cpu_initialization: bool = leaf(False, flag="--use-cpu-initialization",
                                        help="initialise weights on the CPU")


class LoggingSection(_Section):
    log_interval: PosInt = leaf(1, flag="--log-interval",
                                help="iterations per log line (1: every iteration, what "
                                "`compare` wants)")
    log_throughput: bool = leaf(True, flag="--log-throughput", help="TFLOP/s/GPU in the log lines")
    timing_log_level: Literal[0, 1, 2] | None = leaf(flag="--timing-log-level",
                                                     help="Megatron timer detail")
    tensorboard_dir: str | None = leaf(flag="--tensorboard-dir", help="TensorBoard output")


_SECTION_MODELS: dict[str, type[_Section]] = {
    "model": ModelSection, "parallel": ParallelSection, "training": TrainingSection,
    "optimizer": OptimizerSection, "data": DataSection, "tokenizer": TokenizerSection,
    "system": SystemSection, "logging": LoggingSection,
}
SECTIONS: tuple[str, ...] = tuple(_SECTION_MODELS)


@dataclass(frozen=True)
class Leaf:
    """One leaf key of the schema, as the argv builder and the docs test read it."""

    name: str
    section: str
    kind: str  # int, float, str, bool or strs (a string or a list of strings)
    default: Any
    required: bool
    nullable: bool
    choices: tuple[Any, ...] | None
    flag: str | None
    help: str
    annotation: Any

    @property
    def path(self) -> str:
        """``section.name``, the key's path in a config file."""
        return f"{self.section}.{self.name}"


def _base(annotation: Any) -> tuple[Any, bool]:
    """An annotation without ``None`` and ``Annotated`` metadata, and whether it admits None."""
    nullable = False
    if typing.get_origin(annotation) in (typing.Union, types.UnionType):
        members = typing.get_args(annotation)
        rest = [a for a in members if a is not type(None)]
        nullable = len(rest) < len(members)
        annotation = rest[0] if len(rest) == 1 else annotation
    while typing.get_origin(annotation) is Annotated:
        annotation = typing.get_args(annotation)[0]
    return annotation, nullable


def _leaves() -> tuple[Leaf, ...]:
    kinds = {int: "int", float: "float", str: "str", bool: "bool"}
    out = []
    for section, model in _SECTION_MODELS.items():
        for name, info in model.model_fields.items():
            extra = info.json_schema_extra
            assert isinstance(extra, dict)
            base, nullable = _base(info.annotation)
            choices = typing.get_args(base) if typing.get_origin(base) is Literal else None
            if choices:
                kind = kinds[type(choices[0])]
            elif typing.get_origin(base) in (typing.Union, types.UnionType):
                kind = "strs"  # str | list[str]
            else:
                kind = kinds[base]
            out.append(Leaf(name, section, kind, info.default, bool(extra["required"]),
                            nullable, choices, extra["flag"], info.description or "",
                            # bounds and validators of a plain Annotated type live in metadata
                            Annotated[(info.annotation, *info.metadata)] if info.metadata
                            else info.annotation))
    return tuple(out)


#: Every leaf key, in schema (= Megatron argument) order.
SCHEMA: tuple[Leaf, ...] = _leaves()
_BY_NAME: dict[str, Leaf] = {f.name: f for f in SCHEMA}
assert len(_BY_NAME) == len(SCHEMA), "leaf names must be unique across sections"

#: A run: any leaf key, flat, plus a description and extra Megatron arguments.
RunSettings = create_model(
    "RunSettings", __base__=_Section, __doc__="One run under ``runs:``.",
    description=(str | None, None), extra_args=(ExtraArgs, None),
    **{f.name: (f.annotation, None) for f in SCHEMA})


class ConfigFile(BaseModel):
    """A whole config file (structure and types; cross-key checks run on a resolved run)."""

    model_config = ConfigDict(extra="forbid", strict=True, frozen=True, protected_namespaces=())

    name: Name | None = None
    description: str | None = None
    variables: dict[VarName, VariableDefault] | None = None
    extra_args: ExtraArgs = None
    runs: dict[Name, RunSettings | None] = PydanticField(min_length=1)  # type: ignore[valid-type]
    # A section may be absent or empty (``model:`` with no keys).
    model: ModelSection | None = None
    parallel: ParallelSection | None = None
    training: TrainingSection | None = None
    optimizer: OptimizerSection | None = None
    data: DataSection | None = None
    tokenizer: TokenizerSection | None = None
    system: SystemSection | None = None
    logging: LoggingSection | None = None


_TOP_KEYS = tuple(k for k in ConfigFile.model_fields if k not in SECTIONS)
_RUN_KEYS = ("description", "extra_args")
_TOPOLOGY_LEVELS = ("auto", "node", "numa", "flat")


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
        return _unknown(path, key, [*_TOP_KEYS, *SECTIONS], hint)
    if loc[0] == "runs":
        hint = (" (run settings are flat leaf keys, e.g. 'seq_length: 4096', not sections)"
                if key in SECTIONS else "")
        return _unknown(path, key, [*_BY_NAME, *_RUN_KEYS], hint)
    hint = f" ('{key}' belongs in section '{home.section}')" if home else ""
    return _unknown(path, key, list(_SECTION_MODELS[loc[0]].model_fields), hint)


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
                           f"got {_describe(value)}")
    if kind == "model_type":
        what = "settings" if loc[0] == "runs" else "keys"
        return ConfigError(f"{where}: expected a mapping of {what}, got {_describe(value)}")
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
        return ConfigError(f"{where}: {text}, got {_describe(value)}")
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
        used = _TOKENIZER_KEYS[values["tokenizer_type"]]
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

