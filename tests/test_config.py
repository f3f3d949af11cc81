"""The config schema, the shipped configs, and every error message of ``load_config``."""

from __future__ import annotations

import copy
import re
from pathlib import Path
from typing import Any

import pytest
import yaml

from charm_megatron.launch.config import (
    SCHEMA,
    ConfigError,
    ResolvedRun,
    config_path,
    list_runs,
    load_config,
    packaged_configs,
    parse_set,
)

REPO = Path(__file__).resolve().parents[1]
VARS = {
    "DATA_PATH": "/data/pile/pile_text_document",
    "VOCAB_FILE": "/data/gpt2/gpt2-vocab.json",
    "MERGE_FILE": "/data/gpt2/gpt2-merges.txt",
}
GPU_CONFIGS = ("gpt-350m", "gpt-1.3b")
SCALE = {(16, 2048), (8, 4096), (4, 8192), (2, 16384)}
HIGH = {(16, 16384), (32, 8192), (64, 4096), (128, 2048)}

# A small valid config the error tests mutate: world 16 (2 x 8), CP 8, so DP 2.
BASE: dict[str, Any] = {
    "name": "t",
    "model": {"num_layers": 4, "hidden_size": 256, "num_attention_heads": 16},
    "tokenizer": {"tokenizer_type": "NullTokenizer", "vocab_size": 1000},
    "data": {"mock_data": True},
    "training": {"train_iters": 10},
    "optimizer": {"lr": 1.0e-4},
    "parallel": {"nodes": 2, "gpus_per_node": 8, "context_parallel_size": 8},
    "runs": {"r": {"seq_length": 2048, "global_batch_size": 16}},
}


@pytest.fixture(autouse=True)
def _no_env_vars(monkeypatch: pytest.MonkeyPatch) -> None:
    # The tests must not depend on the caller's environment.
    for name in [*VARS, "X", "Y"]:
        monkeypatch.delenv(name, raising=False)


def write(tmp_path: Path, data: dict[str, Any], name: str = "t.yaml") -> Path:
    path = tmp_path / name
    path.write_text(yaml.safe_dump(data, sort_keys=False))
    return path


def mutate(**changes: Any) -> dict[str, Any]:
    """BASE with ``section__key=value`` changes (value ``...`` deletes the key)."""
    data = copy.deepcopy(BASE)
    for dotted, value in changes.items():
        *parents, leaf = dotted.split("__")
        node = data
        for part in parents:
            node = node.setdefault(part, {})
        if value is ...:
            del node[leaf]
        else:
            node[leaf] = value
    return data


def error(tmp_path: Path, data: dict[str, Any], run: str | None = "r", **kw: Any) -> str:
    with pytest.raises(ConfigError) as info:
        load_config(write(tmp_path, data), run, **kw)
    return str(info.value)


# --------------------------------------------------------------------------- shipped configs
def test_packaged_configs_are_the_top_level_configs() -> None:
    shipped = packaged_configs()
    assert set(shipped) == {"gpt-350m", "gpt-1.3b", "gpt-tiny-cpu"}
    top = {p.stem: p for p in (REPO / "configs").glob("*.yaml")}
    assert set(top) == set(shipped), "configs/ and charm_megatron/configs/ list different files"
    for name, path in shipped.items():
        # configs/ holds symlinks to the package copies (the source of truth); a copy would
        # also pass as long as it is byte-identical.
        assert top[name].read_bytes() == path.read_bytes(), f"configs/{name}.yaml differs"


@pytest.mark.parametrize("name", GPU_CONFIGS)
def test_gpu_configs_hold_the_paper_grids(name: str) -> None:
    runs = list_runs(name)
    grid = {}
    for run in runs:
        cfg = load_config(name, run, VARS)
        m = re.fullmatch(r"(scale|high)-s(\d+)-gb(\d+)", run)
        assert m, f"run name {run} does not say its grid, seq and batch"
        assert (cfg["seq_length"], cfg["global_batch_size"]) == (int(m[2]), int(m[3]))
        grid.setdefault(m[1], set()).add((cfg["global_batch_size"], cfg["seq_length"]))
        assert (cfg["nodes"], cfg["gpus_per_node"], cfg.world_size) == (2, 8, 16)
        assert cfg["context_parallel_size"] == 16
        assert cfg["tensor_model_parallel_size"] == cfg["pipeline_model_parallel_size"] == 1
        assert cfg["micro_batch_size"] == 1 and cfg.data_parallel_size == 1
        assert cfg["max_position_embeddings"] == cfg["seq_length"]
    assert grid == {"scale": SCALE, "high": HIGH}


