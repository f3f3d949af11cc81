"""An emulated multi-node cluster on one Linux machine: network namespaces, veths, tc shapers.

Layout (addresses come from 10.213.0.0/24 and exist only inside namespaces created here, so two
clusters alive at once may reuse them without conflict):

``nic="node"`` - all ranks of a node share one cross-node link::

    node namespace N_g (ranks g*M .. g*M+M-1 run here; own host name via a UTS namespace)
      lo                  intra-node traffic (optional tbf = intra_rate)
      eth0 10.213.0.(g+1) --veth--> p<g> in the bridge namespace (br0)
                          tbf on eth0 = node egress, tbf on p<g> = node ingress

``nic="rank"`` - every rank has its own cross-node link (one NIC per GPU)::

    rank namespace R_r (one rank each; the node's host name)
      eth0 10.213.0.(r+1) --veth--> p<r> in the bridge namespace (br0): cross-node link
      loc0                --veth--> l<l> in node namespace N_g (br0): intra-node switch
      routes: the addresses of the node's other ranks via loc0 (/32), everything else via eth0
      tbf on eth0 / p<r> = cross rate each way, on loc0 / l<l> = intra rate each way

``nic="rank", link_model="htb"`` - one NIC per rank that carries intra- and cross-node traffic::

    rank namespace R_r
      eth0 10.213.0.(r+1) --veth--> p<r> in the bridge namespace (br0): every peer, same device
      htb on eth0: class 1:10 (intra rate) for destinations on the rank's node, 1:20 (cross
      rate) for the rest (charm_megatron.lab.emulate.htb); egress only unless ``ingress=True``,
      which adds the same classes by *source* on p<r>

Ranks join with ``GLOO_SOCKET_IFNAME=eth0`` in both models, so gloo advertises the ``eth0``
address and the kernel's routing decides which link carries each connection.
"""

from __future__ import annotations

import atexit
import itertools
import os
import signal
import socket
import sys
import threading
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Literal

from charm_megatron.lab.emulate.htb import CROSS_CLASS, INTRA_CLASS, htb_commands, parse_class_bytes
from charm_megatron.lab.emulate.link_probe import transfer
from charm_megatron.lab.emulate.netns import (
    CLONE_NEWNET,
    CLONE_NEWUTS,
    PREFIX,
    available,
    cleanup_stale,
    list_netns,
    netns_path,
    run_ip,
    setns,
    unshare,
)
from charm_megatron.lab.emulate.rates import format_rate, parse_rate, parse_size

__all__ = ["LINK_MODELS", "NIC_MODELS", "EmulatedCluster", "RankPlace", "RateReport", "enter"]

NicModel = Literal["node", "rank"]
#: The NIC models, for option choices and checks.
NIC_MODELS: tuple[str, ...] = ("node", "rank")
LinkModelName = Literal["tbf", "htb"]
LINK_MODELS = ("tbf", "htb")
_SUBNET = "10.213.0"
_INTRA_MTU = 65535  # like lo: the intra-node path should not pay per-packet costs lo avoids
_COUNTER = itertools.count()


@dataclass(frozen=True)
class RankPlace:
    """Where one rank lives in an :class:`EmulatedCluster` (picklable; pass it to children)."""

    rank: int
    group: int
    local: int
    netns: str
    netns_path: str
    ifname: str
    address: str
    hostname: str | None

    def env(self) -> dict[str, str]:
        """Environment for the rank's process (gloo must bind the emulated interface)."""
        return {"GLOO_SOCKET_IFNAME": self.ifname}


def enter(place: RankPlace) -> None:
    """Move the calling process into ``place``: its network namespace, and a fresh UTS namespace
    with the node's host name. Call it first thing in a fresh child, before torch.distributed
    (or anything else) opens sockets or starts threads: namespaces are per thread."""
    setns(place.netns_path, CLONE_NEWNET)
    if place.hostname:
        unshare(CLONE_NEWUTS)
        socket.sethostname(place.hostname)
    os.environ.update(place.env())


