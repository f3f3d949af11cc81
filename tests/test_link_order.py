"""Link order (docs/model.md, *Link order*): a link that serves transfers in the order they
started (one NCCL communicator; the emulator's software links) against max-min fair sharing."""

import pytest

from charm_megatron.lab.bench.gpu_emulation import DeviceSetup
from charm_megatron.model import PROFILES, Cluster, predict
from charm_megatron.model.fluid import Job, allocate, allocate_in_order
from charm_megatron.plan.cost import Problem


def _jobs():
    return [Job(1.0, (("link", 1.0),)), Job(1.0, (("link", 1.0),)),
            Job(1.0, (("other", 1.0),))]


def test_in_order_the_first_takes_what_it_can_use_and_the_next_the_rest():
    first, second, alone = _jobs()
    allocate_in_order([first, second, alone], {"link": 10.0, "other": 4.0})
    assert (first.rate, second.rate, alone.rate) == (10.0, 0.0, 4.0)
    capped = Job(1.0, (("link", 1.0),), cap=3.0)
    later = Job(1.0, (("link", 1.0),))
    allocate_in_order([capped, later], {"link": 10.0})
    assert (capped.rate, later.rate) == (3.0, 7.0)
    # Fair sharing splits the same link.
    a, b, c = _jobs()
    allocate([a, b, c], {"link": 10.0, "other": 4.0})
    assert (a.rate, b.rate, c.rate) == (5.0, 5.0, 4.0)
    with pytest.raises(ValueError, match="bounded"):
        allocate_in_order([Job(1.0, ())], {})


def test_link_order_is_checked():
    with pytest.raises(ValueError, match="link_order"):
        Cluster(intra_gbps=1, cross_gbps=1, tflops=1, link_order="lifo")
    with pytest.raises(ValueError, match="shared core pool"):
        Cluster(intra_gbps=1, cross_gbps=1, tflops=1, cores=2, link_order="fifo")
    assert "fifo" in PROFILES["h100"].cluster.with_(link_order="fifo").describe()


def test_ring_backward_with_slow_merges_is_where_the_order_matters():
    """The ring's forward has one transfer per link at a time: the order cannot matter. Its
    backward sends the dkv partial beside the next kv block; served first, the partial's
    merge overlaps the kv transfer, shared fairly it waits for both (the h100-paper-measured
    profile's Table 5 row: 503 ms fair, 458 fifo; emulated 459)."""
    cl = PROFILES["h100-paper-measured"].cluster
    groups = [list(range(0, 8)), list(range(8, 16))]
    p = Problem(128, 3360, 12, 12, 192, 2, wide_partials=True)
    fair = predict("ring", groups, p, cl, False)
    fifo = predict("ring", groups, p, cl.with_(link_order="fifo"), False)
    assert fifo.forward.time_s == pytest.approx(fair.forward.time_s, rel=1e-9)
    assert fifo.backward.time_s == pytest.approx(0.458, rel=0.01)
    assert fair.backward.time_s == pytest.approx(0.503, rel=0.01)


def test_the_software_link_emulator_tells_the_model_its_order():
    dev = DeviceSetup("h100", link_order="fifo")
    assert dev.model_cluster.link_order == "fifo"
    assert DeviceSetup("h100").model_cluster.link_order == "fair"
    assert dev.model_cluster.cross_gbps == PROFILES["h100"].cluster.cross_gbps


def test_the_emulated_ring_backward_matches_the_in_order_model(capsys):
    """The measured finding, kept: on the paper-implementation device the emulated ring's
    backward (a CSV of docs/performance/emulated-t5/paper-measured) is within 1 % of the
    in-order model and about 9 % below the fair one."""
    from script_loader import SCRIPTS

    from charm_megatron.cli import main as cli_main

    csv_path = SCRIPTS.parent / "docs/performance/emulated-t5/paper-measured/2x8-b16-s13440.csv"
    assert cli_main(["report", "link-order", str(csv_path)]) == 0
    ring_bwd = next(line for line in capsys.readouterr().out.splitlines()
                    if "| ring | bwd |" in line)
    vs_fair, vs_fifo = (float(x) for x in ring_bwd.strip(" |").split("|")[-2:])
    assert abs(vs_fifo - 1) < 0.01 and vs_fair < 0.92
