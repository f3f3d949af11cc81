"""``charm-megatron`` command line: one subcommand per module, imported only when used.

Each module named in ``COMMANDS`` provides ``register(parser)`` (adds its arguments) and
``run(args) -> int``. Importing this file imports neither torch nor Megatron, so
``charm-megatron --help`` is instant.
"""

from __future__ import annotations

import argparse
import importlib
import sys

# subcommand -> (module, one-line help)
COMMANDS: dict[str, tuple[str, str]] = {
    "demo": ("charm_megatron.demo", "the CPU demo: ring vs CHARM+ on CPU ranks"),
    "plan": ("charm_megatron.commands.plan", "print a ring / rmplus / charm schedule and its costs"),
    "topo": ("charm_megatron.topology.cli", "probe and print the CP topology (run under torchrun/srun)"),
    "args": ("charm_megatron.launch.args_cli", "print the Megatron-LM command line for a config run"),
    "compare": ("charm_megatron.launch.compare", "compare iteration times in Megatron-LM logs"),
    "bench": ("charm_megatron.lab.bench.cli", "operator benchmark: ring vs rmplus vs charm"),
    "model": ("charm_megatron.lab.calibration.cli", "performance model: predicted time on a described cluster"),
    "report": ("charm_megatron.lab.reports.cli", "the docs' tables, from bench CSVs, the model and measurements"),
}


def _load(name: str):
    module_name, _ = COMMANDS[name]
    try:
        return importlib.import_module(module_name)
    except ModuleNotFoundError as exc:
        if exc.name and module_name.startswith(exc.name):
            raise SystemExit(f"charm-megatron {name}: not available in this version ({exc})") from exc
        raise


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    parser = argparse.ArgumentParser(prog="charm-megatron", description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    for name, (_, help_text) in COMMANDS.items():
        sub.add_parser(name, help=help_text, add_help=False)
    if not argv or argv[0] in ("-h", "--help") or argv[0] not in COMMANDS:
        parser.parse_args(argv or ["--help"])
        return 2
    name = argv[0]
    module = _load(name)
    cmd_parser = argparse.ArgumentParser(prog=f"charm-megatron {name}", description=COMMANDS[name][1])
    module.register(cmd_parser)
    args = cmd_parser.parse_args(argv[1:])
    return int(module.run(args) or 0)


if __name__ == "__main__":
    sys.exit(main())