@dataclass(frozen=True)
class RateReport:
    """Rates measured by :meth:`EmulatedCluster.measure_rates` (bytes per second)."""

    intra: float | None
    cross: float | None
    cross_concurrent: float | None
    configured_intra: float | None
    configured_cross: float
    nic: str
    ranks_per_group: int
    link_model: str = "tbf"

    def __str__(self) -> str:
        def show(v: float | None) -> str:
            return "n/a" if v is None else format_rate(v)

        lines = [
            f"cross-node, one pair:   {show(self.cross)}  (configured {format_rate(self.configured_cross)}"
            f" per {'node' if self.nic == 'node' else 'rank'} link, {self.link_model})",
            f"intra-node, one pair:   {show(self.intra)}  (configured "
            f"{'unlimited' if self.configured_intra is None else format_rate(self.configured_intra)})",
        ]
        if self.cross_concurrent is not None:
            lines.append(
                f"cross-node, {self.ranks_per_group} pairs at once: {show(self.cross_concurrent)} in total"
            )
        return "\n".join(lines)


class EmulatedCluster:
    """``groups`` emulated nodes of ``ranks_per_group`` ranks joined by links of ``cross_rate``.

    A context manager: ``__enter__`` builds the namespaces, ``__exit__`` (and atexit, SIGTERM and
    SIGHUP in the creating process) removes them. Needs root and iproute2: check
    :func:`available` first and fall back to :class:`LinkModel` when it says no.

    ``cross_rate`` / ``intra_rate``: tc rates (``"1gbit"``, ``"200mbit"``, ``"1.5GB/s"``) or bytes
    per second; ``intra_rate=None`` leaves intra-node traffic unshaped. ``nic``: ``"node"`` (the
    ranks of a node share one link) or ``"rank"`` (one link per rank). ``hostnames``: ``True`` for
    ``node0``, ``node1``, ...; a list of names; or ``False`` to keep the machine's host name.

    ``link_model``: ``"tbf"`` (separate shaped veths for cross- and intra-node traffic, see the
    module doc) or ``"htb"`` (``nic="rank"`` only: one veth per rank whose ``htb`` classes pick
    the rate by the peer's node). ``ingress``: also shape traffic *into* each rank (``None``: the
    model's default, ``True`` for tbf as always, ``False`` for htb, egress-only like a NIC whose
    peer's egress already paces what it receives). ``cross_burst`` / ``intra_burst``: the
    shapers' buckets (default ``max(512 KiB, rate/250)`` / ``max(4 MiB, rate/250)``).
    ``mtu``: of every ``eth0`` veth and its bridge end (default: the kernel's 1500, an Ethernet
    NIC's; the tbf model's separate intra-node veths always have 65535, like ``lo``).
    """

    def __init__(
        self,
        groups: int = 2,
        ranks_per_group: int = 4,
        cross_rate: str | float = "1gbit",
        intra_rate: str | float | None = None,
        nic: NicModel = "node",
        hostnames: bool | Sequence[str] = True,
        *,
        cross_burst: str | int | None = None,
        intra_burst: str | int | None = None,
        link_model: LinkModelName = "tbf",
        ingress: bool | None = None,
        mtu: int | None = None,
        queue_s: float = 0.1,
    ) -> None:
        if groups < 1 or ranks_per_group < 1:
            raise ValueError(f"need groups >= 1 and ranks_per_group >= 1, got {groups}, {ranks_per_group}")
        # tbf's queue: packets wait at most this long before they are dropped (its "latency").
        self.queue_s = float(queue_s)
        if groups * ranks_per_group > 250:
            raise ValueError("at most 250 ranks (one /24 of addresses)")
        if nic not in NIC_MODELS:
            raise ValueError(f"nic must be 'node' or 'rank', got {nic!r}")
        if link_model not in LINK_MODELS:
            raise ValueError(f"link_model must be one of {', '.join(LINK_MODELS)}, got {link_model!r}")
        if link_model == "htb" and nic != "rank":
            raise ValueError("link_model='htb' models one NIC per rank (intra- and cross-node "
                             f"traffic on one device): use nic='rank' with it, not nic={nic!r}")
        if mtu is not None and not 576 <= int(mtu) <= _INTRA_MTU:
            raise ValueError(f"mtu must be between 576 and {_INTRA_MTU}, got {mtu}")
        self.link_model: str = link_model
        self.mtu: int | None = None if mtu is None else int(mtu)
        self.ingress: bool = (link_model == "tbf") if ingress is None else bool(ingress)
        self.groups = groups
        self.ranks_per_group = ranks_per_group
        self.nic: str = nic
        self.cross_rate = parse_rate(cross_rate)
        self.intra_rate = None if intra_rate is None else parse_rate(intra_rate)
        # tbf needs burst >= rate/HZ to reach its rate; 512 KiB is what CPU-TESTBED measured at
        # 1 Gbit (94-98 % of the rate); intra-node needs >= 4 MiB to stay steady.
        self.cross_burst = parse_size(cross_burst) if cross_burst is not None else max(
            512 * 1024, int(self.cross_rate / 250))
        self.intra_burst = parse_size(intra_burst) if intra_burst is not None else max(
            4 * 1024 * 1024, int((self.intra_rate or 0) / 250))
        if link_model == "tbf":
            self._check_tbf_bursts()
        if hostnames is True:
            self.hostnames: list[str] | None = [f"node{g}" for g in range(groups)]
        elif hostnames is False or hostnames is None:
            self.hostnames = None
        else:
            self.hostnames = [str(h) for h in hostnames]
            if len(self.hostnames) != groups:
                raise ValueError(f"hostnames needs {groups} names, got {len(self.hostnames)}")
        self._owner = os.getpid()
        self.name = f"{PREFIX}{self._owner}-{next(_COUNTER)}"
        self._created: list[str] = []
        self._lock = threading.Lock()
        self.places: tuple[RankPlace, ...] = tuple(self._plan_places())

    def _check_tbf_bursts(self) -> None:
        """tbf drops every packet longer than its bucket (htb lets one through and owes the
        tokens), so a bucket below the path's MTU stalls the connection until TCP times out."""
        eth = (self.mtu or 1500) + 14  # the qdisc counts the Ethernet header
        intra = (65536 if self.nic == "node" else _INTRA_MTU) + 14  # lo / loc0
        if self.cross_burst < eth:
            raise ValueError(f"cross_burst {self.cross_burst} B is below eth0's packet size "
                             f"{eth} B: tbf would drop every full packet; use at least {eth}")
        if self.intra_rate is not None and self.intra_burst < intra:
            raise ValueError(f"intra_burst {self.intra_burst} B is below the intra-node path's "
                             f"packet size {intra} B (MTU of lo / loc0): tbf would drop every "
                             f"full packet; use at least {intra} (or link_model='htb')")

    # ----------------------------------------------------------------- layout
    @property
    def world_size(self) -> int:
        return self.groups * self.ranks_per_group

    @property
    def bridge_ns(self) -> str:
        return f"{self.name}-br"

    def node_ns(self, g: int) -> str:
        return f"{self.name}-n{g}"

    def _rank_ns(self, r: int) -> str:
        return f"{self.name}-r{r}"

    def _plan_places(self) -> list[RankPlace]:
        out = []
        for r in range(self.world_size):
            g, li = divmod(r, self.ranks_per_group)
            ns = self.node_ns(g) if self.nic == "node" else self._rank_ns(r)
            addr = f"{_SUBNET}.{(g if self.nic == 'node' else r) + 1}"
            out.append(RankPlace(r, g, li, ns, netns_path(ns), "eth0", addr,
                                 self.hostnames[g] if self.hostnames else None))
        return out

    def place(self, rank: int) -> RankPlace:
        return self.places[rank]

    @property
    def master_addr(self) -> str:
        """Address of rank 0, reachable from every rank (for env:// / TCPStore rendezvous)."""
        return self.places[0].address

    def env(self, rank: int) -> dict[str, str]:
        """Environment for ``rank``'s process."""
        return self.places[rank].env()

    def enter(self, rank: int) -> None:
        """Move the calling process into ``rank``'s place (see :func:`enter`)."""
        enter(self.places[rank])

    def command(self, rank: int, argv: Sequence[str]) -> list[str]:
        """``argv`` wrapped to run as ``rank`` in a subprocess (namespace + host name + env)."""
        p = self.places[rank]
        cmd = [sys.executable, "-m", "charm_megatron.lab.emulate", "exec", "--netns", p.netns]
        if p.hostname:
            cmd += ["--hostname", p.hostname]
        cmd += ["--env", f"GLOO_SOCKET_IFNAME={p.ifname}", "--", *argv]
        return cmd

    def describe(self) -> str:
        lines = [f"emulated cluster {self.name}: {self.groups} nodes x {self.ranks_per_group} ranks, "
                 f"nic={self.nic}, {self.link_model} ("
                 f"{'egress and ingress' if self.ingress else 'egress only'}), "
                 f"cross {format_rate(self.cross_rate)} burst {self.cross_burst // 1024} KiB, intra "
                 f"{'unlimited' if self.intra_rate is None else format_rate(self.intra_rate)}"
                 + (f" burst {self.intra_burst // 1024} KiB" if self.intra_rate else "")
                 + f", eth0 mtu {self.mtu or 1500}"]
        for p in self.places:
            lines.append(f"  rank {p.rank}: node {p.group} ({p.hostname or 'host name unchanged'}) "
                         f"netns {p.netns} {p.ifname} {p.address}")
        return "\n".join(lines)

    # ----------------------------------------------------------------- life cycle
    def __enter__(self) -> EmulatedCluster:
        self.start()
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()

    def start(self) -> None:
        """Create the namespaces, links and qdiscs. Raises RuntimeError if not :func:`available`."""
        ok, why = available()
        if not ok:
            raise RuntimeError(f"cannot emulate a cluster here: {why}")
        cleanup_stale()
        _register(self)
        try:
            self._build()
        except BaseException:
            self.close()
            raise

    def close(self) -> None:
        """Delete every namespace of this cluster (idempotent; only in the creating process).

        Processes still inside a namespace keep it alive after this: stop the ranks first.
        """
        if os.getpid() != self._owner:
            return  # a forked child must not tear down its parent's cluster
        with self._lock:
            names, self._created = self._created, []
        if names:
            run_ip(["-force", "-batch", "-"], check=False,
                   input_text="".join(f"netns del {n}\n" for n in reversed(names)))
            left = set(names) & set(list_netns())
            for n in left:  # one retry each; -force batch mode may stop at a busy mount
                run_ip(["netns", "del", n], check=False)
        _unregister(self)

    def _add_netns(self, names: list[str]) -> None:
        with self._lock:
            self._created.extend(names)  # recorded first: a failure half-way still cleans up
        run_ip(["-batch", "-"], input_text="".join(f"netns add {n}\n" for n in names))

    def _build(self) -> None:
        G, M = self.groups, self.ranks_per_group
        br = self.bridge_ns
        nodes = [self.node_ns(g) for g in range(G)]
        ranks = [self._rank_ns(r) for r in range(G * M)] if self.nic == "rank" else []
        if self.link_model == "htb":
            nodes = []  # no node switch: same-node traffic also goes through the bridge
        self._add_netns([br, *nodes, *ranks])
        cross = self._tbf(self.cross_rate, self.cross_burst)
        intra = self._tbf(self.intra_rate, self.intra_burst) if self.intra_rate else None
        ip: dict[str, list[str]] = {n: [] for n in (br, *nodes, *ranks)}
        tc: dict[str, list[str]] = {n: [] for n in (br, *nodes, *ranks)}
        ip[br] += ["link set lo up", "link add br0 type bridge", "link set br0 up"]
        if self.link_model == "htb":
            self._htb_commands(ip, tc)
        elif self.nic == "node":
            for g, ns in enumerate(nodes):
                ip[br] += [f"link add p{g}{self._mtu_arg()} type veth peer name eth0"
                           f"{self._mtu_arg()} netns {ns}",
                           f"link set p{g} master br0", f"link set p{g} up"]
                ip[ns] += ["link set lo up", f"addr add {_SUBNET}.{g + 1}/24 dev eth0",
                           "link set eth0 up"]
                tc[ns].append(f"qdisc add dev eth0 root {cross}")
                if self.ingress:
                    tc[br].append(f"qdisc add dev p{g} root {cross}")
                if intra:
                    tc[ns].append(f"qdisc add dev lo root {intra}")
        else:
            for ns in nodes:
                ip[ns] += ["link set lo up", "link add br0 type bridge",
                           f"link set br0 mtu {_INTRA_MTU}", "link set br0 up"]
            for r, rns in enumerate(ranks):
                g, li = divmod(r, M)
                ns = nodes[g]
                ip[br] += [f"link add p{r}{self._mtu_arg()} type veth peer name eth0"
                           f"{self._mtu_arg()} netns {rns}",
                           f"link set p{r} master br0", f"link set p{r} up"]
                ip[ns] += [f"link add l{li} mtu {_INTRA_MTU} type veth peer name loc0 mtu {_INTRA_MTU} netns {rns}",
                           f"link set l{li} master br0", f"link set l{li} up"]
                ip[rns] += ["link set lo up", f"addr add {_SUBNET}.{r + 1}/24 dev eth0",
                            "link set eth0 up", "link set loc0 up"]
                # Same-node peers via the node switch; the /32s beat eth0's /24 route.
                ip[rns] += [f"route add {_SUBNET}.{g * M + k + 1}/32 dev loc0"
                            for k in range(M) if k != li]
                tc[rns].append(f"qdisc add dev eth0 root {cross}")
                if self.ingress:
                    tc[br].append(f"qdisc add dev p{r} root {cross}")
                if intra:
                    tc[rns].append(f"qdisc add dev loc0 root {intra}")
                    if self.ingress:
                        tc[ns].append(f"qdisc add dev l{li} root {intra}")
        # Order matters: veths are created from the bridge / node side before the peers'
        # namespaces configure them.
        for ns in (br, *nodes, *ranks):
            if ip[ns]:
                run_ip(["-n", ns, "-batch", "-"], input_text="\n".join(ip[ns]) + "\n")
        for ns in (br, *nodes, *ranks):
            if tc[ns]:
                run_ip(["-n", ns, "-batch", "-"], tool="tc", input_text="\n".join(tc[ns]) + "\n")

    def _mtu_arg(self) -> str:
        return f" mtu {self.mtu}" if self.mtu else ""

    def _htb_commands(self, ip: dict[str, list[str]], tc: dict[str, list[str]]) -> None:
        """The htb layout: one veth per rank into the bridge, classes by the peer's node."""
        M, br = self.ranks_per_group, self.bridge_ns
        shape = {"cross_rate": self.cross_rate, "cross_burst": self.cross_burst,
                 "intra_rate": self.intra_rate, "intra_burst": self.intra_burst}
        for r in range(self.world_size):
            rns, g = self._rank_ns(r), r // M
            peers = [f"{_SUBNET}.{g * M + k + 1}" for k in range(M) if g * M + k != r]
            ip[br] += [f"link add p{r}{self._mtu_arg()} type veth peer name eth0"
                       f"{self._mtu_arg()} netns {rns}",
                       f"link set p{r} master br0", f"link set p{r} up"]
            ip[rns] += ["link set lo up", f"addr add {_SUBNET}.{r + 1}/24 dev eth0",
                        "link set eth0 up"]
            tc[rns] += htb_commands("eth0", peers, match="dst", **shape)
            if self.ingress:
                tc[br] += htb_commands(f"p{r}", peers, match="src", **shape)

    def link_bytes(self, rank: int) -> dict[str, int | None]:
        """Bytes ``rank`` has sent so far through its ``"intra"`` and ``"cross"`` shapers (the
        htb classes, or the tbf qdiscs on loc0 / eth0; ``None``: that path is not shaped). With
        ``nic="node"`` the cross figure is the whole node's."""
        if not self._created:
            raise RuntimeError("the cluster is not running (use it as a context manager)")
        p = self.places[rank]
        if self.link_model == "htb":
            out = run_ip(["-n", p.netns, "-s", "class", "show", "dev", "eth0"], tool="tc").stdout
            classes = parse_class_bytes(out)
            return {"intra": classes.get(INTRA_CLASS), "cross": classes[CROSS_CLASS]}
        intra_dev = "lo" if self.nic == "node" else "loc0"
        return {"intra": self._qdisc_bytes(p.netns, intra_dev) if self.intra_rate else None,
                "cross": self._qdisc_bytes(p.netns, "eth0")}

    def tcp_counters(self, rank: int) -> dict[str, int]:
        """The kernel's TCP counters in ``rank``'s namespace (``/proc/net/snmp`` ``Tcp:`` and
        ``/proc/net/netstat`` ``TcpExt:``, e.g. ``RetransSegs``, ``TCPTimeouts``,
        ``TCPLossProbes``), cumulative since the cluster was built."""
        if not self._created:
            raise RuntimeError("the cluster is not running (use it as a context manager)")
        text = run_ip(["netns", "exec", self.places[rank].netns, "cat", "/proc/net/snmp",
                       "/proc/net/netstat"]).stdout
        return parse_proc_counters(text, ("Tcp:", "TcpExt:"))

    @staticmethod
    def _qdisc_bytes(ns: str, dev: str) -> int:
        words = run_ip(["-n", ns, "-s", "qdisc", "show", "dev", dev], tool="tc").stdout.split()
        return int(words[words.index("Sent") + 1])

    def _tbf(self, rate: float, burst: int) -> str:
        return f"tbf rate {int(rate * 8)}bit burst {burst} latency {int(self.queue_s * 1000)}ms"

    # ----------------------------------------------------------------- measurement
    def measure_rates(self, seconds: float = 0.3, concurrent: bool = False) -> RateReport:
        """Measure intra- and cross-node TCP rates with plain sockets (no torch).

        One pair each: rank 0 -> rank 1 (intra) and rank 0 -> rank M (cross); with ``concurrent``
        also all M counterpart pairs (node 0 -> node 1) at once, which shows the NIC model
        (``node``: they share one link; ``rank``: each has its own). Rates are receiver-side
        bytes over the time from first to last byte; ``seconds`` per transfer.
        """
        if not self._created:
            raise RuntimeError("the cluster is not running (use it as a context manager)")
        M = self.ranks_per_group
        intra = transfer(self.places, [(0, 1)], seconds)[0] if M >= 2 else None
        cross = transfer(self.places, [(0, M)], seconds)[0] if self.groups >= 2 else None
        conc = None
        if concurrent and self.groups >= 2:
            conc = sum(transfer(self.places, [(k, M + k) for k in range(M)], seconds))
        return RateReport(intra, cross, conc, self.intra_rate, self.cross_rate, self.nic, M,
                          self.link_model)


