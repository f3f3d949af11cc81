"""What a recipe run is given besides the profiles built before it."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass


@dataclass(frozen=True)
class Inputs:
    """``bench``: the bench CSVs the CPU testbed is calibrated on; ``log``: where fits report."""

    bench: tuple[str, ...] = ()
    log: Callable[[str], None] | None = None