@pytest.mark.parametrize("name,hidden,lr", [("gpt-350m", 1024, 3e-4), ("gpt-1.3b", 2048, 2e-4)])
def test_gpu_config_model(name: str, hidden: int, lr: float) -> None:
    cfg = load_config(name, "scale-s2048-gb16", VARS)
    assert cfg.config_name == name
    assert (cfg["num_layers"], cfg["hidden_size"], cfg["num_attention_heads"]) == (24, hidden, 16)
    assert cfg["ffn_hidden_size"] == 4 * hidden and cfg["num_query_groups"] is None
    assert cfg["tokenizer_type"] == "GPT2BPETokenizer" and cfg["precision"] == "bf16"
    assert (cfg["vocab_file"], cfg["merge_file"]) == (VARS["VOCAB_FILE"], VARS["MERGE_FILE"])
    assert cfg["data_path"] == VARS["DATA_PATH"] and not cfg["mock_data"]
    assert (cfg["lr"], cfg["lr_decay_style"]) == (lr, "cosine")
    assert cfg["min_lr"] == pytest.approx(lr / 10)
    assert (cfg["adam_beta1"], cfg["adam_beta2"], cfg["weight_decay"]) == (0.9, 0.95, 0.1)
    assert cfg["attention_dropout"] == 0.0 and cfg["charm_topology"] == "auto"


def test_tiny_cpu_config() -> None:
    runs = list_runs("gpt-tiny-cpu")
    assert runs
    for run in runs:
        cfg = load_config("gpt-tiny-cpu", run)  # no variables needed
        assert (cfg["num_layers"], cfg["hidden_size"], cfg["num_attention_heads"]) == (2, 64, 4)
        assert cfg["num_query_groups"] == 2
        assert (cfg["nodes"], cfg["gpus_per_node"], cfg["context_parallel_size"]) == (1, 4, 4)
        assert cfg["mock_data"] and cfg["data_path"] is None and cfg["precision"] == "fp32"
        assert cfg["transformer_impl"] == "local" and cfg["distributed_backend"] == "gloo"
        assert cfg["train_iters"] <= 20
    assert load_config("gpt-tiny-cpu", "demo-s256-gb2")["seq_length"] == 256


def test_config_by_path_and_by_name_agree() -> None:
    a = load_config(REPO / "configs" / "gpt-350m.yaml", "high-s8192-gb32", VARS)
    b = load_config("gpt-350m", "high-s8192-gb32", VARS)
    assert a.values == b.values and isinstance(a, ResolvedRun)
    assert config_path("gpt-350m.yaml") == packaged_configs()["gpt-350m"]


def test_schema_leaf_names_unique_and_documented() -> None:
    names = [f.name for f in SCHEMA]
    assert len(names) == len(set(names))
    doc = (REPO / "docs" / "configs.md").read_text()
    missing = [n for n in names if f"`{n}`" not in doc]
    assert not missing, f"docs/configs.md does not document {missing}"


# --------------------------------------------------------------------------- merging, variables
def test_precedence_default_section_run_override(tmp_path: Path) -> None:
    data = mutate(training__seq_length=1024, runs__r__micro_batch_size=2)
    cfg = load_config(write(tmp_path, data), "r", {"global_batch_size": "32"})
    assert cfg["seq_length"] == 2048 and cfg.sources["seq_length"] == "runs.r.seq_length"
    assert cfg["micro_batch_size"] == 2
    assert cfg["global_batch_size"] == 32 and cfg.sources["global_batch_size"] == "--set global_batch_size"
    assert cfg["adam_beta2"] == 0.95 and cfg.sources["adam_beta2"] == "default"
    assert cfg.data_parallel_size == 2


def test_overrides_are_parsed_per_key_type(tmp_path: Path) -> None:
    sets = parse_set(["parallel.nodes=4", "split=98,2,0", "swiglu=true", "lr=1e-3",
                      "charm_topology=0-3,4-7"])
    cfg = load_config(write(tmp_path, BASE), "r", sets)
    assert cfg["nodes"] == 4 and cfg.world_size == 32
    assert cfg["split"] == "98,2,0" and cfg["swiglu"] is True and cfg["lr"] == 1e-3
    assert cfg["charm_topology"] == "0-3,4-7"
    with pytest.raises(ConfigError, match=r"^--set nodes=4x: expected KEY=VALUE|^--set nodes: "):
        load_config(write(tmp_path, BASE), "r", parse_set(["nodes=4x"]))
    with pytest.raises(ConfigError, match=r"^--set oops: expected KEY=VALUE"):
        parse_set(["oops"])


