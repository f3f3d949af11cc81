"""One link description for the emulator and the model (issue 41): a per-message rate *and* a
port aggregate, shared in start order.

The model (``model/sim.py``, ``link_order="fifo"``) gives a rank's intra port ``intra_port_gbps``
in all and each message at most ``intra_gbps``; the software links
(``lab/emulate/linkmodel.py``) now book the same way: a new message moves at ``min(per-message
rate, what its egress has left, what its receiver's ingress has left)`` given the reservations
already booked. The numbers here are the profiles' 365 and 450 (GB/s on H100) scaled to
3.65 and 4.5 MB/s, so one 1.095 MB message takes T = 0.3 s alone.

Hand computation of one rank sending two such messages at once to two peers: the first takes
365 of the 450 port and arrives after T; the second moves at the 85 left until then (moving
85/365 of its bytes), then at 365 for the remaining 280/365: it arrives after
T + T * 280/365 = T * 645/365 = 0.5301 s (queued whole, as before this change: 2T = 0.6 s).
"""

from __future__ import annotations

import datetime
import time

import pytest
from link_rank_cases import post_and_wait

from charm_megatron.lab.emulate import SoftwareLinks
from charm_megatron.lab.emulate.linkmodel import KEEP_PAST_S, LinkModel, book_message
from charm_megatron.local_ranks import run_ranks
from charm_megatron.model import Cluster, get_profile, simulate, tile_flops
from charm_megatron.model.links import Links, LinkSpec
from charm_megatron.plan.core import Comm, Half, Plan, Tile, Wait, Xfer, tile_spec
from charm_megatron.plan.cost import Problem

MSG = 3.65e6  # bytes/s one message reaches (365 GB/s scaled)
PORT = 4.5e6  # bytes/s a port carries in all (450 GB/s scaled)
NBYTES = 1_095_000  # one message
T = NBYTES / MSG  # 0.3 s alone
LATENCY_S = 0.02
SECOND = T * 645 / 365  # the hand computation above: 0.5301 s
SLACK_S = 0.04  # the emulator's processes may be this late (scheduling on 2 shared cores)
TIMEOUT = datetime.timedelta(seconds=30)

P = Problem(b=1, s=3072, hq=1, hkv=1, d=64, elem=2)  # the model's message: one kv block


def _old_rule(links: dict, msgs: list[tuple[str, str, float, float]]) -> list[float]:
    """The software links before this change: a message reserved both links whole for
    ``bytes / rate`` from ``max(earliest, egress busy until, ingress busy until)``."""
    busy: dict[str, float] = {}
    out = []
    for eg, ing, earliest, nbytes in msgs:
        start = max(earliest, busy.get(eg, 0.0), busy.get(ing, 0.0))
        busy[eg] = start + nbytes / links[eg].rate
        busy[ing] = start + nbytes / links[ing].rate
        out.append(max(busy[eg], busy[ing]) + LATENCY_S)
    return out


# ----------------------------------------------------------------------------- the model
def _cluster(n: int, port: float | None, compute_s: float = 0.1) -> Cluster:
    """Intra links on which one kv block of ``P`` takes ``T`` alone; a port ``port / MSG``
    times wider (``None``: one message fills it); served in start order."""
    gbps = P.block_bytes("kv", n) / T / 1e9
    tflops = tile_flops(tile_spec(0, 0, False), P, n) / compute_s / 1e12
    return Cluster(intra_gbps=gbps, cross_gbps=gbps / 8, tflops=tflops, nic="rank",
                   latency_us=LATENCY_S * 1e6, link_order="fifo",
                   intra_port_gbps=None if port is None else gbps * port / MSG)


def _send(peers: list[int], handle: int = 0) -> Comm:
    return Comm(handle, "kv", tuple(Xfer(p, "own.kv", "kv", 0, Half.FULL) for p in peers))


def _recv(srcs: list[int]) -> Comm:
    return Comm(0, "kv", (), tuple(Xfer(s, "kv.rx", "kv", s, Half.FULL) for s in srcs))


def _model(ops: list[list], port: float | None, compute_s: float = 0.1) -> list[float]:
    n = len(ops)
    plan = Plan("ports", "forward", n, (tuple(range(n)),), False)
    plan.ops = ops
    res = simulate(plan, P, _cluster(n, port, compute_s), [list(range(n))])
    return [r.finish_s for r in res.ranks]


