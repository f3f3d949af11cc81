"""A kernel backend checked against plain math before it computes anything that matters: one
small block, forward (out, lse) and backward (dq, dk, dv), against the float64 reference, per
(backend, device, dtype, head dim, mask), once per process. A kernel that is wrong on a user's
driver or library version is then never used (the selection warns and skips it; a forced one
raises), instead of training on wrong gradients."""

from __future__ import annotations

import functools

import torch

from charm_megatron.kernels.base import AttentionBackend
from charm_megatron.kernels.reference import ReferenceBackend

# Relative error (max |a - b| / max |b|) a correct kernel stays under, by input dtype: the
# half-precision inputs round every product; the reference is float64.
TOLERANCE = {torch.float16: 2e-2, torch.bfloat16: 5e-2, torch.float32: 2e-3,
             torch.float64: 1e-9}
# The block: GQA (2 query heads per kv head) and 96 rows, enough to cross the fused kernels'
# tile edges, small enough to cost milliseconds.
ROWS, BATCH, HEADS_Q, HEADS_KV = 96, 1, 4, 2


def _rel(got: torch.Tensor, want: torch.Tensor, absolute: bool = False) -> float:
    """Max error relative to the largest reference value (``absolute``: not divided; for the
    lse, a logarithm, whose error is already relative to what it measures)."""
    got, want = got.double(), want.double()
    finite = torch.isfinite(want)
    if not torch.equal(torch.isfinite(got), finite):
        return float("inf")
    scale = 1.0 if absolute else (want[finite].abs().max().item() or 1.0)
    return (got[finite] - want[finite]).abs().max().item() / scale


def check(backend: AttentionBackend, device: torch.device, dtype: torch.dtype, head_dim: int,
          causal: bool, v_head_dim: int | None = None) -> str | None:
    """What is wrong with ``backend`` on one block (``None``: within :data:`TOLERANCE` on out,
    dq, dk and dv relative to their largest value, and on lse absolutely). An exception is a
    failure, quoted."""
    gen = torch.Generator().manual_seed(1234)
    dv = v_head_dim or head_dim

    def draw(*shape: int) -> torch.Tensor:
        return torch.randn(*shape, generator=gen, dtype=torch.float64)

    q = draw(ROWS, BATCH, HEADS_Q, head_dim)
    k = draw(ROWS, BATCH, HEADS_KV, head_dim)
    v = draw(ROWS, BATCH, HEADS_KV, dv)
    dout = draw(ROWS, BATCH, HEADS_Q, dv)
    scale = head_dim ** -0.5
    ref = ReferenceBackend(torch.float64)
    out_r, lse_r = ref.forward(q, k, v, causal, scale)
    grads_r = ref.backward(dout, q, k, v, out_r, lse_r, causal, scale)
    cast = [t.to(device=device, dtype=dtype) for t in (q, k, v, dout)]
    try:
        out, lse = backend.forward(*cast[:3], causal, scale)
        grads = backend.backward(cast[3], *cast[:3], out, lse, causal, scale)
    except Exception as exc:  # noqa: BLE001 - any failure of the kernel is the finding
        return f"{type(exc).__name__}: {exc}"
    tol = TOLERANCE.get(dtype, 5e-2)
    errors = {name: _rel(got.cpu(), want, absolute=name == "lse") for name, got, want in
              (("out", out, out_r), ("lse", lse, lse_r), *zip(("dq", "dk", "dv"), grads, grads_r))}
    bad = {n: e for n, e in errors.items() if not e <= tol}
    if bad:
        shown = ", ".join(f"{n} {e:.2g}" for n, e in bad.items())
        return f"relative error {shown} over {tol:g} against float64 plain math"
    return None


@functools.cache
def cached_check(backend: AttentionBackend, device: torch.device, dtype: torch.dtype,
                 head_dim: int, causal: bool) -> str | None:
    """:func:`check`, once per process per key (backends are per-process singletons)."""
    return check(backend, device, dtype, head_dim, causal)
