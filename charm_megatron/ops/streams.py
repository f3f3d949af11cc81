"""One process group per plan stream, so kv, q and cross traffic really run concurrently.

On NCCL each group is its own communicator (its own CUDA stream inside ProcessGroupNCCL), so a
kv exchange never queues behind a q exchange; on gloo each group has its own transport pairs
and background threads. Groups are created once per CP group, by its members only
(``use_local_synchronization``), because different CP groups of a Megatron job reach their
first attention call in no particular order.
"""

from __future__ import annotations

import datetime
import os
from dataclasses import dataclass

import torch.distributed as dist

from charm_megatron.plan.core import STREAMS

_CACHE: dict[tuple, StreamGroups] = {}


def comm_timeout() -> datetime.timedelta:
    """Bound on every blocking wait: ``CHARM_COMM_TIMEOUT_S`` seconds (default 600)."""
    seconds = float(os.environ.get("CHARM_COMM_TIMEOUT_S", "600"))
    return datetime.timedelta(seconds=seconds)


@dataclass
class StreamGroups:
    """The CP group's ranks and one process group per stream."""

    ranks: list[int]  # global rank of each CP-local rank
    groups: dict[str, dist.ProcessGroup]

    @property
    def size(self) -> int:
        return len(self.ranks)


def stream_groups(group: dist.ProcessGroup | None) -> StreamGroups:
    """The per-stream process groups of CP group ``group`` (created on first use, then cached)."""
    if group is None:
        group = dist.group.WORLD
    ranks = dist.get_process_group_ranks(group)
    key = (id(group), tuple(ranks))
    cached = _CACHE.get(key)
    if cached is not None:
        return cached
    groups = {}
    if len(ranks) > 1:
        for name in STREAMS:
            groups[name] = dist.new_group(
                ranks=ranks, timeout=comm_timeout(), use_local_synchronization=True,
                group_desc=f"charm_cp_{name}",
            )
        if dist.get_backend(group) == "nccl":
            # NCCL creates communicators lazily, and a batched P2P call as a communicator's
            # first operation must involve every rank; one tiny all-reduce per stream group
            # creates them up front, collectively.
            import torch

            probe = torch.zeros(1, device=torch.device("cuda", torch.cuda.current_device()))
            for g in groups.values():
                dist.all_reduce(probe, group=g)
    sg = StreamGroups(list(ranks), groups)
    _CACHE[key] = sg
    return sg
