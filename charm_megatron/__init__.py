"""charm-megatron: CHARM+ cross-hardware context-parallel attention for Megatron-LM.

Public API (tensors are Megatron's ``[s, b, h, d]``):

* :func:`cp_attention` - context-parallel attention (``algo`` = ``ring``, ``rmplus``, ``charm``,
  any registered algorithm, or ``auto``).
* :class:`CPOptions` - a call's settings (timeout, kernel backend, checks, the algorithms'
  settings), from the ``CHARM_*`` variables or given.
* :class:`Topology` - how the CP ranks split into groups of fast links.

Heavy modules (torch.distributed, Megatron) are imported on first use.
"""

from __future__ import annotations

from typing import Any

__version__ = "0.1.0"
__all__ = ["CPOptions", "Topology", "cp_attention", "__version__"]


def __getattr__(name: str) -> Any:
    if name == "cp_attention":
        from charm_megatron.ops.attention import cp_attention

        return cp_attention
    if name == "CPOptions":
        from charm_megatron.ops.options import CPOptions

        return CPOptions
    if name == "Topology":
        from charm_megatron.topology import Topology

        return Topology
    raise AttributeError(f"module 'charm_megatron' has no attribute {name!r}")
