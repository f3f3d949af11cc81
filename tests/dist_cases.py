"""Rank functions for the multi-rank tests (module level so the forkserver can pickle them)."""

from __future__ import annotations

import torch
import torch.distributed as dist

from charm_megatron import CPOptions, cp_attention
from charm_megatron.kernels.reference import ReferenceBackend
from charm_megatron.layout import shard

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}


def make_inputs(seed: int, s: int, b: int, hq: int, hkv: int, d: int):
    """Random full-sequence q, k, v, dout in float64 (identical on every rank)."""
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(s, b, hq, d, generator=g, dtype=torch.float64)
    k = torch.randn(s, b, hkv, d, generator=g, dtype=torch.float64)
    v = torch.randn(s, b, hkv, d, generator=g, dtype=torch.float64)
    dout = torch.randn(s, b, hq, d, generator=g, dtype=torch.float64)
    return q, k, v, dout


def reference(q, k, v, dout, causal: bool, scale: float):
    """float64 full-sequence out, lse [b, h, s], dq, dk, dv (plain math, no CP)."""
    ref = ReferenceBackend(torch.float64)
    out, lse = ref.forward(q, k, v, causal, scale)
    dq, dk, dv = ref.backward(dout, q, k, v, out, lse, causal, scale)
    return out, lse, dq, dk, dv


def local_part(x: torch.Tensor, rank: int, n: int, causal: bool, seq_dim: int = 0):
    if causal:
        return shard(x, rank, n, seq_dim=seq_dim)
    return x.chunk(n, dim=seq_dim)[rank]


def local_reference(ref, rank: int, n: int, causal: bool) -> list[torch.Tensor]:
    """This rank's part of a full-sequence reference ``(out, lse [b, h, s], dq, dk, dv)``."""
    return [local_part(ref[0], rank, n, causal), local_part(ref[1], rank, n, causal, 2),
            *(local_part(t, rank, n, causal) for t in ref[2:5])]


def rel_err(x: torch.Tensor, ref: torch.Tensor) -> float:
    return ((x.double() - ref.double()).norm() / ref.double().norm()).item()


