"""Rank functions for the packed-sequence (THD) tests (module level: the forkserver pickles them).

The reference is written from the definition, independent of the kernels and the layout code's
internals: every document on its own, unpadded, float64 softmax attention (causal or full),
gradients by float64 autograd.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from charm_megatron import cp_attention
from charm_megatron.layout import thd_index

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp64": torch.float64}


def doc_lengths(kind: str, cp: int) -> tuple[list[int], list[int] | None]:
    """(real lengths, padded lengths or None when cu_seqlens_padded is omitted)."""
    c = 2 * cp

    def pad(n):
        return -(-n // c) * c

    if kind == "one":  # one document with padding at its end
        real = [3 * c - 1]
    elif kind == "short":  # many documents shorter than 2*cp (most chunks padding)
        real = [1, c - 1, 2, max(1, c // 2), 3 % c or 1, 1]
    elif kind == "unequal":  # very unequal lengths, padding in some
        real = [6 * c + 3, 1, c, 2 * c - 1]
    elif kind == "nopad":  # multiples of 2*cp, cu_seqlens_padded omitted
        return [2 * c, c, 3 * c], None
    elif kind == "odd":  # CP size 1 only: any lengths, no padding
        return [5, 1, 8, 3], None
    else:
        raise ValueError(kind)
    return real, [pad(n) for n in real]


def cumulative(lengths: list[int]) -> torch.Tensor:
    return torch.tensor([0] + list(torch.tensor(lengths).cumsum(0).tolist()), dtype=torch.int32)


def reference(q, k, v, dout, real: list[int], causal: bool, scale: float):
    """float64 out [T, hq, d], lse [hq, T], dq, dk, dv on the *unpadded* packed sequence."""
    q, k, v = (t.detach().double().requires_grad_() for t in (q, k, v))
    g = q.shape[1] // k.shape[1]
    outs, lses, start = [], [], 0
    for n in real:
        qd = q[start:start + n].transpose(0, 1)  # [hq, n, d]
        kd = k[start:start + n].transpose(0, 1).repeat_interleave(g, 0)
        vd = v[start:start + n].transpose(0, 1).repeat_interleave(g, 0)
        s = qd @ kd.transpose(1, 2) * scale
        if causal:
            s = s.masked_fill(torch.ones(n, n, dtype=torch.bool).triu(1), float("-inf"))
        lse = torch.logsumexp(s, -1)
        outs.append((torch.softmax(s, -1) @ vd).transpose(0, 1))
        lses.append(lse)
        start += n
    out, lse = torch.cat(outs), torch.cat(lses, 1)
    out.backward(dout.double())
    return out.detach(), lse.detach(), q.grad, k.grad, v.grad


def _pad_rows(x: torch.Tensor, real: list[int], padded: list[int]) -> torch.Tensor:
    """Unpadded packed rows -> padded packed rows (zeros after each document's tokens)."""
    out = x.new_zeros((sum(padded), *x.shape[1:]))
    a = p = 0
    for n, m in zip(real, padded):
        out[p:p + n] = x[a:a + n]
        a, p = a + n, p + m
    return out


def _real_mask(real: list[int], padded: list[int]) -> torch.Tensor:
    return torch.cat([torch.arange(m) < n for n, m in zip(real, padded)])


def by_document(attend, q, k, v, real: list[int]):
    """``attend(q, k, v)`` of each unpadded document (rows ``[n, h, d]`` in, ``(out [n, h, dv],
    lse [h, n])`` out) concatenated: ``(out [T, h, dv], lse [h, T])``."""
    outs, lses, start = [], [], 0
    for n in real:
        o, m = attend(q[start:start + n], k[start:start + n], v[start:start + n])
        outs.append(o)
        lses.append(m)
        start += n
    return torch.cat(outs), torch.cat(lses, 1)


def local_rows(real: list[int], padded: list[int] | None, rank: int, world: int):
    """``(local, mask)``: ``local(x)`` maps unpadded packed rows to this rank's padded THD rows
    (Megatron's THD CP layout; CP size 1 holds them all), ``mask`` its real (non-padding) rows."""
    pad_or_real = padded if padded is not None else real
    idx = (torch.arange(sum(pad_or_real)) if world == 1
           else thd_index(rank, world, cumulative(pad_or_real)))

    def local(x: torch.Tensor) -> torch.Tensor:
        return _pad_rows(x, real, pad_or_real)[idx]

    return local, _real_mask(real, pad_or_real)[idx]


def one_case(rank: int, world: int, algo: str, topology, causal: bool, dtype: str, hkv: int,
             docs: str, seed: int = 0, options=None, roles: str | None = None, hq: int = 4):
    """One packed forward+backward; returns (errors vs float64, padding-is-zero, results).
    ``roles``: cp_attention's role mix (None: its default); ``hq`` query heads."""
    dt = DTYPES[dtype]
    real, padded = doc_lengths(docs, world)
    pad_or_real = padded if padded is not None else real
    total = sum(real)
    d = 8
    gen = torch.Generator().manual_seed(seed)
    q, k, v, dout = (torch.randn(total, h, d, generator=gen, dtype=torch.float64).to(dt)
                     for h in (hq, hkv, hkv, hq))
    scale = d ** -0.5
    ref = reference(q, k, v, dout, real, causal, scale)
    # (CP size 1 holds the whole sequence: any lengths, no chunking)
    idx = (torch.arange(sum(pad_or_real)) if world == 1
           else thd_index(rank, world, cumulative(pad_or_real)))
    mask = _real_mask(real, pad_or_real)[idx]

    def local(x):
        return _pad_rows(x, real, pad_or_real)[idx]

    ql, kl, vl = (local(t).to(dt).requires_grad_() for t in (q, k, v))
    kw = {} if roles is None else {"roles": roles}
    out, lse = cp_attention(ql, kl, vl, algo=algo, topology=topology, causal=causal,
                            cu_seqlens=cumulative(real),
                            cu_seqlens_padded=None if padded is None else cumulative(padded),
                            return_lse=True, options=options, **kw)
    out.backward(local(dout).to(dt))
    assert out.shape == ql.shape and out.dtype == dt
    lse_dtype = torch.float64 if dt == torch.float64 else torch.float32  # one rule at any CP
    assert lse.shape == (hq, ql.shape[0]) and lse.dtype == lse_dtype, (lse.shape, lse.dtype)
    got = [out, lse, ql.grad, kl.grad, vl.grad]
    want = [local(ref[0]), local(ref[1].t()).t(), local(ref[2]), local(ref[3]), local(ref[4])]
    errs = {}
    for name, g_, w, full in zip(("out", "lse", "dq", "dk", "dv"), got, want, ref):
        if name == "lse":
            g_, w = g_[:, mask], w[:, mask]
        else:
            g_, w = g_[mask], w[mask]
        # Relative to this shard's norm, floored at a rank's share of the whole tensor's: some
        # shards' true dq is exactly zero (one-token documents), where bf16 leaves ~1e-2 noise.
        floor = full.norm().item() / world ** 0.5
        errs[name] = ((g_.double() - w).norm() / max(w.norm().item(), floor)).item()
    zero = all(bool((t[~mask] == 0).all()) for t in (out, ql.grad, kl.grad, vl.grad))
    return errs, zero, [t.detach().clone() for t in got]


def _run_case(rank: int, world: int, case: tuple):
    """``case``: (algo, topology, causal, dtype, hkv, docs[, roles, hq])."""
    base, extra = case[:6], case[6:]
    roles, hq = extra if extra else (None, 4)
    return one_case(rank, world, *base, roles=roles, hq=hq)


def run_packed_matrix(rank: int, world: int, cases: list[tuple], repeat: list[tuple]):
    """Many cases in one process group; cases in ``repeat`` also run twice (bitwise check)."""
    results = {}
    for case in cases:
        errs, zero, got = _run_case(rank, world, case)
        if case in repeat:
            _, _, again = _run_case(rank, world, case)
            errs["bitwise"] = all(torch.equal(a, b) for a, b in zip(got, again))
        results[case] = (errs, zero)
    return results


def packed_bad_input(rank: int, world: int, case: str):
    """Every rank calls with a bad packed input; returns the error it raised."""
    c = 2 * world
    cu = torch.tensor([0, c, 3 * c], dtype=torch.int32)
    kwargs = dict(cu_seqlens=cu)
    t = 3 * c // world
    q = torch.randn(t, 4, 8)
    k = v = torch.randn(t, 2, 8)
    if case == "decreasing":
        kwargs["cu_seqlens"] = torch.tensor([0, 3 * c, c, 3 * c], dtype=torch.int32)
    elif case == "length":
        q, k, v = q[:-2], k[:-2], v[:-2]
    elif case == "mismatch":  # same totals, different document boundaries on rank 0
        if rank == 0:
            kwargs["cu_seqlens"] = torch.tensor([0, 2 * c, 3 * c], dtype=torch.int32)
    elif case == "padded_multiple":
        kwargs.update(cu_seqlens=torch.tensor([0, c - 1, 3 * c - 2], dtype=torch.int32),
                      cu_seqlens_padded=torch.tensor([0, c + 1, 3 * c], dtype=torch.int32))
    elif case == "unpadded_multiple":
        kwargs["cu_seqlens"] = torch.tensor([0, c - 1, 3 * c], dtype=torch.int32)
    elif case == "padded_shorter":
        kwargs["cu_seqlens_padded"] = torch.tensor([0, c, 2 * c, 3 * c], dtype=torch.int32)
        kwargs["cu_seqlens"] = torch.tensor([0, 2 * c, 2 * c + 1, 3 * c], dtype=torch.int32)
    elif case == "float_cu":
        kwargs["cu_seqlens"] = cu.float()
    elif case == "not_3d":
        q = q.unsqueeze(1)
    elif case == "roles":
        kwargs["roles"] = "pepper"
    try:
        cp_attention(q, k, v, **kwargs)
    except (ValueError, TypeError) as exc:
        dist.barrier()  # every rank got here: nobody is left waiting in a collective
        return f"{type(exc).__name__}: {exc}"
    return None


def run_bad_inputs(rank: int, world: int, cases: list[str]):
    """All bad-input cases in one process group (each must leave no rank in a collective)."""
    return {case: packed_bad_input(rank, world, case) for case in cases}


def wire_sizes(rank: int, world: int, algo: str, topology, configs: list[tuple]):
    """Per ``(roles, hq, hkv)`` of ``configs`` (roles None: the default): element counts of
    every tensor this rank sends, packed (causal, padding present) and unpacked with the same
    local length and role mix: the plans move the same (half-)blocks."""
    import charm_megatron.ops.executor as ex

    sent: list[int] = []
    real_batch = ex.dist.batch_isend_irecv

    def recording(ops):
        sent.extend(op.tensor.numel() for op in ops if op.op is dist.isend)
        return real_batch(ops)

    ex.dist.batch_isend_irecv = recording
    results = {}
    try:
        for roles, hq, hkv in configs:
            kw = {} if roles is None else {"roles": roles}
            real, padded = doc_lengths("unequal", world)
            t = sum(padded) // world
            q = torch.randn(t, hq, 8, requires_grad=True)
            k = torch.randn(t, hkv, 8, requires_grad=True)
            v = torch.randn(t, hkv, 8, requires_grad=True)
            sent[:] = []
            out = cp_attention(q, k, v, algo=algo, topology=topology,
                               cu_seqlens=cumulative(real), cu_seqlens_padded=cumulative(padded),
                               **kw)
            out.sum().backward()
            packed, sent[:] = list(sent), []
            q4, k4, v4 = (x.detach().unsqueeze(1).requires_grad_() for x in (q, k, v))
            cp_attention(q4, k4, v4, algo=algo, topology=topology, **kw).sum().backward()
            results[(roles, hq, hkv)] = (packed, list(sent))
        return results
    finally:
        ex.dist.batch_isend_irecv = real_batch


# ------------------------------------------------------------------- the failure model
def _opts(**kw):
    from charm_megatron.ops.options import CPOptions

    return CPOptions(timeout_s=4.0, **kw)  # short bound: a broken case fails in seconds


def packed_mismatch(rank: int, world: int, case: str):
    """The last rank's packed call differs in ``case`` (algo, causal, cu_seqlens, dtype, roles,
    backward_order); returns (exception type, message, seconds) of every rank."""
    import time

    c = 2 * world
    real, padded = [3 * c - 1, c], [3 * c, c]
    kw = dict(algo="ring", causal=True, options=_opts())
    odd = rank == world - 1
    dtype = torch.float32
    if case == "algo" and odd:
        kw["algo"] = "rmplus"
    elif case == "causal" and odd:
        kw["causal"] = False
    elif case == "cu_seqlens" and odd:  # same totals, other document boundaries
        real, padded = [c - 1, 3 * c], [c, 3 * c]
    elif case == "dtype" and odd:
        dtype = torch.float64
    elif case == "roles":  # the role mix picks the plans: it is agreed on like the algorithm
        kw["algo"] = "charm"
        kw["topology"] = "flat"
        kw["roles"] = "paper" if odd else "bytes"
    t = sum(padded) // world
    g = torch.Generator().manual_seed(rank)
    q = torch.randn(t, 4, 8, generator=g).to(dtype).requires_grad_()
    k, v = (torch.randn(t, 2, 8, generator=g).to(dtype) for _ in range(2))
    kw.update(cu_seqlens=cumulative(real), cu_seqlens_padded=cumulative(padded))
    t0 = time.monotonic()
    try:
        if case == "backward_order":  # two calls, backwards in different orders
            qs = [q.detach().clone().requires_grad_() for _ in range(2)]
            outs = [cp_attention(x, k, v, **kw) for x in qs]
            for o in (outs[::-1] if odd else outs):
                o.sum().backward()
        else:
            cp_attention(q, k, v, **kw).sum().backward()
    except Exception as exc:  # noqa: BLE001 - the type is part of what the test checks
        return type(exc).__name__, str(exc), time.monotonic() - t0
    return "no error", "", time.monotonic() - t0


def packed_failure_then_normal_call(rank: int, world: int, algo: str, topology, where: str,
                                    bad_rank: int):
    """``bad_rank``'s 2nd ``where`` kernel call raises in a packed call; then every rank makes
    ordinary packed calls. Returns (error text of the failed call, its seconds, max error of
    the next calls vs the float64 reference)."""
    import time

    from dist_failure_cases import FailingBackend

    backend = FailingBackend(where, 2) if rank == bad_rank else "torch"
    t0 = time.monotonic()
    text = "no error"
    try:
        one_case(rank, world, algo, topology, True, "fp32", 2, "unequal",
                 options=_opts(backend=backend))
    except (RuntimeError, ValueError) as exc:  # CPAttentionError is a RuntimeError
        text = f"{type(exc).__name__}: {exc}"
    took = time.monotonic() - t0
    err = 0.0
    for seed, causal in ((11, True), (12, False)):
        errs, zero, _ = one_case(rank, world, algo, topology, causal, "fp32", 2, "unequal",
                                 seed=seed, options=_opts())
        err = max(err, *errs.values(), 0.0 if zero else 1.0)
    return text, took, err
