"""``charm-megatron args``: golden command lines, Megatron flag validity, formats, errors.

Regenerate the goldens after an intended change (then review the diff by eye)::

    UPDATE_GOLDEN=1 .venv/bin/python -m pytest tests/test_args.py
"""

from __future__ import annotations

import json
import os
import re
import shlex
from pathlib import Path

import pytest

from charm_megatron import cli
from charm_megatron.launch.args_cli import (
    CHARM_COMM_TYPES,
    COMM_TYPES,
    MEGATRON_COMM_TYPES,
    build_argv,
    command,
    megatron_argv,
)
from charm_megatron.launch.config import ConfigError, list_runs, load_config

GOLDEN = Path(__file__).parent / "golden"
VARS = {
    "DATA_PATH": "/data/pile/pile_text_document",
    "VOCAB_FILE": "/data/gpt2/gpt2-vocab.json",
    "MERGE_FILE": "/data/gpt2/gpt2-merges.txt",
}
CONFIGS = ("gpt-350m", "gpt-1.3b", "gpt-tiny-cpu")
GOLDEN_COMMS = ("p2p", "charm")
# Options that charm_megatron.pretrain_gpt adds to Megatron-LM's parser.
OUR_FLAGS = {"--charm-topology"}


@pytest.fixture(autouse=True)
def _no_env_vars(monkeypatch: pytest.MonkeyPatch) -> None:
    for name in VARS:
        monkeypatch.delenv(name, raising=False)


def megatron_flags() -> dict[str, tuple[str, set[str]]]:
    """Megatron-LM core_v0.16.1's pretrain options: flag -> (kind, choices)."""
    out = {}
    for line in (GOLDEN / "megatron_flags.txt").read_text().splitlines():
        if line.startswith("#") or not line.strip():
            continue
        flag, kind, choices = (line.split("\t") + [""])[:3]
        out[flag] = (kind, set(filter(None, choices.split(","))))
    return out


def golden_text(config: str) -> str:
    lines = []
    for run in list_runs(config):
        for comm in GOLDEN_COMMS:
            cfg = load_config(config, run, VARS)
            lines.append(f"# charm-megatron args {config} --run {run} --cp-comm-type {comm}")
            lines.append(shlex.join(command(cfg, comm)))
    return "\n".join(lines) + "\n"


@pytest.mark.parametrize("config", CONFIGS)
def test_golden_command_lines(config: str) -> None:
    path = GOLDEN / "args" / f"{config}.txt"
    text = golden_text(config)
    if os.environ.get("UPDATE_GOLDEN"):
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)
    assert path.is_file(), f"{path} missing; run with UPDATE_GOLDEN=1"
    assert text == path.read_text(), f"{path} is stale; UPDATE_GOLDEN=1 regenerates it (review!)"


def check_megatron_argv(argv: list[str]) -> None:
    """Every option is Megatron-LM's (or ours), switches take no value, values fit choices."""
    flags = megatron_flags()
    i = 0
    while i < len(argv):
        flag = argv[i]
        assert flag.startswith("--"), f"expected an option at {i}, got {flag!r} in {argv}"
        if flag in OUR_FLAGS:
            i += 2
            continue
        assert flag in flags, f"{flag} is not a Megatron-LM pretrain_gpt.py option"
        kind, choices = flags[flag]
        if kind == "switch":
            i += 1
            continue
        values = []
        i += 1
        while i < len(argv) and not argv[i].startswith("--"):
            values.append(argv[i])
            i += 1
        assert values, f"{flag} needs a value"
        assert kind == "list" or len(values) == 1, f"{flag} takes one value, got {values}"
        for value in values:
            assert not choices or value in choices, f"{flag} {value}: not in {sorted(choices)}"


@pytest.mark.parametrize("config", CONFIGS)
@pytest.mark.parametrize("comm", COMM_TYPES)
def test_every_option_is_a_megatron_option(config: str, comm: str) -> None:
    for run in list_runs(config):
        check_megatron_argv(megatron_argv(config, run, comm, VARS))


def test_flag_list_is_megatron_lm() -> None:
    flags = megatron_flags()
    assert len(flags) > 500
    for flag in ("--num-layers", "--context-parallel-size", "--cp-comm-type", "--mock-data",
                 "--group-query-attention", "--num-query-groups", "--log-throughput"):
        assert flag in flags
    assert "--charm-topology" not in flags


