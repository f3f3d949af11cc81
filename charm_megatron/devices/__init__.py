"""Device profiles: what the performance model knows about a cluster's hardware (links, NICs,
kernel rate, overheads), one JSON file per device.

* :mod:`.schema` - the file format (``charm-megatron-profile/1``): :func:`load_profile`,
  :func:`save_profile`, :func:`dumps`;
* ``data/<name>.json`` - the built-in devices (``l20-pcie``, ``h20``, ``h100``, ``h200``,
  ``cpu-testbed``, and ``h20-table4``, ``h100-paper``, ``h100-paper-measured`` for the paper's
  implementation), each written by its recipe in :mod:`charm_megatron.lab.devices` (``python -m
  charm_megatron.lab.calibration.refit``); ``measurements/`` what the measured ones came from;
* :mod:`.registry` - the lookup: :data:`PROFILES`, :func:`get_profile`.

Adding a device is one file: a profile in ``data/`` (shipped), or in a directory listed on
``CHARM_DEVICES`` (:data:`DEVICES_ENV`; ``os.pathsep``-separated, read at each lookup, so bench
ranks and Megatron ranks see it). ``charm-megatron model --profile NAME``, ``bench
--device-model NAME``, ``CHARM_MODEL_PROFILE=NAME`` and :func:`get_profile` then accept its
name. Runtime code: no torch, nothing from the lab.
"""

from charm_megatron.devices.registry import (
    DATA_DIR,
    MEASUREMENTS_DIR,
    PROFILES,
    builtin_profiles,
    device_dirs,
    get_profile,
    profile_files,
)
from charm_megatron.devices.registry import ENV as DEVICES_ENV
from charm_megatron.devices.schema import FORMAT, dumps, is_profile_path, load_profile, save_profile

__all__ = [
    "DATA_DIR",
    "DEVICES_ENV",
    "FORMAT",
    "MEASUREMENTS_DIR",
    "PROFILES",
    "builtin_profiles",
    "device_dirs",
    "dumps",
    "get_profile",
    "is_profile_path",
    "load_profile",
    "profile_files",
    "save_profile",
]
