"""The named profiles: the built-in ones (files in ``profile_data/``, written by
:mod:`charm_megatron.lab.calibration.refit`) and profile files given by path.

Its own module so that the data types (:mod:`~charm_megatron.model.cluster`) and their file
format (:mod:`~charm_megatron.model.profile_io`) import nothing above them.
"""

from __future__ import annotations

from charm_megatron.model.cluster import Profile
from charm_megatron.model.profile_io import builtin_profiles, is_profile_path, load_profile

#: The built-in profiles by name (``l20-pcie``, ``h20``, ``h100``, ``cpu-testbed``).
PROFILES: dict[str, Profile] = builtin_profiles()


def get_profile(name: str) -> Profile:
    """The built-in profile called ``name``, or the profile file at path ``name`` (a ``.json``
    written by ``charm-megatron model --calibrate``); :class:`ValueError` lists the known ones."""
    if is_profile_path(name):
        return load_profile(name)
    try:
        return PROFILES[name]
    except KeyError:
        raise ValueError(f"unknown profile {name!r}; choose one of {', '.join(PROFILES)} or "
                         "give the path of a profile file (.json)") from None
