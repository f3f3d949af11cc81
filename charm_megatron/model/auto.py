"""Which cluster ``algo="auto"`` predicts with: a profile option, or the generic default.

``cp_attention(..., algo="auto")`` calls::

    choose_algo_cached(groups, problem, auto_cluster(options.model_profile), causal=causal)

where ``options.model_profile`` (:class:`~charm_megatron.ops.options.CPOptions`, resolved at
the API edge from ``CHARM_MODEL_PROFILE``) is a built-in profile name, a profile file written
by ``charm-megatron model --calibrate``, or ``None``; a :class:`Profile` or a :class:`Cluster`
is accepted here too. ``None`` means the generic
:func:`~charm_megatron.model.cluster.default_cluster_for` the topology (``auto_cluster``
returns ``None``). This module reads no environment variable: ``cp_attention``'s options and
the ``charm-megatron model`` command line do. Every rank must see the same profile: the choice
is made without communicating (``cp_attention``'s agreement check compares the profile's name
and a digest of its cluster).
"""

from __future__ import annotations

import os
from functools import lru_cache

from charm_megatron.devices import get_profile, is_profile_path
from charm_megatron.model.cluster import Cluster, Profile

#: The variable the API edges read the profile from (CPOptions.from_env, the model CLI).
ENV = "CHARM_MODEL_PROFILE"


@lru_cache(maxsize=16)
def _load(name: str, mtime: float) -> Cluster:
    # mtime in the key: a recalibrated file is read again, an unchanged one once.
    return get_profile(name).cluster


def auto_cluster(profile: str | Profile | Cluster | None = None, *,
                 where: str = "the model profile option") -> Cluster | None:
    """The cluster ``auto`` should predict with (``None``: the generic default).

    Raises :class:`ValueError` naming the setting (``where``) when the profile cannot be found
    or read.
    """
    if isinstance(profile, Cluster):
        return profile
    if isinstance(profile, Profile):
        return profile.cluster
    name = profile.strip() if isinstance(profile, str) else profile
    if not name:
        return None
    try:
        if not is_profile_path(name):  # a named device: the registry caches it (and sees
            return get_profile(name).cluster  # CHARM_DEVICES change)
        mtime = os.path.getmtime(name) if os.path.exists(name) else 0.0
        return _load(name, mtime)
    except ValueError as exc:
        raise ValueError(f"{where}={name!r}: {exc}") from None
