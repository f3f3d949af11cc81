"""Rank functions for tests/test_adversarial_sink_window.py (module level: the forkserver
pickles them): softmax offsets (sinks) whose values differ between ranks or are not finite,
a learnable sink that changes every step, sinks on packed THD with padding rows, the per-rank
sink gradient of every algorithm, and windows that are written differently but are the same
mask (or really differ).

References are float64 and written from the definition (tests/sink_cases.py,
tests/window_cases.py); a rank's share of the sink gradient is the float64 autograd gradient
of the offset with ``dout`` kept on that rank's query rows only (zero elsewhere), which is
independent of the formula ops/softmax_offset.py uses.
"""

from __future__ import annotations

import functools
import time

import torch
import torch.distributed as dist

import packed_cases
import window_cases
from charm_megatron import cp_attention
from charm_megatron.layout import thd_index
from charm_megatron.ops.options import CPOptions
from dist_cases import local_part, local_reference, make_inputs, rel_err
from sink_cases import _attend_with_sink, sbhd_reference

TIMEOUT_S = 20.0


def _opts() -> CPOptions:
    return CPOptions(timeout_s=TIMEOUT_S)


def _count_transfers() -> list[int]:
    """Count this process's point-to-point batches from now on (every transfer of a plan or
    of a head all-to-all is one ``batch_isend_irecv``; the agreement runs on the control
    channel's ``all_to_all_single``)."""
    count = [0]
    real = dist.batch_isend_irecv

    def counted(ops):
        count[0] += 1
        return real(ops)

    dist.batch_isend_irecv = counted
    return count


def _outcome(fn) -> tuple[str, str]:
    try:
        fn()
    except Exception as exc:  # noqa: BLE001 - the test reads what was raised
        return type(exc).__name__, str(exc)
    return "ok", ""


def _sink_inputs(world: int, causal: bool, seed: int = 21, hq: int = 4, hkv: int = 2):
    s, b, d = 8 * world, 2, 8
    q, k, v, dout = make_inputs(seed, s, b, hq, hkv, d)
    gen = torch.Generator().manual_seed(seed + 1)
    offset = torch.randn(hq, generator=gen, dtype=torch.float64) * 2
    return q, k, v, dout, offset, d ** -0.5


def _sink_call(rank: int, world: int, algo: str, topology, causal: bool, q, k, v, dout,
               offset) -> dict:
    """One float64 forward + backward with a learnable offset: this rank's errors of out,
    lse, dq, dk, dv against the float64 reference and of the offset gradient summed over the
    ranks."""
    ref = sbhd_reference(q, k, v, dout, offset, causal, q.shape[-1] ** -0.5)
    ql, kl, vl = (local_part(t, rank, world, causal).requires_grad_() for t in (q, k, v))
    off = offset.clone().requires_grad_()
    out, lse = cp_attention(ql, kl, vl, algo=algo, topology=topology, causal=causal,
                            return_lse=True, softmax_offset=off, options=_opts())
    out.backward(local_part(dout, rank, world, causal))
    want = local_reference(ref, rank, world, causal)
    errs = {n: rel_err(g, w) for n, g, w in
            zip(("out", "lse", "dq", "dk", "dv"), (out, lse, ql.grad, kl.grad, vl.grad), want)}
    total = off.grad.clone()
    dist.all_reduce(total)
    errs["doffset"] = rel_err(total, ref[5])
    return errs


# ----------------------------------------------------------------------- issue 3: values
def offset_values_differ(rank: int, world: int, algo: str, topology, bad: str) -> dict:
    """Every rank passes a softmax offset of the same shape and dtype; rank 1's values differ
    (``bad="values"``: one head off by 0.25) or hold a NaN / an inf (``bad="nan"`` /
    ``"inf"``). Returns what the call raised on this rank, how many transfer batches it
    posted (must be 0: refused before any data moves), and the errors of a correct call
    right after (the CP group stays usable)."""
    causal = True
    q, k, v, dout, offset, _ = _sink_inputs(world, causal)
    mine = offset.clone()
    if rank == 1:
        mine[2] = {"values": mine[2] + 0.25, "nan": float("nan"), "inf": float("inf")}[bad]
    ql, kl, vl = (local_part(t, rank, world, causal).requires_grad_() for t in (q, k, v))
    moved = _count_transfers()
    kind, text = _outcome(lambda: cp_attention(ql, kl, vl, algo=algo, topology=topology,
                                               causal=causal, softmax_offset=mine,
                                               options=_opts()))
    transfers = moved[0]
    after = _sink_call(rank, world, algo, topology, causal, q, k, v, dout, offset)
    return {"kind": kind, "text": text, "transfers": transfers, "after": after}


