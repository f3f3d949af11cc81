"""``tc`` commands for the ``htb`` link model: one NIC per rank, classes by peer node.

One veth carries all of a rank's traffic, intra- and cross-node alike (the layout of the
independent harness in issue 12, item 7). Its root ``htb`` qdisc has two leaf classes that do not
borrow from each other (``rate == ceil``, no parent class): ``1:10`` intra-node and ``1:20``
cross-node. ``u32`` filters put packets whose *peer* address (destination on the rank's egress,
source on its ingress) belongs to the rank's own node into ``1:10``; everything else falls into the
default class ``1:20``. An unshaped intra-node path (``intra_rate=None``) sends same-node packets
to the qdisc itself (``classid 1:0``), which htb passes on unshaped ("direct").

``burst`` and ``cburst`` are both set to the configured bucket: with ``rate == ceil`` htb lets a
class send only while *both* buckets hold tokens, and tc's default ``cburst`` is about one MTU
(``ceil / HZ`` with HZ reported as 10^9), so a ``burst`` alone would not give the bucket it names.
"""

from __future__ import annotations

from collections.abc import Sequence

__all__ = ["INTRA_CLASS", "CROSS_CLASS", "htb_commands", "parse_class_bytes"]

INTRA_CLASS = "1:10"
CROSS_CLASS = "1:20"
# Deficit round robin between classes only matters when they borrow (they do not here), but tc
# warns about a quantum above 200000 bytes, which rate / r2q would give at Gbit rates.
_QUANTUM = 60000


def _class(dev: str, classid: str, rate_Bps: float, burst: int) -> str:
    rate = f"{int(rate_Bps * 8)}bit"
    return (f"class add dev {dev} parent 1: classid {classid} htb rate {rate} ceil {rate} "
            f"burst {burst} cburst {burst} quantum {_QUANTUM}")


def htb_commands(dev: str, same_node: Sequence[str], *, match: str, cross_rate: float,
                 cross_burst: int, intra_rate: float | None, intra_burst: int) -> list[str]:
    """``tc -batch`` lines shaping ``dev``: packets whose ``match`` address (``"dst"`` for
    egress, ``"src"`` for ingress) is in ``same_node`` go to the intra class, the rest cross."""
    if match not in ("dst", "src"):
        raise ValueError(f"match must be 'dst' or 'src', got {match!r}")
    lines = [f"qdisc add dev {dev} root handle 1: htb default 20",
             _class(dev, CROSS_CLASS, cross_rate, cross_burst)]
    target = "1:0"  # the qdisc itself: htb sends these packets unshaped
    if intra_rate is not None:
        lines.append(_class(dev, INTRA_CLASS, intra_rate, intra_burst))
        target = INTRA_CLASS
    lines += [f"filter add dev {dev} parent 1: protocol ip prio 1 u32 match ip {match} {a}/32 "
              f"flowid {target}" for a in same_node]
    return lines


def parse_class_bytes(tc_output: str) -> dict[str, int]:
    """``{classid: bytes sent}`` from ``tc -s class show`` output."""
    out: dict[str, int] = {}
    current = None
    for line in tc_output.splitlines():
        words = line.split()
        if len(words) >= 3 and words[0] == "class":
            current = words[2]
        elif current and words[:1] == ["Sent"] and len(words) >= 2:
            out[current] = int(words[1])
            current = None
    return out
