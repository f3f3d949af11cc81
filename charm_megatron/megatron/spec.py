"""``use_charm``: put CHARM+ into the core-attention slot of a megatron-core layer or block spec.

megatron-core chooses modules through specs: a layer spec is a ``ModuleSpec(TransformerLayer)``
whose ``submodules.self_attention`` is a ``ModuleSpec(SelfAttention)`` whose
``submodules.core_attention`` is the class that computes ``softmax(q k^T) v``
(``DotProductAttention`` in the local spec, ``TEDotProductAttention`` in the Transformer Engine
spec). Block specs (``TransformerBlockSubmodules``, used for MoE and heterogeneous models) and
multi-token-prediction specs hold lists of such layer specs. :func:`use_charm` walks any of
these and fills that one slot with :class:`~charm_megatron.megatron.selector.PerLayerCoreAttention`,
which builds CHARM+ in layers whose ``--cp-comm-type`` entry is ours and the slot's original
core attention in the others; every other module (linear layers, norms, MLP/MoE, the TE/local
choice) stays exactly what the caller built.
"""

from __future__ import annotations

import copy
import dataclasses
from typing import Any, TypeVar

from megatron.core.transformer.attention import CrossAttention, SelfAttention
from megatron.core.transformer.multi_latent_attention import MultiLatentAttention
from megatron.core.transformer.spec_utils import ModuleSpec, import_module

from charm_megatron.megatron.attention import CharmDotProductAttention
from charm_megatron.megatron.selector import PerLayerCoreAttention

SpecT = TypeVar("SpecT")

__all__ = ["use_charm", "count_charm_attention", "is_charm_slot"]


def use_charm(spec: SpecT, topology: str | None = None) -> SpecT:
    """A copy of ``spec`` whose self-attention core attentions run CHARM+ where the layer's
    ``cp_comm_type`` is ours.

    Each ``SelfAttention``'s ``submodules.core_attention`` becomes
    ``ModuleSpec(PerLayerCoreAttention, params={"original": <what it was>, "topology":
    topology})``: layers whose comm type (entry ``layer_number - 1`` of a per-layer list, see
    :mod:`charm_megatron.megatron.comm_types`) is one of ours, or unset, get
    :class:`CharmDotProductAttention`; the others get the original (e.g.
    ``TEDotProductAttention`` for ``a2a``), with their comm type passed through unchanged.
    ``topology`` (``--charm-topology``: ``auto``, ``flat``, ``2x4`` ...; ``None``:
    ``CHARM_TOPOLOGY``, else the probe) goes to every CHARM+ layer.

    ``spec`` may be a layer spec (``ModuleSpec`` of ``TransformerLayer``, e.g. from
    ``get_gpt_layer_local_spec`` / ``get_gpt_layer_with_transformer_engine_spec``), a block spec
    (``TransformerBlockSubmodules``, e.g. from ``get_gpt_decoder_block_spec``), an MTP block spec,
    a bare ``ModuleSpec(SelfAttention)``, or any dataclass / list nesting of these.

    * The input is never modified; the result is a new object of the same type. Every
      container (``ModuleSpec``, submodule dataclasses, lists, tuples, dicts) is copied, with
      sharing preserved (a block spec that reuses one layer spec for many layers still does);
      leaves (module classes, functions, other objects) are shared, as ``copy.deepcopy`` does
      for classes - unlike ``deepcopy`` this also works for leaves that cannot be copied
      (e.g. Transformer Engine placeholders when TE is absent).
    * Idempotent: a slot that already holds ``PerLayerCoreAttention`` or
      :class:`CharmDotProductAttention` (or a subclass) keeps it, so ``use_charm(use_charm(s))``
      equals ``use_charm(s)``; a ``topology`` given again replaces the earlier one.
    * Cross-attention (``CrossAttention``) is left alone: CHARM+ is for causal self-attention
      over a context-parallel-split sequence.
    * Multi-latent attention (``MLASelfAttention``) gets the same slot: its core attention is
      built with ``k_channels`` / ``v_channels`` (different q / k and v head dims), which
      :class:`CharmDotProductAttention` takes.
    """
    if topology is not None and not str(topology).strip():
        raise ValueError("use_charm: empty topology; use e.g. 'auto', 'flat' or '2x4'")
    result = _copy_structure(spec, memo={})
    _rewrite(result, seen=set(), topology=None if topology is None else str(topology).strip())
    return result


def count_charm_attention(spec: Any) -> int:
    """How many self-attention slots of ``spec`` hold CHARM+ (``PerLayerCoreAttention`` or
    :class:`CharmDotProductAttention`).

    Distinct spec objects are counted once (a block spec reuses one layer spec object for many
    layers), so this is a check ("does this spec carry CHARM+?"), not a layer count.
    """
    found: list[Any] = []

    def record(submodules: Any) -> None:
        if is_charm_slot(submodules.core_attention):
            found.append(submodules)

    _visit(spec, seen=set(), on_self_attention=record)
    return len(found)