def test_variables_env_set_default_and_literal(tmp_path: Path, monkeypatch) -> None:
    data = mutate(data__mock_data=False, data__data_path="${X}/a_${Y:-def}_$${keep}")
    path = write(tmp_path, data)
    monkeypatch.setenv("X", "/env")
    assert load_config(path, "r")["data_path"] == "/env/a_def_${keep}"
    assert load_config(path, "r", {"X": "/set", "Y": "y"})["data_path"] == "/set/a_y_${keep}"
    data["variables"] = {"X": "/cfg"}
    monkeypatch.delenv("X")
    assert load_config(write(tmp_path, data), "r")["data_path"] == "/cfg/a_def_${keep}"


def test_unset_variable_names_key_and_variable(tmp_path: Path) -> None:
    msg = error(tmp_path, mutate(data__mock_data=False, data__data_path="${X}"))
    assert msg.startswith("data.data_path: variable ${X} is not set")
    assert "--set X=..." in msg


def test_unset_variables_are_all_listed() -> None:
    with pytest.raises(ConfigError) as info:
        load_config("gpt-350m", "scale-s2048-gb16")
    msg = str(info.value)
    assert msg.startswith("data.data_path: variable ${DATA_PATH} is not set")
    assert "${VOCAB_FILE} (tokenizer.vocab_file)" in msg and "${MERGE_FILE}" in msg


def test_unused_values_need_no_variables() -> None:
    # Mock data needs no DATA_PATH; the NullTokenizer needs no vocabulary files.
    cfg = load_config("gpt-350m", "scale-s2048-gb16", {
        "mock_data": "true", "tokenizer_type": "NullTokenizer", "vocab_size": "50257"})
    assert cfg["data_path"] is None and cfg["vocab_file"] is None and cfg["vocab_size"] == 50257


def test_single_run_is_the_default(tmp_path: Path) -> None:
    assert load_config(write(tmp_path, BASE)).run_name == "r"
    data = mutate(runs__s={"seq_length": 4096, "global_batch_size": 16})
    msg = error(tmp_path, data, run=None)
    assert msg.startswith("runs: t.yaml has 2 runs; choose one with --run (r, s)")


# --------------------------------------------------------------------------- structure errors
@pytest.mark.parametrize("changes,expected", [
    ({"modle": {}}, "modle: unknown key; did you mean 'model'?"),
    ({"model__num_layer": 4}, "model.num_layer: unknown key; did you mean 'num_layers'?"),
    ({"training__hidden_size": 4}, "training.hidden_size: unknown key ('hidden_size' belongs in section 'model')"),
    ({"num_layers": 4}, "num_layers: unknown key ('num_layers' belongs in section 'model')"),
    ({"runs__r__seq_len": 4}, "runs.r.seq_len: unknown key; did you mean 'seq_length'?"),
    ({"runs__r__training": {"seq_length": 4}}, "runs.r.training: unknown key (run settings are flat"),
    ({"model": [1, 2]}, "model: expected a mapping of keys, got list"),
    ({"runs__r": [1]}, "runs.r: expected a mapping of settings, got list"),
    ({"runs": ...}, "runs: missing required key"),
    ({"runs": {}}, "runs: expected a non-empty mapping"),
    ({"runs": {"bad name": {}}}, "runs.bad name: a run name must start with a letter or digit"),
    ({"name": "a/b"}, "name: must start with a letter or digit"),
    ({"variables": {"lower": "x"}}, "variables.lower: variable names are UPPER_CASE"),
    ({"runs__r__extra_args": "--foo"}, "runs.r.extra_args: expected a list of strings"),
])
def test_structure_errors(tmp_path: Path, changes: dict[str, Any], expected: str) -> None:
    assert error(tmp_path, mutate(**changes)).startswith(expected)


def test_unknown_run(tmp_path: Path) -> None:
    assert error(tmp_path, BASE, run="rr").startswith("runs.rr: no such run in t.yaml (did you mean 'r'?)")


def test_not_yaml_and_not_a_mapping(tmp_path: Path) -> None:
    bad = tmp_path / "bad.yaml"
    bad.write_text("model: [unclosed\n")
    with pytest.raises(ConfigError, match="not valid YAML"):
        load_config(bad)
    bad.write_text("- a\n- b\n")
    with pytest.raises(ConfigError, match="top level must be a mapping"):
        load_config(bad)
    with pytest.raises(ConfigError, match="no such config file"):
        load_config(tmp_path / "missing.yaml")


