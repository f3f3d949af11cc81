"""An algorithm's settings: what each one is called, which values it takes, its default.

A :class:`Setting` is declared once, by the algorithm that reads it (CHARM+'s pass order,
role mix and splits, :mod:`charm_megatron.algorithms.charm.entry`), and registered with it
(:mod:`charm_megatron.plan.registry`); everything that exposes settings derives from that
declaration: ``CPOptions`` keywords, environment variables (read only by ``ops/options.py``),
CLI flags and their help. :class:`Values` is one call's resolved settings.

Plan layer: no torch.
"""

from __future__ import annotations

import enum
from collections.abc import Iterable, Iterator, Mapping
from dataclasses import dataclass

__all__ = ["Setting", "Values"]

# A kind with these member values also takes True / False (a bare CLI flag, a boolean option).
_ON, _OFF = "on", "off"


@dataclass(frozen=True)
class Setting:
    """One setting of an algorithm.

    ``name``: an identifier (the ``CPOptions`` keyword; the CLI flag is ``--name-with-dashes``);
    ``kind``: the enum of its values; ``default``: a member of ``kind``; ``help``: one line
    for CLI help and docs; ``env``: the environment variable that sets it, read only at the API
    edge (``ops/options.py``), ``None`` where there is none."""

    name: str
    kind: type[enum.Enum]
    default: enum.Enum
    help: str
    env: str | None = None

    def __post_init__(self) -> None:
        if not self.name.isidentifier():
            raise ValueError(f"setting name {self.name!r} must be an identifier")
        if not isinstance(self.default, self.kind):
            raise ValueError(f"setting {self.name}: default {self.default!r} is not a "
                             f"{self.kind.__name__}")

    @property
    def flag(self) -> str:
        """The CLI flag: ``--split-visiting`` for ``split_visiting``."""
        return "--" + self.name.replace("_", "-")

    @property
    def choices(self) -> tuple[str, ...]:
        """The values ``parse`` accepts as strings, in declaration order."""
        return tuple(str(m.value) for m in self.kind)

    @property
    def switch(self) -> bool:
        """Whether the kind has ``on`` / ``off`` members (so True / False name them)."""
        return {_ON, _OFF} <= set(self.choices)

    def parse(self, value: object, where: str = "") -> enum.Enum:
        """The member of :attr:`kind` that ``value`` names: a member, its string value (or
        an int naming a numeric value), or, for a kind with ``on`` / ``off`` members, True /
        False. ``ValueError`` naming ``where`` (e.g. ``"cp_attention"``), the setting, its
        variable and the choices otherwise."""
        if isinstance(value, self.kind):
            return value
        name = value
        if isinstance(value, bool):
            if self.switch:
                return self.kind(_ON if value else _OFF)
            name = None  # a bool is not a number here
        elif isinstance(value, int):  # a numeric setting (head_parallel=4) by its number
            name = str(value)
        if isinstance(name, str):
            for member in self.kind:
                if member.value == name:
                    return member
        prefix = f"{where}: " if where else ""
        env = f" ({self.env})" if self.env else ""
        raise ValueError(f"{prefix}{self.name}={value!r}{env}; choose one of "
                         f"{', '.join(self.choices)}")


@dataclass(frozen=True)
class Values(Mapping[str, enum.Enum]):
    """The resolved settings of one call: ``(name, member)`` pairs sorted by name, frozen and
    hashable (they key plan caches). Read with ``values["roles"]`` or ``values.get(name)``;
    make them with :func:`charm_megatron.plan.registry.settings_values`."""

    pairs: tuple[tuple[str, enum.Enum], ...] = ()

    def __post_init__(self) -> None:
        object.__setattr__(self, "pairs", tuple(sorted(self.pairs, key=lambda kv: kv[0])))

    def __getitem__(self, name: str) -> enum.Enum:
        for key, member in self.pairs:
            if key == name:
                return member
        raise KeyError(name)

    def __iter__(self) -> Iterator[str]:
        return (key for key, _ in self.pairs)

    def __len__(self) -> int:
        return len(self.pairs)

    def __hash__(self) -> int:
        return hash(self.pairs)

    def __eq__(self, other: object) -> bool:
        if isinstance(other, Values):
            return self.pairs == other.pairs
        return NotImplemented

    def as_dict(self) -> dict[str, enum.Enum]:
        return dict(self.pairs)

    def only(self, names: Iterable[str]) -> Values:
        """The values of the settings ``names`` (an algorithm's own)."""
        keep = set(names)
        return Values(tuple((k, m) for k, m in self.pairs if k in keep))

    def __repr__(self) -> str:
        return "Values(" + ", ".join(f"{k}={m.value!r}" for k, m in self.pairs) + ")"
