"""The cluster the bench's ``auto`` contender predicts with: a profile on this run's links.

``cp_attention(algo="auto")`` picks with the performance model on the cluster of
``CHARM_MODEL_PROFILE`` (``charm_megatron.model.auto``). A profile describes the links it was
calibrated on; a bench run on the emulated cluster sets its own (``--nic``, ``--cross-rate``,
``--intra-rate``, the ``tbf`` buckets, the shared cores). So before the ranks start, the
launcher writes a profile file holding the base profile's fitted costs on *this run's* links
(:func:`charm_megatron.lab.calibration.testbed.bench_cluster`, rates as measured in namespaces, else as
configured) and points ``CHARM_MODEL_PROFILE`` of the ranks at it: ``auto`` then decides by
the user's code path (``cp_attention``'s own profile option) with the right inputs.

The base profile is the one ``CHARM_MODEL_PROFILE`` names in the bench's environment (e.g. a
file of ``charm-megatron model --calibrate``), else the built-in ``cpu-testbed``. Under
torchrun and on loopback (``--ranks``) nothing is written: the links are real (or absent), and
``auto`` runs as a user's call would, with the environment's profile.
"""

from __future__ import annotations

import contextlib
import os
import tempfile
from collections.abc import Iterator

from charm_megatron.devices import get_profile, save_profile
from charm_megatron.lab.calibration.testbed import bench_cluster
from charm_megatron.model.auto import ENV as PROFILE_ENV
from charm_megatron.model.cluster import Profile

#: The base profile when the environment names none (calibrated on this project's testbed).
DEFAULT_BASE = "cpu-testbed"


def base_profile(env: dict[str, str] | None = None) -> Profile:
    """The profile whose costs ``auto`` keeps (``CHARM_MODEL_PROFILE`` of ``env``, default
    ``os.environ``; else :data:`DEFAULT_BASE`)."""
    name = ((env if env is not None else os.environ).get(PROFILE_ENV) or "").strip()
    return get_profile(name or DEFAULT_BASE)


@contextlib.contextmanager
def run_profile(job, *, nic: str, cross_Bps: float, intra_Bps: float | None, cross_burst: int,
                intra_burst: int, cores: int, emulated: bool) -> Iterator[str | None]:
    """While the ranks run: a profile file for this run's links, named by the ranks'
    ``CHARM_MODEL_PROFILE`` (``job.env``); yields a line for the run's notes (``None`` when
    the job times neither ``auto`` nor ``charm``, whose ``split_visiting="auto"`` also
    predicts). The file is removed afterwards."""
    if not {"auto", "charm"} & set(job.cfg.algos):
        yield None
        return
    device = job.cfg.device
    if device is not None:  # an emulated GPU cluster: the device profile on its real links
        base = get_profile(device.profile)
        cluster = device.model_cluster
    else:
        base = base_profile()
        cluster = bench_cluster(base.cluster, nic=nic, cross_Bps=cross_Bps,
                                intra_Bps=intra_Bps, cross_burst=cross_burst,
                                intra_burst=intra_burst, cores=cores, emulated=emulated)
    prof = Profile(f"bench-{base.name}", cluster, job.topology,
                   f"{base.name}'s costs on this bench run's links (lab/bench/autoprofile.py)")
    with tempfile.TemporaryDirectory(prefix="charm-bench-auto-") as tmp:
        path = os.path.join(tmp, "bench-cluster.json")
        save_profile(prof, path)
        saved = job.env.get(PROFILE_ENV)
        job.env[PROFILE_ENV] = path
        try:
            yield (f"auto (and charm's split_visiting) predicts with profile {base.name} on "
                   f"this run's links: "
                   f"{cluster.describe()}")
        finally:
            if saved is None:
                job.env.pop(PROFILE_ENV, None)
            else:
                job.env[PROFILE_ENV] = saved
