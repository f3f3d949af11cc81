"""The timed device of the emulated GPU cluster: a kernel backend that waits instead of computing.

Each rank of an emulated GPU cluster runs the real plans, executor, streams, agreement checks
and messages on emulated links; only its device is emulated. :class:`TimedBackend` takes the
place of the attention kernels (``CPOptions(backend=TimedBackend(...))``): for every tile it is
given it waits for the time the modelled device would take, computed by the performance
model's formulas on the device profile (a :class:`~charm_megatron.model.cluster.Cluster`:
``tflops``, the backward factor, the tile-size and head-dim efficiency, the per-op overhead,
the merge rate, the slowdown per stream with communication in flight), so the model and the
emulator price a tile alike and differ only in what the model cannot see: the executor's real
order of events, the real messages and their real contention.

* **Values mean nothing.** Outputs keep the shapes and dtypes of the real kernels' (so every
  message has its real size) but hold zeros; results of an emulated run are timings only.
* **Time dilation** (``dilation`` ``D``): every op lasts ``D`` times its device time, and the
  emulated links run ``D`` times slower than the real ones, so the emulator's own fixed costs
  (Python, gloo, TCP, ~0.1-1 ms per message and op on these machines) shrink to ``1/D`` of
  themselves in device time, the range of a real GPU's kernel launch and NCCL latency.
* **A scaled problem on the wire** (:class:`WireScale`): the tensors may be the real ones with
  the batch and the rows per rank divided by whole factors, while the device times the
  *virtual* full-size tile; the links are then slowed by the same factor, so every ratio of
  compute to communication is the real one while memory and TCP load fit this machine.
* The host's waits for the device sleep, releasing the GIL and the core: 16 or 32 emulated
  devices share 2 cores.

The device is asynchronous, like a GPU's stream (issue 41): an op is queued, not waited for.
Its device interval starts when the device is free (or now, if it is idle) and lasts its device
time x ``D``; the call returns at once, so the host's own CPU work (Python, torch ops on wire
tensors, gloo bookkeeping) overlaps the device's work as a real host's kernel launches do. The
host waits for the device only where a GPU's host or stream would: before it posts a batch of
messages (:meth:`TimedBackend.before_post`: NCCL on a stream starts after the kernels before
it) and at the end of a call (:meth:`TimedBackend.synchronize`, the bench's
``cuda.synchronize``). The device's busy intervals are then the model's program clock
(:mod:`charm_megatron.model.sim`). ``synchronous=True`` keeps the device of before, where
every op sleeps from its call to its return (the host's CPU work then adds to the measured
device time).

**The virtual clock** (``virtual``, a :class:`~.virtual_time.VirtualTime` shared with the
rank's software links; the bench's default): an op starts at ``max(busy_until, host_t)`` instead
of the wall clock's now, where ``host_t`` is when what the host waited for was done (a
message's modelled arrival, the device's end at a synchronisation), so a host that wakes late
after a message, or spends long in Python before its next op, no longer shifts the device's
timeline; its posts are booked at the virtual time too (``LinkTransport``), and the bench
times a call on this clock (:meth:`TimedBackend.virtual_now`). Without it the device is
asynchronous on the wall clock (``device_clock`` ``async``, the device of a747235): the same
queue, a :class:`~.virtual_time.WallTime` whose host time is always the wall clock's now, so an
op starts no earlier than its call. docs/emulator.md has the whole method.
"""

from __future__ import annotations

import math
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field, replace

import torch

from charm_megatron.lab.emulate import moving
from charm_megatron.lab.emulate.moving import DeviceChain, MovingBatch, QueuedOp
from charm_megatron.lab.emulate.virtual_time import VirtualTime, WallTime
from charm_megatron.model import effects
from charm_megatron.model.cluster import Cluster
from charm_megatron.plan.cost import Problem
from charm_megatron.plan.head_stage import copy_passes
from charm_megatron.plan.tile_rule import scaled
from charm_megatron.plan.vocab import Kind

#: How many times the host prices the ops it queued again while it waits for the device
#: (:meth:`TimedBackend._drain`): each sleep can end with more of their transfers booked.
REPRICE_ROUNDS = 4


