"""The benchmark on an emulated GPU cluster: every rank's device is a timed device, its links
the real ones slowed down (docs/emulator.md).

* :class:`DeviceSetup` - what a run emulates: the device profile (a model cluster: compute
  terms for the device, link rates for the links), the dilation ``D``, the wire scale ``F``;
  the emulated links run at the profile's rates / (``F`` x ``D``), so a message takes ``D``
  times its real (full-size) time;
* :func:`choose_scale` - the wire scale of a run: the batch and the rows per rank divided by
  whole factors, one pair for every point of the run (the links are shaped once per run);
* :class:`CoreMeter` - the busiest core's utilisation while calls are timed (``/proc/stat``);
  above :data:`CPU_LIMITED` the run does not measure the device but this machine's cores;
* :func:`setup_for` - the :class:`DeviceSetup` of a bench run's options and points.

The checks of an emulated run (the textbook ring among them) are in
:mod:`charm_megatron.lab.bench.emulator_checks`.

No torch here: the ranks build their :class:`~charm_megatron.lab.emulate.device.TimedBackend`
from a :class:`DeviceSetup`.
"""

from __future__ import annotations

import math
import os
from collections.abc import Sequence
from dataclasses import dataclass

from charm_megatron.devices import get_profile
from charm_megatron.model.cluster import Cluster
from charm_megatron.model.links import Links

#: The busiest core's utilisation above which a run is marked CPU-limited (issue 23).
CPU_LIMITED = 0.70
#: The dilation floor: below it the emulator's own per-message cost (about 1 ms of wall time
#: per message on these machines) would exceed ~20 us of device time.
MIN_DILATION = 50.0
#: ``--dilation auto`` stretches the shortest dependent unit of a run's contenders (the
#: model's, on the device; :func:`auto_dilation`) to at least this many wall seconds: each
#: step of a CP call waits on every rank, and a step with 16-32 processes on 2 cores costs
#: ~10-20 ms of scheduling (docs/emulator.md), so a step of 0.5 s keeps that within a few
#: per cent.
STEP_WALL_S = 0.5
MAX_DILATION = 5000.0
#: On the virtual clock with the links in start order (``device_clock="virtual"``) a late host
#: no longer reaches the measured time, so the dilation only has to keep the hosts within the
#: links' lag bound: a tenth of the step, within [:data:`VIRTUAL_MIN_DILATION`, ...]. Measured
#: 2026-12-06 (docs/emulator.md, *Time dilation on the virtual clock*): 2x8 Llama-8B-like 32k
#: gave the same device times to six digits at D = 1500, 150, 15 and 3 (373 s of wall at 1500,
#: 50 s at 150), and 4x8 with one NIC per node at 32k the same at D = 50 and 5.
VIRTUAL_STEP_WALL_S = 0.05
VIRTUAL_MIN_DILATION = 10.0
#: How a rank's timed device keeps time (``--device-clock``, docs/emulator.md): ``virtual``
#: (ops and posts on the rank's virtual clock, calls timed on it; issue 41), ``async`` (ops
#: queued on the wall clock, a747235), ``sync`` (every op slept at its call, before issue 41).
#: ``virtual-post-order``: the virtual clock with the software links booking each message when
#: its second side posts, in wall-clock order (as before 2026-12-06's start order), for an A/B
#: of the links' order (docs/emulator.md, *The links' order*).
DEVICE_CLOCKS = ("virtual", "virtual-post-order", "async", "sync")
#: Default size of a q block on the wire: large enough that per-message costs stay small next to
#: the bytes, small enough that 32 ranks' messages fit 2 cores' copy rate.
DEFAULT_WIRE_BYTES = 256 * 1024


