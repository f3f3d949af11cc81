"""The backward's stand-in output (ops.row_delta.out_with_delta) gives the kernels the same
gradients as the real output for any finite dout: checked against the plain kernel with the
real output, one block, no communication."""

import pytest
import torch

from charm_megatron.kernels import get_backend
from charm_megatron.ops.row_delta import delta_exponent, out_with_delta, scaled_delta


def _rel(a, b):
    return ((a.double() - b.double()).norm() / b.double().norm().clamp_min(1e-300)).item()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float64])
@pytest.mark.parametrize("scale", [1e37, 1e30, 1.0, 1e-30, 1e-40])
def test_stand_in_matches_the_real_output(dtype, scale):
    if dtype == torch.bfloat16 and scale == 1e-40:
        pytest.skip("bf16 has almost no mantissa left at 1e-40; the fused kernel itself fails")
    g = torch.Generator().manual_seed(3)
    q, k, v = (torch.randn(16, 1, 4, 8, generator=g).to(dtype) for _ in range(3))
    dout = (torch.randn(16, 1, 4, 8, generator=g, dtype=torch.float64) * scale).to(dtype)
    dout[3, 0, 1] = 0  # a zero row stays zero
    be = get_backend("cpu", dtype, name="torch")
    out, lse = be.forward(q, k, v, True, 0.35)
    want = be.backward(dout, q, k, v, out, lse, True, 0.35)
    e = delta_exponent(dout)
    exact = torch.ldexp((dout.double() * out.double()).sum(-1), -e.double())
    delta = scaled_delta(dout, out, e)  # what the backward sends: fp32 for fp32 / bf16
    assert delta.dtype == (torch.float64 if dtype == torch.float64 else torch.float32)
    assert torch.isfinite(delta).all()
    assert _rel(delta, exact) < (1e-14 if dtype == torch.float64 else 1e-6)
    standin = out_with_delta(dout, delta.to(lse.dtype))
    assert torch.isfinite(standin).all()
    got = be.backward(dout, q, k, v, standin, lse, True, 0.35)
    tol = {torch.float32: 1e-5, torch.bfloat16: 2e-2, torch.float64: 1e-12}[dtype]
    if scale < 1e-38 and dtype == torch.float32:
        tol = 1e-3  # denormal dout: the kernel's own fp32 rowsum keeps only a few digits
    for a, b in zip(got, want):
        assert _rel(a, b) < tol
