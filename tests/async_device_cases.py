"""The rank function of the asynchronous timed device's gloo tests (module level so the
forkserver can pickle it): tests/test_async_device.py."""

from __future__ import annotations

import time

import torch

from charm_megatron import CPOptions, cp_attention
from charm_megatron.devices import get_profile
from charm_megatron.lab.emulate.device import TimedBackend
from charm_megatron.ops.transport import TorchTransport


class _PostClock:
    """torch's transport, recording for every batch with sends when it was posted and until
    when the rank's device then had work queued (the post must not come before that)."""

    name = "post-clock"

    def __init__(self, device: TimedBackend) -> None:
        self.inner = TorchTransport()
        self.device = device
        self.posts: list[tuple[float, float]] = []  # (perf_counter at the post, busy-until)

    def post(self, ops):
        if any(op.send for op in ops):
            self.posts.append((time.perf_counter(), self.device.busy_until))
        return self.inner.post(ops)


def timed_ring_call(rank: int, world: int, tile_wall_s: float, synchronous: bool) -> dict:
    """One ring forward and backward of causal attention on a timed H200, dilated so that a
    full tile of the forward lasts ``tile_wall_s`` of wall time: each direction's wall time,
    its device time x D (``device_wall_s``), and every post with sends (time, busy-until)."""
    s, b, h, d = 8 * world, 1, 2, 16
    cluster = get_profile("h200").cluster
    probe = TimedBackend(cluster, sm_contention=False)
    tile_s = probe.tile_seconds(s // world, s // world, b, h, h, d, 2, False, False)
    device = TimedBackend(cluster, dilation=tile_wall_s / tile_s, sm_contention=False,
                          synchronous=synchronous)
    transport = _PostClock(device)
    opts = CPOptions(backend=device, transport=transport)
    g = torch.Generator().manual_seed(rank)
    q, k, v = (torch.randn(s // world, b, h, d, generator=g, dtype=torch.bfloat16)
               .requires_grad_() for _ in range(3))
    out = {}
    for direction in ("fwd", "bwd"):
        before = device.clock.device_s
        t0 = time.perf_counter()
        if direction == "fwd":
            res = cp_attention(q, k, v, algo="ring", causal=True, options=opts)
        else:
            res.backward(torch.zeros_like(res))
        out[direction] = time.perf_counter() - t0
        out[f"{direction}_device_wall_s"] = (device.clock.device_s - before) * device.dilation
        # what is still queued when the call returned (0: the call waited for its device)
        out[f"{direction}_left_s"] = max(device.busy_until - time.perf_counter(), 0.0)
    out["posts"] = transport.posts
    out["waited_s"] = device.clock.waited_s * device.dilation
    return out