@dataclass(frozen=True)
class DeviceSetup:
    """One emulated GPU cluster: ``profile`` (a device name or a profile file) gives the
    device and, unless overridden, the links; ``dilation`` stretches device time;
    ``batch_scale`` / ``rows_scale`` shrink the problem on the wire."""

    profile: str
    dilation: float = MIN_DILATION
    batch_scale: int = 1
    rows_scale: int = 1
    cross_Bps: float | None = None  # real (device-time) rates; None: the profile's
    intra_Bps: float | None = None
    sm_contention: bool = True
    hw_groups: tuple[tuple[int, ...], ...] = ()  # the emulated nodes (CP-local ranks)
    nic: str | None = None  # "rank" / "node": the cross links' sharing; None: the profile's
    # How the emulated links serve concurrent transfers: "fifo" on the software link model
    # (it books each transfer when posted); None: the profile's (tc's queues share fairly).
    link_order: str | None = None
    # How the timed device keeps time (DEVICE_CLOCKS): the virtual clock by default; "async"
    # and "sync" reproduce runs before it, where the host's lateness (sync: all its CPU work)
    # adds to the measured device time.
    device_clock: str = "virtual"

    def __post_init__(self) -> None:
        if not self.dilation > 0:
            raise ValueError(f"--dilation must be > 0, got {self.dilation!r}")
        if self.device_clock not in DEVICE_CLOCKS:
            raise ValueError(f"--device-clock must be one of {', '.join(DEVICE_CLOCKS)}, got "
                             f"{self.device_clock!r}")
        if self.cluster.cores is not None:
            raise ValueError(f"--device-model {self.profile}: a CPU profile (shared cores) "
                             "is not a device; choose a GPU profile (h100, h20, l20-pcie) or "
                             "a file written by scripts/gpu_check.py")

    @property
    def cluster(self) -> Cluster:
        return get_profile(self.profile).cluster

    @property
    def on_virtual_clock(self) -> bool:
        """Ops, posts and calls on each rank's virtual clock (``virtual``,
        ``virtual-post-order``)."""
        return self.device_clock.startswith("virtual")

    @property
    def links_in_start_order(self) -> bool:
        """The software links serve messages in virtual start order (``virtual``)."""
        return self.device_clock == "virtual"

    @property
    def synchronous(self) -> bool:
        """Every op sleeps at its call (the device of before issue 41)."""
        return self.device_clock == "sync"

    def virtual_time(self):
        """A new virtual clock for one rank (``None`` unless on one, :attr:`on_virtual_clock`):
        the rank's timed devices (:meth:`backend`) and its software links share it."""
        from charm_megatron.lab.emulate.virtual_time import VirtualTime

        return VirtualTime() if self.on_virtual_clock else None

    @property
    def bytes_scale(self) -> int:
        return self.batch_scale * self.rows_scale

    @property
    def device_cross_Bps(self) -> float:
        return self.cross_Bps if self.cross_Bps is not None else self.cluster.cross_gbps * 1e9

    @property
    def device_intra_Bps(self) -> float:
        if self.intra_Bps is not None:
            return self.intra_Bps
        return self.cluster.intra_gbps * 1e9

    def te_cluster(self) -> Cluster:
        """The device profile's cluster on TransformerEngine's kernel curve (the ``te-*``
        contenders' device; the profile's own where it has no such curve)."""
        from charm_megatron.model.te_contenders import te_cluster

        return te_cluster(get_profile(self.profile))

    @property
    def model_cluster(self) -> Cluster:
        """The device profile with this run's real link rates: what the emulated cluster is
        (the model's prediction of a run, and what its calls' ``auto`` settings time with)."""
        return self.with_links(self.cluster)

    def with_links(self, cluster: Cluster) -> Cluster:
        """``cluster`` (the device, or the device on another kernel) with this run's links."""
        return cluster.with_(cross_gbps=self.device_cross_Bps / 1e9,
                                  intra_gbps=self.device_intra_Bps / 1e9,
                                  nic=self.nic or self.cluster.nic,
                                  link_order=self.link_order)

    def links(self) -> Links:
        """This run's links in device time: the model's own description of
        :attr:`model_cluster` (per-message rate, port aggregate, latency, order, per kind;
        :class:`~charm_megatron.model.links.Links`), which the model predicts the run with."""
        return Links.of(self.model_cluster)

    def wire_links(self) -> Links:
        """:meth:`links` on the wire: what the emulated (software) links are built from
        (``SoftwareLinks.from_links``): rates ``F`` x ``D`` lower, latency ``D`` x longer."""
        return self.links().on_wire(self.bytes_scale, self.dilation)

    def wire_rate(self, device_Bps: float) -> float:
        """The emulated link's rate (bytes/s of wire data) for a real link of ``device_Bps``:
        ``F`` times fewer bytes, ``D`` times slower."""
        return device_Bps / (self.bytes_scale * self.dilation)

    @property
    def wire_latency_s(self) -> float:
        """The emulated links' per-message latency in wall seconds: the profile's
        ``latency_us`` (the model's, which the software links add to every message), ``D``
        times longer like all device time; the wire scale does not touch it."""
        return self.wire_links().intra.latency_s

    def backend(self, rank: int, *, te_kernel: bool = False, virtual=None):
        """CP-local rank ``rank``'s timed device (imports torch); the hardware groups say
        which of its messages cross, so for how long their bytes move (a message alone on its
        ports: :meth:`links`' per-message rate and latency). ``te_kernel``: the device on
        TransformerEngine's kernel curve (:meth:`te_cluster`), for the ``te-*`` contenders.
        ``virtual``: the rank's virtual clock with ``device_clock="virtual"`` (one per rank
        for all its devices and links; ``None``: a new one, :meth:`virtual_time`, which the
        rank's software links must then follow, ``LinkTransport.follow(device.virtual)``)."""
        if virtual is not None and not self.on_virtual_clock:
            raise ValueError(f"device_clock {self.device_clock!r}: no virtual clock wanted")
        if virtual is None:
            virtual = self.virtual_time()
        from charm_megatron.lab.emulate.device import LinkClock, TimedBackend, WireScale

        spec = self.links()
        links = LinkClock(rank, self.hw_groups, spec.intra.one_message_Bps,
                          spec.cross.one_message_Bps, spec.intra.latency_s)
        return TimedBackend(self.te_cluster() if te_kernel else self.cluster,
                            dilation=self.dilation,
                            scale=WireScale(self.batch_scale, self.rows_scale),
                            sm_contention=self.sm_contention, links=links,
                            synchronous=self.synchronous, virtual=virtual)

    def describe(self) -> str:
        return (f"device {self.profile} ({self.model_cluster.describe()}); "
                f"device clock {self.device_clock}; "
                f"dilation x{self.dilation:g}; "
                f"wire scale: batch / {self.batch_scale}, rows / {self.rows_scale} "
                f"(messages {self.bytes_scale}x smaller than real)")