def test_comm_types_differ_only_in_comm_type_and_topology() -> None:
    cfg = load_config("gpt-350m", "high-s16384-gb16", VARS)
    base = build_argv(cfg, "p2p")
    i = base.index("--cp-comm-type")
    for comm in COMM_TYPES:
        argv = build_argv(cfg, comm)
        expected = base[:i + 1] + [comm] + base[i + 2:]
        if comm in CHARM_COMM_TYPES:
            expected[i + 2:i + 2] = ["--charm-topology", "auto"]
        assert argv == expected, comm
    assert set(MEGATRON_COMM_TYPES) | set(CHARM_COMM_TYPES) == set(COMM_TYPES)


def test_argv_content_of_a_gpu_run() -> None:
    argv = megatron_argv("gpt-1.3b", "scale-s8192-gb4", "charm", VARS)
    pairs = dict(zip(argv, argv[1:]))
    assert pairs["--seq-length"] == "8192" and pairs["--global-batch-size"] == "4"
    assert pairs["--max-position-embeddings"] == "8192" and pairs["--hidden-size"] == "2048"
    assert pairs["--context-parallel-size"] == "16" and pairs["--cp-comm-type"] == "charm"
    assert pairs["--data-path"] == VARS["DATA_PATH"]
    assert pairs["--tokenizer-type"] == "GPT2BPETokenizer"
    assert "--bf16" in argv and "--mock-data" not in argv and "--group-query-attention" not in argv


def test_argv_of_the_cpu_demo() -> None:
    argv = megatron_argv("gpt-tiny-cpu", "demo-s256-gb2", "charm")
    pairs = dict(zip(argv, argv[1:]))
    assert "--mock-data" in argv and "--data-path" not in argv
    assert "--bf16" not in argv and "--fp16" not in argv
    assert "--group-query-attention" in argv and pairs["--num-query-groups"] == "2"
    assert pairs["--charm-topology"] == "2x2" and pairs["--distributed-backend"] == "gloo"
    assert "--no-gradient-accumulation-fusion" in argv


def test_data_blend_extra_args_and_quoting(tmp_path: Path) -> None:
    text = (GOLDEN.parent.parent / "configs" / "gpt-tiny-cpu.yaml").read_text()
    text = text.replace("  mock_data: true", "  mock_data: false\n  data_path: ['0.3', '${A}', 0.7, /b c]")
    text += "extra_args: [--exit-interval, '5']\n"
    path = tmp_path / "blend.yaml"
    path.write_text(text)
    cfg = load_config(path, "demo-s256-gb2", {"A": "/d/it's $HOME"})
    argv = build_argv(cfg, "p2p")
    i = argv.index("--data-path")
    assert argv[i:i + 5] == ["--data-path", "0.3", "/d/it's $HOME", "0.7", "/b c"]
    assert argv[-2:] == ["--exit-interval", "5"]
    check_megatron_argv(argv)
    # shell format: one line that a shell splits back into exactly these words
    assert shlex.split(shlex.join(command(cfg, "p2p"))) == command(cfg, "p2p")


def run_cli(capsys: pytest.CaptureFixture[str], *argv: str) -> tuple[int, str, str]:
    rc = cli.main(list(argv))
    out, err = capsys.readouterr()
    return rc, out, err


def test_cli_formats(capsys: pytest.CaptureFixture[str]) -> None:
    common = ["args", "gpt-350m", "--run", "scale-s4096-gb8", "--cp-comm-type", "rmplus"]
    sets = [x for k, v in VARS.items() for x in ("--set", f"{k}={v}")]
    expected = megatron_argv("gpt-350m", "scale-s4096-gb8", "rmplus", VARS)

    rc, out, _ = run_cli(capsys, *common, *sets)
    assert rc == 0 and shlex.split(out) == ["python", "-m", "charm_megatron.pretrain_gpt", *expected]
    rc, out, _ = run_cli(capsys, *common, *sets, "--format", "lines")
    assert rc == 0 and out.splitlines() == expected
    rc, out, _ = run_cli(capsys, *common, *sets, "--format", "json", "--python", "python3")
    data = json.loads(out)
    assert data["argv"] == expected and data["command"][:3] == ["python3", "-m",
                                                                "charm_megatron.pretrain_gpt"]
    assert (data["config"], data["run"], data["comm_type"], data["world_size"], data["cp"]) == (
        "gpt-350m", "scale-s4096-gb8", "rmplus", 16, 16)
    rc, out, _ = run_cli(capsys, *common, *sets, "--format", "env", "--set", "nodes=4")
    env = dict(line.split("=", 1) for line in out.splitlines())
    assert env["CONFIG"] == "gpt-350m" and env["NODES"] == "4" and env["WORLD_SIZE"] == "32"
    assert env["DP"] == "2" and env["COMM_TYPE"] == "rmplus"


