"""Launching experiments: configs (:mod:`.config`), Megatron command lines (:mod:`.args_cli`)
and log comparison (:mod:`.compare`). Pure Python plus PyYAML; matplotlib only for plots.

The names below are imported on first use, so ``import charm_megatron.launch`` stays cheap.
"""

from __future__ import annotations

import importlib
from typing import Any

_EXPORTS = {
    "ConfigError": "config",
    "ResolvedRun": "config",
    "load_config": "config",
    "list_runs": "config",
    "build_argv": "args_cli",
    "command": "args_cli",
    "megatron_argv": "args_cli",
    "parse_log": "compare",
    "compare": "compare",
}
__all__ = sorted(_EXPORTS)


def __getattr__(name: str) -> Any:
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module 'charm_megatron.launch' has no attribute {name!r}")
    return getattr(importlib.import_module(f"charm_megatron.launch.{module}"), name)
