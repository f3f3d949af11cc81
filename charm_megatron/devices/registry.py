"""The named device profiles: the built-in ones (``devices/data/*.json``) and those of the
directories on ``CHARM_DEVICES``.

A profile is known by the ``name`` in its file. ``CHARM_DEVICES`` (directories separated by
``os.pathsep``, as ``PATH``) adds every ``*.json`` profile file of each directory; it is read at
each lookup, so a process started with it (a bench rank, a Megatron rank) and a test that sets
it both see its devices. A name defined twice (an added device named as a built-in one, or
in two added files) is a :class:`ValueError` naming both files: an added device never replaces
a built-in one silently. Added files are read again when a directory's listing or a file's
modification time changes.
"""

from __future__ import annotations

import os
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import TYPE_CHECKING

from charm_megatron.devices.schema import is_profile_path, load_profile, read_profile_file

if TYPE_CHECKING:
    from charm_megatron.model.cluster import Profile

#: The variable naming extra directories of device profile files.
ENV = "CHARM_DEVICES"
#: The built-in devices' profile files (one per device, ``<name>.json``).
DATA_DIR = Path(__file__).with_name("data")
#: Measurements the built-in profiles were derived from (read by the lab's recipes only).
MEASUREMENTS_DIR = Path(__file__).with_name("measurements")
#: Built-in devices listed first, in this order (GPU ones, then the CPU testbed); the other
#: built-in ones follow by name, then the added ones (directory by directory, by file name).
ORDER = ("l20-pcie", "h20", "h100", "cpu-testbed")


def device_dirs(value: str | None = None) -> list[Path]:
    """The directories ``value`` (default: ``$CHARM_DEVICES``) names; empty entries are
    skipped, one that is not a directory is a :class:`ValueError`."""
    if value is None:
        value = os.environ.get(ENV, "")
    dirs = [Path(p) for p in value.split(os.pathsep) if p.strip()]
    for d in dirs:
        _scan(d)  # raises for a missing one
    return dirs


def _scan(directory: str | Path) -> tuple[tuple[str, int], ...]:
    """(path, modification time) of the ``*.json`` files of ``directory``, by name (os.scandir:
    a lookup runs on every ``cp_attention`` call that names a profile)."""
    try:
        with os.scandir(directory) as entries:
            return tuple(sorted((e.path, e.stat().st_mtime_ns) for e in entries
                                if e.name.endswith(".json") and e.is_file()))
    except (FileNotFoundError, NotADirectoryError):
        raise ValueError(f"{ENV}: {str(directory)!r} is not a directory (it lists directories "
                         f"of device profile files, separated by {os.pathsep!r})") from None


def _read(files: list[Path], *, builtin: bool,
          into: dict[str, tuple[Path, Profile]]) -> None:
    for path in files:
        prof = read_profile_file(path, builtin=builtin)
        if prof.name in into:
            first = into[prof.name][0]
            raise ValueError(f"device profile {prof.name!r} is defined twice: in {first} and in "
                             f"{path} (a device added by {ENV} may not reuse a known name; "
                             "rename one)")
        into[prof.name] = (path, prof)


# The built-in table is read once per process (package data); the added one again whenever
# CHARM_DEVICES, a listed directory's files or their modification times change.
_BUILTIN: dict[str, tuple[Path, Profile]] | None = None
_ADDED: tuple[tuple, dict[str, tuple[Path, Profile]]] | None = None


def _builtin() -> dict[str, tuple[Path, Profile]]:
    """Name -> (file, profile) of the built-in devices, in :data:`ORDER`, then by name."""
    global _BUILTIN
    if _BUILTIN is None:
        found = {Path(p).stem: Path(p) for p, _ in _scan(DATA_DIR)}
        names = [n for n in ORDER if n in found] + sorted(set(found) - set(ORDER))
        table: dict[str, tuple[Path, Profile]] = {}
        _read([found[n] for n in names], builtin=True, into=table)
        _BUILTIN = table
    return _BUILTIN


def _all() -> dict[str, tuple[Path, Profile]]:
    """Name -> (file, profile) of every known device: built-in, then added."""
    global _ADDED
    builtin = _builtin()
    value = os.environ.get(ENV, "")
    if not value.strip():
        return builtin
    key = (value, tuple(_scan(d) for d in value.split(os.pathsep) if d.strip()))
    if _ADDED is None or _ADDED[0] != key:
        table = dict(builtin)
        _read([Path(p) for scan in key[1] for p, _ in scan], builtin=False, into=table)
        _ADDED = (key, table)
    return _ADDED[1]


def builtin_profiles() -> dict[str, Profile]:
    """The shipped profiles, by name, in :data:`ORDER` (``CHARM_DEVICES`` not included)."""
    return {n: prof for n, (_, prof) in _builtin().items()}


def profile_files() -> dict[str, Path]:
    """The file of every known device, by name (built-in ones first)."""
    return {n: path for n, (path, _) in _all().items()}


class _Profiles(Mapping[str, "Profile"]):
    """Every known device profile by name: the built-in ones, then those of ``CHARM_DEVICES``
    (a live view: it reads the variable at each use)."""

    def __getitem__(self, name: str) -> Profile:
        return _all()[name][1]

    def __iter__(self) -> Iterator[str]:
        return iter(_all())

    def __len__(self) -> int:
        return len(_all())

    def __repr__(self) -> str:
        return f"PROFILES({', '.join(self)})"


#: The device profiles by name (``l20-pcie``, ``h20``, ``h100``, ``cpu-testbed``, the other
#: built-in ones, then those of ``CHARM_DEVICES``).
PROFILES: Mapping[str, Profile] = _Profiles()


def get_profile(name: str) -> Profile:
    """The device profile called ``name`` (built in or in a ``CHARM_DEVICES`` directory), or the
    profile file at path ``name`` (a ``.json`` written by ``charm-megatron model
    --calibrate``); :class:`ValueError` lists the known ones."""
    if is_profile_path(name):
        return load_profile(name)
    known = _all()
    try:
        return known[name][1]
    except KeyError:
        raise ValueError(f"unknown profile {name!r}; choose one of {', '.join(known)}, give the "
                         f"path of a profile file (.json), or add a device: its profile file in "
                         f"a directory on {ENV}") from None