def test_cli_list_runs(capsys: pytest.CaptureFixture[str]) -> None:
    rc, out, _ = run_cli(capsys, "args", "gpt-1.3b", "--list-runs")
    assert rc == 0 and out.split() == list_runs("gpt-1.3b") and len(out.split()) == 8


@pytest.mark.parametrize("argv,message", [
    (["args", "gpt-350m", "--run", "scale-s2048-gb16", "--cp-comm-type", "p2p"],
     "data.data_path: variable ${DATA_PATH} is not set"),
    (["args", "gpt-tiny-cpu", "--run", "nope", "--cp-comm-type", "p2p"], "runs.nope: no such run"),
    (["args", "gpt-tiny-cpu", "--run", "demo-s256-gb2"], "--cp-comm-type: required"),
    (["args", "gpt-tiny-cpu", "--run", "demo-s256-gb2", "--cp-comm-type", "p2p", "--set",
      "seq_length=100"], "--set seq_length: 100 is not divisible by 2·CP = 8"),
    (["args", "no-such-config", "--cp-comm-type", "p2p"], "no-such-config: no such config file"),
])
def test_cli_errors(capsys: pytest.CaptureFixture[str], argv: list[str], message: str) -> None:
    rc, out, err = run_cli(capsys, *argv)
    assert rc == 2 and out == ""
    assert err.startswith("charm-megatron args: " + message)


def test_unknown_comm_type_is_refused(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit):
        cli.main(["args", "gpt-tiny-cpu", "--cp-comm-type", "magic"])
    cfg = load_config("gpt-tiny-cpu", "demo-s256-gb2")
    with pytest.raises(ConfigError, match="--cp-comm-type: 'magic' is not one of"):
        build_argv(cfg, "magic")


def test_golden_files_are_reviewed_shape() -> None:
    # A cheap guard on the goldens themselves: one command per (run, comm), each line a full
    # command for the right run.
    for config in CONFIGS:
        lines = (GOLDEN / "args" / f"{config}.txt").read_text().splitlines()
        assert len(lines) == 2 * len(GOLDEN_COMMS) * len(list_runs(config))
        for header, cmd in zip(lines[::2], lines[1::2]):
            m = re.fullmatch(r"# charm-megatron args (\S+) --run (\S+) --cp-comm-type (\S+)", header)
            assert m and m[1] == config
            words = shlex.split(cmd)
            pairs = dict(zip(words, words[1:]))
            assert pairs["--cp-comm-type"] == m[3]
            seq, gbs = re.search(r"-s(\d+)-gb(\d+)$", m[2]).groups()
            assert (pairs["--seq-length"], pairs["--global-batch-size"]) == (seq, gbs)


def test_lines_format_refuses_unrepresentable_arguments(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    text = (GOLDEN.parent.parent / "configs" / "gpt-tiny-cpu.yaml").read_text()
    path = tmp_path / "t.yaml"
    path.write_text(text + "extra_args: [--exit-interval, '']\n")
    rc, out, err = run_cli(capsys, "args", str(path), "--run", "demo-s256-gb2",
                           "--cp-comm-type", "p2p", "--format", "lines")
    assert rc == 2 and out == "" and "cannot hold the argument ''" in err
    rc, out, _ = run_cli(capsys, "args", str(path), "--run", "demo-s256-gb2",
                         "--cp-comm-type", "p2p", "--format", "json")
    assert rc == 0 and json.loads(out)["argv"][-1] == ""
