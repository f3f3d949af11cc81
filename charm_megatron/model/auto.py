"""Which cluster ``algo="auto"`` predicts with: an argument, ``CHARM_MODEL_PROFILE``, or none.

``cp_attention(..., algo="auto")`` calls::

    choose_algo_cached(groups, problem, auto_cluster(profile), causal=causal)

where ``profile`` is the caller's option (a built-in profile name, a profile file written by
``charm-megatron model --calibrate``, a :class:`Profile` or a :class:`Cluster`) or ``None``.
With ``None`` the environment variable ``CHARM_MODEL_PROFILE`` (a name or a path) is used, and
without it the generic :func:`~charm_megatron.model.cluster.default_cluster_for` the topology
(``auto_cluster`` returns ``None``). Every rank must see the same profile: the choice is made
without communicating, so a profile that differs between ranks would make them run different
algorithms.
"""

from __future__ import annotations

import os
from functools import lru_cache

from charm_megatron.model.cluster import Cluster, Profile, get_profile

ENV = "CHARM_MODEL_PROFILE"


@lru_cache(maxsize=16)
def _load(name: str, mtime: float) -> Cluster:
    # mtime in the key: a recalibrated file is read again, an unchanged one once.
    return get_profile(name).cluster


def auto_cluster(profile: str | Profile | Cluster | None = None) -> Cluster | None:
    """The cluster ``auto`` should predict with (``None``: the generic default).

    Raises :class:`ValueError` naming the setting when the profile cannot be found or read.
    """
    if isinstance(profile, Cluster):
        return profile
    if isinstance(profile, Profile):
        return profile.cluster
    name, where = profile, "the model profile option"
    if name is None:
        name, where = os.environ.get(ENV) or None, ENV
    if not name:
        return None
    try:
        mtime = os.path.getmtime(name) if os.path.exists(name) else 0.0
        return _load(name, mtime)
    except ValueError as exc:
        raise ValueError(f"{where}={name!r}: {exc}") from None