def _copy_structure(obj: Any, memo: dict[int, Any]) -> Any:
    """Copy the containers of a spec tree (see :func:`use_charm`); ``memo`` keeps aliasing."""
    if id(obj) in memo:
        return memo[id(obj)]
    if dataclasses.is_dataclass(obj) and not isinstance(obj, type):
        new = copy.copy(obj)
        memo[id(obj)] = new
        for f in dataclasses.fields(obj):
            # object.__setattr__ also works for frozen dataclasses, and skips __post_init__.
            object.__setattr__(new, f.name, _copy_structure(getattr(obj, f.name), memo))
        return new
    if isinstance(obj, list):
        new_list: list[Any] = []
        memo[id(obj)] = new_list
        new_list.extend(_copy_structure(x, memo) for x in obj)
        return new_list
    if isinstance(obj, dict):
        new_dict: dict[Any, Any] = {}
        memo[id(obj)] = new_dict
        new_dict.update((k, _copy_structure(v, memo)) for k, v in obj.items())
        return new_dict
    if type(obj) is tuple:
        new_tuple = tuple(_copy_structure(x, memo) for x in obj)
        memo[id(obj)] = new_tuple
        return new_tuple
    return obj  # a leaf: class, function, enum, string, placeholder ...


def _rewrite(obj: Any, seen: set[int], topology: str | None) -> None:
    def replace(submodules: Any) -> None:
        slot = submodules.core_attention
        if is_charm_slot(slot):
            if topology is not None:
                if not isinstance(slot, ModuleSpec):
                    slot = ModuleSpec(module=slot)
                # A fresh spec: the input's (possibly shared) one stays as it was.
                submodules.core_attention = ModuleSpec(
                    module=slot.module, params={**slot.params, "topology": topology},
                    submodules=slot.submodules,
                )
            return
        submodules.core_attention = ModuleSpec(
            module=PerLayerCoreAttention, params={"original": slot, "topology": topology}
        )

    _visit(obj, seen, on_self_attention=replace)


def _visit(obj: Any, seen: set[int], on_self_attention: Any) -> None:
    """Depth-first walk over specs, dataclasses, lists, tuples and dicts.

    ``seen`` guards against visiting a shared object twice (block specs alias one layer spec
    across layers; deepcopy preserves that aliasing).
    """
    is_container = isinstance(obj, (ModuleSpec, list, tuple, dict)) or (
        dataclasses.is_dataclass(obj) and not isinstance(obj, type)
    )
    if not is_container:
        return  # leaves: classes, functions, None, strings, placeholders
    if id(obj) in seen:
        return
    seen.add(id(obj))

    if isinstance(obj, ModuleSpec):
        module = _resolve(obj.module)
        if isinstance(module, type) and issubclass(module, CrossAttention):
            return  # cross-attention keeps its own core attention
        # Multi-latent attention (MLASelfAttention) is self-attention whose value head dim
        # differs from the query / key one; cp_attention takes v at its own width.
        if isinstance(module, type) and issubclass(module, (SelfAttention, MultiLatentAttention)):
            sub = obj.submodules
            if sub is None or not hasattr(sub, "core_attention"):
                raise ValueError(
                    f"use_charm: the SelfAttention spec {obj!r} has no submodules.core_attention"
                )
            on_self_attention(sub)
        _visit(obj.submodules, seen, on_self_attention)
        _visit(obj.params, seen, on_self_attention)
        return

    if dataclasses.is_dataclass(obj) and not isinstance(obj, type):
        for f in dataclasses.fields(obj):
            _visit(getattr(obj, f.name), seen, on_self_attention)
        return
    if isinstance(obj, (list, tuple)):
        for item in obj:
            _visit(item, seen, on_self_attention)
        return
    if isinstance(obj, dict):
        for item in obj.values():
            _visit(item, seen, on_self_attention)


def _resolve(module: Any) -> Any:
    """The class a ``ModuleSpec.module`` names (it may be a ``(module_path, name)`` tuple)."""
    if isinstance(module, tuple):
        return import_module(module)
    return module


def is_charm_slot(core_attention: Any) -> bool:
    """True when a spec's ``core_attention`` slot is CHARM+'s (``PerLayerCoreAttention`` or
    :class:`CharmDotProductAttention`, as a class or a ``ModuleSpec``)."""
    target = core_attention.module if isinstance(core_attention, ModuleSpec) else core_attention
    target = _resolve(target)
    return isinstance(target, type) and issubclass(
        target, (CharmDotProductAttention, PerLayerCoreAttention)
    )
