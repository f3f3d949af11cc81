"""Each kernel backend against the plain-math reference (float64), forward and backward."""

import pytest
import torch

from charm_megatron.kernels import available_backends, get_backend
from charm_megatron.kernels.reference import ReferenceBackend
from charm_megatron.kernels.registry import BACKENDS
from charm_megatron.ops.options import kernel_backend

REF = ReferenceBackend(torch.float64)


def _rand(*shape, seed):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(*shape, generator=g, dtype=torch.float64)


def _naive(q, k, v, causal, scale):
    # Repeat kv heads explicitly: an independent formulation of GQA.
    g = q.shape[2] // k.shape[2]
    k, v = k.repeat_interleave(g, 2), v.repeat_interleave(g, 2)
    s = torch.einsum("qbhd,kbhd->bhqk", q, k) * scale
    if causal:
        s = s.masked_fill(torch.ones(q.shape[0], k.shape[0], dtype=torch.bool).triu(1), -torch.inf)
    lse = torch.logsumexp(s, -1)
    return torch.einsum("bhqk,kbhd->qbhd", torch.softmax(s, -1), v), lse


@pytest.mark.parametrize("causal", [True, False])
@pytest.mark.parametrize("hkv", [4, 2, 1])
def test_reference_matches_naive_and_autograd(causal, hkv):
    q, k, v = _rand(6, 2, 4, 8, seed=1), _rand(6, 2, hkv, 8, seed=2), _rand(6, 2, hkv, 8, seed=3)
    out, lse = REF.forward(q, k, v, causal, 0.3)
    n_out, n_lse = _naive(q, k, v, causal, 0.3)
    torch.testing.assert_close(out, n_out)
    torch.testing.assert_close(lse, n_lse)
    qa, ka, va = (t.clone().requires_grad_() for t in (q, k, v))
    dout = _rand(6, 2, 4, 8, seed=4)
    _naive(qa, ka, va, causal, 0.3)[0].backward(dout)
    dq, dk, dv = REF.backward(dout, q, k, v, out, lse, causal, 0.3)
    for got, want in ((dq, qa.grad), (dk, ka.grad), (dv, va.grad)):
        torch.testing.assert_close(got, want)


# The built-in backends usable here (not those tests register, e.g. tests/toy_kernel.py).
@pytest.mark.parametrize("backend", [b for b in available_backends("cpu")
                                     if b in BACKENDS and b != "reference"])
@pytest.mark.parametrize("dtype,tol", [(torch.float32, 2e-5), (torch.bfloat16, 3e-2)])
# 384 rows: a causal square block the CPU backend cuts into pieces (kernels/causal_split.py).
@pytest.mark.parametrize("causal,sq,sk", [(True, 16, 16), (False, 16, 16), (False, 8, 24),
                                         (True, 384, 384)])
@pytest.mark.parametrize("hkv", [8, 2, 1])
def test_backend_against_reference(backend, dtype, tol, causal, sq, sk, hkv):
    be = get_backend("cpu", dtype, name=backend)
    q = _rand(sq, 2, 8, 32, seed=5)
    k, v = _rand(sk, 2, hkv, 32, seed=6), _rand(sk, 2, hkv, 32, seed=7)
    dout = _rand(sq, 2, 8, 32, seed=8)
    scale = 32 ** -0.5
    r_out, r_lse = REF.forward(q, k, v, causal, scale)
    r_grads = REF.backward(dout, q, k, v, r_out, r_lse, causal, scale)
    qd, kd, vd, dd = (t.to(dtype) for t in (q, k, v, dout))
    out, lse = be.forward(qd, kd, vd, causal, scale)
    assert out.shape == q.shape and out.dtype == dtype
    assert lse.shape == (2, 8, sq) and lse.dtype == torch.float32

    def rel(a, b):
        return ((a.double() - b).norm() / b.norm()).item()

    assert rel(out, r_out) < tol
    assert rel(lse, r_lse) < tol
    grads = be.backward(dd, qd, kd, vd, out, lse, causal, scale)
    for got, want in zip(grads, r_grads):
        assert got.shape == want.shape
        assert rel(got, want) < tol


def test_backend_override_and_errors():
    from charm_megatron.ops.options import CPOptions

    assert get_backend("cpu", torch.float32, name="reference").name == "reference"
    with pytest.raises(ValueError, match="CHARM_ATTN_BACKEND"):
        get_backend("cpu", torch.float32, name="nonsense")
    # The variable is read at the API edge only, into the options
    opts = CPOptions.from_env({"CHARM_ATTN_BACKEND": "reference"})
    assert kernel_backend(opts, torch.device("cpu"), torch.float32).name == "reference"
    assert get_backend("cpu", torch.float32).name == "torch"


