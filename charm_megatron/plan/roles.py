"""What each exchange of RM+ / CHARM+ moves: kv blocks or q blocks, chosen by bytes.

An RM+ pair is a *kv-pair* (both send their kv; backward the dk/dv partials come back) or a
*q-pair* (both send their q side; the partial outputs / dq come back). Across groups a rank
*passes q* (the paper) or *passes kv* (docs/algorithm.md, *Pass-kv across groups*). With grouped-query attention a kv
block is ``h_q / h_kv`` times smaller than a q block, so the paper's fixed choice moves several
times the bytes it needs to.

The rule (:func:`choose`) is one comparison of the bytes the two alternatives of one exchange
move, computed from the block table (:data:`charm_megatron.plan.vocab.BLOCKS`) and the rows
each message carries (halves under the causal mask). It reads the shape (:class:`RoleShape`:
heads, kv heads, head dim, element bytes) and nothing else; there is no table keyed on head
ratios. An alternative must move at least :data:`TIE_MARGIN` fewer bytes to replace the
paper's choice: with multi-head attention the forward roles differ only by the fp32 lse
(``4·h`` bytes per token against ``2·h·d·e``), and the paper's schedule is kept.

A *role mix* (:class:`~charm_megatron.plan.vocab.RoleMix`, its values :data:`ROLE_MIXES`)
forces the choice for experiments. The default, ``bytes``, needs the shape to weigh bytes;
without one (a shape-free plan) it keeps the paper's roles, so shape-free plans are the
paper's.

Plan layer: no torch.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

from charm_megatron.plan.vocab import BLOCKS, Half, Kind, Role, RoleMix, block_sizes

__all__ = ["ROLE_MIXES", "TIE_MARGIN", "Decision", "RoleChoice", "RoleShape", "check_roles",
           "choose", "row_bytes"]

#: ``bytes``: every exchange takes the role that moves fewer bytes for this shape and
#: direction; ``paper``: the paper's Algorithm 1 (RM+ rounds alternate kv / q, queries cross
#: the slow link); ``kv`` / ``q``: every exchange (RM+ pairs and the cross phase) passes kv / q.
ROLE_MIXES = tuple(m.value for m in RoleMix)
#: An alternative replaces the paper's role only if it moves this fraction fewer bytes.
TIE_MARGIN = 0.05


def check_roles(value: object, option: str = "roles") -> RoleMix:
    """The role mix ``value`` names (a :class:`RoleMix` or its value), else a ``ValueError``
    naming ``option`` and the choices."""
    if value not in ROLE_MIXES:
        raise ValueError(f"unknown {option} {value!r}; choose one of {', '.join(ROLE_MIXES)} "
                         "(bytes: the cheaper role per exchange; paper: Algorithm 1; kv / q: "
                         "every exchange passes kv / q)")
    return RoleMix(value)


@dataclass(frozen=True)
class RoleShape:
    """What the byte rule reads of an attention call: query heads, kv heads, head dim, the
    bytes of one input element, the v head dim (``dv``, 0: as ``d``) and whether partials
    travel in fp32 (``wide``: ``CPOptions(partials="fp32")``). (Batch and sequence length
    scale both alternatives alike.)"""

    hq: int
    hkv: int
    d: int
    elem: int = 2
    dv: int = 0  # v / output head dim; 0: as d (MLA: v narrower than q and k)
    wide: bool = False  # partials (out, dq, dkv) travel in fp32

    def __post_init__(self) -> None:
        for name in ("hq", "hkv", "d", "elem"):
            if getattr(self, name) < 1:
                raise ValueError(f"RoleShape.{name} must be >= 1, got {getattr(self, name)}")
        if self.dv < 0:
            raise ValueError(f"RoleShape.dv must be >= 0 (0: as d), got {self.dv}")


@functools.lru_cache(maxsize=4096)  # a pure function the role rules ask per exchange
def row_bytes(kind: Kind, shape: RoleShape, half: Half = Half.FULL) -> float:
    """Bytes per token of a block of ``kind`` (the rows of ``half``) as it travels."""
    sizes = block_sizes(1, shape.hq, shape.hkv, shape.d, shape.dv)
    return BLOCKS[Kind(kind)].row_bytes(sizes, shape.elem, shape.wide) * half.fraction


@dataclass(frozen=True)
class RoleChoice:
    """How a builder picks roles: the ``mix`` and the ``shape`` its bytes are weighed for
    (``None``: shape-free, so ``bytes`` keeps the paper's roles)."""

    mix: RoleMix = RoleMix.BYTES
    shape: RoleShape | None = None

    def __post_init__(self) -> None:
        # A plain string is accepted and stored as its member, so equal choices hash alike.
        object.__setattr__(self, "mix", check_roles(self.mix))


@dataclass(frozen=True)
class Decision:
    """One exchange's role as a plan chose it (printed by ``charm-megatron plan``).

    ``where``: ``pair`` (an RM+ pair) or ``cross`` (the cross-group phase); ``kv_bytes`` /
    ``q_bytes``: bytes per token of a block that the two alternatives move (both directions
    together; None without a shape); ``context``: which blocks the pass holds."""

    where: str
    peer: int
    role: Role
    kv_bytes: float | None
    q_bytes: float | None
    context: str = ""


def choose(choice: RoleChoice, paper: Role, kv_bytes: float | None,
           q_bytes: float | None) -> Role:
    """The role of one exchange: forced by the mix, or the one moving fewer bytes (by more than
    :data:`TIE_MARGIN`; otherwise, and where the bytes are unknown for want of a shape, the
    paper's ``paper``). Every rank of the exchange computes the same bytes, so both sides
    agree."""
    if choice.mix is RoleMix.PAPER:
        return paper
    if choice.mix in (RoleMix.KV, RoleMix.Q):
        return Role(choice.mix.value)
    if kv_bytes is None or q_bytes is None:
        return paper
    cheaper = Role.KV if kv_bytes < q_bytes else Role.Q
    low, high = sorted((kv_bytes, q_bytes))
    return cheaper if low < (1.0 - TIE_MARGIN) * high else paper