def run_attention(rank: int, world: int, algo: str, topology, causal: bool, dtype: str,
                  s: int, b: int, hq: int, hkv: int, d: int, seed: int = 0):
    """One CP attention forward+backward; returns this rank's relative errors vs float64."""
    dt = DTYPES[dtype]
    q, k, v, dout = make_inputs(seed, s, b, hq, hkv, d)
    scale = d ** -0.5
    ref = reference(q, k, v, dout, causal, scale)
    ql, kl, vl = (local_part(t, rank, world, causal).to(dt).requires_grad_() for t in (q, k, v))
    out, lse = cp_attention(ql, kl, vl, algo=algo, topology=topology, causal=causal,
                            return_lse=True)
    out.backward(local_part(dout, rank, world, causal).to(dt))
    want = local_reference(ref, rank, world, causal)
    got = [out, lse, ql.grad, kl.grad, vl.grad]
    assert out.dtype == dt and lse.dtype == torch.float32
    assert lse.shape == (b, hq, s // world)
    return {name: rel_err(g, w) for name, g, w in zip(("out", "lse", "dq", "dk", "dv"), got, want)}


def run_twice_bitwise(rank: int, world: int, algo: str, topology, causal: bool):
    """Same inputs twice: outputs and gradients must be bitwise identical."""
    q, k, v, dout = make_inputs(1, 8 * world, 2, 4, 2, 16)
    results = []
    for _ in range(2):
        ql, kl, vl = (local_part(t, rank, world, causal).float().requires_grad_()
                      for t in (q, k, v))
        out = cp_attention(ql, kl, vl, algo=algo, topology=topology, causal=causal)
        out.backward(local_part(dout, rank, world, causal).float())
        results.append([out.detach(), ql.grad, kl.grad, vl.grad])
    return all(torch.equal(a, b) for a, b in zip(*results))


def bad_input(rank: int, world: int, case: str):
    """Each rank calls cp_attention with the same bad input; returns the error it raised."""
    s, b, h, d = 4 * world, 2, 4, 8
    q = torch.randn(s // world, b, h, d)
    k = torch.randn(s // world, b, h, d)
    v = torch.randn(s // world, b, h, d)
    kwargs = {}
    if case == "odd_seq":
        q, k, v = q[:3], k[:3], v[:3]
    elif case == "dtype":
        k = k.double()
    elif case == "batch":
        k, v = k[:, :1], v[:, :1]
    elif case == "head_dim":
        k, v = k[..., :4], v[..., :4]
    elif case == "gqa":
        k, v = k[:, :, :3], v[:, :, :3]
    elif case == "not_4d":
        q = q[0]
    elif case == "algo":
        kwargs["algo"] = "spiral"
    elif case == "topology_size":
        kwargs.update(algo="charm", topology="2x3")
    elif case == "topology_unequal":
        kwargs.update(algo="charm", topology="0-2,3")
    elif case.startswith("scale_"):
        kwargs["softmax_scale"] = {"scale_zero": 0.0, "scale_negative": -0.125,
                                   "scale_nan": float("nan"), "scale_inf": float("inf"),
                                   "scale_string": "0.1"}[case]
    elif case == "offset_shape":
        kwargs["softmax_offset"] = torch.zeros(h + 1)
    elif case == "offset_int":
        kwargs["softmax_offset"] = torch.zeros(h, dtype=torch.int64)
    elif case == "window_negative":
        kwargs["window_size"] = (-2, 0)
    elif case == "window_type":
        kwargs["window_size"] = 4
    elif case == "a2a_heads":  # kv heads 1 over 2 ranks: Ulysses cannot split them
        k, v = k[:, :, :1], v[:, :, :1]
        kwargs["algo"] = "a2a"
    elif case == "backend_flash_on_cpu":
        from charm_megatron.ops.options import CPOptions

        kwargs["options"] = CPOptions(backend="flash_attn")
    try:
        cp_attention(q, k, v, **kwargs)
    except (ValueError, TypeError, NotImplementedError) as exc:
        dist.barrier()  # every rank got here: nobody is left waiting in a collective
        return f"{type(exc).__name__}: {exc}"
    return None


def over_tolerance(per_rank: list[dict], tol_of) -> list[str]:
    """Every case, rank and quantity of a matrix run (``run_matrix``, or any runner returning
    per rank ``{case: {quantity: error}}``) whose error against the float64 reference is not
    below ``tol_of(case, quantity)``, as readable lines; ``vs_ring`` (agreement with ring, not
    a reference error) is left out."""
    return [f"{case} rank {r}: {name} {err:.3g}"
            for r, res in enumerate(per_rank) for case, errs in res.items()
            for name, err in errs.items() if name != "vs_ring" and not err < tol_of(case, name)]


def run_matrix(rank: int, world: int, cases: list[tuple], rows_per_rank: int = 8,
               head_dim: int = 16, heads: int = 8):
    """Run many (algo, topology, causal, dtype, hkv[, roles or settings]) cases in one process
    group (``roles``: cp_attention's role mix, or a tuple of ``(setting, value)`` pairs;
    absent: the defaults), ``rows_per_rank`` sequence rows
    on each rank, ``heads`` query heads.

    Returns per case the max relative errors vs the float64 reference and vs ring's result on
    the same inputs. The float64 reference sees the inputs after rounding to the test dtype,
    so the comparison measures the algorithm, not the input rounding.
    """
    results = {}
    ring_out = {}
    # The inputs and this rank's part of the float64 reference depend on the mask, dtype and
    # kv heads only: made once per such key, however many cases (algorithms, topologies,
    # settings) share it (never modified: the cases run on copies).
    inputs: dict[tuple, tuple] = {}
    s, b, hq, d = rows_per_rank * world, 2, heads, head_dim
    scale = d ** -0.5
    for case in cases:
        algo, topology, causal, dtype, hkv = case[:5]
        extra = {} if len(case) < 6 else ({"options": CPOptions(**dict(case[5]))}
                                          if isinstance(case[5], tuple)
                                          else {"roles": case[5]})
        dt = DTYPES[dtype]
        key = (causal, dtype, hkv)
        if key not in inputs:
            q, k, v, dout = (t.to(dt).double() for t in make_inputs(7, s, b, hq, hkv, d))
            ref = reference(q, k, v, dout, causal, scale)
            inputs[key] = (q, k, v, dout, local_reference(ref, rank, world, causal))
        q, k, v, dout, want = inputs[key]
        ql, kl, vl = (local_part(t, rank, world, causal).to(dt).requires_grad_()
                      for t in (q, k, v))
        out, lse = cp_attention(ql, kl, vl, algo=algo, topology=topology, causal=causal,
                                return_lse=True, **extra)
        out.backward(local_part(dout, rank, world, causal).to(dt))
        got = [out, lse, ql.grad, kl.grad, vl.grad]
        errs = {n: rel_err(g, w) for n, g, w in zip(("out", "lse", "dq", "dk", "dv"), got, want)}
        if algo == "ring":
            ring_out[key] = [t.detach().clone() for t in got]
        elif key in ring_out:
            errs["vs_ring"] = max(rel_err(g, w) for g, w in zip(got, ring_out[key]))
        results[tuple(case)] = errs
    return results


def peer_goes_missing(rank: int, world: int):
    """Rank 1 never joins; rank 0 must get an error within the timeout, not hang."""
    import time

    from dist_failure_cases import stay_absent_until_the_others_are_done, the_others_are_done

    if rank == 1:
        stay_absent_until_the_others_are_done(8)  # alive but absent: the worst case
        return None
    x = torch.randn(4, 1, 2, 8)
    t0 = time.monotonic()
    try:
        cp_attention(x, x, x, algo="ring")
    except Exception as exc:  # noqa: BLE001 - any error is the right outcome here
        return (type(exc).__name__, time.monotonic() - t0)
    finally:
        the_others_are_done()
    return ("no error", time.monotonic() - t0)


def run_auto(rank: int, world: int, topology: str):
    """algo='auto' picks an algorithm (the same on every rank) and matches ring."""
    from charm_megatron.model import choose_algo_cached
    from charm_megatron.plan.cost import Problem
    from charm_megatron.topology import Topology

    q, k, v, dout = make_inputs(3, 8 * world, 2, 4, 2, 16)
    outs = {}
    for algo in ("ring", "auto"):
        ql, kl, vl = (local_part(t, rank, world, True).float().requires_grad_() for t in (q, k, v))
        out = cp_attention(ql, kl, vl, algo=algo, topology=topology)
        out.backward(local_part(dout, rank, world, True).float())
        outs[algo] = [out.detach(), ql.grad, kl.grad, vl.grad]
    groups = tuple(tuple(g) for g in Topology.parse(topology, cp_size=world).groups)
    chosen = choose_algo_cached(groups, Problem(2, 8 * world, 4, 2, 16, 4), causal=True)
    err = max(rel_err(a, b) for a, b in zip(outs["auto"], outs["ring"]))
    return chosen, err


def run_partials(rank: int, world: int, cases: list[tuple], rows_per_rank: int = 8):
    """Each (algo, topology, causal) case in bf16 with ``CPOptions(partials=...)`` for both
    values: the max relative errors against the float64 reference, and the bytes this rank
    sent in each dtype (every ``dist.batch_isend_irecv`` of the call, real messages; the
    wrapper only counts them)."""
    from charm_megatron import CPOptions

    sent: dict[str, int] = {}
    real = dist.batch_isend_irecv

    def counting(ops):
        for op in ops:
            if op.op is dist.isend:
                key = str(op.tensor.dtype).removeprefix("torch.")
                sent[key] = sent.get(key, 0) + op.tensor.numel() * op.tensor.element_size()
        return real(ops)

    dist.batch_isend_irecv = counting
    try:
        results = {}
        s, b, hq, hkv, d = rows_per_rank * world, 2, 8, 4, 16
        for algo, topology, causal in cases:
            q, k, v, dout = (t.to(torch.bfloat16).double()
                             for t in make_inputs(11, s, b, hq, hkv, d))
            ref = reference(q, k, v, dout, causal, d ** -0.5)
            want = local_reference(ref, rank, world, causal)
            for partials in ("input", "fp32"):
                ql, kl, vl = (local_part(t, rank, world, causal).to(torch.bfloat16)
                              .requires_grad_() for t in (q, k, v))
                sent.clear()
                out, lse = cp_attention(ql, kl, vl, algo=algo, topology=topology,
                                        causal=causal, return_lse=True,
                                        options=CPOptions(partials=partials))
                out.backward(local_part(dout, rank, world, causal).to(torch.bfloat16))
                got = [out, lse, ql.grad, kl.grad, vl.grad]
                errs = {n: rel_err(g, w)
                        for n, g, w in zip(("out", "lse", "dq", "dk", "dv"), got, want)}
                results[(algo, topology, causal, partials)] = (errs, dict(sent))
        return results
    finally:
        dist.batch_isend_irecv = real
