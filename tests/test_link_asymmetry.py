"""Asymmetric exchanges on the software link model (issue 41, item 1): a message starts at the
later of its two posts and carries the sender's link state, so one late side, or one sender
feeding two peers over one egress, gets the same arrival from the emulator
(``lab/emulate/linkmodel.py``, real gloo ranks), from the performance model (``model/sim.py``
on a hand-built plan) and from the hand computation written out in each test.

Every modelled time is 50-300 ms (well above scheduling noise); the emulator is held to
[hand, hand + 40 ms]: its arrival can never be early (it counts from a post time taken after
the test's own clock reading), only late by scheduling (up to ~35 ms seen with ten runnable
processes on two cores). Every asymmetric case differs from the old rule by 100 ms, so the
window still tells them apart. The model is held to 1 %.
"""

from __future__ import annotations

import datetime
import threading
import time

import pytest
from link_rank_cases import post_and_wait

from charm_megatron.lab.emulate import SoftwareLinks
from charm_megatron.local_ranks import run_ranks
from charm_megatron.model import Cluster, simulate, tile_flops
from charm_megatron.plan.core import Comm, Half, Plan, Tile, Wait, Xfer, tile_spec
from charm_megatron.plan.cost import Problem

RATE = 10e6  # bytes/s of every link in these tests
NBYTES = 1_000_000  # one message: 250 000 float32
BYTES_S = NBYTES / RATE  # 0.1 s on a link
LATENCY_S = 0.02  # per message
LATE_S = 0.1  # how late the late side posts
SLACK_S = 0.04  # the emulator may be this late (scheduling on a busy 2-core machine)
TIMEOUT = datetime.timedelta(seconds=30)

# The model's problem: a message is one kv block; the cluster's rates make it take BYTES_S.
P = Problem(b=1, s=2048, hq=1, hkv=1, d=64, elem=2)


def _cluster(n: int, nic: str, compute_s: float) -> Cluster:
    """Links that move one kv block of ``P`` (over ``n`` ranks) in ``BYTES_S``, ``LATENCY_S``
    per message, and a device on which one diagonal tile takes ``compute_s``; served first
    come first served, as the software links do (the bench tells the model so)."""
    gbps = P.block_bytes("kv", n) / BYTES_S / 1e9
    tflops = tile_flops(tile_spec(0, 0, False), P, n) / compute_s / 1e12
    return Cluster(intra_gbps=gbps, cross_gbps=gbps, tflops=tflops, nic=nic,
                   latency_us=LATENCY_S * 1e6, link_order="fifo")


def _send(peers: list[int]) -> Comm:
    return Comm(0, "kv", tuple(Xfer(p, "own.kv", "kv", 0, Half.FULL) for p in peers))


def _recv(src: int) -> Comm:
    return Comm(0, "kv", (), (Xfer(src, "kv.rx", "kv", src, Half.FULL),))


def _delay(rank: int) -> Tile:
    """A tile standing for a late post: it takes the cluster's ``compute_s``."""
    return Tile(tile_spec(rank, rank, False), "own.q", "own.kv", "acc.out")


def _model(ops: list[list], groups: list[list[int]], nic: str, compute_s: float = LATE_S):
    plan = Plan("asym", "forward", len(ops), (tuple(range(len(ops))),), False)
    plan.ops = ops
    res = simulate(plan, P, _cluster(len(ops), nic, compute_s), groups)
    return [r.finish_s for r in res.ranks]


# ----------------------------------------------------------------------------- gloo ranks


def _emulate(tmp_path, groups: int, per_group: int, nic: str, script: dict):
    spec = SoftwareLinks(groups, per_group, RATE, intra_rate=RATE, nic=nic,
                         state_dir=str(tmp_path), latency_s=LATENCY_S)
    return run_ranks(post_and_wait, groups * per_group, spec, script, NBYTES, TIMEOUT,
                     timeout_s=120, pg_timeout_s=60)


def _close(got: float, hand: float) -> None:
    assert hand - 0.002 <= got <= hand + SLACK_S, (got - hand)


