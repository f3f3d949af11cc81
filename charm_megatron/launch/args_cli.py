"""``charm-megatron args``: the Megatron-LM command line of one config run.

::

    charm-megatron args gpt-350m --run scale-s2048-gb16 --cp-comm-type charm
    python -m charm_megatron.pretrain_gpt --num-layers 24 ... --cp-comm-type charm --charm-topology auto ...

Every generated option is an option of Megatron-LM's ``pretrain_gpt.py`` (checked in the tests
against the option list of Megatron-LM ``core_v0.16.1``), except ``--charm-topology``, which
``charm_megatron.pretrain_gpt`` adds. ``--cp-comm-type p2p`` is Megatron's own ring (and
``a2a``, ``allgather`` its other CP algorithms); the algorithm registry's choices (``ring``,
``rmplus``, ``charm``, ``auto``: :mod:`charm_megatron.plan.registry`) are served by
charm-megatron and also get ``--charm-topology``.

Python API: :func:`build_argv` (Megatron arguments of a :class:`ResolvedRun`), :func:`command`
(with the ``python -m charm_megatron.pretrain_gpt`` prefix) and :func:`megatron_argv` (load a
config and build in one call).
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import sys
from collections.abc import Mapping
from typing import Any

from charm_megatron.launch.config import (
    SCHEMA,
    ConfigError,
    ResolvedRun,
    list_runs,
    load_config,
    parse_set,
)
from charm_megatron.megatron.args import CHARM_COMM_TYPES as MEGATRON_CHARM_COMM_TYPES
from charm_megatron.plan.registry import NameView, describe_choices

__all__ = [
    "CHARM_COMM_TYPES",
    "COMM_TYPES",
    "ENTRY_MODULE",
    "MEGATRON_COMM_TYPES",
    "build_argv",
    "command",
    "megatron_argv",
    "register",
    "run",
]

#: Megatron-LM's own context-parallel algorithms (``p2p`` is its ring; they need TE).
MEGATRON_COMM_TYPES: tuple[str, ...] = ("p2p", "a2a", "allgather")
#: Served by charm-megatron's attention (the registry's choices less the TE-named peers, as
#: ``charm_megatron.megatron.args`` rules); these get ``--charm-topology``.
CHARM_COMM_TYPES = MEGATRON_CHARM_COMM_TYPES
COMM_TYPES = NameView(lambda: tuple(dict.fromkeys(MEGATRON_COMM_TYPES
                                                  + tuple(MEGATRON_CHARM_COMM_TYPES))))
#: The training entry point the command runs (``python -m ENTRY_MODULE``).
ENTRY_MODULE = "charm_megatron.pretrain_gpt"

# Megatron switches that turn off its CUDA-only fused kernels (system.fused_kernels: false).
_NO_FUSION_FLAGS = (
    "--no-gradient-accumulation-fusion",
    "--no-masked-softmax-fusion",
    "--no-bias-gelu-fusion",
    "--no-bias-dropout-fusion",
    "--no-rope-fusion",
    "--no-persist-layer-norm",
)
_PRECISION_FLAGS = {"bf16": ["--bf16"], "fp16": ["--fp16"], "fp32": []}
# Keys build_argv handles by name; every other key maps to its Field.flag one-to-one.
_SPECIAL = {"num_query_groups", "charm_topology", "context_parallel_size", "precision",
            "mock_data", "data_path", "fused_kernels", "nodes", "gpus_per_node"}
assert all(f.flag for f in SCHEMA if f.name not in _SPECIAL), "a plain schema key lacks a flag"


def _text(value: Any) -> str:
    """A value as Megatron's argparse reads it: ints plainly, floats round-trip exactly."""
    if isinstance(value, float):
        return repr(value)
    return str(value)


def build_argv(cfg: ResolvedRun, comm_type: str) -> list[str]:
    """The Megatron-LM arguments (no program name) of ``cfg`` with ``--cp-comm-type comm_type``.

    Options come in schema order (model, parallel, training, optimizer, data, tokenizer,
    system, logging), then the config's ``extra_args`` and the run's ``extra_args`` verbatim.
    """
    if comm_type not in COMM_TYPES:
        raise ConfigError(f"--cp-comm-type: {comm_type!r} is not one of {', '.join(COMM_TYPES)}")
    v = cfg.values
    argv: list[str] = []
    for f in SCHEMA:
        value = v[f.name]
        name = f.name
        if name == "num_query_groups":
            if value is not None:
                argv += ["--group-query-attention", "--num-query-groups", _text(value)]
        elif name == "charm_topology":
            # Emitted next to --context-parallel-size; see below.
            continue
        elif name == "context_parallel_size":
            argv += ["--context-parallel-size", _text(value), "--cp-comm-type", comm_type]
            if comm_type in CHARM_COMM_TYPES:
                argv += ["--charm-topology", str(v["charm_topology"])]
        elif name == "precision":
            argv += _PRECISION_FLAGS[value]
        elif name == "mock_data":
            if value:
                argv.append("--mock-data")
        elif name == "data_path":
            if not v["mock_data"]:
                paths = value if isinstance(value, list) else [value]
                argv += ["--data-path", *map(str, paths)]
        elif name == "fused_kernels":
            if not value:
                argv += list(_NO_FUSION_FLAGS)
        elif name in ("nodes", "gpus_per_node"):
            continue  # the launcher's business (torchrun / SLURM), not Megatron's
        elif f.kind == "bool":
            if value:
                argv.append(str(f.flag))
        elif value is not None:
            argv += [str(f.flag), _text(value)]
    argv += list(cfg.extra_args)
    return argv