def _delay(rank: int) -> Tile:
    return Tile(tile_spec(rank, rank, False), "own.q", "own.kv", "acc.out")


# ----------------------------------------------------------------------------- arithmetic
def _ports(n: int, port: float | None) -> dict[str, LinkModel]:
    return {f"{d}{r}": LinkModel(MSG, port_rate=port, name=f"{d}{r}")
            for r in range(n) for d in ("out", "in")}


def test_two_messages_from_one_rank_share_a_wider_port_as_the_model_does():
    """Rank 0 sends one message to each of ranks 1 and 2 at once: the first arrives after T,
    the second after T * 645/365 (module doc), on the software links' booking, in the model,
    and by hand; the egress is booked at 450 (full) until T, then at 365."""
    links = _ports(3, PORT)
    t0 = time.monotonic() + 5.0  # in the future: nothing is pruned as past
    first = book_message((links["out0"], links["in1"]), t0, NBYTES, LATENCY_S)
    second = book_message((links["out0"], links["in2"]), t0, NBYTES, LATENCY_S)
    assert first - t0 == pytest.approx(T + LATENCY_S, rel=1e-9)
    assert second - t0 == pytest.approx(SECOND + LATENCY_S, rel=1e-9)
    assert second - t0 == pytest.approx(0.5501369863, rel=1e-9)  # the number, written out
    assert links["out0"].reserved(t0 + T / 2) == pytest.approx(PORT)
    assert links["out0"].reserved(t0 + T + 0.01) == pytest.approx(MSG)
    assert links["in2"].reserved(t0 + T / 2) == pytest.approx(PORT - MSG)
    assert links["out0"].reserved(t0 + SECOND + 0.001) == 0.0
    # The model: ranks 1 and 2 finish when their message arrived, rank 0 with the second.
    finish = _model([[_send([1, 2]), Wait(0)], [_recv([0]), Wait(0)], [_recv([0]), Wait(0)]],
                    PORT)
    assert finish[1] == pytest.approx(first - t0, rel=1e-6)
    assert finish[2] == pytest.approx(second - t0, rel=1e-6)
    assert finish[0] == pytest.approx(second - t0, rel=1e-6)


def test_egress_and_ingress_limits_together_match_the_model():
    """Five ranks of one node: rank 0 sends to 2 and 3 at 0; rank 1 sends to 3 and 4 at
    0.1 s. Rank 3's ingress takes 0->3 (85, then 365 once 0->2 is done) and 1->3 (what is
    left of 450), rank 1's egress carries 1->3 and 1->4: every rate is bounded by a different
    port at some time. The booking's arrivals give each rank's finish exactly as the model."""
    d = 0.1
    links = _ports(5, PORT)
    t0 = time.monotonic() + 5.0
    arr = {}
    for src, dst, start in ((0, 2, 0.0), (0, 3, 0.0), (1, 3, d), (1, 4, d)):
        arr[src, dst] = book_message((links[f"out{src}"], links[f"in{dst}"]), t0 + start,
                                     NBYTES, LATENCY_S) - t0
    emulated = [max(arr[0, 2], arr[0, 3]), max(arr[1, 3], arr[1, 4]), arr[0, 2],
                max(arr[0, 3], arr[1, 3]), arr[1, 4]]
    ops = [[_send([2, 3]), Wait(0)], [_delay(1), _send([3, 4]), Wait(0)],
           [_recv([0]), Wait(0)], [_recv([0, 1]), Wait(0)], [_recv([1]), Wait(0)]]
    finish = _model(ops, PORT, compute_s=d)
    assert finish == pytest.approx(emulated, rel=1e-6)
    # By hand (rates in MB/s): 0->2 takes 3.65 of rank 0's egress, 0->3 the 0.85 left until
    # 0->2 arrives at T, then 3.65: it arrives at SECOND (as in the test above). 1->3 starts
    # at d with 4.5 - 0.85 = 3.65 of rank 3's ingress free: 3.65 until T, then (0->3 booked
    # first takes 3.65 of it) 0.85 until SECOND, then 3.65 for the rest.
    assert arr[0, 2] == pytest.approx(T + LATENCY_S, rel=1e-9)
    assert arr[0, 3] == pytest.approx(SECOND + LATENCY_S, rel=1e-9)
    rest = NBYTES - MSG * (T - d) - (PORT - MSG) * (SECOND - T)
    assert arr[1, 3] == pytest.approx(SECOND + rest / MSG + LATENCY_S, rel=1e-9)
    assert arr[1, 3] == pytest.approx(0.5965434, rel=1e-6)


