"""The :class:`Topology` value: how the ranks of one CP group split into groups of fast links.

Pure Python (no torch): the plan builders, the model and the CLI use it without a process group.
Ranks are *CP-local* (``0..n-1``, the rank inside the CP process group), never global ranks.

String syntax (``Topology.parse`` / ``str(topology)``, also ``CHARM_TOPOLOGY``):

* ``GxM`` - ``G`` groups of ``M`` ranks, group ``g`` = ranks ``g*M .. g*M+M-1`` (``2x4``,
  ``1x8`` = flat). ``X`` and ``×`` are accepted for ``x``.
* ``flat`` - one group of all ranks; needs the CP size (``parse("flat", cp_size=8)``).
* ``0-3,4-7`` - without ``/`` or ``;``: a comma-separated list of groups, each one range ``a-b``
  (a list of bare ranks such as ``0,1,2,3`` is rejected as ambiguous; ``4x1`` says that).
* ``0,2,4,6/1,3,5,7`` - with ``/`` (or ``;``) between groups: inside a group, commas join ranks
  and ranges (``0-1,4-5/2-3,6-7``).

Groups are normalised: ranks sorted inside a group, groups ordered by their lowest rank. The
local index of a rank is its position in its (sorted) group; its counterparts are the ranks with
the same local index in the other groups.
"""

from __future__ import annotations

import operator
import re
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any

__all__ = ["Topology", "format_ranks"]

_OVERRIDE_HINT = "set CHARM_TOPOLOGY / --charm-topology (or pass topology=...)"
_SYNTAX_HINT = (
    "use 'GxM' (e.g. '2x4'), 'flat' (with the CP size), '0-3,4-7' (one range per group), or "
    "explicit groups separated by '/' with ranks and ranges inside (e.g. '0,2,4,6/1,3,5,7')"
)
_GXM = re.compile(r"^\s*(\d+)\s*[xX×]\s*(\d+)\s*$")
_ITEM = re.compile(r"^\s*(\d+)\s*(?:-\s*(\d+)\s*)?$")


