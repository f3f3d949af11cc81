"""The SLURM scripts: ``--dry-run`` output, and real submissions against fake sbatch/srun.

No SLURM needed: the scripts run under bash with a PATH holding only the system directories
(and, where a test says so, fake ``sbatch`` / ``srun`` / ``scontrol`` that record their
arguments). ``charm-megatron`` is reached as ``$PYTHON -m charm_megatron.cli``.
"""

from __future__ import annotations

import json
import os
import shlex
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from charm_megatron.launch.args_cli import megatron_argv
from charm_megatron.launch.config import list_runs

REPO = Path(__file__).resolve().parents[1]
SLURM = REPO / "scripts" / "slurm"
SCRIPTS = ("launch.sh", "sweep.sh", "run.sbatch")
BASH = shutil.which("bash")
VARS = {
    "DATA_PATH": "/data/pile/pile_text_document",
    "VOCAB_FILE": "/data/gpt2/gpt2-vocab.json",
    "MERGE_FILE": "/data/gpt2/gpt2-merges.txt",
}
SETS = [x for k, v in VARS.items() for x in ("--set", f"{k}={v}")]

pytestmark = pytest.mark.skipif(BASH is None, reason="bash is not installed")


def env_for(tmp_path: Path, fake_bin: Path | None = None) -> dict[str, str]:
    path = "/usr/bin:/bin"
    if fake_bin is not None:
        path = f"{fake_bin}:{path}"
    env = {k: v for k, v in os.environ.items() if not k.startswith(("CHARM_", "SLURM_"))}
    for name in (*VARS, "MEGATRON_LM_PATH"):
        env.pop(name, None)
    env.update(PATH=path, PYTHON=sys.executable, PYTHONPATH=str(REPO), HOME=str(tmp_path))
    return env


