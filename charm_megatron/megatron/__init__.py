"""Megatron layer: CHARM+ as a megatron-core core attention, selected by ``--cp-comm-type charm``.

Public API:

* :class:`CharmDotProductAttention` - core-attention module for the spec slot
  ``self_attention.submodules.core_attention`` (``cp_comm_type`` ``charm`` / ``rmplus`` /
  ``ring`` / ``auto``; ``topology=``; dynamic CP through ``packed_seq_params``).
* :func:`use_charm` - a copy of a layer / block / MTP spec whose self-attentions build CHARM+
  in layers whose ``--cp-comm-type`` entry is ours and keep their own core attention in the
  others (:class:`PerLayerCoreAttention`); ``use_charm(spec, topology="2x4")``.
* :mod:`charm_megatron.megatron.comm_types` - which entry each layer gets
  (:func:`layer_comm_type`, :class:`PerLayerCommTypes`).
* :mod:`charm_megatron.megatron.layer_specs` - ready layer specs for Megatron-LM's
  ``--spec charm_megatron.megatron.layer_specs NAME`` (no patch, no launcher).
* :func:`charm_gpt_specs`, :func:`check_model`, :func:`describe_model` - what the launcher and
  the patch call around ``GPTModel(...)``.
* :func:`add_charm_args`, :func:`uses_charm`, :func:`charm_comm_types`, :func:`our_comm_types`
  - Megatron-LM argument helpers (``charm_megatron.megatron.args``, importable without torch or
  Megatron).

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
    "PerLayerCoreAttention": "selector",
    "PerLayerCommTypes": "comm_types",
    "layer_comm_type": "comm_types",
    "use_charm": "spec",
    "count_charm_attention": "spec",
    "charm_gpt_specs": "build",
    "check_model": "build",
    "describe_model": "build",
    "add_charm_args": "args",
    "chain_extra_args_providers": "args",
    "charm_comm_types": "args",
    "our_comm_types": "args",
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
