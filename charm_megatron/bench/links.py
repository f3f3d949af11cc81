"""The software link model wired into gloo traffic (fallback without network namespaces).

:class:`charm_megatron.emulate.SoftwareLinks` books every transfer on a modelled link and makes
``wait()`` return no earlier than the link could have delivered it. This module installs it in a
rank process by wrapping ``torch.distributed.batch_isend_irecv`` - the one call through which the
executor of :func:`charm_megatron.cp_attention` moves data (``dist.batch_isend_irecv`` is looked
up at call time, so the wrapper takes effect without touching the executor). On gloo that call
returns one work handle per operation, so each handle can be booked on the link its peer sits
behind (send: this rank's egress; receive: its ingress).

Not throttled: torch's functional collectives (PyTorch's own CP attention, which the benchmark
therefore skips in this mode) and barriers. The model's limits (docs/topology.md): the real bytes
move at loopback speed, so CPU contention in a network stack and TCP fair sharing are not
modelled, and a transfer that only progresses inside ``wait()`` is not penalised.
"""

from __future__ import annotations

import os
from typing import Any

from charm_megatron.emulate import SoftwareLinks

ENV_FLAG = "CHARM_BENCH_LINKS"
_INSTALLED: list[Any] = []  # the RankLinks of this process, once installed


def install(links: Any) -> None:
    """Wrap ``torch.distributed.batch_isend_irecv`` in this process with ``links``
    (a :class:`charm_megatron.emulate.RankLinks`)."""
    import torch.distributed as dist

    original = dist.batch_isend_irecv
    if getattr(original, "_charm_links", None) is not None:
        original = original._charm_original  # re-installing replaces, never stacks

    def batch_isend_irecv(p2p_op_list: list) -> list:
        works = original(p2p_op_list)
        if len(works) != len(p2p_op_list):
            # A coalescing backend (NCCL) returns one handle for the batch: no per-link
            # attribution possible. The benchmark only installs this on gloo.
            raise RuntimeError("software link model: the backend coalesced a P2P batch; it "
                               "only works with gloo (one work handle per operation)")
        wrapped = []
        for work, op in zip(works, p2p_op_list):
            nbytes = op.tensor.numel() * op.tensor.element_size()
            wrapped.append(links.wrap(work, nbytes, op.peer, op.op is dist.isend))
        return wrapped

    batch_isend_irecv._charm_links = links  # type: ignore[attr-defined]
    batch_isend_irecv._charm_original = original  # type: ignore[attr-defined]
    dist.batch_isend_irecv = batch_isend_irecv
    os.environ[ENV_FLAG] = "software"
    _INSTALLED[:] = [links]


def booked_cross_bytes() -> int | None:
    """Bytes this rank booked on its cross-node egress link (None: model not installed). Zero
    after a run with cross-node traffic means the wrapper saw none of it: the executor stopped
    using ``batch_isend_irecv`` and the run was plain loopback."""
    if not _INSTALLED:
        return None
    return int(_INSTALLED[0].cross_out.bytes_posted)


class SoftwareLinkSetup:
    """Picklable ``setup(rank, world)`` hook for ``run_ranks``: install the model in the child."""

    def __init__(self, spec: SoftwareLinks) -> None:
        self.spec = spec

    def __call__(self, rank: int, world: int) -> None:
        install(self.spec.for_rank(rank))