def sh(tmp_path: Path, script: str, *args: str, fake_bin: Path | None = None,
       extra_env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    env = env_for(tmp_path, fake_bin)
    env.update(extra_env or {})
    return subprocess.run([BASH, str(SLURM / script), *args], cwd=tmp_path, env=env,
                          capture_output=True, text=True, timeout=120)


def recorder(bin_dir: Path, name: str, stdout: str = "") -> Path:
    """A fake command that writes its arguments, one per line, to bin_dir/<name>.args."""
    bin_dir.mkdir(exist_ok=True)
    tool = bin_dir / name
    tool.write_text(f"#!/bin/bash\nprintf '%s\\n' \"$@\" > {shlex.quote(str(bin_dir / name))}.args\n"
                    f"printf '%s' {shlex.quote(stdout)}\n")
    tool.chmod(0o755)
    return bin_dir / f"{name}.args"


def fake_megatron_lm(tmp_path: Path) -> dict[str, str]:
    """MEGATRON_LM_PATH pointing at a directory shaped like a checkout (for submit-time checks)."""
    root = tmp_path / "Megatron-LM"
    (root / "megatron" / "training").mkdir(parents=True, exist_ok=True)
    (root / "pretrain_gpt.py").write_text("")
    return {"MEGATRON_LM_PATH": str(root)}


def after_marker(words: list[str], marker: str) -> list[str]:
    return words[words.index(marker) + 1:]


# --------------------------------------------------------------------------- static checks
@pytest.mark.parametrize("script", (*SCRIPTS, "common.sh"))
def test_shellcheck_clean(script: str) -> None:
    if shutil.which("shellcheck") is None:
        pytest.skip("shellcheck is not installed (apt-get install shellcheck)")
    proc = subprocess.run(["shellcheck", "-x", script], cwd=SLURM, capture_output=True,
                          text=True, timeout=60)
    assert proc.returncode == 0, proc.stdout + proc.stderr


@pytest.mark.parametrize("script", SCRIPTS)
def test_help(tmp_path: Path, script: str) -> None:
    proc = sh(tmp_path, script, "--help")
    assert proc.returncode == 0 and "docs/slurm.md" in proc.stdout


# --------------------------------------------------------------------------- launch.sh --dry-run
def test_launch_dry_run(tmp_path: Path) -> None:
    proc = sh(tmp_path, "launch.sh", "--config", "gpt-350m", "--run", "scale-s8192-gb4",
              "--comm", "charm", "--dry-run", *SETS)
    assert proc.returncode == 0, proc.stderr
    lines = proc.stdout.splitlines()
    run_dir = tmp_path / "runs" / "gpt-350m" / "scale-s8192-gb4" / "charm"
    assert lines[0] == f"# run directory: {run_dir}"
    argv = megatron_argv("gpt-350m", "scale-s8192-gb4", "charm", VARS)

    submit = shlex.split(lines[lines.index("# submit:") + 1])
    assert submit[0] == "sbatch"
    opts = submit[: submit.index(str(SLURM / "run.sbatch"))]
    pairs = dict(zip(opts, opts[1:]))
    assert pairs["--nodes"] == "2" and pairs["--gpus-per-node"] == "8"
    assert pairs["--ntasks-per-node"] == "1"
    assert pairs["--output"] == f"{run_dir}/train-%j.log"
    assert pairs["--job-name"] == "charm-gpt-350m-scale-s8192-gb4-charm"
    assert after_marker(submit, "--") == argv

    step = shlex.split(lines[-1])
    assert step[:8] == ["srun", "--nodes", "2", "--ntasks-per-node", "1", "--kill-on-bad-exit=1",
                        "torchrun", "--nnodes"]
    tr = dict(zip(step, step[1:]))
    assert tr["--nproc-per-node"] == "8" and tr["--rdzv-backend"] == "c10d"
    assert tr["--rdzv-endpoint"] == "<head>:29500"
    assert after_marker(step, "-m") == ["charm_megatron.pretrain_gpt", *argv]
    assert not (tmp_path / "runs").exists(), "a dry run must write nothing"


def test_launch_dry_run_overrides(tmp_path: Path) -> None:
    proc = sh(tmp_path, "launch.sh", "--config", "gpt-350m", "--run", "high-s16384-gb16",
              "--comm", "p2p", "--nodes", "4", "--port", "31000", "--runs-dir", "/scratch/r",
              "--partition", "gpu", "--time", "00:30:00", "--sbatch-arg", "--qos=high",
              "--dry-run", *SETS)
    assert proc.returncode == 0, proc.stderr
    lines = proc.stdout.splitlines()
    submit = shlex.split(lines[lines.index("# submit:") + 1])
    pairs = dict(zip(submit, submit[1:]))
    assert pairs["--nodes"] == "4" and pairs["--partition"] == "gpu"
    assert pairs["--time"] == "00:30:00" and "--qos=high" in submit
    assert pairs["--output"] == "/scratch/r/gpt-350m/high-s16384-gb16/p2p/train-%j.log"
    assert "--charm-topology" not in submit  # Megatron's own p2p ring needs no topology
    step = shlex.split(proc.stdout.splitlines()[-1])
    tr = dict(zip(step, step[1:]))
    assert tr["--nnodes"] == "4" and tr["--rdzv-endpoint"] == "<head>:31000"


def test_launch_env_defaults(tmp_path: Path) -> None:
    proc = sh(tmp_path, "launch.sh", "--dry-run", extra_env={
        "CHARM_CONFIG": "gpt-tiny-cpu", "CHARM_RUN": "demo-s512-gb1", "CHARM_COMM": "rmplus"})
    assert proc.returncode == 0, proc.stderr
    assert "/runs/gpt-tiny-cpu/demo-s512-gb1/rmplus" in proc.stdout.splitlines()[0]
    step = shlex.split(proc.stdout.splitlines()[-1])
    assert after_marker(step, "-m")[1:] == megatron_argv("gpt-tiny-cpu", "demo-s512-gb1", "rmplus")


@pytest.mark.parametrize("args,message", [
    (["--run", "r"], "launch.sh: --config is required"),
    (["--config", "gpt-tiny-cpu", "--run", "demo-s256-gb2", "--bogus"], "unknown option '--bogus'"),
    (["--config", "gpt-350m", "--run", "scale-s2048-gb16", "--nodes", "1", *SETS],
     "charm-megatron args: --set nodes: CP 16 does not divide the GPU count"),
    (["--config", "gpt-350m", "--run", "scale-s2048-gb16"], "variable ${DATA_PATH} is not set"),
])
def test_launch_errors(tmp_path: Path, args: list[str], message: str) -> None:
    proc = sh(tmp_path, "launch.sh", *args, "--dry-run")
    assert proc.returncode == 2 and message in proc.stderr, proc.stderr
    assert proc.stdout == ""


def test_launch_without_sbatch_fails_clearly(tmp_path: Path) -> None:
    if shutil.which("sbatch", path="/usr/bin:/bin"):
        pytest.skip("this machine has a real sbatch")
    proc = sh(tmp_path, "launch.sh", "--config", "gpt-tiny-cpu", "--run", "demo-s256-gb2")
    assert proc.returncode == 2 and "sbatch not found" in proc.stderr
    assert not (tmp_path / "runs").exists()


# --------------------------------------------------------------------------- real submission
def test_launch_submits_exact_argv_and_records_the_run(tmp_path: Path) -> None:
    fake = tmp_path / "bin"
    sbatch_args = recorder(fake, "sbatch", stdout="4242;cluster\n")
    # A data path a shell would mangle: spaces, quotes, $, glob and ; characters.
    nasty = "/data/my corpus/it's $HOME *;x"
    sets = ["--set", f"DATA_PATH={nasty}", "--set", "VOCAB_FILE=/v.json", "--set",
            "MERGE_FILE=/m.txt"]
    proc = sh(tmp_path, "launch.sh", "--config", "gpt-1.3b", "--run", "scale-s2048-gb16",
              "--comm", "charm", *sets, fake_bin=fake, extra_env=fake_megatron_lm(tmp_path))
    assert proc.returncode == 0, proc.stderr
    run_dir = tmp_path / "runs" / "gpt-1.3b" / "scale-s2048-gb16" / "charm"
    assert proc.stdout.strip() == f"submitted 4242: {run_dir}"
    expected = megatron_argv("gpt-1.3b", "scale-s2048-gb16", "charm",
                             {"DATA_PATH": nasty, "VOCAB_FILE": "/v.json", "MERGE_FILE": "/m.txt"})
    assert nasty in expected

    got = sbatch_args.read_text().splitlines()
    assert got[0] == "--parsable", "--parsable must reach sbatch, not the job script"
    assert after_marker(got, "--") == expected
    assert got[got.index(str(SLURM / "run.sbatch")) + 1:got.index("--")] == [
        "--run-dir", str(run_dir), "--nodes", "2", "--gpus-per-node", "8", "--port", "29500"]

    assert (run_dir / "megatron-args.txt").read_text().splitlines() == expected
    meta = json.loads((run_dir / "meta.json").read_text())
    assert (meta["config"], meta["run"], meta["comm_type"], meta["argv"]) == (
        "gpt-1.3b", "scale-s2048-gb16", "charm", expected)
    assert (run_dir / "jobs.txt").read_text() == "4242\n"
    assert shlex.split((run_dir / "sbatch.sh").read_text())[-len(expected):] == expected


def test_run_sbatch_job_step(tmp_path: Path) -> None:
    fake = tmp_path / "bin"
    srun_args = recorder(fake, "srun")
    recorder(fake, "scontrol", stdout="gpu-node-17\ngpu-node-18\n")
    run_dir = tmp_path / "r"
    argv = ["--num-layers", "2", "--data-path", "/a b/c"]
    proc = sh(tmp_path, "run.sbatch", "--run-dir", str(run_dir), "--gpus-per-node", "8", "--",
              *argv, fake_bin=fake, extra_env={"SLURM_JOB_ID": "99", "SLURM_NNODES": "2",
                                               "SLURM_JOB_NODELIST": "gpu-node-[17-18]"})
    assert proc.returncode == 0, proc.stderr
    expected = ["--nodes", "2", "--ntasks-per-node", "1", "--kill-on-bad-exit=1", "torchrun",
                "--nnodes", "2", "--nproc-per-node", "8", "--rdzv-id", "99", "--rdzv-backend",
                "c10d", "--rdzv-endpoint", "gpu-node-17:29500", "-m",
                "charm_megatron.pretrain_gpt", *argv]
    assert srun_args.read_text().splitlines() == expected
    saved = (run_dir / "command.sh").read_text().splitlines()
    assert saved[0] == "#!/usr/bin/env bash" and "job 99" in saved[1]
    assert shlex.split(saved[-1]) == ["srun", *expected]


def test_run_sbatch_outside_slurm(tmp_path: Path) -> None:
    proc = sh(tmp_path, "run.sbatch", "--nodes", "1", "--", "--num-layers", "2")
    assert proc.returncode == 2 and "not inside a SLURM job" in proc.stderr
    proc = sh(tmp_path, "run.sbatch", "--dry-run", "--", "--num-layers", "2")
    assert proc.returncode == 2 and "--nodes must be a positive integer" in proc.stderr
    proc = sh(tmp_path, "run.sbatch", "--nodes", "1", "--dry-run")
    assert proc.returncode == 2 and "no Megatron arguments" in proc.stderr


# --------------------------------------------------------------------------- sweep.sh
def test_sweep_dry_run_covers_every_run_with_ring_and_charm(tmp_path: Path) -> None:
    proc = sh(tmp_path, "sweep.sh", "--config", "gpt-350m", "--dry-run", *SETS)
    assert proc.returncode == 0, proc.stderr
    lines = proc.stdout.splitlines()
    headers = [line for line in lines if line.startswith("### ")]
    runs = list_runs("gpt-350m")
    assert headers == [f"### [{i + 1}/{2 * len(runs)}] gpt-350m {run} {comm}"
                       for i, (run, comm) in enumerate((r, c) for r in runs
                                                       for c in ("p2p", "charm"))]
    steps = [shlex.split(line) for line in lines if line.startswith("srun ")]
    assert len(steps) == len(headers)
    for (run, comm), step in zip(((r, c) for r in runs for c in ("p2p", "charm")), steps):
        assert after_marker(step, "-m")[1:] == megatron_argv("gpt-350m", run, comm, VARS)
    assert not (tmp_path / "runs").exists()


def test_sweep_selects_runs_and_comm_types(tmp_path: Path) -> None:
    proc = sh(tmp_path, "sweep.sh", "--config", "gpt-tiny-cpu", "--runs", "demo-s512-gb1",
              "--comm", "p2p,rmplus,charm", "--dry-run", "--port", "29999")
    assert proc.returncode == 0, proc.stderr
    headers = [line for line in proc.stdout.splitlines() if line.startswith("### ")]
    assert headers == ["### [1/3] gpt-tiny-cpu demo-s512-gb1 p2p",
                       "### [2/3] gpt-tiny-cpu demo-s512-gb1 rmplus",
                       "### [3/3] gpt-tiny-cpu demo-s512-gb1 charm"]
    assert proc.stdout.count("<head>:29999") == 3


def test_sweep_submits_with_fake_sbatch(tmp_path: Path) -> None:
    fake = tmp_path / "bin"
    recorder(fake, "sbatch", stdout="7\n")
    proc = sh(tmp_path, "sweep.sh", "--config", "gpt-tiny-cpu", fake_bin=fake,
              extra_env=fake_megatron_lm(tmp_path))
    assert proc.returncode == 0, proc.stderr
    dirs = sorted(p.relative_to(tmp_path / "runs").as_posix()
                  for p in (tmp_path / "runs").glob("*/*/*"))
    assert dirs == [f"gpt-tiny-cpu/{r}/{c}" for r in sorted(list_runs("gpt-tiny-cpu"))
                    for c in ("charm", "p2p")]


# --------------------------------------------------------------------------- MEGATRON_LM_PATH
@pytest.mark.parametrize("script", ["launch.sh", "sweep.sh"])
@pytest.mark.parametrize("case", ["unset", "not-a-checkout"])
def test_submit_checks_megatron_lm_path_before_sbatch(tmp_path: Path, script: str,
                                                      case: str) -> None:
    fake = tmp_path / "bin"
    sbatch_args = recorder(fake, "sbatch", stdout="1\n")
    env = {} if case == "unset" else {"MEGATRON_LM_PATH": str(tmp_path)}
    args = ["--config", "gpt-tiny-cpu"] + (["--run", "demo-s256-gb2"] if script == "launch.sh"
                                           else [])
    proc = sh(tmp_path, script, *args, fake_bin=fake, extra_env=env)
    assert proc.returncode == 2, proc.stderr
    assert "MEGATRON_LM_PATH" in proc.stderr
    assert ("is not set" if case == "unset" else "is not a Megatron-LM checkout") in proc.stderr
    assert not sbatch_args.exists() and not (tmp_path / "runs").exists()
    # --dry-run still prints the plan, with a note saying a real submission would stop (each
    # launch.sh of a sweep prints it: one run of the sweep's three shows it, in a third of
    # the time; test_sweep_dry_run_covers_every_run_with_ring_and_charm lists them all).
    one = ["--runs", "demo-s256-gb2"] if script == "sweep.sh" else []
    dry = sh(tmp_path, script, *args, *one, "--dry-run", extra_env=env)
    assert dry.returncode == 0 and "a real submission would stop here" in dry.stderr, dry.stderr
    assert dry.stdout.count("# run directory: ") == 2 - (script == "launch.sh"), dry.stdout


# --------------------------------------------------------------------------- comm types
def test_launch_accepts_auto(tmp_path: Path) -> None:
    """``--comm auto`` (docs/megatron.md) reaches Megatron's command line with the topology."""
    proc = sh(tmp_path, "launch.sh", "--config", "gpt-tiny-cpu", "--run", "demo-s512-gb1",
              "--comm", "auto", "--dry-run")
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.splitlines()[0].endswith("/gpt-tiny-cpu/demo-s512-gb1/auto")
    assert "--cp-comm-type auto --charm-topology" in proc.stdout


def test_sweep_checks_every_comm_type_before_submitting(tmp_path: Path) -> None:
    fake = tmp_path / "bin"
    recorder(fake, "sbatch", stdout="7\n")
    proc = sh(tmp_path, "sweep.sh", "--config", "gpt-tiny-cpu", "--comm", "p2p,bogus",
              fake_bin=fake)
    assert proc.returncode == 2
    assert "--comm: 'bogus' is not one of p2p,a2a,allgather,ring,rmplus,charm,auto" in proc.stderr
    assert not (fake / "sbatch.args").exists() and not (tmp_path / "runs").exists()
