"""What Megatron-LM's GPT builder needs from charm-megatron: one call before ``GPTModel(...)``
and the checks and start-up lines after it.

Used by the launcher (``charm_megatron.pretrain_gpt``) and by the Megatron-LM patch
(``patches/``), so both behave the same:

* :func:`charm_gpt_specs` - the layer spec and MTP block spec through ``use_charm`` (with
  ``--charm-topology``) and the config's per-layer ``cp_comm_type`` list made safe for
  megatron-core 0.16.1 (:func:`charm_megatron.megatron.comm_types.fix_per_layer_list`);
* :func:`check_model` - every self-attention holds what its layer's comm type asks for;
* :func:`describe_model` - the start-up lines (one per distinct algo / topology / CP group).
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

from charm_megatron.megatron.args import uses_charm
from charm_megatron.megatron.comm_types import fix_per_layer_list, is_ours

__all__ = ["charm_gpt_specs", "check_model", "describe_model", "print_model_description"]


def charm_gpt_specs(args: Any, config: Any, layer_spec: Any, mtp_block_spec: Any) -> tuple:
    """``(layer_spec, mtp_block_spec)`` for ``GPTModel`` when Megatron-LM ``args`` select CHARM+
    for any layer (unchanged otherwise); fixes ``config.cp_comm_type`` in place (see above)."""
    if not uses_charm(args):
        return layer_spec, mtp_block_spec
    if getattr(args, "use_legacy_models", False):
        raise RuntimeError(
            f"charm-megatron: --cp-comm-type {' '.join(args.cp_comm_type)} needs megatron-core "
            "models; drop --use-legacy-models"
        )
    from charm_megatron.megatron.spec import use_charm

    fix_per_layer_list(config)
    topology = getattr(args, "charm_topology", None)
    layer_spec = use_charm(layer_spec, topology=topology)
    if mtp_block_spec is not None:
        mtp_block_spec = use_charm(mtp_block_spec, topology=topology)
    return layer_spec, mtp_block_spec


def _self_attentions(model: Any) -> Iterator[Any]:
    from megatron.core.transformer.attention import SelfAttention

    models = model if isinstance(model, (list, tuple)) else [model]
    for m in models:
        for module in m.modules():
            if isinstance(module, SelfAttention):
                yield module


def check_model(model: Any) -> int:
    """Raise ``RuntimeError`` unless every ``SelfAttention`` in ``model`` (a module or a list of
    pipeline chunks) holds CHARM+ exactly where its layer's comm type is ours.

    Returns the number of CHARM+ core attentions (0 is fine: a pipeline stage may hold no
    transformer layers, or only layers with Megatron's own comm types).
    """
    from charm_megatron.megatron.attention import CharmDotProductAttention
    from charm_megatron.megatron.selector import chosen_comm_type

    n = 0
    for attn in _self_attentions(model):
        comm = chosen_comm_type(attn.config, attn.layer_number)
        is_charm = isinstance(attn.core_attention, CharmDotProductAttention)
        if is_ours(comm) and not is_charm:
            raise RuntimeError(
                f"charm-megatron: layer {attn.layer_number} has --cp-comm-type {comm}, but the "
                f"model was built with {type(attn.core_attention).__name__} in layer "
                f"{attn.layer_number}: the model builder did not go through "
                "gpt_builders.GPTModel (ModelOpt, a custom model_provider?); build its spec with "
                "charm_megatron.megatron.use_charm"
            )
        n += is_charm
    return n


def _ranges(numbers: list[int]) -> str:
    """``[1, 2, 3, 5]`` -> ``"1-3,5"``."""
    out: list[str] = []
    for n in sorted(set(numbers)):
        if out and int(out[-1].split("-")[-1]) == n - 1:
            out[-1] = f"{out[-1].split('-')[0]}-{n}"
        else:
            out.append(str(n))
    return ",".join(out)


def describe_model(model: Any) -> list[str]:
    """One ``charm-megatron: ...`` line per distinct (algo, CP size, topology, CP group) among
    the CHARM+ layers of ``model``; ``layers=`` is added when the lines cover different layers.

    ``groups`` are CP-local ranks; ``cp_ranks`` the global ranks of this process's CP group.
    """
    from charm_megatron.megatron.attention import CharmDotProductAttention

    seen: dict[tuple, list[int]] = {}
    models = model if isinstance(model, (list, tuple)) else [model]
    for m in models:
        for module in m.modules():
            if isinstance(module, CharmDotProductAttention):
                d = module.describe()
                key = (d["cp_comm_type"], d["cp_size"], d["topology"], d["groups"], d["cp_ranks"])
                seen.setdefault(key, []).append(d["layer"])
    lines = []
    for (algo, size, topo, groups, ranks), layers in seen.items():
        text = "[" + ",".join("[" + ",".join(map(str, g)) + "]" for g in groups) + "]"
        line = (
            f"charm-megatron: cp_comm_type={algo} cp_size={size} topology={topo} "
            f"groups={text} cp_ranks={','.join(map(str, ranks)) or '0'}"
        )
        if len(seen) > 1:
            line += f" layers={_ranges(layers)}"
        lines.append(line)
    return lines


def _first_rank_of_stage() -> bool:
    """True on global rank 0, and with pipeline parallelism on the first rank of each stage
    (tensor, context and data rank 0): the lines differ per stage, not within one."""
    import torch.distributed as dist

    if not (dist.is_available() and dist.is_initialized()):
        return True
    try:
        from megatron.core import parallel_state as ps

        if ps.model_parallel_is_initialized():
            return (
                ps.get_tensor_model_parallel_rank() == 0
                and ps.get_data_parallel_rank(with_context_parallel=True) == 0
            )
    except (ImportError, AssertionError, RuntimeError):
        pass
    return dist.get_rank() == 0


def print_model_description(model: Any) -> None:
    """Print :func:`describe_model`'s lines once per pipeline stage (see there). Not
    ``logging``: Megatron-LM sets the root logger to INFO, which would repeat them per rank."""
    if _first_rank_of_stage():
        for line in describe_model(model):
            print(line, flush=True)
