"""``PerLayerCoreAttention``: the core-attention slot :func:`use_charm` fills, choosing per layer.

megatron-core builds the core attention of every layer from one spec slot. With per-layer
``--cp-comm-type`` values a model may need CHARM+ in some layers and the spec's own core
attention (Transformer Engine's, for ``p2p`` / ``a2a`` / ``allgather`` / ``a2a+p2p``) in others.
``ModuleSpec(PerLayerCoreAttention, params={"original": <the spec's core attention>, ...})``
does that: megatron-core "instantiates" it with the usual keyword arguments, and its
``__new__`` returns either a :class:`CharmDotProductAttention` or the original module, built
with those same arguments. The returned object is that module itself (no wrapper), so
everything that inspects the core attention sees the real class.

TransformerEngine's ``p2p`` and ``allgather`` in a layer whose spec has megatron-core's local
``DotProductAttention`` (which refuses CP: a local spec, a machine without TE) are served by
CHARM+'s layer with our ring / allgather plans (``args.stand_in``); TE's own core attention,
or any other, is kept for them.
"""

from __future__ import annotations

from typing import Any

from megatron.core.transformer.spec_utils import ModuleSpec, build_module

from charm_megatron.megatron.args import stand_in
from charm_megatron.megatron.attention import CharmDotProductAttention
from charm_megatron.megatron.comm_types import is_ours, layer_comm_type

__all__ = ["PerLayerCoreAttention", "chosen_comm_type", "refuses_cp"]


def refuses_cp(original: Any) -> bool:
    """True when ``original`` (a class, a ``ModuleSpec`` or an import path) is megatron-core's
    local ``DotProductAttention``, which refuses context parallelism (it asserts that CP is
    TEDotProductAttention's). Any other core attention (TE's, a user's own) is kept."""
    module = original.module if isinstance(original, ModuleSpec) else original
    path = module if isinstance(module, str) else (
        f"{getattr(module, '__module__', '')}.{getattr(module, '__qualname__', '')}")
    return path == "megatron.core.transformer.dot_product_attention.DotProductAttention"


def chosen_comm_type(config: Any, layer_number: int, passed: str | None = None) -> str | None:
    """The comm type layer ``layer_number`` runs: the config's (entry ``layer_number - 1`` of a
    per-layer list), else what megatron-core ``passed``."""
    return layer_comm_type(getattr(config, "cp_comm_type", None), int(layer_number), passed)


class PerLayerCoreAttention:
    """Builds CHARM+ for layers whose comm type is ours (or unset), the original otherwise.

    Keyword arguments besides megatron-core's: ``original`` (the core attention the user's spec
    had: a class, a ``ModuleSpec`` or an import path) and ``topology`` (for CHARM+ layers).
    For an original layer the comm type megatron-core passes is replaced by this layer's own
    entry (megatron-core 0.16.1 passes the next layer's), and nothing is added: a value
    megatron-core did not pass (CP size 1) is still not passed.
    """

    def __new__(  # type: ignore[misc]
        cls,
        *args: Any,
        original: Any = None,
        topology: str | None = None,
        **kwargs: Any,
    ) -> Any:
        config = kwargs.get("config", args[0] if args else None)
        layer_number = kwargs.get("layer_number", args[1] if len(args) > 1 else 1)
        comm_type = chosen_comm_type(config, layer_number, kwargs.get("cp_comm_type"))
        if comm_type is None or is_ours(comm_type):
            return CharmDotProductAttention(*args, topology=topology, **kwargs)
        if stand_in(comm_type) is not None and (original is None or refuses_cp(original)):
            # TE's p2p / allgather where the spec's core attention is the local one (a local
            # spec, a machine without TE): ours serve them instead of its refusal of CP.
            return CharmDotProductAttention(*args, topology=topology, **kwargs)
        if original is None:
            raise ValueError(
                f"layer {layer_number} has cp_comm_type {comm_type!r}, which CHARM+ does not "
                "serve, and the spec had no core attention of its own to fall back on"
            )
        if "cp_comm_type" in kwargs:
            kwargs["cp_comm_type"] = comm_type
        spec = original if isinstance(original, ModuleSpec) else ModuleSpec(module=original)
        return build_module(spec, *args, **kwargs)
