"""The emulator's virtual clock (issue 41, docs/emulator.md, lab/emulate/virtual_time.py): a
rank's device ops and posts start at the times its host waited for, not when its crowded host
got round to them, so a late host measures as an on-time one while causality holds."""

from __future__ import annotations

import math
import time

import pytest
import virtual_clock_cases as cases

from charm_megatron.lab.emulate import LinkTransport, SoftwareLinks
from charm_megatron.lab.emulate.linkmodel import KEEP_PAST_S
from charm_megatron.lab.emulate.virtual_time import VirtualTime
from charm_megatron.local_ranks import run_ranks
from charm_megatron.ops.transport import P2P

NBYTES = 40_000
RATE = 1_000_000.0  # bytes/s: a message moves for 40 ms
LATENCY_S = 0.01
MOVE_S = NBYTES / RATE + LATENCY_S  # one message, alone on its links, post to arrival
TILE_S = 0.1  # one tile's wall time on the dilated device
LATE_S = 0.3  # how late the host wakes after a message: longer than the tile


class _Done:
    """A real transfer that is already complete (the links' timing is all that is tested)."""

    def wait(self, timeout=None) -> bool:
        return True

    def is_completed(self) -> bool:
        return True


class _NoWire:
    name = "no-wire"

    def post(self, ops):
        return [_Done() for _ in ops]


def _message():
    import torch

    return torch.zeros(NBYTES // 4)


def _exchange(late_s: float, virtual: bool) -> dict:
    """Rank 1 (on the wall clock) posts its send of a message and its receive of the answer;
    then rank 0 (the rank under test) receives the message, its host wakes ``late_s`` after
    it arrived, runs a tile and sends the answer. Rank 0's start, the message's arrival, its
    device's end, the answer's booking on its egress and the call's end."""
    spec = SoftwareLinks(2, 1, cross_rate=RATE, nic="rank", latency_s=LATENCY_S)
    clock = VirtualTime() if virtual else None
    dev = cases.timed_device(TILE_S, clock)
    mine = LinkTransport(spec.for_rank(0), _NoWire(), clock)
    peer = LinkTransport(spec.for_rank(1), _NoWire())
    peer_works = peer.post([P2P(True, _message(), 0), P2P(False, _message(), 0)])
    start = clock.begin() if virtual else time.monotonic()  # after the peer's posts
    dev.before_post()
    (recv,) = mine.post([P2P(False, _message(), 1)])
    recv.wait()
    time.sleep(late_s)
    cases.tile(dev)
    busy = dev.busy_until
    dev.before_post()
    (send,) = mine.post([P2P(True, _message(), 1)])
    send.wait()
    dev.synchronize()
    for w in peer_works:
        w.wait()
    end = dev.virtual_now() if virtual else time.monotonic()
    return {"start": start, "arrival": recv.deadline, "busy": busy,
            "answer_booked": spec.for_rank(0).cross_out.busy_until - NBYTES / RATE,
            "call_s": end - start}


def test_a_late_host_gets_the_on_time_hosts_virtual_times_and_not_the_wall_clock_device():
    on_time, late = _exchange(0.0, True), _exchange(LATE_S, True)
    for got in (on_time, late):
        assert got["arrival"] == pytest.approx(got["start"] + MOVE_S, abs=1e-9)
        # the tile starts at the message's arrival; the answer is booked when the tile ends
        assert got["busy"] == pytest.approx(got["arrival"] + TILE_S, abs=1e-9)
        assert got["answer_booked"] == pytest.approx(got["busy"], abs=1e-9)
        assert got["call_s"] == pytest.approx(2 * MOVE_S + TILE_S, abs=1e-9)
    assert late["call_s"] == pytest.approx(on_time["call_s"], abs=1e-9)
    # The asynchronous device on the wall clock starts the tile when the host queues it.
    wall = _exchange(LATE_S, False)
    assert wall["busy"] >= wall["arrival"] + LATE_S + TILE_S
    assert wall["answer_booked"] >= wall["busy"]
    assert wall["call_s"] >= 2 * MOVE_S + TILE_S + LATE_S


def test_two_gloo_ranks_the_late_receivers_answer_is_booked_at_its_virtual_time(tmp_path):
    """Two processes through software links (one per node, a NIC each): rank 1 wakes
    :data:`LATE_S` after rank 0's message arrived, runs a tile and answers. The answer is
    booked from the tile's end on the virtual clock, not from the late post, and each rank's
    call time is the hand computation: both messages' times plus the tile, from the later of
    the two ranks' starts (the first message needs both posts)."""
    spec = SoftwareLinks(2, 1, cross_rate=RATE, nic="rank", latency_s=LATENCY_S,
                         state_dir=str(tmp_path))
    r0, r1 = run_ranks(cases.late_receiver, 2, spec, NBYTES, TILE_S, LATE_S, timeout_s=120,
                       pg_timeout_s=60)
    first = max(r0["start"], r1["start"]) + MOVE_S
    assert r1["first_arrival"] == pytest.approx(first, abs=1e-9)
    answer_start = first + TILE_S
    assert r1["answer_wall_post"] >= first + LATE_S > answer_start  # posted late on the wall
    assert r1["egress_busy_until"] == pytest.approx(answer_start + NBYTES / RATE, abs=1e-9)
    answer_arrival = answer_start + MOVE_S
    for got in (r0, r1):
        assert got["end"] - got["start"] == pytest.approx(answer_arrival - got["start"],
                                                          abs=1e-9)


def test_every_rank_starts_a_timed_call_when_the_last_one_reached_it():
    """The bench's call start on the virtual clock: one time for all ranks, the latest
    rank's arrival, so an early rank's start does not hold how late the other left the
    barrier."""
    (s0, reached0), (s1, reached1) = run_ranks(cases.call_start, 2, LATE_S, timeout_s=60,
                                               pg_timeout_s=30)
    assert s0 == s1
    assert reached1 <= s1 < reached1 + 0.05  # rank 1's time when it got there
    assert s0 >= reached0 + LATE_S * 0.9  # not rank 0's own


def test_the_clock_re_anchors_at_the_wall_between_calls_and_never_runs_ahead():
    clock = VirtualTime()
    t0 = clock.begin()
    clock.queue(0.05)
    clock.arrived(t0 + 0.02)
    assert clock.ready() == pytest.approx(t0 + 0.05)
    clock.arrived(math.nan)  # a message on a free link: no modelled arrival
    time.sleep(0.06)
    clock.end_call()
    assert clock.now() == pytest.approx(t0 + 0.05)  # the call's virtual end, kept
    time.sleep(0.05)
    anchored = clock.start()  # the next call's first op: at the wall, not 0.05 s back
    assert anchored >= t0 + 0.11
    assert clock.lag() >= 0.0


def test_a_post_trailing_the_wall_past_what_the_links_keep_is_refused():
    spec = SoftwareLinks(2, 1, cross_rate=RATE, nic="rank")
    clock = VirtualTime()
    clock.begin()
    clock.host_t = clock.busy_until = time.monotonic() - KEEP_PAST_S  # a hopelessly late host
    with pytest.raises(RuntimeError, match="trails the wall"):
        LinkTransport(spec.for_rank(0), _NoWire(), clock).post([P2P(True, _message(), 1)])