@dataclass(frozen=True)
class WireScale:
    """How the problem on the wire maps to the virtual one the device times: the batch and the
    rows of every block are ``batch`` and ``rows`` times larger there (whole factors)."""

    batch: int = 1
    rows: int = 1

    def __post_init__(self) -> None:
        for name in ("batch", "rows"):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, int) or v < 1:
                raise ValueError(f"WireScale.{name} must be a whole number >= 1, got {v!r}")

    @property
    def bytes(self) -> int:
        """How much larger every virtual block is than its wire copy."""
        return self.batch * self.rows


@dataclass(frozen=True)
class LinkClock:
    """How long a message takes on this rank's real links, for the compute slowdown while it
    moves: ``rank`` (CP-local), the hardware ``groups``, the real rates (bytes/s) one message
    reaches inside a group and across groups (``DeviceSetup.backend``: the model's
    per-message rates, ``LinkSpec.one_message_Bps``), and the per-message latency.

    It assumes each message moves alone on its ports at that rate: a message sharing a port
    (a second intra message of the rank at once on a port wider than one message, or any
    message queued behind another) moves longer on the links than this span says. It is the
    span only until the software links have booked the message (:mod:`.moving`); links that
    book nothing (netns) keep it, and there the slowdown ends early; the model counts a
    stream as moving while any of its messages has bytes left."""

    rank: int
    groups: tuple[tuple[int, ...], ...]
    intra_Bps: float
    cross_Bps: float
    latency_s: float = 0.0

    def crosses(self, peer: int) -> bool:
        """True if a message to or from ``peer`` leaves this rank's hardware group."""
        return not any(self.rank in g and peer in g for g in self.groups)

    def seconds(self, peer: int, nbytes: float) -> float:
        rate = self.cross_Bps if self.crosses(peer) else self.intra_Bps
        return self.latency_s + nbytes / rate


@dataclass
class DeviceClock:
    """What a timed device has run and the host has waited for it, in device seconds (wall
    seconds / dilation): the synchronous device waits in every op, the asynchronous one where
    the host synchronises with it (:meth:`TimedBackend.synchronize`)."""

    tiles: int = 0
    merges: int = 0
    device_s: float = 0.0  # the modelled device time asked for
    waited_s: float = 0.0  # wall time actually waited, / dilation
    lock: threading.Lock = field(default_factory=threading.Lock, repr=False)

    def add(self, device_s: float, waited_s: float, tile: bool) -> None:
        with self.lock:
            self.device_s += device_s
            self.waited_s += waited_s
            if tile:
                self.tiles += 1
            else:
                self.merges += 1

    def add_repriced(self, device_s: float) -> None:
        """Ops already queued took ``device_s`` longer once priced again (:mod:`.moving`)."""
        with self.lock:
            self.device_s += device_s

    def add_wait(self, waited_s: float) -> None:
        """The host waited ``waited_s`` (device seconds) for the asynchronous device."""
        with self.lock:
            self.waited_s += waited_s


