"""Software links that serve messages in virtual start order (lab/emulate/link_order.py,
docs/emulator.md *The links' order*): on the ranks' virtual clocks a run's device times do not
depend on the order in which this machine's processes happened to post on the wall clock."""

from __future__ import annotations

import time

import link_start_order_cases as cases
import pytest

from charm_megatron.lab.emulate import SoftwareLinks
from charm_megatron.lab.emulate.floors import FloorBoard
from charm_megatron.lab.emulate.virtual_time import VirtualTime
from charm_megatron.local_ranks import run_ranks

NBYTES = 40_000
RATE = 1_000_000.0  # bytes/s: a message moves for 40 ms
LATENCY_S = 0.01
MOVE_S = NBYTES / RATE
TILE_S = 0.01  # rank 1's tile before it posts: its message starts this much later
LATE_S = 0.3  # how late rank 0's host posts on the wall: well after rank 1


def _links(tmp_path, start_order: bool, **kw) -> SoftwareLinks:
    return SoftwareLinks(2, 2, cross_rate=RATE, nic="node", latency_s=LATENCY_S,
                         state_dir=str(tmp_path), start_order=start_order, **kw)


@pytest.mark.parametrize("start_order", [True, False])
def test_a_message_that_starts_earlier_is_served_first_even_when_posted_later(
        tmp_path, start_order):
    """Ranks 0 and 1 share node 0's NIC to node 1 (one message fills it). Rank 1's message
    starts a tile after the call's start, rank 0's at it, but rank 0's host posts 0.3 s late
    on the wall. In start order rank 0's message goes first and rank 1's queues behind it;
    booked in wall order (the links without floors) rank 0's is the one pushed back."""
    got = run_ranks(cases.late_early_sender, 4, _links(tmp_path, start_order), NBYTES,
                    TILE_S, LATE_S, timeout_s=120, pg_timeout_s=60)
    t = got[0]["start"]
    assert all(g["start"] == t for g in got)
    if start_order:
        first = t + MOVE_S + LATENCY_S
        second = t + 2 * MOVE_S + LATENCY_S  # from rank 0's last byte, not from its own start
    else:
        second = t + TILE_S + MOVE_S + LATENCY_S
        first = t + 2 * MOVE_S + LATENCY_S  # 10 ms before rank 1's booking, the rest after
    expected = {0: first, 1: second, 2: first, 3: second}
    for rank, g in enumerate(got):
        assert g["arrival"] == pytest.approx(expected[rank], abs=1e-9), rank
        assert g["end"] == pytest.approx(expected[rank], abs=1e-9), rank
        assert g["late"] == 0


def test_an_all_to_all_posted_in_any_wall_order_gets_the_arrivals_of_rank_order(tmp_path):
    """Four ranks on two nodes (a NIC per node, intra ports of their own): every rank posts
    its ops of the all-to-all at the call's start; posted in rank order on the wall, then in two
    shuffled wall orders, every message arrives at the same time after the start."""
    spec = _links(tmp_path, True, intra_rate=4 * RATE)
    got = run_ranks(cases.all_to_all, 4, spec, NBYTES, [None, 1, 2], timeout_s=120,
                    pg_timeout_s=60)
    calls = [{} for _ in range(3)]
    for per_rank in got:
        for call, arrivals in zip(calls, per_rank):
            call.update(arrivals)
    ordered = calls[0]
    assert len(ordered) == 12
    # Node 0's egress carries four messages to node 1, one at a time. Each op is a batch of
    # its own on one communicator, so a rank's batches start one after another, each when the
    # one before could have arrived alone (latency + bytes: 50 ms across, 20 ms inside a
    # node). Ranks 2 and 3 send first (across, across, inside: 120 ms), so their receives from
    # rank 0 start at 120 ms, completed by the receiver: by receiver, one at a time on node
    # 0's egress; their receives from rank 1 start at 170 ms, behind them.
    for n, key in enumerate([(0, 2), (0, 3), (1, 2), (1, 3)]):
        assert ordered[key] == pytest.approx(0.12 + (n + 1) * MOVE_S + LATENCY_S, abs=1e-9)
    for shuffled in calls[1:]:
        assert shuffled.keys() == ordered.keys()
        for key, t in ordered.items():
            assert shuffled[key] == pytest.approx(t, abs=1e-9), key


def test_a_communicators_next_batch_starts_after_its_previous_one_could_complete(tmp_path):
    """One communicator runs its batches one after another (NCCL; the model activates a
    stream's batches in turn): ranks 0 and 1 each post two single-send batches back to back
    on node 0's NIC, rank 1 a tile later. Each second batch starts when the first could have
    arrived alone (latency + bytes), so rank 1's first message goes before rank 0's second,
    as in the model; booked at their posts, rank 0's two went first and rank 1's first
    arrived two messages late (2x8, visiting kv in quarters: forward 1.20x the model)."""
    got = run_ranks(cases.two_batches_on_one_stream, 4, _links(tmp_path, True), NBYTES,
                    TILE_S, timeout_s=120, pg_timeout_s=60)
    t = got[0]["start"]
    assert all(g["start"] == t for g in got)
    first = [t + (n + 1) * MOVE_S + LATENCY_S for n in range(4)]  # node 0's egress, in turn
    expected = {0: [first[0], first[2]], 1: [first[1], first[3]]}
    for rank, g in enumerate(got):
        assert g["arrivals"] == pytest.approx(expected[rank % 2], abs=1e-9), rank


def test_a_stuck_rank_makes_the_others_fail_in_time_naming_it(tmp_path):
    """Rank 2 is in the call and never posts: its floor holds the message of ranks 0 and 1,
    whose waits raise within their timeout, naming it."""
    spec = SoftwareLinks(3, 1, cross_rate=RATE, nic="rank", latency_s=LATENCY_S,
                         state_dir=str(tmp_path), start_order=True)
    got = run_ranks(cases.stuck_rank, 3, spec, NBYTES, 4.0, 1.0, timeout_s=60,
                    pg_timeout_s=30)
    for text in got[:2]:
        assert text != "served"
        took, message = text.split(" ", 1)
        assert 1.0 <= float(took) < 2.5
        assert "not served in time" in message and "rank 2's floor" in message


def test_an_idle_rank_reads_as_the_readers_now_and_wakes_no_earlier():
    board = FloorBoard(None, 2)
    assert board.floors() == [0.0, 0.0]  # not published: nothing can be served
    board.publish(0, 5.0)
    board.idle(1)
    before = time.monotonic()
    floors = board.floors()
    assert floors[0] == 5.0 and floors[1] >= before
    assert board.wake(1) >= floors[1]


def test_the_clock_publishes_ready_its_lookahead_and_idle():
    class Slot:
        def __init__(self):
            self.values = []

        def publish(self, t):
            self.values.append(t)

        def idle(self):
            self.values.append("idle")

        def wake(self):
            t = time.monotonic()
            self.values.append(("wake", t))
            return t

    clock, slot = VirtualTime(), Slot()
    clock.publish_floor(slot)
    assert slot.values == ["idle"]
    t0 = clock.begin()
    assert slot.values[1][0] == "wake" and slot.values[-1] == t0
    clock.waiting(t0 + 1.0)  # blocked for a message: posts nothing before its arrival
    assert slot.values[-1] == t0 + 1.0
    clock.arrived(t0 + 1.5)
    assert slot.values[-1] == t0 + 1.5
    clock.posts_done()
    clock.end_call()
    assert slot.values[-1] == "idle"
    anchored = clock.ready()  # the next call re-anchors after its floor woke
    assert slot.values[-2][0] == "wake" and anchored >= slot.values[-2][1]
