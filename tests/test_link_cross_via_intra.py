"""``cross_via_intra`` on the software links (the ``l20-pcie`` profile's): a PCIe GPU's
cross-NUMA messages also go through its own PCIe port, so a cross message from src to dst is
booked on its cross egress and ingress *and* on src's intra egress and dst's intra ingress,
moving at what all four ports have left, its own per-message rate still the cross one (as the
model's ``_flow``, ``model/sim.py``, uses ``("iout", src)`` and ``("iin", dst)`` for it).

Hand computation (rates in units of MSG, one intra message's rate; B = MSG x 0.3 s): rank 0
of node 0 sends one message of B to rank 1 (its node) and one to rank 2 (the other node) at
once. Rank 0's intra port carries 1.5 MSG; a cross link 0.75 MSG. The intra message, booked
first, takes MSG of the port and arrives after 0.3 s. The cross message moves at what is left
of rank 0's intra egress, 0.5 MSG, until then (0.5 B), then at its cross rate 0.75 MSG (not the
intra 1: its own rate stays the cross one) for the other 0.5 B, 0.2 s: it arrives after 0.5 s.
Without ``cross_via_intra`` it would arrive after B / 0.75 MSG = 0.4 s.
"""

from __future__ import annotations

import time

import pytest

from charm_megatron.lab.emulate import SoftwareLinks
from charm_megatron.model import Cluster, simulate
from charm_megatron.model.links import Links
from charm_megatron.plan.core import Comm, Half, Plan, Wait, Xfer
from charm_megatron.plan.cost import Problem

P = Problem(b=1, s=3072, hq=1, hkv=1, d=64, elem=2)  # the model's message: one kv block
N = 4  # 2 nodes x 2 ranks
NBYTES = P.block_bytes("kv", N)
MSG = NBYTES / 0.3  # bytes/s: one intra message alone takes 0.3 s
LATENCY_S = 0.02
INTRA_S, CROSS_S = 0.3, 0.5  # the hand computation (module doc)


def _cluster(cross_via_intra: bool) -> Cluster:
    return Cluster(intra_gbps=MSG / 1e9, intra_port_gbps=1.5 * MSG / 1e9,
                   cross_gbps=0.75 * MSG / 1e9, tflops=1.0, nic="node",
                   latency_us=LATENCY_S * 1e6, link_order="fifo",
                   cross_via_intra=cross_via_intra)


def _model(cross_via_intra: bool) -> list[float]:
    send = Comm(0, "kv", tuple(Xfer(p, "own.kv", "kv", 0, Half.FULL) for p in (1, 2)))
    recv = Comm(0, "kv", (), (Xfer(0, "kv.rx", "kv", 0, Half.FULL),))
    plan = Plan("cross_via_intra", "forward", N, (tuple(range(N)),), False)
    plan.ops = [[send, Wait(0)], [recv, Wait(0)], [recv, Wait(0)], []]
    res = simulate(plan, P, _cluster(cross_via_intra), [[0, 1], [2, 3]])
    return [r.finish_s for r in res.ranks]


@pytest.mark.parametrize("via", [True, False], ids=["cross_via_intra", "plain"])
def test_a_cross_message_shares_its_senders_intra_port(via):
    """Rank 0 sends an intra and a cross message at once (module doc): with
    ``cross_via_intra`` the cross one arrives after 0.5 s (0.4 s without), on the software
    links built from the model's description and in the model alike."""
    spec = SoftwareLinks.from_links(2, 2, Links.of(_cluster(via)))
    assert spec.cross_via_intra is via
    links = spec.links(0, 2)
    assert [lk.name for lk in links] == (
        ["cross-out node0", "cross-in node1", "intra-out rank0", "intra-in rank2"] if via
        else ["cross-out node0", "cross-in node1"])
    assert [lk.name for lk in spec.links(0, 1)] == ["intra-out rank0", "intra-in rank1"]
    ranks = [spec.for_rank(r) for r in range(N)]
    # Alone, a cross message moves at its cross rate (its intra ports are wider).
    assert ranks[0].alone_s(2, NBYTES, True) == pytest.approx(0.4 + LATENCY_S)
    t0 = time.monotonic() + 5.0  # in the future: nothing is pruned as past
    sends = [ranks[0].post(NBYTES, peer, True, at=t0) for peer in (1, 2)]
    recvs = [ranks[peer].post(NBYTES, 0, False, at=t0) for peer in (1, 2)]
    assert [w.deadline for w in recvs] == [w.deadline for w in sends]
    intra, cross = (w.deadline - t0 for w in sends)
    cross_s = CROSS_S if via else 0.4
    assert intra == pytest.approx(INTRA_S + LATENCY_S, rel=1e-9)
    assert cross == pytest.approx(cross_s + LATENCY_S, rel=1e-9)
    # Rank 0's intra egress: the intra message's MSG plus the cross one's 0.5 MSG, then the
    # cross one's 0.75 MSG alone.
    out0 = spec.links(0, 1)[0]
    assert out0.reserved(t0 + 0.1) == pytest.approx(1.5 * MSG if via else MSG)
    assert out0.reserved(t0 + 0.4) == pytest.approx(0.75 * MSG if via else 0.0)
    finish = _model(via)
    assert finish[1] == pytest.approx(intra, rel=1e-6)
    assert finish[2] == pytest.approx(cross, rel=1e-6)
    assert finish[0] == pytest.approx(cross, rel=1e-6)