class TimedBackend:
    """A kernel backend whose every op waits for the device time of ``cluster`` (see module).

    ``dilation``: wall seconds per device second; ``scale``: the wire-to-virtual factors;
    ``sm_contention``: apply the profile's ``comm_slowdown`` once per stream (communicator)
    with a transfer of this rank moving, as the model does (:func:`.effects.contention`; the
    executor says when it posts and completes one and on which stream, :meth:`posted` /
    :meth:`waited`; ``links`` says for how long its bytes move); ``False`` or no ``links``
    ignores it. ``synchronous``: every op sleeps its time at its call (the device of before
    issue 41) instead of being queued on the device's timeline. ``virtual``: the rank's virtual
    clock (module doc; shared with its links and its other timed devices): ops start on it,
    not at the wall clock's now."""

    name = "timed"

    def __init__(self, cluster: Cluster, *, dilation: float = 1.0,
                 scale: WireScale = WireScale(), sm_contention: bool = True,
                 links: LinkClock | None = None,
                 sleep: Callable[[float], None] = time.sleep,
                 synchronous: bool = False, virtual: VirtualTime | None = None) -> None:
        if not dilation > 0:
            raise ValueError(f"dilation must be > 0, got {dilation!r}")
        if cluster.cores is not None:
            raise ValueError("a timed device models one device per rank; this cluster "
                             "describes a shared CPU pool (cores=...): choose a GPU profile")
        self.cluster = cluster
        self.dilation = float(dilation)
        self.scale = scale
        self.sm_contention = sm_contention
        self._sleep = sleep
        self.links = links
        # handle -> its transfers that may still move, on which stream: the slowdown counts
        # the streams with something still moving (contention)
        self._moving: dict[int, MovingBatch] = {}
        # the ops queued since the host last waited for the device, priced again then on what
        # the links know by that time (moving.py), and where the last of them ends
        self._chain = DeviceChain()
        self._chain_end = -math.inf
        if synchronous and virtual is not None:
            raise ValueError("the synchronous device sleeps every op at its call: it has no "
                             "virtual clock")
        # The device's one queue (None: the synchronous device, which never queues): the
        # rank's virtual clock, or a timeline on the wall clock (the asynchronous device).
        self.timeline: VirtualTime | None = (
            virtual if virtual is not None else None if synchronous else WallTime())
        self.clock = DeviceClock()

    @classmethod
    def from_profile(cls, profile: str, *, dilation: float = 1.0, batch_scale: int = 1,
                     rows_scale: int = 1, sm_contention: bool = True,
                     links: LinkClock | None = None,
                     synchronous: bool = False,
                     virtual: VirtualTime | None = None) -> TimedBackend:
        """The timed device of a performance-model profile (a built-in name such as ``h100``,
        or a profile file written by ``scripts/gpu_check.py``). Without ``links`` the device
        cannot tell how long its transfers move, so SM contention is left out."""
        from charm_megatron.devices import get_profile

        return cls(get_profile(profile).cluster, dilation=dilation,
                   scale=WireScale(batch_scale, rows_scale), sm_contention=sm_contention,
                   links=links, synchronous=synchronous, virtual=virtual)

    # -- what the executor and the call resolution ask of it ----------------------------
    @property
    def problem_scale(self) -> WireScale:
        """The virtual problem of a call (its model problem and variant rules use it)."""
        return self.scale

    def posted(self, handle: int, messages: list[tuple[int, int]],
               stream: object = None, works: Sequence[tuple[int, object]] = ()) -> None:
        """The executor posted batch ``handle`` on ``stream`` (its communicator; ``None``: one
        unnamed stream): ``(peer, wire bytes)`` per message, and ``(peer, handle)`` per
        transfer it posted. Its bytes move until its last message arrives: the span during
        which this rank's compute is slowed (``comm_slowdown`` for this stream; only its
        cross messages count with ``comm_slowdown_links="cross"``). When it moves is what the
        software links know (:mod:`.moving`): from the match (both sides posted) to the
        booked arrival, queueing behind others on a shared link included, as the model
        counts it; until booked, the longest message's time alone on this rank's links
        (:class:`LinkClock`); ops queued before then are priced again when the host next
        waits for the device (:meth:`_drain`)."""
        if self.links is None or not (self.sm_contention and self.cluster.comm_slowdown):
            return
        if self.cluster.comm_slowdown_links == "cross":  # intra copies hold no SMs here
            messages = [(p, b) for p, b in messages if self.links.crosses(p)]
            works = [(p, w) for p, w in works if self.links.crosses(p)]
            if not messages:
                return
        seconds = max((self.links.seconds(peer, nbytes * self.scale.bytes)
                       for peer, nbytes in messages), default=0.0)
        self._moving[handle] = MovingBatch(self._post_time(), seconds * self.dilation, stream,
                                           tuple(w for _, w in works),
                                           self.links.latency_s * self.dilation)

    def waited(self, handle: int) -> None:
        """Batch ``handle`` completed: whatever it moved has arrived by now (its spans end at
        the host's time; kept until the device is committed, for the ops priced again)."""
        batch = self._moving.get(handle)
        if batch is not None:
            batch.waited_at = (self.timeline.host() if self.timeline is not None
                               else time.perf_counter())

    # -- where the host waits for the device --------------------------------------------------
    @property
    def device_clock(self) -> str:
        """Which device this is: ``virtual`` (ops on the rank's virtual clock), ``async`` (ops
        queued on the wall clock) or ``sync`` (every op slept at its call)."""
        if self.timeline is None:
            return "sync"
        return "async" if isinstance(self.timeline, WallTime) else "virtual"

    @property
    def synchronous(self) -> bool:
        """Every op sleeps at its call (no queue)."""
        return self.timeline is None

    @property
    def virtual(self) -> VirtualTime | None:
        """The rank's virtual clock (``None`` on the wall-clock devices)."""
        return None if isinstance(self.timeline, WallTime) else self.timeline

    @property
    def busy_until(self) -> float:
        """When the work queued on the device ends (``time.monotonic`` seconds, the clock of
        ``time.perf_counter`` on Linux; on the virtual clock its virtual time; 0 on the
        synchronous device, which never queues)."""
        return self.timeline.busy_until if self.timeline is not None else 0.0

    def virtual_now(self) -> float:
        """The time the host has reached: on the virtual clock ``max(host_t, busy_until)``
        (a call's virtual end once it synchronised), else the wall clock's now."""
        return self.timeline.now() if self.timeline is not None else time.perf_counter()

    def synchronize(self) -> None:
        """The host waits until the device has run everything queued on it (a GPU's
        ``cuda.synchronize``): the executor calls it at the end of each call, so a call's
        measured time includes its device work. Nothing to wait for on the synchronous
        device. On the virtual clock the host's time is then the device's end, and the call is
        over (:meth:`.VirtualTime.end_call`)."""
        self._drain()
        if self.timeline is not None:
            self.timeline.end_call()

    def before_post(self) -> None:
        """The executor is about to post a batch of messages: its sends may hold what the
        device's queued ops produce, and on a GPU the transfer (NCCL on a stream) starts only
        after the kernels before it, so the post waits for the device."""
        self._drain()
        if self.timeline is not None:
            self.timeline.synced()

    def posts_done(self) -> None:
        """The executor has posted everything of this call (before its status exchange): on
        start-order links the rank's floor is idle until its next call (:mod:`.floors`)."""
        if self.virtual is not None:
            self.virtual.posts_done()

    def _drain(self) -> None:
        """Sleep until the device's queue ends on the wall clock. On the virtual clock too:
        the wall must not run behind the times the rank books and reports (causality among
        ranks); a host already late sleeps nothing. The ops queued since the last drain are
        priced again first and once more after the sleep (the links may have booked the
        transfers that run under them meanwhile: :mod:`.moving`), then the host commits to
        their end."""
        self._reprice()
        for _ in range(REPRICE_ROUNDS):
            remaining = self.busy_until - time.perf_counter()
            if remaining > 0:
                t0 = time.perf_counter()
                self._sleep(remaining)
                self.clock.add_wait((time.perf_counter() - t0) / self.dilation)
            if not self._reprice():
                break
        self._commit()

    def _reprice(self) -> bool:
        """Price the chain of ops queued since the last drain again; push the device's end
        later if they take longer now (never earlier: the rank's floor was published on it).
        True if it moved."""
        timeline = self.timeline
        if timeline is None or not self._chain.ops:
            return False
        if timeline.busy_until != self._chain_end:  # another device queued on this timeline
            self._chain.clear()
            return False

        spans = self._spans()  # once: what the links know now holds for every op

        def price(op: QueuedOp, start: float) -> float:
            return self._priced(op.work_s, op.slowed, start, spans) * self.dilation

        end = self._chain.end(price)
        if end <= self._chain_end:
            return False
        self.clock.add_repriced((end - self._chain_end) / self.dilation)
        timeline.extend(end)
        self._chain_end = timeline.busy_until
        return True

    def _commit(self) -> None:
        """The host has waited for the device: its queued ops are final, and batches whose
        bytes stopped moving before the device's end can slow nothing more."""
        self._chain.clear()
        done = self.busy_until if self.timeline is not None else time.perf_counter()
        for h in [h for h, b in self._moving.items()
                  if b.end() <= done and (b.waited_at < math.inf or b.settled())]:
            del self._moving[h]

    def _start(self) -> float:
        """When an op queued now starts on the device: when the device is free, or, if it is
        idle, now (the wall clock) or the host's virtual time (the virtual clock)."""
        return self.timeline.start() if self.timeline is not None else time.perf_counter()

    def _post_time(self) -> float:
        """When a batch posted now starts: when its data is ready (after the host synced with
        the device before posting: the wall clock's now, or the virtual time)."""
        return self.timeline.ready() if self.timeline is not None else time.perf_counter()

    # -- device time ------------------------------------------------------------------------
    def tile_seconds(self, sq: int, sk: int, b: int, hq: int, hkv: int, d: int, elem: int,
                     causal: bool, backward: bool, kept: float = 1.0) -> float:
        """Device seconds of one tile of ``sq`` x ``sk`` *virtual* rows, batch ``b``, ``hq`` /
        ``hkv`` heads of dim ``d``, ``elem`` bytes per element: the model's price
        (:mod:`charm_megatron.model.sim`'s ``_op_cost``): FLOPs at the profile's rate and tile
        efficiency, the fold of its result into the accumulators at the merge rate, the
        per-op overhead, the whole of it slowed while a transfer is in flight (the model's
        compute job is one op at its full cost, capped at ``1 / contention``; until
        2026-12-06 only the FLOPs were slowed here). ``kept``: the share of the tile's pairs
        a sliding window keeps (its FLOPs scale with it)."""
        return self._slowed(self._tile_work_s(sq, sk, b, hq, hkv, d, elem, causal, backward,
                                              kept))

    def _tile_work_s(self, sq: int, sk: int, b: int, hq: int, hkv: int, d: int, elem: int,
                     causal: bool, backward: bool, kept: float = 1.0) -> float:
        """:meth:`tile_seconds` at full speed (no transfer moving)."""
        cl = self.cluster
        flops = 4.0 * b * hq * d * sq * sk * (0.5 if causal else 1.0) * kept
        if backward:
            flops *= cl.bwd_factor
        eff = effects.kernel_efficiency(cl, sq, sk, d)
        if backward:
            folded = (Problem(b, sq, hq, hkv, d, elem).block_bytes(Kind.DQ, 1)
                      + Problem(b, sk, hq, hkv, d, elem).block_bytes(Kind.DKV, 1))
        else:
            folded = Problem(b, sq, hq, hkv, d, elem).block_bytes(Kind.OUT, 1)
        return (flops / (cl.tflops * 1e12 * eff) + self.merge_seconds(folded)
                + cl.op_overhead_us * 1e-6)

    def _slowed(self, work_s: float) -> float:
        """Device seconds of ``work_s`` of compute queued now while this rank's transfers
        move (:meth:`_priced` from the op's start on the device)."""
        return self._priced(work_s, True, self._start(), self._spans())

    def _spans(self) -> dict[object, list[moving.Span]]:
        """Each stream's moving spans as far as this rank's links know now (:mod:`.moving`);
        none where SM contention is off."""
        if not (self.sm_contention and self.cluster.comm_slowdown):
            return {}
        return moving.spans_by_stream(self._moving.values())

    def _priced(self, work_s: float, slowed: bool, start: float,
                spans: dict[object, list[moving.Span]]) -> float:
        """Device seconds of an op of ``work_s`` at full speed from ``start``: ``slowed`` (a
        kernel or merge) it is the model's effect, ``1 + comm_slowdown * k`` times slower
        while ``k`` streams move (:func:`.effects.slowed_over`); a copy is never slowed."""
        if not slowed or not spans:
            return work_s
        return effects.slowed_over(self.cluster, work_s, start, spans, self.dilation)

    def merge_seconds(self, nbytes: float) -> float:
        """Device seconds to accumulate ``nbytes`` of partials (virtual bytes)."""
        gbps = self.cluster.merge_gbps
        return nbytes / (gbps * 1e9) if gbps else 0.0

    def _wait(self, device_s: float, tile: bool) -> None:
        """Run an op of ``device_s`` on the device, as it is (never slowed)."""
        self._run(device_s, tile, slowed=False)

    def _run(self, work_s: float, tile: bool, slowed: bool = True) -> None:
        """Run an op of ``work_s`` at full speed on the device, ``slowed`` while this rank's
        transfers move: queued after what it holds (the host goes on at once; priced again
        when the host next waits for the device, :meth:`_drain`), or, on the synchronous
        device, slept through here."""
        device_s = self._slowed(work_s) if slowed else work_s
        timeline = self.timeline
        if timeline is not None:
            floor, base = timeline.host(), timeline.busy_until
            start = timeline.queue(device_s * self.dilation)
            self._chain.add(base, QueuedOp(floor, work_s, slowed))
            self._chain_end = start + device_s * self.dilation
            self.clock.add(device_s, 0.0, tile)
            return
        t0 = time.perf_counter()
        self._sleep(device_s * self.dilation)
        self.clock.add(device_s, (time.perf_counter() - t0) / self.dilation, tile)
        self._commit()

    def _virtual(self, rows: int, batch: int) -> tuple[int, int]:
        return rows * self.scale.rows, batch * self.scale.batch

    # -- the backend interface ----------------------------------------------------------------
    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, causal: bool,
                scale: float) -> tuple[torch.Tensor, torch.Tensor]:
        sq, b = self._virtual(q.shape[0], q.shape[1])
        sk, _ = self._virtual(k.shape[0], k.shape[1])
        self._run(self._tile_work_s(sq, sk, b, q.shape[2], k.shape[2], q.shape[3],
                                    q.element_size(), causal, False), True)
        lse_dtype = torch.float64 if q.dtype == torch.float64 else torch.float32
        lse = torch.zeros((q.shape[1], q.shape[2], q.shape[0]), dtype=lse_dtype,
                          device=q.device)
        return torch.zeros_like(q), lse

    def backward(self, dout: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                 out: torch.Tensor, lse: torch.Tensor, causal: bool,
                 scale: float) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        sq, b = self._virtual(q.shape[0], q.shape[1])
        sk, _ = self._virtual(k.shape[0], k.shape[1])
        self._run(self._tile_work_s(sq, sk, b, q.shape[2], k.shape[2], q.shape[3],
                                    q.element_size(), causal, True), True)
        return torch.zeros_like(q), torch.zeros_like(k), torch.zeros_like(v)

    def forward_masked(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                       allowed: torch.Tensor, scale: float, *, window=None,
                       spec=None) -> tuple[torch.Tensor, torch.Tensor]:
        """A tile under a sliding window's mask ``allowed``: priced at the share it keeps."""
        return self._masked(q, k, v, allowed, None, window, spec)

    def backward_masked(self, dout: torch.Tensor, q: torch.Tensor, k: torch.Tensor,
                        v: torch.Tensor, out: torch.Tensor, lse: torch.Tensor,
                        allowed: torch.Tensor, scale: float, *, window=None,
                        spec=None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        return self._masked(q, k, v, allowed, dout, window, spec)

    def _kept(self, allowed: torch.Tensor, window, spec) -> tuple[float, bool]:
        """The share of the *virtual* tile's pairs the window keeps, and whether it is priced
        as causal: from the window and tile (``window``: the executor's, in wire rows) scaled
        to the virtual rows, as the model prices it; the wire mask's own mean (a band a few
        wire rows wide keeps a few % more than the virtual one) where they are not given."""
        if window is None or spec is None:
            return (float(allowed.float().mean()) if allowed.numel() else 0.0), False
        r = self.scale.rows
        left, right = scaled((window.left, window.right), r)
        virtual = replace(window, left=left, right=right, rows=window.rows * r)
        return virtual.fraction(spec), spec.causal

    def _masked(self, q, k, v, allowed, dout, window, spec):
        sq, b = self._virtual(q.shape[0], q.shape[1])
        sk, _ = self._virtual(k.shape[0], k.shape[1])
        kept, causal = self._kept(allowed, window, spec)
        backward = dout is not None
        self._run(self._tile_work_s(sq, sk, b, q.shape[2], k.shape[2], q.shape[3],
                                    q.element_size(), causal, backward, kept), True)
        if backward:
            return torch.zeros_like(q), torch.zeros_like(k), torch.zeros_like(v)
        lse_dtype = torch.float64 if q.dtype == torch.float64 else torch.float32
        lse = torch.zeros((q.shape[1], q.shape[2], q.shape[0]), dtype=lse_dtype,
                          device=q.device)
        return q.new_zeros((*q.shape[:-1], v.shape[-1])), lse

    def copied(self, nbytes: float) -> None:
        """The executor copied ``nbytes`` on the device outside a kernel (a head all-to-all
        packing and placing head slices): the model's stage copies, the virtual bytes at the
        merge rate (model/sim.py, ``stage_copy_s``)."""
        self._wait(self.merge_seconds(nbytes * self.scale.bytes), False)

    def stage_copied(self, nbytes: float, a: int, home: bool) -> None:
        """A head all-to-all of ``a`` ranks copied tensors of ``nbytes`` (wire bytes, once):
        as the model prices the stage (model/sim.py, ``stage_copy_s``), the passes its
        profile's all-to-all makes (``copy_passes(a, cluster.head_copies)``: ours, or TE's on
        a ``te-*`` contender's device), before the plan or on the way ``home``."""
        passes = copy_passes(a, self.cluster.head_copies)[1 if home else 0]
        self.copied(passes * nbytes)

    def merged(self, wire_bytes: float) -> None:
        """The executor merged a received partial of ``wire_bytes``: its device time (the
        model's ``Merge`` op: the virtual bytes at the merge rate, plus the per-op overhead),
        slowed while a transfer is in flight as the model slows every compute op (not before
        2026-12-06)."""
        virtual = wire_bytes * self.scale.bytes
        self._run(self.merge_seconds(virtual) + self.cluster.op_overhead_us * 1e-6, False)