# --------------------------------------------------------------------------- type errors
@pytest.mark.parametrize("changes,expected", [
    ({"model__num_layers": "24"}, "model.num_layers: expected an integer, got str '24'"),
    ({"runs__r__seq_length": 2048.5}, "runs.r.seq_length: expected an integer, got float 2048.5"),
    ({"model__num_layers": True}, "model.num_layers: expected an integer, got bool True"),
    ({"model__swiglu": "yes"}, "model.swiglu: expected true or false, got str 'yes'"),
    ({"optimizer__lr": "fast"}, "optimizer.lr: expected a number, got str 'fast'"),
    ({"optimizer__lr": [1]}, "optimizer.lr: expected a number, got list [1]"),
    ({"training__precision": "fp8"}, "training.precision: 'fp8' is not one of bf16, fp16, fp32"),
    ({"training__precision": None}, "training.precision: must not be null"),
    ({"parallel__nodes": 0}, "parallel.nodes: must be >= 1, got 0"),
    ({"tokenizer__vocab_file": 3}, "tokenizer.vocab_file: expected a string, got int 3"),
    ({"data__data_path": {"a": 1}}, "data.data_path: expected a string or a list of strings"),
    ({"data__data_path": []}, "data.data_path: expected a string or a non-empty list of strings"),
    # a run's values are checked by the same schema, under the run's path
    ({"runs__r__nodes": 0}, "runs.r.nodes: must be >= 1, got 0"),
    ({"runs__r__precision": "fp8"}, "runs.r.precision: 'fp8' is not one of bf16, fp16, fp32"),
    ({"runs__r__lr": "inf"}, "runs.r.lr: expected a finite number, got 'inf'"),
    ({"model__num_layers": None}, "model.num_layers: must not be null (expected int; it is required)"),
    ({"variables": {"X": [1]}}, "variables.X: expected a string or null, got list [1]"),
])
def test_type_errors(tmp_path: Path, changes: dict[str, Any], expected: str) -> None:
    assert error(tmp_path, mutate(**changes)).startswith(expected)


def test_float_keys_accept_yaml_exponent_strings(tmp_path: Path) -> None:
    # PyYAML reads 1e-4 (no dot) as a string; a float key takes it as the number it reads as.
    path = tmp_path / "t.yaml"
    path.write_text(yaml.safe_dump(BASE, sort_keys=False).replace("lr: 0.0001", "lr: 1e-4"))
    assert load_config(path)["lr"] == 1e-4


def test_missing_required_key(tmp_path: Path) -> None:
    msg = error(tmp_path, mutate(model__num_layers=...))
    assert msg.startswith("model.num_layers: missing required key")
    msg = error(tmp_path, mutate(runs__r__seq_length=...))
    assert msg.startswith("training.seq_length: missing required key")
    assert "under 'training:' or in runs.r" in msg


def test_override_errors(tmp_path: Path) -> None:
    path = write(tmp_path, BASE)
    with pytest.raises(ConfigError, match=r"^--set seq_lenght: unknown key; did you mean 'seq_length'"):
        load_config(path, "r", {"seq_lenght": "1"})
    with pytest.raises(ConfigError, match=r"^--set model.seq_length: unknown key"):
        load_config(path, "r", {"model.seq_length": "4096"})
    with pytest.raises(ConfigError, match=r"^--set seq_length: expected an integer"):
        load_config(path, "r", {"seq_length": "long"})
    with pytest.raises(ConfigError, match=r"^--set parallel.nodes: must be >= 1, got 0"):
        load_config(path, "r", {"parallel.nodes": "0"})


def test_empty_section_is_allowed(tmp_path: Path) -> None:
    data = mutate(system=None)
    assert load_config(write(tmp_path, data), "r")["transformer_impl"] == "transformer_engine"


# --------------------------------------------------------------------------- cross-key checks
def test_seq_length_divisible_by_2cp(tmp_path: Path) -> None:
    msg = error(tmp_path, mutate(runs__r__seq_length=2040))
    assert msg.startswith("runs.r.seq_length: 2040 is not divisible by 2·CP = 16 "
                          "(context_parallel_size 8 from parallel.context_parallel_size)")
    msg = error(tmp_path, BASE, overrides={"seq_length": "2056"})
    assert msg.startswith("--set seq_length: 2056 is not divisible by 2·CP = 16")


def test_cp_divides_gpu_count(tmp_path: Path) -> None:
    msg = error(tmp_path, mutate(parallel__gpus_per_node=6))
    assert msg.startswith("parallel.context_parallel_size: CP 8 does not divide the GPU count "
                          "nodes × gpus_per_node = 2 × 6 = 12")


