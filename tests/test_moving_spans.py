"""The timed device's SM-contention spans follow the model's (lab/emulate/moving.py).

The model slows a rank's compute while a message of its moves: from the time both sides have
posted until the message's last byte arrives, queueing behind others on a shared link
included. The software links learn the match when the peer posts and the arrival when the
message is booked, which on start-order links can be after the device has queued the ops that
run under it; so the device prices its queued ops again when the host next waits for it.
Driven directly on a frozen clock, no processes.
"""

from __future__ import annotations

import math

import pytest

from charm_megatron.devices import get_profile
from charm_megatron.lab.emulate.device import LinkClock, TimedBackend
from charm_megatron.lab.emulate.moving import MovingBatch
from charm_megatron.model.effects import slowed_over, slowed_s

H200 = get_profile("h200").cluster
SLOW = 1.0 + H200.comm_slowdown
LINKS = LinkClock(0, ((0,), (1,)), intra_Bps=1e12, cross_Bps=1e9)  # 0.5 GB: 0.5 s alone


class _Link:
    """A software-link handle: the match once the peer posted, the arrival once booked."""

    def __init__(self, matched=None, deadline=None):
        self.matched, self.deadline = matched, deadline


def _device(monkeypatch, now: list[float]) -> TimedBackend:
    monkeypatch.setattr("charm_megatron.lab.emulate.device.time.perf_counter", lambda: now[0])
    return TimedBackend(H200, links=LINKS, sleep=lambda s: None)


def test_an_op_queued_before_its_transfer_is_booked_is_priced_again(monkeypatch):
    """A 1 s tile queued while a matched message is not booked yet is priced on its time
    alone (0.5 s); once the links book it behind others (arrival 2 s after the post) the
    host's next wait for the device prices the tile again: slowed all through, as the
    model's would be. Without the second pricing the device would end 0.08 s early."""
    now = [100.0]
    dev = _device(monkeypatch, now)
    link = _Link(matched=100.0)
    dev.posted(3, [(1, 500_000_000)], works=[(1, link)])
    dev._run(1.0, tile=True)
    first = 0.5 + (1.0 - 0.5 / SLOW)
    assert dev.busy_until == pytest.approx(100.0 + first)
    link.deadline = 102.0  # served behind the other ranks' messages on the shared NIC
    dev.synchronize()
    assert dev.busy_until == pytest.approx(100.0 + SLOW)
    assert dev.clock.device_s == pytest.approx(SLOW)


def test_the_span_starts_when_the_peer_has_posted(monkeypatch):
    """A receive posted at 100 whose send is posted at 100.6 and arrives at 101 slows a 1 s
    tile from 100 only during [100.6, 101]; one whose send is not posted yet not at all."""
    now = [100.0]
    dev = _device(monkeypatch, now)
    dev.posted(3, [(1, 500_000_000)], works=[(1, _Link(matched=100.6, deadline=101.0))])
    want = 0.6 + 0.4 + (0.4 - 0.4 / SLOW)  # full speed, slowed 0.4 s, the rest at full speed
    assert dev._slowed(1.0) == pytest.approx(want)
    dev.waited(3)  # the host waited on it: nothing of it moves after the host's time
    assert dev._slowed(1.0) == 1.0
    dev.posted(4, [(1, 500_000_000)], works=[(1, _Link(matched=None))])
    assert dev._slowed(1.0) == 1.0  # the send is not posted: nothing moves yet


def test_spans_from_the_start_are_the_models_slowdown():
    """With every span under way at the op's start the piecewise price is the model's
    (effects.slowed_s), streams falling away one by one; a gap between two spans of one
    stream runs at full speed."""
    spans = {"kv": [(0.0, 0.3)], "q": [(-1.0, 0.8)], "cross": [(0.0, 2.5)]}
    got = slowed_over(H200, 1.5, 0.0, spans)
    assert got == pytest.approx(slowed_s(H200, 1.5, [0.3, 0.8, 2.5]), rel=1e-12)
    gap = slowed_over(H200, 1.0, 0.0, {"kv": [(0.0, 0.2), (0.6, 0.8)]})
    assert gap == pytest.approx(0.2 + 0.4 + 0.2 + (1.0 - 0.2 / SLOW - 0.4 - 0.2 / SLOW))
    assert slowed_over(H200, 1.0, 10.0, spans, scale=10.0) == 1.0  # all over by then


def test_a_batch_span_as_the_links_know_it():
    """Matched and booked: the model's span (latency after the match, to the arrival);
    matched only: its time alone from the match; not matched: none; a plain handle: from
    the post (the device of before); the host's wait ends them all."""
    booked = MovingBatch(10.0, 0.5, "kv", (_Link(11.0, 13.0),), latency=0.01)
    assert booked.spans() == [(11.01, 13.0)] and booked.settled()
    pending = _Link(11.0)
    matched = MovingBatch(10.0, 0.5, "kv", (pending,), latency=0.01)
    assert matched.spans() == [(11.01, 11.5)] and not matched.settled()
    pending.deadline = 12.0
    assert matched.spans() == [(11.01, 12.0)] and matched.settled()
    assert MovingBatch(10.0, 0.5, "kv", (_Link(),)).spans() == []
    assert MovingBatch(10.0, 0.5, "kv").spans() == [(10.0, 10.5)]
    booked.waited_at = 12.0
    assert booked.spans() == [(11.01, 12.0)] and booked.end() == 12.0
    booked.waited_at = 11.0
    assert booked.spans() == [] and booked.end() == -math.inf