def learnable_sink_steps(rank: int, world: int, algo: str, topology, steps: int = 3) -> list:
    """A learnable sink as megatron-core keeps it: one parameter, updated in place after
    every step with the all-reduced gradient (identical on every rank, different every step).
    Per step: the errors of out, dq, the summed offset gradient against float64; forward and
    backward must both pass the agreement every step."""
    causal = True
    q, k, v, dout, offset, scale = _sink_inputs(world, causal, seed=31)
    param = offset.clone().requires_grad_()
    results = []
    for _ in range(steps):
        ref = sbhd_reference(q, k, v, dout, param.detach(), causal, scale)
        ql, kl, vl = (local_part(t, rank, world, causal).requires_grad_() for t in (q, k, v))
        param.grad = None
        out = cp_attention(ql, kl, vl, algo=algo, topology=topology, causal=causal,
                           softmax_offset=param, options=_opts())
        out.backward(local_part(dout, rank, world, causal))
        grad = param.grad.clone()
        dist.all_reduce(grad)
        want = local_reference(ref, rank, world, causal)
        results.append({"out": rel_err(out, want[0]), "dq": rel_err(ql.grad, want[2]),
                        "doffset": rel_err(grad, ref[5])})
        with torch.no_grad():  # the optimizer step: the same on every rank
            param -= 0.5 * grad
    return results


# ------------------------------------------------------------ issue 4: packed THD padding
def _packed_reference(q, k, v, dout, offset, real: list[int], causal: bool):
    """float64 out ``[T, hq, d]``, lse ``[hq, T]``, dq, dk, dv, d offset of the unpadded packed
    documents with a sink."""
    qr, kr, vr, orr = (t.detach().clone().requires_grad_() for t in (q, k, v, offset))
    attend = functools.partial(_attend_with_sink, offset=orr, causal=causal,
                               scale=q.shape[-1] ** -0.5)
    out, lse = packed_cases.by_document(attend, qr, kr, vr, real)
    out.backward(dout)
    return out.detach(), lse.detach(), qr.grad, kr.grad, vr.grad, orr.grad


def packed_sink_padding(rank: int, world: int, cases: list[tuple]) -> dict:
    """Packed documents with padding and a learnable sink, ``dout`` random (non-zero) at the
    padding rows too. Per case ``(algo, topology, causal, docs)``: errors of out, lse, dq,
    dk, dv at real rows; ``lse_padding`` (1.0 unless every padding row's lse is -inf),
    ``zero_padding`` (1.0 unless out, dq, dk, dv are zero there), and the errors of this
    rank's offset gradient against its real rows' float64 share and of the summed one."""
    results = {}
    hq, hkv, d = 4, 2, 8
    for case in cases:
        algo, topology, causal, docs = case
        real, padded = packed_cases.doc_lengths(docs, world)
        gen = torch.Generator().manual_seed(9)
        q, k, v, dout = (torch.randn(sum(real), h, d, generator=gen, dtype=torch.float64)
                         for h in (hq, hkv, hkv, hq))
        offset = torch.randn(hq, generator=gen, dtype=torch.float64) * 2
        local, mask = packed_cases.local_rows(real, padded, rank, world)

        ref = _packed_reference(q, k, v, dout, offset, real, causal)
        # This rank's real rows' share of d offset: dout kept on its real rows only.
        keep = torch.zeros(sum(padded), dtype=torch.bool)
        keep[thd_index(rank, world, packed_cases.cumulative(padded))] = True
        unpadded_keep = torch.cat([keep[p0:p0 + n] for p0, n in
                                   zip(packed_cases.cumulative(padded)[:-1].tolist(), real)])
        share = _packed_reference(q, k, v, dout * unpadded_keep.view(-1, 1, 1), offset, real,
                                  causal)[5]

        ql, kl, vl = (local(t).requires_grad_() for t in (q, k, v))
        dl = local(dout)
        dl[~mask] = torch.randn(int((~mask).sum()), hq, d, generator=gen, dtype=torch.float64)
        off = offset.clone().requires_grad_()
        out, lse = cp_attention(
            ql, kl, vl, algo=algo, topology=topology, causal=causal, return_lse=True,
            cu_seqlens=packed_cases.cumulative(real),
            cu_seqlens_padded=packed_cases.cumulative(padded), softmax_offset=off,
            options=_opts())
        out.backward(dl)
        errs = window_cases.real_rows_errors(local, mask, ref, (out, lse, ql.grad, kl.grad, vl.grad))
        errs["lse_padding"] = 0.0 if bool((lse[:, ~mask] == float("-inf")).all()) else 1.0
        errs["zero_padding"] = 0.0 if all(bool((t[~mask] == 0).all()) for t in
                                          (out, ql.grad, kl.grad, vl.grad)) else 1.0
        errs["doffset_rank"] = rel_err(off.grad, share)
        total = off.grad.clone()
        dist.all_reduce(total)
        errs["doffset"] = rel_err(total, ref[5])
        results[case] = errs
    return results


