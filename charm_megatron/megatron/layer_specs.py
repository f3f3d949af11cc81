"""Ready layer specs with CHARM+ for Megatron-LM's ``--spec MODULE NAME`` (no patch, no launcher).

Megatron-LM core_v0.16.1's ``gpt_builders.gpt_builder`` does
``transformer_layer_spec = import_module(args.spec)`` when ``--spec`` is given
(``gpt_builders.py:44-45``), and ``import_module((module, name))`` returns
``vars(module)[name]`` (``megatron/core/transformer/spec_utils.py:43-55``): the *object* named
``NAME``, not something it calls. So this module holds the specs themselves, built at import:

* ``charm_te_layer_spec`` - megatron-core's Transformer Engine GPT layer
  (``get_gpt_layer_with_transformer_engine_spec()``: TE linear layers with fused norms) with
  the core attention slot filled by ``use_charm``;
* ``charm_local_layer_spec`` - the same for megatron-core's local (non-TE) GPT layer
  (``get_gpt_layer_local_spec()``; ``--transformer-impl local``).

Use::

    pretrain_gpt.py ... --context-parallel-size 8 --cp-comm-type charm \\
        --spec charm_megatron.megatron.layer_specs charm_te_layer_spec

Layers whose ``--cp-comm-type`` entry is ours get CHARM+, the others the spec's own core
attention (TE's, for ``p2p`` / ``a2a`` ...). The topology comes from ``CHARM_TOPOLOGY`` (else
the probe): ``--charm-topology`` is an argument of the launcher and the patch only. What this
route does not do (the launcher and the patch do): MoE / heterogeneous / MTP spec choices
(``--spec`` replaces them in Megatron itself), the start-up line, the check of the built model,
and per-layer ``--cp-comm-type`` lists (megatron-core 0.16.1's own off-by-one read makes the
last layer raise ``IndexError`` before our attention is built).

Without Transformer Engine, ``charm_te_layer_spec`` is a spec whose construction raises
``ImportError`` saying so (megatron-core 0.16.1 cannot even describe its TE spec then).
"""

from __future__ import annotations

from typing import Any

from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
from megatron.core.transformer.spec_utils import ModuleSpec

from charm_megatron.megatron.spec import use_charm

__all__ = ["charm_local_layer_spec", "charm_te_layer_spec", "local_layer_spec", "te_layer_spec"]


class TransformerEngineMissing:
    """Stands in for the TE layer spec when Transformer Engine is not importable."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        raise ImportError(
            "charm_megatron.megatron.layer_specs.charm_te_layer_spec needs Transformer Engine "
            "(pip install transformer-engine[pytorch]); without it use --spec "
            "charm_megatron.megatron.layer_specs charm_local_layer_spec --transformer-impl local"
        )


def local_layer_spec(topology: str | None = None) -> ModuleSpec:
    """megatron-core's local GPT layer spec with CHARM+ (see the module docstring)."""
    return use_charm(get_gpt_layer_local_spec(), topology=topology)


def te_layer_spec(topology: str | None = None) -> ModuleSpec:
    """megatron-core's Transformer Engine GPT layer spec with CHARM+; raises ``ImportError``
    (or megatron-core's own error) without Transformer Engine."""
    from megatron.core.models.gpt.gpt_layer_specs import (
        get_gpt_layer_with_transformer_engine_spec,
    )

    return use_charm(get_gpt_layer_with_transformer_engine_spec(), topology=topology)


def _te_or_missing() -> ModuleSpec:
    try:
        import transformer_engine  # noqa: F401
    except ImportError:
        return ModuleSpec(module=TransformerEngineMissing)
    return te_layer_spec()


charm_local_layer_spec: ModuleSpec = local_layer_spec()
charm_te_layer_spec: ModuleSpec = _te_or_missing()