def test_tp_pp_cp_divides_world(tmp_path: Path) -> None:
    msg = error(tmp_path, mutate(runs__r__tensor_model_parallel_size=4))
    assert msg.startswith("runs.r.tensor_model_parallel_size: TP·PP·CP = 4·1·8 = 32 does not "
                          "divide the world size nodes × gpus_per_node = 16")
    msg = error(tmp_path, mutate(parallel__pipeline_model_parallel_size=4))
    assert msg.startswith("parallel.pipeline_model_parallel_size: TP·PP·CP = 1·4·8 = 32")


def test_global_batch_divisible_by_micro_batch_times_dp(tmp_path: Path) -> None:
    msg = error(tmp_path, mutate(runs__r__global_batch_size=3))
    assert msg.startswith("runs.r.global_batch_size: 3 is not divisible by micro_batch_size × DP "
                          "= 1 × 2 = 2")
    msg = error(tmp_path, mutate(training__micro_batch_size=4, runs__r__global_batch_size=12))
    assert msg.startswith("runs.r.global_batch_size: 12 is not divisible by micro_batch_size × "
                          "DP = 4 × 2 = 8")


def test_heads_divisible_by_tp_and_query_groups(tmp_path: Path) -> None:
    # world 24 = 2 x 12, CP 8, TP 3: 16 heads do not split over 3 TP ranks.
    msg = error(tmp_path, mutate(parallel__gpus_per_node=12, parallel__context_parallel_size=8,
                                 parallel__tensor_model_parallel_size=3, parallel__nodes=1,
                                 runs__r__global_batch_size=1))
    assert msg.startswith("parallel.context_parallel_size: CP 8 does not divide")
    msg = error(tmp_path, mutate(parallel__gpus_per_node=12, parallel__context_parallel_size=4,
                                 parallel__tensor_model_parallel_size=3, parallel__nodes=1,
                                 model__hidden_size=240, runs__r__global_batch_size=1))
    assert msg.startswith("model.num_attention_heads: 16 heads are not divisible by "
                          "tensor_model_parallel_size 3")
    msg = error(tmp_path, mutate(model__num_query_groups=3))
    assert msg.startswith("model.num_query_groups: num_attention_heads 16 is not divisible by "
                          "num_query_groups 3")
    msg = error(tmp_path, mutate(model__num_query_groups=2, parallel__tensor_model_parallel_size=4,
                                 parallel__context_parallel_size=4, runs__r__global_batch_size=1))
    assert msg.startswith("model.num_query_groups: 2 query groups are not divisible by "
                          "tensor_model_parallel_size 4")


@pytest.mark.parametrize("changes,expected", [
    ({"model__hidden_size": 250}, "model.hidden_size: 250 is not divisible by num_attention_heads 16"),
    ({"model__num_layers": 3, "parallel__pipeline_model_parallel_size": 2},
     "model.num_layers: 3 layers are not divisible by pipeline_model_parallel_size 2"),
    ({"model__max_position_embeddings": 1024}, "model.max_position_embeddings: 1024 is less than seq_length 2048"),
    ({"optimizer__min_lr": 1.0}, "optimizer.min_lr: 1.0 is greater than lr 0.0001"),
    ({"optimizer__lr_warmup_fraction": 0.1, "optimizer__lr_warmup_iters": 5},
     "optimizer.lr_warmup_iters: set lr_warmup_fraction or lr_warmup_iters, not both"),
    ({"data__mock_data": False}, "data.data_path: missing"),
    ({"tokenizer": {"tokenizer_type": "GPT2BPETokenizer"}}, "tokenizer.vocab_file: required with tokenizer_type GPT2BPETokenizer"),
    ({"tokenizer": {"tokenizer_type": "NullTokenizer"}}, "tokenizer.vocab_size: required with tokenizer_type NullTokenizer"),
    ({"tokenizer": {"tokenizer_type": "HuggingFaceTokenizer"}}, "tokenizer.tokenizer_model: required"),
    ({"parallel__charm_topology": "3x4"}, "parallel.charm_topology: "),
    ({"parallel__charm_topology": "banana"}, "parallel.charm_topology: "),
])
def test_value_errors(tmp_path: Path, changes: dict[str, Any], expected: str) -> None:
    assert error(tmp_path, mutate(**changes)).startswith(expected)


@pytest.mark.parametrize("topology", ["auto", "node", "numa", "flat", "2x4", "1x8", "0-3,4-7",
                                      "0,2,4,6/1,3,5,7"])
def test_valid_topologies(tmp_path: Path, topology: str) -> None:
    assert load_config(write(tmp_path, mutate(parallel__charm_topology=topology)))[
        "charm_topology"] == topology


def test_config_error_is_a_value_error() -> None:
    assert issubclass(ConfigError, ValueError)
