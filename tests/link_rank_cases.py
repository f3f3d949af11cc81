"""The rank function of the software-link tests on gloo processes (module level so the
forkserver can pickle it): test_link_asymmetry.py and test_link_ports.py."""

from __future__ import annotations

import datetime
import time

from charm_megatron.lab.emulate import SoftwareLinks


def post_and_wait(rank: int, world: int, spec: SoftwareLinks, script: dict, nbytes: int,
                  timeout: datetime.timedelta) -> tuple[float, float]:
    """Post this rank's ops of ``script`` (rank -> (delay s, [(send?, peer), ...])), each a
    message of ``nbytes``, through the executor's transport over the software links, wait
    them all (each bounded by ``timeout``); (post, done) times."""
    import torch
    import torch.distributed as dist

    from charm_megatron.ops.transport import P2P

    transport = spec.for_rank(rank).transport()
    delay, ops = script.get(rank, (0.0, []))
    tensors = [torch.zeros(nbytes // 4) for _ in ops]
    dist.barrier()
    if delay:
        time.sleep(delay)
    posted = time.monotonic()
    p2p = [P2P(send, t, peer) for (send, peer), t in zip(ops, tensors)]
    works = transport.post(p2p) if p2p else []
    for w in works:
        w.wait(timeout)
    return posted, time.monotonic()