def test_causal_needs_equal_lengths():
    be = get_backend("cpu", torch.float32)
    q, k = torch.randn(4, 1, 2, 8), torch.randn(6, 1, 2, 8)
    with pytest.raises(ValueError, match="equal q and kv lengths"):
        be.forward(q, k, k, True, 1.0)


@pytest.mark.parametrize("s", [192, 384, 1024])
@pytest.mark.parametrize("hkv", [4, 1])
def test_causal_split_matches_the_whole_block(s, hkv):
    """The cut pieces (1 to 3 levels deep) give the whole causal block's gradients."""
    from charm_megatron.kernels import causal_split

    q = _rand(s, 2, 4, 16, seed=11).permute(1, 2, 0, 3)  # [b, h, s, d] strided views
    k = _rand(s, 2, hkv, 16, seed=12).permute(1, 2, 0, 3)
    v = _rand(s, 2, hkv, 16, seed=13).permute(1, 2, 0, 3)
    dout = _rand(s, 2, 4, 16, seed=14).permute(1, 2, 0, 3)
    assert causal_split.worth_cutting(q, k, True)
    out, lse = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(q, k, v, 0.0, True,
                                                                          scale=0.25)
    want = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward(
        dout, q, k, v, out, lse, 0.0, True, scale=0.25)
    got = causal_split.backward(dout, q, k, v, out, lse, 0.25)
    for g, w in zip(got, want):
        torch.testing.assert_close(g, w, rtol=1e-11, atol=1e-11)


def test_causal_split_leaves_other_blocks_whole():
    from charm_megatron.kernels import causal_split

    def block(sq, sk):
        return torch.zeros(1, 1, sq, 8), torch.zeros(1, 1, sk, 8)

    assert not causal_split.worth_cutting(*block(384, 384), False)  # no mask: nothing wasted
    assert not causal_split.worth_cutting(*block(192, 384), True)   # not square
    assert not causal_split.worth_cutting(*block(128, 128), True)   # too short to pay
    assert causal_split.worth_cutting(*block(2048, 2048), True)


@pytest.mark.parametrize("s", [192, 384, 1024])
def test_forward_pieces_cover_the_causal_triangle_once(s):
    from charm_megatron.kernels import causal_split

    pieces = causal_split.forward_pieces(s)
    assert len(pieces) > 1  # these sizes are cut
    hits = torch.zeros(s, s, dtype=torch.int64)
    for rows, keys, causal in pieces:
        block = torch.ones(rows.stop - rows.start, keys.stop - keys.start, dtype=torch.int64)
        if causal:
            assert rows == keys  # a causal piece is a smaller square on the diagonal
            block = block.tril()
        hits[rows, keys] += block
    assert torch.equal(hits, torch.ones(s, s, dtype=torch.int64).tril())
    assert causal_split.forward_pieces(128) == [(slice(0, 128), slice(0, 128), True)]


@pytest.mark.parametrize("s", [192, 384, 1024])
def test_executor_cut_forward_tile_matches_the_whole_block(s):
    """A causal square tile accumulated in pieces (ops/executor.py) equals the whole-block
    kernel's output and lse."""
    from charm_megatron.kernels import causal_split
    from charm_megatron.kernels.torch_backend import TorchBackend
    from charm_megatron.ops.executor import BlockShape, Executor
    from charm_megatron.plan.core import Half, Kind, Loc, Reset, Tile, TileSpec

    q, k, v = _rand(s, 2, 4, 32, seed=21), _rand(s, 2, 2, 32, seed=22), _rand(s, 2, 2, 32, seed=23)
    want_out, want_lse = TorchBackend().forward(q, k, v, True, 0.25)
    ex = Executor(None, TorchBackend(), BlockShape(s, 2, 4, 2, 32, torch.float64,
                                                   torch.device("cpu")), 0.25)
    spec = TileSpec(0, 0, Half.FULL, Half.FULL, True)
    assert ex._forward_cut(spec, q, k) is not None
    assert ex._forward_cut(spec, q[..., :16], k[..., :16]) is None  # narrow heads stay whole
    ex.set_own("own.q", "q", q)
    ex.set_own("own.kv", "kv", k, v)
    acc = Loc("acc.out")
    ex.interpret(Reset(acc, Kind.OUT, 0))
    ex.interpret(Tile(TileSpec(0, 0, Half.FULL, Half.FULL, True), Loc.own(Kind.Q),
                      Loc.own(Kind.KV), acc))
    got_out, got_lse = ex.result(acc)
    torch.testing.assert_close(got_out, want_out, rtol=1e-11, atol=1e-11)
    torch.testing.assert_close(got_lse, want_lse.permute(2, 0, 1), rtol=1e-11, atol=1e-11)
    assert causal_split.worth_cutting_forward(s, s, True, head_dim=32)
    assert not causal_split.worth_cutting_forward(s, s, False, head_dim=32)
    assert not causal_split.worth_cutting_forward(s, s, True, head_dim=16)