# --------------------------------------------------- issue 5: per-rank sink gradient rule
def per_rank_sink_grad(rank: int, world: int, cases: list[tuple]) -> dict:
    """Per case ``(algo, topology, causal)``, float64 sbhd with GQA: the error of this rank's
    offset gradient against the float64 share of its own query rows (the gradient with
    ``dout`` kept on those rows only), and of the sum over the ranks against the whole."""
    results = {}
    for case in cases:
        algo, topology, causal = case
        q, k, v, dout, offset, scale = _sink_inputs(world, causal, seed=41, hq=8, hkv=4)
        rows = local_part(torch.arange(q.shape[0]), rank, world, causal)
        mine = torch.zeros_like(dout)
        mine[rows] = dout[rows]
        whole = sbhd_reference(q, k, v, dout, offset, causal, scale)[5]
        share = sbhd_reference(q, k, v, mine, offset, causal, scale)[5]
        ql, kl, vl = (local_part(t, rank, world, causal).requires_grad_() for t in (q, k, v))
        off = offset.clone().requires_grad_()
        out = cp_attention(ql, kl, vl, algo=algo, topology=topology, causal=causal,
                           softmax_offset=off, options=_opts())
        out.backward(local_part(dout, rank, world, causal))
        total = off.grad.clone()
        dist.all_reduce(total)
        results[case] = {"doffset_rank": rel_err(off.grad, share),
                         "doffset": rel_err(total, whole)}
    return results


# ------------------------------------------------------------ issue 7: effective windows
def window_variants(rank: int, world: int, algo: str, topology, causal: bool, mine,
                    others, ref_window) -> dict:
    """Rank 0 passes ``window_size=mine``, the others ``others``; ``ref_window`` (``None``:
    the two differ, the call must be refused) is the mask both mean. Returns what the call
    raised, the transfer batches it posted before raising, and on success this rank's errors
    against float64; then a plain call, which must work whatever happened."""
    q, k, v, dout = make_inputs(17, 8 * world, 2, 4, 2, 8)
    scale = 8 ** -0.5
    ql, kl, vl = (local_part(t, rank, world, causal).requires_grad_() for t in (q, k, v))
    window = mine if rank == 0 else others
    moved = _count_transfers()
    got: dict = {}

    def call():
        out, lse = cp_attention(ql, kl, vl, algo=algo, topology=topology, causal=causal,
                                return_lse=True, window_size=window, options=_opts())
        out.backward(local_part(dout, rank, world, causal))
        got["res"] = (out, lse, ql.grad, kl.grad, vl.grad)

    kind, text = _outcome(call)
    result = {"kind": kind, "text": text, "transfers": moved[0]}
    if kind == "ok" and ref_window is not None:
        ref = window_cases.reference(q, k, v, dout, causal, ref_window, scale)
        want = local_reference(ref, rank, world, causal)
        result["errs"] = {n: rel_err(g, w) for n, g, w in
                          zip(("out", "lse", "dq", "dk", "dv"), got["res"], want)}
    ref = window_cases.reference(q, k, v, dout, causal, (-1, -1), scale)
    out = cp_attention(*(local_part(t, rank, world, causal) for t in (q, k, v)), algo=algo,
                       topology=topology, causal=causal, options=_opts())
    result["after"] = rel_err(out, local_reference(ref, rank, world, causal)[0])
    return result


def thd_window_variants(rank: int, world: int, algo: str, topology, causal: bool, mine,
                        others, ref_window) -> dict:
    """As :func:`window_variants` on packed documents (the window measured inside each)."""
    real, padded = packed_cases.doc_lengths("unequal", world)
    hq, hkv, d = 4, 2, 8
    gen = torch.Generator().manual_seed(19)
    q, k, v, dout = (torch.randn(sum(real), h, d, generator=gen, dtype=torch.float64)
                     for h in (hq, hkv, hkv, hq))
    local, mask = packed_cases.local_rows(real, padded, rank, world)
    ql, kl, vl = (local(t).requires_grad_() for t in (q, k, v))
    window = mine if rank == 0 else others
    t0 = time.monotonic()
    kind, text = "ok", ""
    try:
        out, lse = cp_attention(
            ql, kl, vl, algo=algo, topology=topology, causal=causal, return_lse=True,
            cu_seqlens=packed_cases.cumulative(real),
            cu_seqlens_padded=packed_cases.cumulative(padded), window_size=window,
            options=_opts())
        out.backward(local(dout))
    except Exception as exc:  # noqa: BLE001 - the test reads what was raised
        kind, text = type(exc).__name__, str(exc)
    result = {"kind": kind, "text": text, "took": time.monotonic() - t0}
    if kind == "ok":
        ref = window_cases._doc_reference(q, k, v, dout, real, causal, ref_window, d ** -0.5)
        errs = window_cases.real_rows_errors(local, mask, ref, (out, lse, ql.grad, kl.grad, vl.grad))
        result["errs"] = errs
    return result
