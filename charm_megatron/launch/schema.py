"""The config schema as pydantic v2 models: one per section, a run's flat keys, the whole file.

Strict types, ``Literal`` choices, bounds and ``extra="forbid"`` are pydantic's; each field's
``leaf(...)`` adds the schema default, the Megatron-LM option it maps to and its help.
:data:`SCHEMA` lists every leaf key in section order, which is also the order of the generated
Megatron arguments (``docs/configs.md`` documents every key). :mod:`charm_megatron.launch.config`
loads files against these models and words their errors.
"""

from __future__ import annotations

import types
import typing
from dataclasses import dataclass
from typing import Annotated, Any, Literal

from pydantic import BaseModel, BeforeValidator, ConfigDict, StringConstraints, create_model
from pydantic import Field as PydanticField
from pydantic_core import PydanticCustomError

__all__ = [
    "SCHEMA",
    "SECTIONS",
    "TOKENIZER_KEYS",
    "RUN_KEYS",
    "TOP_KEYS",
    "ConfigFile",
    "DataSection",
    "Leaf",
    "LoggingSection",
    "ModelSection",
    "OptimizerSection",
    "ParallelSection",
    "RunSettings",
    "SECTION_MODELS",
    "SystemSection",
    "TokenizerSection",
    "TrainingSection",
    "describe",
    "leaf",
]


# --------------------------------------------------------------------------- value types
def describe(value: Any) -> str:
    """``type repr`` of a value, shortened: what error messages show of a bad value."""
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
                                  "{got}", {"got": describe(value)})
    if value and all(map(_is_text, value)):
        return [str(v) for v in value]
    raise PydanticCustomError("strs_type", "expected a string or a non-empty list of strings, "
                              "got {got}", {"got": describe(value)})


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
                              "got {got}", {"got": describe(value)})


def _variable_default(value: Any) -> Any:
    if value is None or _is_text(value):
        return None if value is None else str(value)
    raise PydanticCustomError("variable_type", "expected a string or null, got {got}",
                              {"got": describe(value)})


ExtraArgs = Annotated[list[str] | None, BeforeValidator(_args)]
VariableDefault = Annotated[str | None, BeforeValidator(_variable_default)]

# Megatron-LM's tokenizer choices (megatron/training/arguments.py, --tokenizer-type), each with
# the tokenizer keys it reads; the others are dropped (neither resolved nor emitted), so e.g.
# --set tokenizer_type=NullTokenizer needs no vocabulary files.
TOKENIZER_KEYS = {
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
assert set(typing.get_args(Tokenizer)) == set(TOKENIZER_KEYS)

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


SECTION_MODELS: dict[str, type[_Section]] = {
    "model": ModelSection, "parallel": ParallelSection, "training": TrainingSection,
    "optimizer": OptimizerSection, "data": DataSection, "tokenizer": TokenizerSection,
    "system": SystemSection, "logging": LoggingSection,
}
SECTIONS: tuple[str, ...] = tuple(SECTION_MODELS)


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
    for section, model in SECTION_MODELS.items():
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
assert len({f.name for f in SCHEMA}) == len(SCHEMA), "leaf names must be unique across sections"

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


TOP_KEYS = tuple(k for k in ConfigFile.model_fields if k not in SECTIONS)
#: Keys of a run besides the leaf keys.
RUN_KEYS = ("description", "extra_args")