def auto_dilation(cluster: Cluster, points: Sequence, groups: Sequence[Sequence[int]],
                  causal: bool, elem: int, algos: Sequence[str] = ("ring",),
                  te: Cluster | None = None, *, step_wall_s: float = STEP_WALL_S,
                  floor: float = MIN_DILATION) -> float:
    """The dilation of ``--dilation auto``: the shortest dependent unit of any contender of the
    run (``algos``, registered algorithms; those whose entry refuses a point are skipped there)
    at any point, stretched to ``step_wall_s`` (:data:`STEP_WALL_S`), within [``floor``,
    :data:`MAX_DILATION`], rounded to two significant digits.

    A contender's dependent unit at a point is the model's time of one direction on the device
    (forward, then backward) over the number of dependent units of that direction's plan: its
    critical path (:func:`~charm_megatron.plan.validate.validate`'s longest chain of
    data-dependent messages) plus one, the work before the first message of the chain. Ring's
    forward has ``n - 1`` such messages, so its unit is its forward time over ``n``, its step,
    as the dilation was sized before it looked at the other contenders; a contender with fewer,
    longer-reaching messages (CHARM+'s two-level schedule) has shorter units when its time is
    shorter, and every unit pays the emulator's fixed cost per dependent step (issue 41). No
    contender with a unit (``algos`` empty or all refused): ring's. ``te``: the device on
    TransformerEngine's kernel, which the ``te-*`` of ``algos`` run their plans on."""
    from charm_megatron.model import predict
    from charm_megatron.model.predict import call_traits, role_shape
    from charm_megatron.model.te_contenders import TE_NAMES, te_problem
    from charm_megatron.model.te_contenders import get as te_get
    from charm_megatron.plan import registry
    from charm_megatron.plan.cost import Problem
    from charm_megatron.plan.validate import validate

    g = tuple(tuple(int(r) for r in grp) for grp in groups)
    n = sum(len(grp) for grp in g)
    # (label, our plan, the cluster it runs on): a te-* contender is its plan on TE's kernel.
    contenders = [(a, a, cluster) for a in dict.fromkeys(algos) if a in registry.ALGORITHM_NAMES]
    if te is not None:
        contenders += [(a, te_get(a).algo, te) for a in dict.fromkeys(algos) if a in TE_NAMES]
    contenders = contenders or [("ring", "ring", cluster)]
    depth: dict[int, tuple[object, int]] = {}  # id(plan) -> (plan, units): plans are shared

    def units(plan) -> int:
        if id(plan) not in depth:
            depth[id(plan)] = (plan, validate(plan).critical_path + 1)
        return depth[id(plan)][1]

    unit = math.inf
    for p in points:
        base = Problem(p.batch, p.seq, p.heads, p.kv_heads, p.head_dim, elem)
        for label, algo, cl in contenders:
            problem = te_problem(label, base) if label in TE_NAMES else base
            if registry.refusal(algo, call_traits(g, problem)) is not None:
                continue
            pred = predict(algo, g, problem, cl, causal)
            fwd, bwd = registry.plans(algo, g, causal, shape=role_shape(problem),
                                      tiles=problem.tiles(n, causal))
            unit = min(unit, pred.forward.time_s / units(fwd),
                       pred.backward.time_s / units(bwd))
    if not math.isfinite(unit):  # every contender refused every point
        return auto_dilation(cluster, points, groups, causal, elem, step_wall_s=step_wall_s,
                             floor=floor) \
            if [c[0] for c in contenders] != ["ring"] else floor
    d = min(MAX_DILATION, max(floor, step_wall_s / unit)) if unit > 0 else floor
    digits = 10 ** (len(str(int(d))) - 2)
    return float(round(d / digits) * digits)