@pytest.mark.parametrize("late", ["sender", "receiver"])
def test_one_side_posts_late(tmp_path, late):
    """Rank 0 sends one message to rank 1 (two nodes, one NIC each); one side posts 100 ms
    after the other. The message starts at the later post: both sides complete at
    later post + bytes / rate + latency (the old rule counted a receive from the receiver's
    post and let a send complete on its egress alone, 100 ms early one way or the other)."""
    late_rank = 0 if late == "sender" else 1
    script = {0: (0.0, [(True, 1)]), 1: (0.0, [(False, 0)])}
    script[late_rank] = (LATE_S, script[late_rank][1])
    (post0, done0), (post1, done1) = _emulate(tmp_path, 2, 1, "rank", script)
    # By hand: the message starts when the later side posts, moves its 1 MB at 10 MB/s
    # (0.1 s) and arrives 20 ms later; both sides' waits return then.
    hand = max(post0, post1) + NBYTES / RATE + LATENCY_S
    _close(done0, hand)
    _close(done1, hand)
    # The model, the late post being a 100 ms tile: 0.1 + 0.02 + 0.1 s after the early post.
    hand_model = LATE_S + LATENCY_S + BYTES_S
    ops = [[_send([1]), Wait(0)], [_recv(0), Wait(0)]]
    ops[late_rank].insert(0, _delay(late_rank))
    for finish in _model(ops, [[0], [1]], "rank"):
        assert finish == pytest.approx(hand_model, rel=0.01)


@pytest.mark.parametrize("nic,groups,per_group,peers", [("rank", 3, 1, [1, 2]),
                                                        ("node", 2, 2, [2, 3])])
def test_one_sender_two_quiet_peers(tmp_path, nic, groups, per_group, peers):
    """Rank 0 sends one message to each of two peers on other nodes, which send nothing; the
    peers post first, rank 0 50 ms later. Both messages leave over rank 0's one egress (its
    NIC, or its node's): the first arrives after bytes / rate, the second after twice that;
    the old rule gave each receiver its own view of its link (both at bytes / rate from its
    own post). With ``nic="node"`` the two peers also share one ingress, which changes
    nothing here (the egress already serialises them)."""
    first, second = peers
    script = {0: (LATE_S / 2, [(True, first), (True, second)]),
              first: (0.0, [(False, 0)]), second: (0.0, [(False, 0)])}
    times = _emulate(tmp_path, groups, per_group, nic, script)
    sent = times[0][0]
    # By hand: both start at rank 0's post (the peers were there); the egress carries the
    # first message's 0.1 s, then the second's: arrivals at +0.12 s and +0.22 s, and rank 0's
    # sends complete with the second.
    hand_first = sent + NBYTES / RATE + LATENCY_S
    hand_second = sent + 2 * NBYTES / RATE + LATENCY_S
    _close(times[first][1], hand_first)
    _close(times[second][1], hand_second)
    _close(times[0][1], hand_second)
    # The model: rank 0's 50 ms tile, then both messages on its egress in posted order.
    n = groups * per_group
    ops: list[list] = [[] for _ in range(n)]
    ops[0] = [_delay(0), _send(peers), Wait(0)]
    ops[first] = [_recv(0), Wait(0)]
    ops[second] = [_recv(0), Wait(0)]
    hw = [list(range(g * per_group, (g + 1) * per_group)) for g in range(groups)]
    finish = _model(ops, hw, nic, compute_s=LATE_S / 2)
    assert finish[first] == pytest.approx(LATE_S / 2 + LATENCY_S + BYTES_S, rel=0.01)
    assert finish[second] == pytest.approx(LATE_S / 2 + LATENCY_S + 2 * BYTES_S, rel=0.01)
    assert finish[0] == pytest.approx(finish[second], rel=1e-9)


def test_symmetric_exchange_unchanged(tmp_path):
    """Regression: two ranks on two nodes exchange one message each way, posted together.
    Each message has its own egress and ingress: both complete at post + bytes / rate +
    latency, as under the old rule (this case passes on the old code by design)."""
    script = {0: (0.0, [(True, 1), (False, 1)]), 1: (0.0, [(True, 0), (False, 0)])}
    (post0, done0), (post1, done1) = _emulate(tmp_path, 2, 1, "rank", script)
    hand = max(post0, post1) + NBYTES / RATE + LATENCY_S  # 0.12 s after the later post
    _close(done0, hand)
    _close(done1, hand)
    ops = [[Comm(0, "kv", (Xfer(1, "own.kv", "kv", 0, Half.FULL),),
                 (Xfer(1, "kv.rx", "kv", 1, Half.FULL),)), Wait(0)],
           [Comm(0, "kv", (Xfer(0, "own.kv", "kv", 1, Half.FULL),),
                 (Xfer(0, "kv.rx", "kv", 0, Half.FULL),)), Wait(0)]]
    for finish in _model(ops, [[0], [1]], "rank"):
        assert finish == pytest.approx(LATENCY_S + BYTES_S, rel=0.01)


