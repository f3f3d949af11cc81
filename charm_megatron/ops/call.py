"""A ``cp_attention`` call's arguments as one frozen value, from the entry point through the
preparation (ops/prepare.py) to the auto-tune candidates (which are the same call with another
``algo``): the list is written once, here, and nothing threads it by hand."""

from __future__ import annotations

from dataclasses import dataclass, fields, replace

import torch

from charm_megatron.ops.options import CPOptions


@dataclass(frozen=True, eq=False)  # eq=False: it holds tensors, which do not compare to a bool
class CallArgs:
    """``cp_attention``'s keyword arguments other than ``group`` (the tensors q, k, v travel
    beside it), with its defaults; see :func:`charm_megatron.cp_attention` for each."""

    algo: str = "ring"
    topology: object = None
    causal: bool = True
    softmax_scale: float | None = None
    cu_seqlens: torch.Tensor | None = None
    cu_seqlens_padded: torch.Tensor | None = None
    options: CPOptions | None = None
    roles: str | None = None
    tag: str | None = None
    softmax_offset: torch.Tensor | None = None
    window_size: tuple[int, int] | None = None

    @classmethod
    def of(cls, **arguments: object) -> CallArgs:
        """From ``cp_attention``'s keywords; an unknown one is a ``TypeError`` naming it and
        the known ones."""
        known = {f.name for f in fields(cls)}
        unknown = sorted(set(arguments) - known)
        if unknown:
            raise TypeError(f"cp_attention: unexpected argument{'s' if len(unknown) > 1 else ''} "
                            f"{', '.join(unknown)}; it takes {', '.join(sorted(known))}")
        return cls(**arguments)  # type: ignore[arg-type]

    def with_(self, **changes: object) -> CallArgs:
        """The same call with ``changes`` (e.g. another ``algo`` for an auto-tune candidate)."""
        return replace(self, **changes)  # type: ignore[arg-type]

    @property
    def packed(self) -> bool:
        """Whether the call is packed THD (either cumulative-lengths tensor given)."""
        return self.cu_seqlens is not None or self.cu_seqlens_padded is not None
