"""The software link model as the executor's transport in a bench rank (fallback without
network namespaces).

:class:`charm_megatron.lab.emulate.SoftwareLinks` books every message on modelled links and makes
``wait()`` return no earlier than they could have delivered it. :func:`install` registers
this rank's :class:`charm_megatron.lab.emulate.LinkTransport` (torch.distributed's
``batch_isend_irecv`` underneath, each op paired with its peer's side and booked on the
sender's egress and the receiver's ingress) as the transport ``software_links`` and selects
it for the process (``CHARM_TRANSPORT``), so every ``cp_attention`` call whose options come
from the environment moves its bytes through it (ops/transport.py).

Not throttled: torch's functional collectives (PyTorch's own CP attention, which the benchmark
therefore skips in this mode), barriers, and calls given explicit options with another
transport. The model's limits (docs/topology.md): the real bytes move at loopback speed, so CPU
contention in a network stack and TCP fair sharing are not modelled, and a transfer that only
progresses inside ``wait()`` is not penalised.
"""

from __future__ import annotations

import os
from typing import Any

from charm_megatron.lab.emulate import LinkTransport, SoftwareLinks

ENV_FLAG = "CHARM_BENCH_LINKS"
TRANSPORT = LinkTransport.name  # the registered name, what CHARM_TRANSPORT selects
_INSTALLED: list[Any] = []  # the RankLinks of this process and its transport, once installed


def install(links: Any) -> None:
    """Make ``links`` (a :class:`charm_megatron.lab.emulate.RankLinks`) this process's transport:
    registered as ``software_links`` (re-installing replaces, never stacks) and selected by
    ``CHARM_TRANSPORT``."""
    from charm_megatron.ops.transport import register_transport

    transport = LinkTransport(links)
    register_transport(TRANSPORT, lambda: transport)
    os.environ["CHARM_TRANSPORT"] = TRANSPORT
    os.environ[ENV_FLAG] = "software"
    _INSTALLED[:] = [links, transport]


def follow(clock: Any) -> bool:
    """Book this process's messages on ``clock``, the rank's virtual clock (a
    :class:`~charm_megatron.lab.emulate.virtual_time.VirtualTime` its timed devices share;
    ``None``: the wall clock), and report their arrivals to it. False (nothing done) without
    the software links installed (``--emulate-backend netns``: TCP has no virtual time)."""
    if not _INSTALLED:
        return False
    _INSTALLED[1].follow(clock)
    return True


def booked_cross_bytes() -> int | None:
    """Bytes this rank booked on its cross-node egress link (None: model not installed). Zero
    after a run with cross-node traffic means the transport saw none of it: the calls ran on
    another transport and the run was plain loopback."""
    if not _INSTALLED:
        return None
    return int(_INSTALLED[0].cross_out.bytes_posted)


def late_bookings() -> int | None:
    """Messages the start-order links served after one that started later (a rank's floor was
    wrong, lab/emulate/link_order.py; 0 when the order held). None: not installed or links
    booked in wall order."""
    if not _INSTALLED or not _INSTALLED[0].spec.start_order:
        return None
    return _INSTALLED[0].spec.start_queue().late


class SoftwareLinkSetup:
    """Picklable ``setup(rank, world)`` hook for ``run_ranks``: install the model in the child."""

    def __init__(self, spec: SoftwareLinks) -> None:
        self.spec = spec

    def __call__(self, rank: int, world: int) -> None:
        install(self.spec.for_rank(rank))
