"""Performance model: replay the real plans on a described cluster and predict time.

The runtime part only (what ``auto`` runs inside a call); fitting profiles, comparing with
measurements and the ``charm-megatron model`` command are the lab's
(:mod:`charm_megatron.lab.calibration`). Pure Python (no torch). Entry points:

* :class:`Cluster` - link bandwidths, NIC model, compute rate, overheads; :data:`PROFILES`
  (``l20-pcie``, ``h20``, ``h100``, ``cpu-testbed``) and :func:`default_cluster_for`;
* :func:`simulate` - one plan on one cluster (a discrete-event simulation of all ranks);
  :class:`ClusterTimer` - the same as the plan layer's clock (what ``auto`` splits time with);
* :func:`predict` / :func:`predict_all` - forward and backward per algorithm;
  :func:`ring_ccr` - the paper's computation-to-communication ratio;
* :func:`choose_algo` (and :func:`choose_algo_cached`) - the fastest registered algorithm,
  for ``algo="auto"``, each weighed with the variants its entry picks (:func:`variants`, e.g.
  CHARM+'s ``auto`` splits);
* :func:`auto_cluster` - the cluster ``auto`` predicts with (its profile argument, which
  ``cp_attention`` takes from ``CPOptions.model_profile`` / ``CHARM_MODEL_PROFILE``, else the
  generic default);
* :func:`load_profile` / :func:`save_profile` read and write profile files, :data:`PROFILES` /
  :func:`get_profile` the named ones (re-exported from :mod:`charm_megatron.devices`, where
  devices are added);
  :mod:`~charm_megatron.model.effects` the second-order effects.

See docs/model.md for what is modelled and what is not.
"""

from charm_megatron.devices import PROFILES, get_profile, load_profile, save_profile
from charm_megatron.model.auto import ENV as PROFILE_ENV
from charm_megatron.model.auto import auto_cluster
from charm_megatron.model.cluster import Cluster, Profile, default_cluster_for
from charm_megatron.model.predict import (
    CCR,
    Prediction,
    choose_algo,
    choose_algo_cached,
    predict,
    predict_all,
    rank_algos,
    rank_algos_cached,
    ring_ccr,
    variants,
)
from charm_megatron.model.sim import ModelError, RankStats, SimResult, simulate, tile_flops
from charm_megatron.model.timer import ClusterTimer

__all__ = [
    "CCR",
    "PROFILES",
    "PROFILE_ENV",
    "Cluster",
    "ClusterTimer",
    "ModelError",
    "Prediction",
    "Profile",
    "RankStats",
    "SimResult",
    "auto_cluster",
    "choose_algo",
    "choose_algo_cached",
    "default_cluster_for",
    "get_profile",
    "load_profile",
    "predict",
    "predict_all",
    "rank_algos",
    "rank_algos_cached",
    "ring_ccr",
    "save_profile",
    "simulate",
    "tile_flops",
    "variants",
]
