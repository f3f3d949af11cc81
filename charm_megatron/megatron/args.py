"""Megatron-LM command-line arguments for CHARM+ and the rules that read ``--cp-comm-type``.

Megatron-LM (``megatron/training/arguments.py``, core_v0.16.1) declares
``--cp-comm-type`` with ``nargs='+'`` and no ``choices``; one value reaches
``TransformerConfig.cp_comm_type`` as a string, several values become a per-layer list. So
``--cp-comm-type charm`` passes Megatron's parser and validation unchanged; this module only
adds ``--charm-topology``, lists our values in ``--cp-comm-type``'s help, and decides when a
run is a CHARM+ run (any layer's value is ours). Which value each layer gets is
``charm_megatron.megatron.comm_types``.

Imports neither torch nor Megatron: the launcher and the Megatron-LM patch use it before
Megatron is initialised.
"""

from __future__ import annotations

import argparse
from collections.abc import Callable, Sequence
from typing import Any

from charm_megatron.plan.registry import NameView, choices, registered

__all__ = [
    "CHARM_COMM_TYPES",
    "TE_COMM_TYPES",
    "add_charm_args",
    "chain_extra_args_providers",
    "charm_comm_types",
    "our_comm_types",
    "stand_in",
    "uses_charm",
]

#: TransformerEngine's context-parallel comm types (megatron-core 0.16.1's ``cp_comm_type``
#: values). A registry entry named as one of them (``allgather``) is our implementation of
#: that peer, for ``cp_attention`` and the benchmarks; in Megatron the value stays TE's.
TE_COMM_TYPES: tuple[str, ...] = ("p2p", "a2a", "allgather", "a2a+p2p")
#: ``--cp-comm-type`` values that select :class:`CharmDotProductAttention`: the algorithm
#: registry's choices (``charm_megatron.plan.registry``, no torch), ``auto`` included, less
#: the peers that carry a TE comm type's name.
CHARM_COMM_TYPES = NameView(lambda: tuple(c for c in choices() if c not in TE_COMM_TYPES))


def stand_in(comm_type: str | None) -> str | None:
    """The registered algorithm that serves TransformerEngine's ``comm_type`` in a layer
    whose core attention is not TE's (a local spec, a machine without TE): the entry whose
    ``te_name`` it is (``p2p``: ``ring``, ``allgather``: ``allgather``); ``None`` for any
    other value (``a2a`` and ``a2a+p2p`` have none yet)."""
    for entry in registered():
        if comm_type is not None and entry.te_name == comm_type:
            return entry.name
    return None


def our_comm_types() -> tuple[str, ...]:
    """The ``--cp-comm-type`` values served by CHARM+'s layer (every other value keeps the core
    attention of the user's spec). The one place the Megatron layer asks; everything in
    ``charm_megatron.megatron`` and the patch goes through it."""
    return tuple(CHARM_COMM_TYPES)


TOPOLOGY_HELP = (
    "CP topology for the CHARM+ --cp-comm-type values: 'auto' (probe hosts and NUMA nodes "
    "of the CP ranks; default), 'node' or 'numa' (probe at that level), 'flat' (one group), "
    "'GxM' (G groups of M consecutive CP ranks, e.g. 2x8), or explicit groups of CP-local "
    "ranks ('0-7,8-15', '0,2/1,3'). Default: the CHARM_TOPOLOGY environment variable, else auto."
)


def _comm_type_help_suffix() -> str:
    return (
        f" charm-megatron adds {', '.join(our_comm_types())} (CHARM+ context-parallel "
        "attention, docs/megatron.md); per-layer lists may mix them with the values above "
        "(layer L gets entry L-1)."
    )


def add_charm_args(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    """Add the ``charm-megatron`` argument group (``--charm-topology``) to ``parser`` and name
    our values in the help of Megatron's ``--cp-comm-type`` (when the parser has it).

    Has the signature of Megatron-LM's ``extra_args_provider`` (returns the parser), which
    Megatron calls after declaring its own arguments. Idempotent.
    """
    if any("--charm-topology" in a.option_strings for a in parser._actions):
        return parser
    group = parser.add_argument_group(title="charm-megatron (CHARM+ context parallelism)")
    group.add_argument("--charm-topology", type=str, default=None, help=TOPOLOGY_HELP)
    for action in parser._actions:
        if "--cp-comm-type" in action.option_strings:
            action.help = (action.help or "") + _comm_type_help_suffix()
    return parser


def chain_extra_args_providers(
    *providers: Callable[[argparse.ArgumentParser], argparse.ArgumentParser] | None,
) -> Callable[[argparse.ArgumentParser], argparse.ArgumentParser]:
    """One ``extra_args_provider`` that applies every non-``None`` provider in order.

    Megatron-LM's ``pretrain(..., extra_args_provider=...)`` takes a single callable;
    ``pretrain_gpt.py`` passes its own (``add_modelopt_args`` when ModelOpt is installed), and
    ours must not replace it.
    """
    chain = [p for p in providers if p is not None]

    def provider(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
        for p in chain:
            result = p(parser)
            parser = parser if result is None else result
        return parser

    return provider


def charm_comm_types(cp_comm_type: str | Sequence[str] | None) -> tuple[str, ...]:
    """The CHARM+ values among ``--cp-comm-type`` (Megatron's parsed list, or one string), in
    order of first appearance; empty when the run uses none of ours.

    Per-layer lists may mix our values with Megatron's own (``p2p``, ``a2a`` ...): layers whose
    entry is ours get CHARM+, the others keep their core attention (see
    ``charm_megatron.megatron.comm_types``).
    """
    if cp_comm_type is None:
        return ()
    values = [cp_comm_type] if isinstance(cp_comm_type, str) else list(cp_comm_type)
    ours = our_comm_types()
    return tuple(dict.fromkeys(v for v in values if v in ours))


def uses_charm(args: Any) -> bool:
    """True when Megatron-LM ``args`` select CHARM+ for at least one layer."""
    return bool(charm_comm_types(getattr(args, "cp_comm_type", None)))
