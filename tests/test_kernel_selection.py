"""The automatic kernel choice (kernels/selection.py) and the kernels' self-check
(kernels/selfcheck.py), on the CPU backends: a deliberately wrong backend (tests/toy_kernel.py,
registered as one file plus one line) is caught, reported and never used; among correct ones
the measured fastest is picked; with none correct the call fails naming each."""

from __future__ import annotations

import warnings

import pytest
import torch
import toy_kernel

from charm_megatron.kernels import registry, selection, selfcheck
from charm_megatron.local_ranks import run_ranks

CPU = torch.device("cpu")


@pytest.fixture(autouse=True)
def fresh_choices():
    selection._CHOICES.clear()
    yield
    selection._CHOICES.clear()


class _Broken:
    """Backends wrong in one output each, or failing outright."""

    def __init__(self, what: str) -> None:
        self.what, self.name = what, f"broken-{what}"

    def forward(self, q, k, v, causal, scale):
        if self.what == "raises":
            raise RuntimeError("no kernel image for this device")
        out, lse = registry.make_backend("torch").forward(q, k, v, causal, scale)
        return (out, lse + 0.01) if self.what == "lse" else (out, lse)

    def backward(self, dout, q, k, v, out, lse, causal, scale):
        dq, dk, dv = registry.make_backend("torch").backward(dout, q, k, v, out, lse, causal,
                                                              scale)
        return (dq, dk, dv.flip(0)) if self.what == "dv" else (dq, dk, dv)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("causal", [True, False])
def test_the_cpu_backends_pass_their_self_check(dtype, causal):
    for name in ("torch", "reference"):
        assert selfcheck.check(registry.make_backend(name), CPU, dtype, 64, causal) is None


@pytest.mark.parametrize("what", ["lse", "dv", "raises"])
def test_the_self_check_names_what_is_wrong(what):
    why = selfcheck.check(_Broken(what), CPU, torch.float32, 32, True)
    assert why is not None
    assert {"lse": "lse", "dv": "dv", "raises": "no kernel image"}[what] in why
    assert selfcheck.check(toy_kernel.WrongDk(), CPU, torch.float32, 32, True).startswith(
        "relative error dk")


def test_a_wrong_backend_is_reported_and_not_used():
    with pytest.warns(RuntimeWarning, match="'toy-wrong-dk' failed its self-check"):
        choice = selection.choose(CPU, torch.float32, 32, True, ("toy-wrong-dk", "torch"))
    assert choice.picked == "torch"
    assert [n for n, _ in choice.refused] == ["toy-wrong-dk"]
    # Made once per process: the second ask neither warns nor checks again.
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert selection.choose(CPU, torch.float32, 32, True,
                                ("toy-wrong-dk", "torch")) is choice


def test_the_measured_fastest_correct_backend_is_picked():
    times = {"torch": 2.0, "reference": 1.0}
    choice = selection.choose(CPU, torch.float32, 32, False, ("torch", "reference"),
                              timer=lambda be, *a: times[be.name])
    assert choice.picked == "reference" and dict(choice.seconds) == times
    times = {"torch": 1.0, "reference": 2.0}
    assert selection.choose(CPU, torch.float32, 32, True, ("torch", "reference"),
                            timer=lambda be, *a: times[be.name]).picked == "torch"
    # The real timer measures something.
    assert selection.time_backend(registry.make_backend("torch"), CPU, torch.float32, 32,
                                  True) > 0


def test_no_correct_backend_fails_the_call_naming_each():
    with pytest.warns(RuntimeWarning), pytest.raises(RuntimeError,
                                                     match="no attention kernel passed"):
        selection.choose(CPU, torch.float32, 32, True, ("toy-wrong-dk",))


def test_auto_backend_runs_the_pick_per_key():
    auto = selection.AutoBackend(("toy-wrong-dk", "torch"))
    q = torch.randn(16, 1, 2, 32)
    with pytest.warns(RuntimeWarning):
        out, lse = auto.forward(q, q, q, True, 0.2)
    want = registry.make_backend("torch").forward(q, q, q, True, 0.2)
    assert torch.equal(out, want[0]) and torch.equal(lse, want[1])
    assert selection.AutoBackend(("torch",)).name == "torch"


def test_registering_a_backend_twice_is_refused():
    with pytest.raises(ValueError, match="already registered"):
        registry.register_backend("torch", lambda: None)
    assert "toy-wrong-dk" in registry.backend_names()
    assert "cudnn" not in registry.available_backends("cpu")
    assert registry.why_not("cudnn", "cpu", torch.bfloat16) == "cuDNN attention runs on CUDA only"


def test_cp_attention_on_gloo_ranks_never_trains_on_the_wrong_kernel():
    for res in run_ranks(_case(), 2, timeout_s=180):
        assert max(res["errors"].values()) < 1e-5, res["errors"]
        assert any("toy-wrong-dk" in w for w in res["warned"])
        assert res["picked"] == ["torch"]


def _case():
    import kernel_selection_cases

    return kernel_selection_cases.wrong_kernel_is_not_used