def choose_scale(points: Sequence, world: int, elem: int,
                 target_bytes: int = DEFAULT_WIRE_BYTES,
                 divides: Sequence[int] = ()) -> tuple[int, int]:
    """``(batch factor, rows factor)`` for every point of a run: the batch divided by the
    batches' greatest common divisor (the wire batch is then whole at every point), the rows
    per rank by the largest common divisor that leaves every point an even number of wire rows
    (the causal halves) and the largest point's q block not below ``target_bytes``; the rows
    factor also divides every length in ``divides`` (a sliding window's sides, which the wire
    copy shrinks alike)."""
    batch = 0
    rows = 0
    for p in points:
        batch = math.gcd(batch, p.batch)
        rows = math.gcd(rows, p.seq // world)
    batch = max(1, batch)
    biggest = max(points, key=lambda p: (p.batch // batch) * (p.seq // world) * p.heads)

    def ok(f: int) -> bool:
        return all(((p.seq // world) // f) % 2 == 0 for p in points) and \
            all(w % f == 0 for w in divides)

    def q_bytes(f: int) -> int:
        return (biggest.batch // batch) * ((biggest.seq // world) // f) * biggest.heads \
            * biggest.head_dim * elem

    best = 1
    for f in range(1, rows + 1):
        if rows % f == 0 and ok(f) and q_bytes(f) >= target_bytes:
            best = f
    return batch, best


def setup_for(profile: str, grid: tuple[int, int], points: Sequence, causal: bool, elem: int,
              *, wire_scale: tuple[int, int] | None = None,
              wire_bytes: int = DEFAULT_WIRE_BYTES, dilation: float | None = None,
              cross_Bps: float | None = None, intra_Bps: float | None = None,
              sm_contention: bool = True, nic: str | None = None,
              divides: Sequence[int] = (), link_order: str | None = None,
              algos: Sequence[str] = ("ring",),
              device_clock: str = "virtual") -> DeviceSetup:
    """The emulated cluster of a bench run on a ``grid`` of (nodes, GPUs per node): the wire
    scale given (checked against every point) or chosen (:func:`choose_scale`), the dilation
    given or ``auto`` (``None``: :func:`auto_dilation` on the run's real links, sized on the
    shortest dependent unit of the run's contenders ``algos``); ``device_clock``: how the
    timed device keeps time (:data:`DEVICE_CLOCKS`)."""
    world = grid[0] * grid[1]
    batch, rows = wire_scale or choose_scale(points, world, elem, wire_bytes, divides)
    for p in points:
        if p.batch % batch or (p.seq // world) % rows or ((p.seq // world) // rows) % 2:
            raise ValueError(f"--wire-scale {batch}x{rows}: point {p.label} has batch {p.batch} "
                             f"and {p.seq // world} rows per rank; both must divide, leaving an "
                             "even number of wire rows")
    groups = tuple(tuple(range(i * grid[1], (i + 1) * grid[1])) for i in range(grid[0]))
    if dilation is None:
        links = DeviceSetup(profile, cross_Bps=cross_Bps, intra_Bps=intra_Bps, nic=nic,
                            link_order=link_order)
        virtual = device_clock == "virtual"
        dilation = auto_dilation(
            links.model_cluster, points, groups, causal, elem, algos,
            links.with_links(links.te_cluster()),
            step_wall_s=VIRTUAL_STEP_WALL_S if virtual else STEP_WALL_S,
            floor=VIRTUAL_MIN_DILATION if virtual else MIN_DILATION)
    return DeviceSetup(profile, dilation, batch, rows, cross_Bps, intra_Bps, sm_contention,
                       groups, nic, link_order, device_clock)


class CoreMeter:
    """The busiest core's utilisation over the spans between :meth:`start` and :meth:`stop`
    (``/proc/stat``: every process on the machine, this benchmark's and anything else's)."""

    def __init__(self, path: str = "/proc/stat") -> None:
        self.path = path
        self.busy: dict[str, float] = {}
        self.total: dict[str, float] = {}
        self._t0: dict[str, tuple[float, float]] | None = None

    def _read(self) -> dict[str, tuple[float, float]]:
        out: dict[str, tuple[float, float]] = {}
        try:
            with open(self.path) as f:
                for line in f:
                    parts = line.split()
                    if parts and parts[0].startswith("cpu") and parts[0] != "cpu":
                        v = [float(x) for x in parts[1:]]
                        idle = v[3] + (v[4] if len(v) > 4 else 0.0)  # idle + iowait
                        out[parts[0]] = (sum(v) - idle, sum(v))
        except OSError:
            pass
        return out

    def start(self) -> None:
        self._t0 = self._read()

    def stop(self) -> None:
        if self._t0 is None:
            return
        now = self._read()
        for cpu, (b1, t1) in now.items():
            b0, t0 = self._t0.get(cpu, (b1, t1))
            self.busy[cpu] = self.busy.get(cpu, 0.0) + (b1 - b0)
            self.total[cpu] = self.total.get(cpu, 0.0) + (t1 - t0)
        self._t0 = None

    def busiest(self) -> float | None:
        """The largest busy fraction of one core (``None``: nothing measured)."""
        fr = [self.busy[c] / t for c, t in self.total.items() if t > 0]
        return max(fr) if fr else None


def proc_stat_available() -> bool:
    return os.path.exists("/proc/stat")