def parse_proc_counters(text: str, sections: Sequence[str]) -> dict[str, int]:
    """``{name: value}`` from /proc/net/snmp-style text (a header line, then a value line, per
    section); only integer fields of ``sections``."""
    out: dict[str, int] = {}
    lines = text.splitlines()
    for head, vals in zip(lines, lines[1:]):
        h, v = head.split(), vals.split()
        if h and v and h[0] == v[0] and h[0] in sections and not v[1:2] == h[1:2]:
            for name, value in zip(h[1:], v[1:]):
                if value.lstrip("-").isdigit():
                    out[name] = int(value)
    return out


# --------------------------------------------------------------------------- clean-up hooks
_LIVE: dict[int, EmulatedCluster] = {}
_HOOKED = False
_PREV: dict[int, Any] = {}


def _cleanup_all() -> None:
    for c in list(_LIVE.values()):
        try:
            c.close()
        except Exception:  # noqa: BLE001 - best effort on the way out
            pass


def _on_signal(signum: int, frame: Any) -> None:
    _cleanup_all()
    prev = _PREV.get(signum, signal.SIG_DFL)
    signal.signal(signum, prev)
    if callable(prev):
        prev(signum, frame)
    else:
        os.kill(os.getpid(), signum)  # default action: die by the same signal


def _register(c: EmulatedCluster) -> None:
    global _HOOKED
    _LIVE[id(c)] = c
    if _HOOKED:
        return
    _HOOKED = True
    atexit.register(_cleanup_all)
    if threading.current_thread() is threading.main_thread():
        for sig in (signal.SIGTERM, signal.SIGHUP):
            prev = signal.getsignal(sig)
            if prev is signal.SIG_IGN or prev is None:
                continue  # the process chose to survive this signal: keep it that way
            _PREV[sig] = prev
            signal.signal(sig, _on_signal)


def _unregister(c: EmulatedCluster) -> None:
    _LIVE.pop(id(c), None)
