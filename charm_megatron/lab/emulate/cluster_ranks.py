"""Run gloo ranks inside an :class:`EmulatedCluster` (same contract as ``run_ranks``)."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

from charm_megatron.lab.emulate.cluster import EmulatedCluster, RankPlace, enter
from charm_megatron.local_ranks import run_ranks

__all__ = ["run_ranks_in_cluster"]


class _EnterPlace:
    """Picklable ``setup(rank, world)`` hook: move the fresh child into its rank's place."""

    def __init__(self, places: Sequence[RankPlace]) -> None:
        self.places = tuple(places)

    def __call__(self, rank: int, world: int) -> None:
        enter(self.places[rank])


def run_ranks_in_cluster(
    cluster: EmulatedCluster,
    fn: Callable[..., Any],
    *args: Any,
    timeout_s: float = 300.0,
    pg_timeout_s: float = 60.0,
    threads: int = 1,
    env: dict[str, str] | None = None,
) -> list[Any]:
    """Run ``fn(rank, world_size, *args)`` on every rank of the running ``cluster``.

    Each child enters its rank's network (and UTS) namespace before ``init_process_group``;
    rendezvous goes through a FileStore file, which every namespace sees (the mount namespace is
    shared). Returns the per-rank results; raises ``RankFailure`` with tracebacks; kills
    stragglers (so the cluster can be torn down right after).
    """
    return run_ranks(
        fn, cluster.world_size, *args, timeout_s=timeout_s, pg_timeout_s=pg_timeout_s,
        threads=threads, env=env, setup=_EnterPlace(cluster.places),
    )
