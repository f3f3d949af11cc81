"""The executor's transport seam (ops/transport.py, issue 40): a toy transport added as one
file (tests/toy_transport.py) plus one line runs real plans, and nothing in the package
assigns to ``torch.distributed``."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest
import torch
from toy_transport import CountingTransport

from charm_megatron import cp_attention
from charm_megatron.local_ranks import run_ranks
from charm_megatron.ops.options import CPOptions
from charm_megatron.ops.transport import (
    TorchTransport,
    get_transport,
    register_transport,
    transport_names,
)
from charm_megatron.plan import registry
from charm_megatron.plan.cost import Problem, traffic
from charm_megatron.topology import Topology
from dist_cases import local_part, local_reference, make_inputs, reference, rel_err

register_transport("counting", CountingTransport)  # the one line (here, and in each rank)

ROOT = Path(__file__).resolve().parents[1]
S, B, HQ, HKV, D = 16, 2, 4, 2, 8  # global rows 16 over 2 ranks


def _counted(rank: int, world: int, algo: str, topology: str | None):
    """One causal forward + backward of ``algo`` on the counting transport: float64 errors
    against the float64 reference (out, lse, dq, dk, dv), then a float32 call's bytes per
    peer (sent, received), and the handles one post gave."""
    opts = CPOptions(transport="counting")
    counter = get_transport("counting")
    q, k, v, dout = make_inputs(5, S, B, HQ, HKV, D)
    want = local_reference(reference(q, k, v, dout, True, D ** -0.5), rank, world, True)
    counts = {}
    errs = None
    for dtype in (torch.float64, torch.float32):
        counter.sent.clear()
        counter.received.clear()
        ql, kl, vl = (local_part(t, rank, world, True).to(dtype).requires_grad_()
                      for t in (q, k, v))
        out, lse = cp_attention(ql, kl, vl, algo=algo, topology=topology, causal=True,
                                return_lse=True, roles="paper", options=opts)
        out.backward(local_part(dout, rank, world, True).to(dtype))
        if dtype is torch.float64:
            errs = [rel_err(g, w) for g, w in zip((out, lse, ql.grad, kl.grad, vl.grad), want)]
        counts[str(dtype)] = (dict(counter.sent), dict(counter.received))
    return errs, counts, type(counter).__name__


@pytest.mark.parametrize("algo,topology,groups", [
    ("ring", None, ((0, 1),)),
    ("charm", "2x1", ((0,), (1,))),
])
def test_a_toy_transport_runs_a_plan_and_counts_its_bytes(algo, topology, groups):
    res = run_ranks(_counted, 2, algo, topology, timeout_s=120)
    if topology is not None:
        assert tuple(tuple(g) for g in Topology.parse(topology, cp_size=2).groups) == groups
    fwd, bwd = registry.plans(algo, groups, True, roles="paper")
    problem = Problem(B, S, HQ, HKV, D, elem=4)  # fp32: every tensor 4 bytes a value
    want = [sum(t.intra[r] + t.cross[r] for t in (traffic(fwd, problem, groups),
                                               traffic(bwd, problem, groups)))
            for r in range(2)]
    for rank, (errs, counts, kind) in enumerate(res):
        assert kind == "CountingTransport"
        assert max(errs) < 1e-12, (rank, errs)  # float64 end to end
        for dtype, (sent, received) in counts.items():
            peer = 1 - rank
            assert set(sent) == set(received) == {peer}, (dtype, sent, received)
            # what one rank sends its peer, the peer receives
            assert sent[peer] == res[peer][1][dtype][1][rank] > 0, dtype
        # the plan's byte count, exactly (fp32: the model's elements and stats alike)
        assert counts["torch.float32"][0][1 - rank] == want[rank], (rank, counts, want)


def test_registry():
    assert get_transport(None) is get_transport("torch")
    assert isinstance(get_transport(), TorchTransport)
    assert get_transport("counting") is get_transport("counting")  # one instance a process
    mine = CountingTransport()
    assert get_transport(mine) is mine and CPOptions(transport=mine).transport_name == "counting"
    assert transport_names()[0] == "torch" and "counting" in transport_names()
    with pytest.raises(ValueError, match="default transport"):
        register_transport("torch", CountingTransport)
    with pytest.raises(ValueError, match="CHARM_TRANSPORT.*not registered"):
        CPOptions(transport="pigeon")
    with pytest.raises(TypeError, match="transport"):
        CPOptions(transport=object())


def _dist_names(tree: ast.AST) -> set[str]:
    """Names bound to ``torch.distributed`` in a module (``import torch.distributed as dist``,
    ``from torch import distributed``); ``torch`` itself is checked by its attribute chain."""
    names = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            names |= {a.asname for a in node.names if a.name == "torch.distributed" and a.asname}
        elif isinstance(node, ast.ImportFrom) and node.module == "torch":
            names |= {a.asname or a.name for a in node.names if a.name == "distributed"}
    return names


def _is_dist(node: ast.AST, names: set[str]) -> bool:
    """``node`` is ``torch.distributed`` (a bound name, or the attribute chain)."""
    if isinstance(node, ast.Name):
        return node.id in names
    return (isinstance(node, ast.Attribute) and node.attr == "distributed"
            and isinstance(node.value, ast.Name) and node.value.id == "torch")


def dist_assignments(source: str) -> list[int]:
    """Lines of ``source`` that assign to an attribute of ``torch.distributed``: ``dist.x =``
    (also augmented, annotated, in tuples), ``del dist.x``, ``setattr(dist, ...)``,
    ``delattr(dist, ...)``."""
    tree = ast.parse(source)
    names = _dist_names(tree) | {"dist"}
    bad = []
    for node in ast.walk(tree):
        targets: list[ast.AST] = []
        if isinstance(node, ast.Assign):
            targets = node.targets
        elif isinstance(node, (ast.AugAssign, ast.AnnAssign)):
            targets = [node.target]
        elif isinstance(node, ast.Delete):
            targets = node.targets
        elif (isinstance(node, ast.Call) and isinstance(node.func, ast.Name)
              and node.func.id in ("setattr", "delattr") and node.args
              and _is_dist(node.args[0], names)):
            bad.append(node.lineno)
        flat: list[ast.AST] = []
        while targets:
            t = targets.pop()
            if isinstance(t, (ast.Tuple, ast.List)):
                targets.extend(t.elts)
            else:
                flat.append(t)
        bad += [t.lineno for t in flat
                if isinstance(t, ast.Attribute) and _is_dist(t.value, names)]
    return bad


def test_the_scan_finds_assignments():
    assert dist_assignments("import torch.distributed as d\nd.batch_isend_irecv = f\n") == [2]
    assert dist_assignments("import torch\ntorch.distributed.x = 1\n") == [2]
    assert dist_assignments("import torch.distributed as dist\nsetattr(dist, 'x', 1)\n") == [2]
    assert dist_assignments("from torch import distributed\na, distributed.y = 1, 2\n") == [2]
    assert dist_assignments("import torch.distributed as dist\nx = dist.get_rank()\n") == []


def test_nothing_in_the_package_assigns_to_torch_distributed():
    bad = {str(f.relative_to(ROOT)): lines
           for f in sorted((ROOT / "charm_megatron").rglob("*.py"))
           if (lines := dist_assignments(f.read_text()))}
    assert bad == {}, f"assigns to torch.distributed: {bad} (add a transport, ops/transport.py)"


def test_the_executor_moves_bytes_only_through_its_transport():
    """The executor's source names no torch.distributed point-to-point call."""
    text = (ROOT / "charm_megatron" / "ops" / "executor.py").read_text()
    for call in ("batch_isend_irecv", "P2POp", "isend", "irecv"):
        assert f"dist.{call}" not in text, call