@dataclass(frozen=True)
class Topology:
    """``G`` groups of ``M`` CP-local ranks each; immutable and hashable.

    Build it with :meth:`flat`, :meth:`from_groups`, :meth:`parse` or :meth:`probe`; the
    constructor takes already-normalised groups and validates them like :meth:`from_groups`.
    """

    groups: tuple[tuple[int, ...], ...]
    # rank -> (group index, local index); derived, excluded from eq/hash/repr.
    _where: tuple[tuple[int, int], ...] = field(default=(), init=False, compare=False, repr=False)

    def __post_init__(self) -> None:
        groups = _normalise(self.groups)
        object.__setattr__(self, "groups", groups)
        where = [(0, 0)] * sum(len(g) for g in groups)
        for gi, grp in enumerate(groups):
            for li, r in enumerate(grp):
                where[r] = (gi, li)
        object.__setattr__(self, "_where", tuple(where))

    # ----------------------------------------------------------------- constructors
    @classmethod
    def flat(cls, n: int) -> Topology:
        """One group of ``n`` ranks (no slow links; CHARM+ degenerates to RM+)."""
        n = _as_int(n, "flat(n)")
        if n < 1:
            raise ValueError(f"Topology.flat(n) needs n >= 1, got {n}")
        return cls((tuple(range(n)),))

    @classmethod
    def from_groups(cls, groups: Iterable[Iterable[int]]) -> Topology:
        """Topology from explicit groups of CP-local ranks, e.g. ``[[0, 1, 2, 3], [4, 5, 6, 7]]``.

        Every rank ``0..n-1`` must appear exactly once and all groups must have the same size;
        otherwise :class:`ValueError` says what is wrong and how to fix it.
        """
        return cls(tuple(tuple(g) for g in groups))

    @classmethod
    def parse(cls, text: str, cp_size: int | None = None) -> Topology:
        """Parse ``GxM``, ``flat``, ``0-3,4-7`` or ``0,2,4,6/1,3,5,7`` (see the module doc).

        With ``cp_size`` the result is also checked against the CP group size.
        """
        if isinstance(text, Topology):
            topo = text
        else:
            topo = _parse(str(text), cp_size)
        if cp_size is not None:
            topo.check_size(cp_size)
        return topo

    # ----------------------------------------------------------------- properties
    @property
    def size(self) -> int:
        """Number of ranks ``n = G * M``."""
        return len(self._where)

    @property
    def num_groups(self) -> int:
        """Number of groups ``G``."""
        return len(self.groups)

    @property
    def group_size(self) -> int:
        """Ranks per group ``M``."""
        return len(self.groups[0])

    @property
    def is_flat(self) -> bool:
        """True for a single group."""
        return len(self.groups) == 1

    @property
    def is_contiguous(self) -> bool:
        """True when group ``g`` is exactly ranks ``g*M .. g*M+M-1`` (printable as ``GxM``)."""
        m = self.group_size
        return all(grp == tuple(range(g * m, g * m + m)) for g, grp in enumerate(self.groups))

    def group_of(self, rank: int) -> int:
        """Index of the group that holds CP-local ``rank``."""
        return self._lookup(rank)[0]

    def local_index(self, rank: int) -> int:
        """Position of ``rank`` inside its group."""
        return self._lookup(rank)[1]

    def rank_at(self, group: int, local: int) -> int:
        """The CP-local rank with local index ``local`` in group ``group``."""
        return self.groups[group][local]

    def counterparts(self, rank: int) -> tuple[int, ...]:
        """Ranks with the same local index in the *other* groups, in group order."""
        g, li = self._lookup(rank)
        return tuple(grp[li] for gi, grp in enumerate(self.groups) if gi != g)

    def check_size(self, cp_size: int) -> None:
        """Raise :class:`ValueError` unless this topology has exactly ``cp_size`` ranks."""
        cp_size = _as_int(cp_size, "cp_size")
        if cp_size != self.size:
            raise ValueError(
                f"topology {self} has {self.size} ranks but the CP group has {cp_size}; "
                f"{_OVERRIDE_HINT} to a topology of {cp_size} ranks ({_examples(cp_size)})"
            )

    def _lookup(self, rank: int) -> tuple[int, int]:
        if not isinstance(rank, int) or isinstance(rank, bool) or not 0 <= rank < self.size:
            raise ValueError(f"rank {rank!r} is not a CP-local rank of topology {self} (0..{self.size - 1})")
        return self._where[rank]

    # ----------------------------------------------------------------- text
    def __str__(self) -> str:
        if self.is_contiguous:
            return f"{self.num_groups}x{self.group_size}"
        return "/".join(format_ranks(g) for g in self.groups)

    def __repr__(self) -> str:
        return f"Topology({str(self)!r})"


# --------------------------------------------------------------------------- helpers
def format_ranks(ranks: Sequence[int]) -> str:
    """``[0, 1, 2, 5, 7, 8]`` -> ``'0-2,5,7-8'`` (sorted input assumed)."""
    parts: list[str] = []
    i = 0
    while i < len(ranks):
        j = i
        while j + 1 < len(ranks) and ranks[j + 1] == ranks[j] + 1:
            j += 1
        parts.append(str(ranks[i]) if i == j else f"{ranks[i]}-{ranks[j]}")
        i = j + 1
    return ",".join(parts)


def _as_int(value: Any, what: str) -> int:
    if isinstance(value, bool) or not isinstance(value, int):
        try:
            return operator.index(value)
        except TypeError:
            raise ValueError(f"{what} must be an integer, got {value!r}") from None
    return value


def _examples(n: int) -> str:
    """A few valid topology strings for ``n`` ranks, for error messages."""
    facts = [f"{g}x{n // g}" for g in range(2, n) if n % g == 0][:3]
    return "e.g. " + ", ".join(facts + ["flat"]) if facts else "e.g. flat"


