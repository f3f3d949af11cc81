"""Megatron layer: CHARM+ as a megatron-core core attention, selected by ``--cp-comm-type charm``.

Public API:

* :class:`CharmDotProductAttention` - core-attention module for the spec slot
  ``self_attention.submodules.core_attention`` (``cp_comm_type`` ``charm`` / ``rmplus`` /
  ``ring`` / ``auto``).
* :func:`use_charm` - a copy of a layer / block spec with CHARM+ in every self-attention.
* :func:`set_topology` / :func:`get_topology` - the CP topology the modules use
  (``--charm-topology``, else ``CHARM_TOPOLOGY``, else the probe).
* :func:`add_charm_args`, :func:`uses_charm`, :func:`charm_comm_type` - Megatron-LM argument
  helpers (``charm_megatron.megatron.args``, importable without torch or Megatron).

Attributes are loaded on first use, so ``charm_megatron.megatron.args`` stays light; the rest
needs megatron-core (``pip install 'charm-megatron[megatron]'``). See ``docs/megatron.md``.
"""

from __future__ import annotations

import importlib
from typing import Any

# attribute -> defining submodule
_EXPORTS = {
    "CharmDotProductAttention": "attention",
    "CHARM_COMM_TYPES": "args",
    "DEFAULT_COMM_TYPE": "attention",
    "set_topology": "attention",
    "get_topology": "attention",
    "use_charm": "spec",
    "count_charm_attention": "spec",
    "add_charm_args": "args",
    "chain_extra_args_providers": "args",
    "charm_comm_type": "args",
    "uses_charm": "args",
}

__all__ = sorted(_EXPORTS)


def __getattr__(name: str) -> Any:
    if name in _EXPORTS:
        module = importlib.import_module(f"charm_megatron.megatron.{_EXPORTS[name]}")
        return getattr(module, name)
    raise AttributeError(f"module 'charm_megatron.megatron' has no attribute {name!r}")


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(_EXPORTS))
