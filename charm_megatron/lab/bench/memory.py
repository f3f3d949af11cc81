"""Peak memory of one call, per rank.

CUDA: growth of ``torch.cuda.max_memory_allocated`` over the call (the caching allocator's count
of bytes handed to tensors).

CPU: torch keeps no running statistics for CPU tensors, but with ``profile_memory=True`` its
profiler records every allocation and free of the CPU allocator, in order, from every thread
(``[memory]`` events with signed byte counts). Their running sum is the bytes held by tensors;
its maximum over the call is the peak growth: receive buffers, accumulators, kernel
temporaries, the output and the gradients; the inputs, allocated before, are excluded (frees of
older tensors count negative, so the peak is relative to the start). Not counted: gloo's own
buffers and Python objects. The resident set is no substitute: glibc keeps freed heap memory
resident and reuses it, so RSS barely moves between calls (measured here: ~0 MB growth for calls
that allocate tens of MB).

The profiler makes the measured call slow; it is never a timed one.
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterator

import torch


@contextlib.contextmanager
def _quiet_stderr() -> Iterator[None]:
    """Silence file descriptor 2 briefly: Kineto prints a line to stderr on every profiler start
    and stop (``USDT: ... profiler_start``), per rank and call. Only wraps those two calls."""
    try:
        saved = os.dup(2)
    except OSError:
        yield
        return
    try:
        with open(os.devnull, "w") as null:
            os.dup2(null.fileno(), 2)
            try:
                yield
            finally:
                os.dup2(saved, 2)
    finally:
        os.close(saved)


class PeakMeter:
    """Peak memory growth over consecutive phases of one call, relative to its start::

        meter = PeakMeter(device)
        with meter.phase("fwd"):
            out = f(q, k, v)
        with meter.phase("fwdbwd"):
            out.backward(dout)
        meter.peaks  # {"fwd": bytes, "fwdbwd": bytes}: highest point up to each phase's end
    """

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self.peaks: dict[str, int] = {}
        self._started = False
        self._base = 0
        self._live = 0  # CPU: bytes held above the start after the last phase
        self._peak = 0

    @contextlib.contextmanager
    def phase(self, label: str) -> Iterator[None]:
        if self.device.type == "cuda":
            if not self._started:
                torch.cuda.synchronize(self.device)
                torch.cuda.reset_peak_memory_stats(self.device)
                self._base = torch.cuda.memory_allocated(self.device)
                self._started = True
            yield
            torch.cuda.synchronize(self.device)
            self.peaks[label] = int(torch.cuda.max_memory_allocated(self.device) - self._base)
            return
        from torch.profiler import ProfilerActivity, profile

        # One profiler session per phase; the running sum carries over, so a later phase's
        # peak is relative to the call's start, not to the phase's.
        prof = profile(activities=[ProfilerActivity.CPU], profile_memory=True)
        with _quiet_stderr():
            prof.start()
        try:
            yield
        finally:
            with _quiet_stderr():
                prof.stop()
        raw = prof.profiler.kineto_results.events() if prof.profiler else []
        for _, nbytes in sorted((e.start_ns(), e.nbytes()) for e in raw
                                if e.name() == "[memory]"):
            self._live += nbytes
            self._peak = max(self._peak, self._live)
        self.peaks[label] = self._peak


def call_peaks(rank: int, world: int, cases, s: int, b: int, hq: int, d: int,
               dtype: torch.dtype = torch.float32) -> dict:
    """A rank function for :func:`charm_megatron.local_ranks.run_ranks`: the peak growth
    (bytes) of the forward and of forward+backward of one ``cp_attention`` call per case
    ``(algo, topology, causal, hkv, roles)``, each measured on a second call (the first also
    builds plans and communicators). Global sequence ``s``, batch ``b``, ``hq`` query heads of
    dim ``d``. Used by ``charm-megatron report memory`` and tests/test_memory.py: memory does not
    depend on link speeds, so plain gloo ranks on loopback measure what an emulated cluster
    would."""
    import torch.distributed as dist

    from charm_megatron import cp_attention

    g = torch.Generator().manual_seed(rank)
    out = {}
    for case in cases:
        algo, topology, causal, hkv, roles = case
        sl = s // world
        q, k, v = (torch.randn(sl, b, h, d, generator=g).to(dtype).requires_grad_()
                   for h in (hq, hkv, hkv))
        dout = torch.randn(sl, b, hq, d, generator=g).to(dtype)
        for _ in range(2):
            meter = PeakMeter(torch.device("cpu"))
            dist.barrier()
            with meter.phase("fwd"):
                o = cp_attention(q, k, v, algo=algo, topology=topology, causal=causal,
                                 roles=roles)
            dist.barrier()
            with meter.phase("fwdbwd"):
                o.backward(dout)
            del o
            q.grad = k.grad = v.grad = None
        out[case] = dict(meter.peaks)
    return out
