"""How one message shares the ports it crosses with the messages booked before it (the
software links' booking, :mod:`charm_megatron.lab.emulate.linkmodel`): first come, first
served, as the model's ``link_order="fifo"`` shares a link. Pure arithmetic on reservation
segments ``(from, until, rate)``; the links' state and locking stay in ``linkmodel``."""

from __future__ import annotations

import math

#: A rate below this fraction of a message's cap is none (what float sums leave of a full port).
_RATE_EPS = 1e-9


def used_at(segs: list[tuple[float, float, float]], t: float) -> float:
    """The rate the segments ``segs`` book at time ``t``."""
    return sum(r for a, b, r in segs if a <= t < b)


def fill(start: float, nbytes: float, cap: float,
         ports: list[tuple[float, list[tuple[float, float, float]]]]
         ) -> tuple[float, list[tuple[float, float, float]]]:
    """A new message's rate over time, first come first served (the model's
    ``link_order="fifo"``, ``model/fluid.py``'s ``allocate_in_order``): from ``start`` it moves
    at ``min(cap, each port's rate less what is booked on it then)`` (``ports``: ``(port rate,
    its reservation segments)``) until its ``nbytes`` are done. Returns when its last byte
    leaves and its own segments ``[(from, until, rate), ...]``, to be booked on every port."""
    if nbytes <= 0:
        return start, []
    ports = [(port, [seg for seg in segs if seg[1] > start]) for port, segs in ports]  # in flight
    edges = sorted({t for _, segs in ports for seg in segs for t in seg[:2] if t > start})
    pieces: list[tuple[float, float, float]] = []
    t, left = start, float(nbytes)
    for edge in [*edges, math.inf]:
        rate = cap
        for port, segs in ports:
            rate = min(rate, port - used_at(segs, t))
        if rate > cap * _RATE_EPS:
            # done here, up to what float times lose (t ~ 1e5 s of monotonic clock)
            if left <= rate * (edge - t) + nbytes * _RATE_EPS:
                end = min(t + left / rate, edge)
                _append(pieces, (t, end, rate))
                return end, pieces
            _append(pieces, (t, edge, rate))
            left -= rate * (edge - t)
        t = edge
    raise AssertionError("unreachable: after the last reservation a port is free")


def _append(pieces: list[tuple[float, float, float]], piece: tuple[float, float, float]) -> None:
    """Add ``piece``, merged into the last one when it continues it at the same rate."""
    if pieces and pieces[-1][1] == piece[0] and pieces[-1][2] == piece[2]:
        pieces[-1] = (pieces[-1][0], piece[1], piece[2])
    else:
        pieces.append(piece)