def command(cfg: ResolvedRun, comm_type: str, python: str = "python") -> list[str]:
    """``[python, "-m", "charm_megatron.pretrain_gpt", *build_argv(cfg, comm_type)]``."""
    return [python, "-m", ENTRY_MODULE, *build_argv(cfg, comm_type)]


def megatron_argv(
    config: str | os.PathLike[str],
    run: str | None = None,
    comm_type: str = "charm",
    overrides: Mapping[str, Any] | None = None,
) -> list[str]:
    """Load ``config`` / ``run`` with ``overrides`` (see ``load_config``) and build its argv."""
    return build_argv(load_config(config, run, overrides), comm_type)


# --------------------------------------------------------------------------- CLI
def register(parser: argparse.ArgumentParser) -> None:
    """Add the ``args`` subcommand's arguments."""
    parser.add_argument("config", nargs="?", help="config file, or a packaged config name "
                        "(gpt-350m, gpt-1.3b, gpt-tiny-cpu)")
    parser.add_argument("--run", help="run name under runs: (optional if there is only one)")
    parser.add_argument("--cp-comm-type", choices=COMM_TYPES,
                        help="Megatron's own p2p (its ring), a2a, allgather; or charm-megatron's "
                        f"{describe_choices()}")
    parser.add_argument("--set", dest="overrides", action="append", default=[],
                        metavar="KEY=VALUE", help="override a key (seq_length=4096, "
                        "parallel.nodes=4) or set a variable (DATA_PATH=/data/x); repeatable")
    parser.add_argument("--format", choices=("shell", "json", "lines", "env"), default="shell",
                        help="shell: one quoted command line (default); lines: the Megatron "
                        "arguments one per line, for `mapfile -t`; json: the command, the "
                        "arguments and the run's facts; env: NAME=value facts for scripts")
    parser.add_argument("--python", default="python",
                        help="interpreter in the shell/json command (default: python)")
    parser.add_argument("--list-runs", action="store_true",
                        help="print the config's run names, one per line, and exit")
    parser.add_argument("--list-comm-types", action="store_true",
                        help="print the accepted --cp-comm-type values, one per line, and exit "
                        "(no config needed; the SLURM scripts check --comm with it)")


def _env_lines(cfg: ResolvedRun, comm_type: str) -> list[str]:
    facts = cfg.summary()
    keys = ("config", "run", "nodes", "gpus_per_node", "world_size", "tp", "pp", "cp", "dp",
            "seq_length", "global_batch_size", "charm_topology")
    out = [f"{k.upper()}={shlex.quote(str(facts[k]))}" for k in keys]
    out.append(f"COMM_TYPE={shlex.quote(comm_type)}")
    return out


#: Printed (stderr) next to a command line whose config runs on CPU ranks (gloo).
CPU_NOTE = (
    "note: this config runs on CPU ranks (--distributed-backend gloo). Megatron-LM's pretrain() "
    "asserts CUDA ('Megatron requires CUDA.') before it parses anything, so this command "
    "documents the arguments and does not train on a CPU-only machine; the runnable CPU "
    "training of this config is `charm-megatron demo` (megatron-core on gloo ranks, docs/demo.md), and "
    "tests/test_megatron_lm_real.py drives Megatron-LM with these arguments up to that gate "
    "(docs/megatron.md)"
)


def _cpu_note(cfg: ResolvedRun) -> str | None:
    return CPU_NOTE if cfg.values.get("distributed_backend") == "gloo" else None


def run(args: argparse.Namespace) -> int:
    """Print the command line (or the run list); 2 with a message on a config error."""
    try:
        if args.list_comm_types:
            print("\n".join(COMM_TYPES))
            return 0
        if args.config is None:
            raise ConfigError("the config (a file or a packaged name) is required")
        if args.list_runs:
            print("\n".join(list_runs(args.config)))
            return 0
        if args.cp_comm_type is None:
            raise ConfigError("--cp-comm-type: required (one of " + ", ".join(COMM_TYPES) + ")")
        cfg = load_config(args.config, args.run, parse_set(args.overrides))
        argv = build_argv(cfg, args.cp_comm_type)
    except ConfigError as exc:
        print(f"charm-megatron args: {exc}", file=sys.stderr)
        return 2
    if args.format == "shell":
        print(shlex.join(command(cfg, args.cp_comm_type, args.python)))
        if _cpu_note(cfg):
            print(f"charm-megatron args: {_cpu_note(cfg)}", file=sys.stderr)
    elif args.format == "lines":
        # One argument per line: a newline inside one, or an empty one (lost by the shell's
        # $(...)), cannot be represented.
        bad = [a for a in argv if "\n" in a or not a]
        if bad:
            print(f"charm-megatron args: --format lines cannot hold the argument {bad[0]!r} "
                  "(empty, or with a newline); use --format json", file=sys.stderr)
            return 2
        print("\n".join(argv))
    elif args.format == "env":
        print("\n".join(_env_lines(cfg, args.cp_comm_type)))
    else:
        payload = dict(cfg.summary(), comm_type=args.cp_comm_type,
                       command=command(cfg, args.cp_comm_type, args.python), argv=argv)
        if _cpu_note(cfg):
            payload["note"] = _cpu_note(cfg)
        print(json.dumps(payload, indent=2))
    return 0