# ----------------------------------------------------------------------------- threads
class _Done:
    def wait(self, *a):
        return True

    def is_completed(self):
        return True


def test_threads_pair_in_order_without_a_state_dir():
    """Threads of one process (no state_dir): sends and receives pair in posted order per
    (src, dst). Rank 0 posts 1 MB then 0.5 MB to rank 1 at t0; rank 1 posts its two receives
    100 ms later. Both start then: the first arrives 0.1 s + latency after, the second queues
    behind it on both links (+0.05 s)."""
    spec = SoftwareLinks(2, 1, RATE, nic="rank", latency_s=LATENCY_S)
    links = [spec.for_rank(0), spec.for_rank(1)]
    got: dict[str, list] = {}

    def sender():
        got["posted0"] = [time.monotonic()]
        got["sends"] = [links[0].wrap(_Done(), n, 1, True) for n in (NBYTES, NBYTES // 2)]

    def receiver():
        time.sleep(LATE_S)
        got["posted1"] = [time.monotonic()]
        got["recvs"] = [links[1].wrap(_Done(), NBYTES, 0, False) for _ in range(2)]

    threads = [threading.Thread(target=sender), threading.Thread(target=receiver)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=10)
    start = got["posted1"][0]
    hand = [start + NBYTES / RATE + LATENCY_S, start + 1.5 * NBYTES / RATE + LATENCY_S]
    for side in ("sends", "recvs"):
        for work, want in zip(got[side], hand):
            assert want - 0.002 <= work.deadline <= want + 0.01, (side, work.deadline - want)
    t0 = time.monotonic()
    got["recvs"][1].wait()
    assert time.monotonic() >= hand[1] and time.monotonic() - t0 < 1.0


def test_an_unmatched_wait_is_bounded():
    """A send whose receiver never posts: its wait gives up within its bound, naming it."""
    spec = SoftwareLinks(2, 1, RATE, nic="rank")
    work = spec.for_rank(0).wrap(_Done(), NBYTES, 1, True)
    assert work.deadline is None and not work.is_completed()
    t0 = time.monotonic()
    with pytest.raises(TimeoutError, match=r"rank 0's send #0 to rank 1 \(channel \w+\) was not matched"):
        work.wait(datetime.timedelta(seconds=0.2))
    assert time.monotonic() - t0 < 2.0


def test_intra_node_messages_without_an_intra_rate_are_free():
    """Regression (as before): no intra rate, no throttling, no latency, nothing to pair."""
    spec = SoftwareLinks(1, 2, RATE, intra_rate=None, nic="node", latency_s=LATENCY_S)
    work = spec.for_rank(0).wrap(_Done(), NBYTES, 1, True)
    assert work.deadline == 0.0 and work.is_completed()


# ----------------------------------------------------------------------------- one description
class _Captured(Exception):
    pass


def test_the_emulated_gpu_cluster_links_carry_the_profiles_latency(monkeypatch):
    """The software links of ``bench --device-model`` add the profile's ``latency_us`` (the
    model's per-message latency, model/sim.py) to every message, dilated like all device
    time."""
    from charm_megatron.cli import main as cli_main
    from charm_megatron.lab.bench import runners
    from charm_megatron.lab.bench.gpu_emulation import DeviceSetup
    from charm_megatron.model import get_profile

    setup = DeviceSetup("h100", 80.0)
    assert setup.wire_latency_s == pytest.approx(get_profile("h100").cluster.latency_us * 1e-6 * 80)

    def capture(*args, **kw):
        raise _Captured(kw)

    monkeypatch.setattr(runners, "run_software", capture)
    with pytest.raises(_Captured) as got:
        cli_main(["bench", "--emulate", "2x1", "--device-model", "h100", "--dilation", "80",
                  "--batch", "1", "--seq", "4096", "--heads", "4x128", "--algos", "ring",
                  "--quiet", "--no-plot"])
    assert got.value.args[0]["links"].intra.latency_s == pytest.approx(10e-6 * 80)
    assert got.value.args[0]["links"].cross.latency_s == pytest.approx(10e-6 * 80)