def _normalise(groups: Any) -> tuple[tuple[int, ...], ...]:
    try:
        raw = [list(g) for g in groups]
    except TypeError:
        raise ValueError(
            f"topology groups must be a list of lists of CP-local ranks, got {groups!r}"
        ) from None
    if not raw:
        raise ValueError("a topology needs at least one group; use Topology.flat(n) for one group")
    out: list[tuple[int, ...]] = []
    for g in raw:
        if not g:
            raise ValueError(f"topology groups must not be empty: {raw!r}")
        out.append(tuple(sorted(_as_int(r, "a rank") for r in g)))
    sizes = sorted({len(g) for g in out})
    if len(sizes) > 1:
        desc = ", ".join(f"{format_ranks(g)} ({len(g)})" for g in out)
        raise ValueError(
            f"topology groups must all have the same size, got sizes {sizes}: {desc}; CHARM+ needs "
            "G groups of M ranks - merge or split groups so that every group has the same number "
            "of ranks, or use 'flat'"
        )
    seen: dict[int, int] = {}
    for gi, g in enumerate(out):
        for r in g:
            if r in seen:
                where = "twice in one group" if seen[r] == gi else f"in groups {seen[r]} and {gi}"
                raise ValueError(
                    f"rank {r} appears {where} of topology {[list(x) for x in out]}; every CP "
                    "rank must be in exactly one group"
                )
            seen[r] = gi
    n = len(seen)
    missing = sorted(set(range(n)) - set(seen))
    if missing:
        extra = sorted(r for r in seen if r >= n or r < 0)
        raise ValueError(
            f"topology groups must hold every CP-local rank 0..{n - 1} exactly once: missing "
            f"{format_ranks(missing)}, out of range {format_ranks(extra)}; CP-local ranks are "
            "positions in the CP group (dist.get_rank(cp_group)), not global ranks"
        )
    out.sort(key=lambda g: g[0])
    return tuple(out)


def _parse(text: str, cp_size: int | None) -> Topology:
    s = text.strip()
    low = s.lower()
    if not s:
        raise ValueError(f"empty topology string; {_SYNTAX_HINT}")
    if low == "flat":
        if cp_size is None:
            raise ValueError(
                "topology 'flat' needs the CP size: Topology.parse('flat', cp_size=n), or write "
                "'1xN' (e.g. '1x8')"
            )
        return Topology.flat(cp_size)
    if low in ("auto", "node", "numa"):
        raise ValueError(
            f"'{s}' is a probe level, not a topology: resolve it with resolve_topology() or "
            f"charm_megatron.topology.probe(group, level='{low}'), or give a topology: {_SYNTAX_HINT}"
        )
    m = _GXM.match(s)
    if m:
        g, k = int(m.group(1)), int(m.group(2))
        if g < 1 or k < 1:
            raise ValueError(f"topology '{s}': G and M in 'GxM' must both be >= 1")
        return Topology(tuple(tuple(range(i * k, i * k + k)) for i in range(g)))
    explicit = "/" in s or ";" in s
    parts = re.split(r"[/;]", s) if explicit else s.split(",")
    if not explicit and len(parts) > 1 and all("-" not in p for p in parts):
        # '0,2,4,6' would read as four groups of one rank: almost surely not what was meant.
        raise ValueError(
            f"topology '{s}' is ambiguous: without '/' each comma-separated item is a whole group "
            f"(one range), so this would be {len(parts)} groups of one rank; write groups "
            f"separated by '/' (e.g. '0,2,4,6/1,3,5,7'), or '{len(parts)}x1' if you mean that"
        )
    groups: list[list[int]] = []
    for part in parts:
        if not part.strip():
            raise ValueError(f"topology '{s}': empty group; {_SYNTAX_HINT}")
        items = part.split(",") if explicit else [part]
        ranks: list[int] = []
        for item in items:
            im = _ITEM.match(item)
            if not im:
                hint = (
                    " (without '/' each comma-separated item is one whole group: write groups "
                    "of several ranks as ranges, or separate groups with '/')"
                    if not explicit and "," in s else ""
                )
                raise ValueError(f"topology '{s}': cannot read '{item.strip()}'{hint}; {_SYNTAX_HINT}")
            a = int(im.group(1))
            b = int(im.group(2)) if im.group(2) is not None else a
            if b < a:
                raise ValueError(f"topology '{s}': range '{item.strip()}' runs backwards")
            ranks.extend(range(a, b + 1))
        groups.append(ranks)
    try:
        return Topology.from_groups(groups)
    except ValueError as exc:
        raise ValueError(f"topology '{s}': {exc}") from None
