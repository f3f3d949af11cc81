"""Which ``--cp-comm-type`` value each transformer layer gets.

Megatron-LM's ``--cp-comm-type`` is one value for every layer or a list of ``num_layers``
values, one per layer. The rule here: **layer L (megatron-core's 1-based, global
``layer_number``, which already includes the pipeline-stage offset) gets entry L-1**. Layers
numbered past ``num_layers`` (the multi-token-prediction layers, which megatron-core numbers
``num_layers + k``) get the last entry.

megatron-core 0.16.1's ``TransformerLayer`` reads ``cp_comm_type[self.layer_number]``
(``transformer_layer.py:297``), one entry too far, so its last layer raises ``IndexError``.
Our core attention never uses the value that read hands it: it asks :func:`layer_comm_type`.
:class:`PerLayerCommTypes` keeps 0.16.1's read in range (see there); the launcher and the patch
put it into the model's config (:func:`fix_per_layer_list`).

Imports neither torch nor Megatron.
"""

from __future__ import annotations

from typing import Any, SupportsIndex

from charm_megatron.megatron.args import our_comm_types

__all__ = [
    "PerLayerCommTypes",
    "fix_per_layer_list",
    "is_ours",
    "layer_comm_type",
]


def is_ours(comm_type: str | None) -> bool:
    """True when ``comm_type`` is served by CHARM+'s layer (``None`` is not)."""
    return comm_type is not None and comm_type in our_comm_types()


class PerLayerCommTypes(list):
    """A per-layer ``cp_comm_type`` list that megatron-core 0.16.1 can index without falling off.

    An ordinary list otherwise (same length, equality, ``isinstance(.., list)``, pickling). An
    integer index at or past the end answers the last entry instead of raising: that is only
    reached by 0.16.1's off-by-one read in ``TransformerLayer`` (and by MTP layers), whose value
    our core attention ignores in favour of :func:`layer_comm_type`. Layers whose core
    attention is not ours (a spec not passed through ``use_charm``) get what that read gives
    them, exactly as in Megatron without charm-megatron - minus the ``IndexError``.
    """

    def __getitem__(self, index: Any) -> Any:
        if isinstance(index, SupportsIndex) and not isinstance(index, slice):
            i = index.__index__()
            if len(self) and i >= len(self):
                return super().__getitem__(len(self) - 1)
        return super().__getitem__(index)


def layer_comm_type(
    cp_comm_type: str | list[str] | None, layer_number: int, passed: str | None = None
) -> str | None:
    """The comm type of layer ``layer_number`` (1-based, global).

    ``cp_comm_type`` is the model config's value (one string, a per-layer list, or ``None``);
    ``passed`` is what megatron-core handed the attention (used only when the config has no
    value, e.g. a module built by hand).
    """
    if cp_comm_type is None:
        return passed
    if isinstance(cp_comm_type, str):
        return cp_comm_type
    values = list(cp_comm_type)
    if not values:
        raise ValueError("cp_comm_type is an empty list; give one value or one per layer")
    if layer_number < 1:
        raise ValueError(f"layer_number {layer_number} is not a 1-based layer number")
    return values[min(layer_number, len(values)) - 1]


def fix_per_layer_list(config: Any) -> Any:
    """Make ``config.cp_comm_type`` a :class:`PerLayerCommTypes` when it is a list (in place;
    returns ``config``). A string or ``None`` is left alone."""
    value = getattr(config, "cp_comm_type", None)
    if isinstance(value, list) and not isinstance(value, PerLayerCommTypes):
        config.cp_comm_type = PerLayerCommTypes(value)
    return config