def test_a_port_no_wider_than_a_message_queues_as_before():
    """Port = per-message rate: messages sharing one port queue whole, exactly the old
    "busy until" arrivals (one sender to several peers, several senders to one receiver,
    staggered starts, sizes)."""
    links = _ports(4, None)
    t0 = time.monotonic() + 5.0
    msgs = [("out0", "in1", t0, NBYTES), ("out0", "in2", t0, NBYTES // 2),
            ("out0", "in3", t0 + 0.1, NBYTES), ("out2", "in1", t0 + 0.05, NBYTES),
            ("out3", "in1", t0 + 0.9, 3 * NBYTES), ("out0", "in2", t0 + 2.0, NBYTES)]
    new = [book_message((links[e], links[i]), s, b, LATENCY_S) for e, i, s, b in msgs]
    assert new == pytest.approx(_old_rule(links, msgs), abs=1e-9)
    assert new[1] - t0 == pytest.approx(1.5 * T + LATENCY_S, rel=1e-9)


def test_a_message_waiting_for_its_ingress_leaves_its_egress_to_others():
    """Where the new booking differs from the old one at port = message (the model's fifo
    rule): rank 1's message to rank 2 waits for rank 2's ingress (rank 0 holds it); rank 1's
    next message, to rank 3, uses rank 1's idle egress meanwhile and arrives after T (the old
    rule held the egress for the waiting message: 3T). The model says T too."""
    links = _ports(4, None)
    t0 = time.monotonic() + 5.0
    a = book_message((links["out0"], links["in2"]), t0, NBYTES, LATENCY_S) - t0
    b = book_message((links["out1"], links["in2"]), t0, NBYTES, LATENCY_S) - t0
    c = book_message((links["out1"], links["in3"]), t0, NBYTES, LATENCY_S) - t0
    assert (a, b, c) == pytest.approx((T + LATENCY_S, 2 * T + LATENCY_S, T + LATENCY_S))
    ops = [[_send([2]), Wait(0)], [_send([2, 3]), Wait(0)], [_recv([0, 1]), Wait(0)],
           [_recv([1]), Wait(0)]]
    finish = _model(ops, None)
    assert finish[3] == pytest.approx(c, rel=1e-6)
    assert finish[2] == pytest.approx(b, rel=1e-6)


def test_cross_links_unchanged():
    """Cross links built from the model's description: one message fills a NIC (per-message
    rate = port), so with ``nic="node"`` two ranks' messages out of one node queue as before,
    and the links' rates are the cluster's."""
    cl = Cluster(intra_gbps=MSG / 1e9, cross_gbps=1e-3, tflops=1.0, nic="node",
                 latency_us=LATENCY_S * 1e6, intra_port_gbps=PORT / 1e9)
    spec = SoftwareLinks.from_links(2, 2, Links.of(cl))
    assert (spec.cross_rate, spec.cross_port_rate, spec.nic) == (1e6, 1e6, "node")
    assert (spec.intra_rate, spec.intra_port_rate) == pytest.approx((MSG, PORT))
    assert spec.latency_s == pytest.approx(LATENCY_S)
    e0, i2 = spec.links(0, 2)
    e1, i3 = spec.links(1, 3)
    assert e0 is e1 and i2 is i3  # the node's one NIC
    assert e0.rate == e0.port_rate == 1e6
    t0 = time.monotonic() + 5.0
    links = {"out": e0, "in": i2}
    msgs = [("out", "in", t0, 100_000), ("out", "in", t0, 50_000),
            ("out", "in", t0 + 0.5, 100_000)]
    new = [book_message((links[e], links[i]), s, b, LATENCY_S) for e, i, s, b in msgs]
    assert new == pytest.approx(_old_rule(links, msgs), abs=1e-9)
    assert new[1] - t0 == pytest.approx(0.15 + LATENCY_S, rel=1e-9)


def test_link_state_in_a_file_keeps_segments_and_prunes_the_past(tmp_path):
    """The reservations live in the state file (another process opening it sees them), and
    those that ended more than KEEP_PAST_S ago are dropped when a link is next booked."""
    path = str(tmp_path / "intra-out-rank0.link")
    a = LinkModel(MSG, port_rate=PORT, shared_path=path)
    b = LinkModel(MSG, port_rate=PORT, shared_path=path)  # another process would open it so
    ingress = [LinkModel(MSG, port_rate=PORT) for _ in range(3)]
    now = time.monotonic()
    book_message((a, ingress[0]), now - KEEP_PAST_S - 1.0, 1000, 0.0)  # long over
    t0 = now + 5.0
    book_message((a, ingress[1]), t0, NBYTES, 0.0)
    assert b.reserved(t0 + 0.1) == pytest.approx(MSG)
    second = book_message((b, ingress[2]), t0, NBYTES, 0.0)
    assert second - t0 == pytest.approx(SECOND, rel=1e-9)
    _, count, segs = a._state()
    assert count == 3 and len(segs) == 3  # the first one's segment was pruned
    assert a.bytes_posted == 2 * NBYTES + 1000


def test_links_of_a_profile_and_of_an_emulated_gpu_cluster():
    """``Links.of`` says what the model uses (h100: 365.1 GB/s per message on a 450 GB/s
    port, a cross port one message fills), and the emulated GPU cluster's software links and
    timed device are that description scaled to the wire."""
    from charm_megatron.lab.bench.gpu_emulation import DeviceSetup

    cl = get_profile("h100").cluster
    links = Links.of(cl)
    assert links.intra == LinkSpec(cl.intra_gbps * 1e9, 450e9, cl.latency_us * 1e-6,
                                   cl.link_order, "rank")
    assert cl.latency_us == 10.0
    assert links.cross.message_Bps == links.cross.port_Bps == cl.cross_gbps * 1e9
    assert links.cross.shared_by == cl.nic
    setup = DeviceSetup("h100", 80.0, batch_scale=2, rows_scale=3, link_order="fifo")
    wire = setup.wire_links()
    assert wire.intra.message_Bps == pytest.approx(cl.intra_gbps * 1e9 / 480)
    assert wire.intra.port_Bps == pytest.approx(450e9 / 480)
    assert wire.intra.latency_s == pytest.approx(10e-6 * 80) == setup.wire_latency_s
    assert wire.intra.order == "fifo"
    spec = SoftwareLinks.from_links(2, 8, wire)
    out, _ = spec.links(0, 1)
    assert (out.rate, out.port_rate) == pytest.approx((wire.intra.message_Bps, 450e9 / 480))
    clock = setup.backend(0).links  # the SM-contention span: a message alone on its ports
    assert clock.intra_Bps == pytest.approx(cl.intra_gbps * 1e9)
    assert clock.cross_Bps == pytest.approx(cl.cross_gbps * 1e9)


# ----------------------------------------------------------------------------- gloo ranks


@pytest.mark.parametrize("port", [PORT, None], ids=["port450", "port365"])
def test_gloo_ranks_one_sender_two_intra_peers(tmp_path, port):
    """Real gloo ranks in separate processes (state in files): rank 0 of one node sends to
    ranks 1 and 2, which posted their receives 50 ms earlier. With the wider port the second
    arrives after T * 645/365 (0.530 s), with a port one message fills after 2T (0.600 s, as
    before this change); the model agrees. ``run_ranks`` bounds the processes (120 s)."""
    spec = SoftwareLinks(1, 3, 1e6, intra_rate=MSG, intra_port_rate=port, nic="rank",
                         state_dir=str(tmp_path), latency_s=LATENCY_S)
    script = {0: (0.05, [(True, 1), (True, 2)]), 1: (0.0, [(False, 0)]),
              2: (0.0, [(False, 0)])}
    times = run_ranks(post_and_wait, 3, spec, script, NBYTES, TIMEOUT, timeout_s=120,
                      pg_timeout_s=60)
    sent = times[0][0]
    second = SECOND if port else 2 * T
    for got, hand in ((times[1][1], sent + T + LATENCY_S),
                      (times[2][1], sent + second + LATENCY_S),
                      (times[0][1], sent + second + LATENCY_S)):
        assert hand - 0.002 <= got <= hand + SLACK_S, got - hand
    finish = _model([[_delay(0), _send([1, 2]), Wait(0)], [_recv([0]), Wait(0)],
                     [_recv([0]), Wait(0)]], port, compute_s=0.05)
    assert finish[2] == pytest.approx(0.05 + LATENCY_S + second, rel=1e-6)
    assert finish[1] == pytest.approx(0.05 + LATENCY_S + T, rel=1e-6)
