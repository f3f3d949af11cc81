"""Megatron-LM command-line arguments for CHARM+ and the rules that read ``--cp-comm-type``.

Megatron-LM (``megatron/training/arguments.py``, core_v0.16.1) declares
``--cp-comm-type`` with ``nargs='+'`` and no ``choices``; one value reaches
``TransformerConfig.cp_comm_type`` as a string, several values become a per-layer list. So
``--cp-comm-type charm`` passes Megatron's parser and validation unchanged; this module only
adds ``--charm-topology`` and decides when a run is a CHARM+ run.

Imports neither torch nor Megatron: the launcher and the Megatron-LM patch use it before
Megatron is initialised.
"""

from __future__ import annotations

import argparse
from collections.abc import Callable, Sequence
from typing import Any

from charm_megatron.plan.registry import CHOICES

__all__ = [
    "CHARM_COMM_TYPES",
    "add_charm_args",
    "chain_extra_args_providers",
    "charm_comm_type",
    "uses_charm",
]

#: ``--cp-comm-type`` values that select :class:`CharmDotProductAttention`: the algorithm
#: registry's choices (``charm_megatron.plan.registry``, no torch), ``auto`` included.
CHARM_COMM_TYPES = CHOICES

TOPOLOGY_HELP = (
    "CP topology for --cp-comm-type charm/rmplus/ring/auto: 'auto' (probe hosts and NUMA nodes "
    "of the CP ranks; default), 'node' or 'numa' (probe at that level), 'flat' (one group), "
    "'GxM' (G groups of M consecutive CP ranks, e.g. 2x8), or explicit groups of CP-local "
    "ranks ('0-7,8-15', '0,2/1,3'). Default: the CHARM_TOPOLOGY environment variable, else auto."
)


def add_charm_args(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    """Add the ``charm-megatron`` argument group (``--charm-topology``) to ``parser``.

    Has the signature of Megatron-LM's ``extra_args_provider`` (returns the parser).
    Idempotent: a parser that already has ``--charm-topology`` is returned unchanged.
    """
    if any("--charm-topology" in a.option_strings for a in parser._actions):
        return parser
    group = parser.add_argument_group(title="charm-megatron (CHARM+ context parallelism)")
    group.add_argument("--charm-topology", type=str, default=None, help=TOPOLOGY_HELP)
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


def charm_comm_type(cp_comm_type: str | Sequence[str] | None) -> str | None:
    """The CHARM+ comm type that ``--cp-comm-type`` selects, or ``None`` if it selects none.

    Accepts Megatron's parsed value (a list, ``nargs='+'``) or a single string. Raises
    ``ValueError`` when CHARM+ values are mixed with Megatron's own (``p2p``, ``a2a`` ...) or
    with each other: per-layer lists are not supported with CHARM+ (and megatron-core
    core_v0.16.1 indexes that list with the 1-based layer number,
    ``transformer_layer.py:297``, so the last layer would fall off its end).
    """
    if cp_comm_type is None:
        return None
    values = [cp_comm_type] if isinstance(cp_comm_type, str) else list(cp_comm_type)
    ours = [v for v in values if v in CHARM_COMM_TYPES]
    if not ours:
        return None
    if len(ours) != len(values):
        others = sorted({v for v in values if v not in CHARM_COMM_TYPES})
        raise ValueError(
            f"--cp-comm-type {' '.join(values)}: CHARM+ types ({', '.join(CHARM_COMM_TYPES)}) "
            f"cannot be mixed with Megatron's {', '.join(others)}; give one value"
        )
    if len(set(ours)) != 1:
        raise ValueError(
            f"--cp-comm-type {' '.join(values)}: per-layer CHARM+ comm types are not "
            "supported; give one value (e.g. --cp-comm-type charm)"
        )
    return ours[0]


def uses_charm(args: Any) -> bool:
    """True when Megatron-LM ``args`` select CHARM+ (``args.cp_comm_type`` is one of ours).

    Raises ``ValueError`` for mixed or per-layer values (see :func:`charm_comm_type`).
    """
    return charm_comm_type(getattr(args, "cp_comm_type", None)) is not None
