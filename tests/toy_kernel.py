"""A kernel backend added from outside as one file plus one line (``register_backend``): the
torch kernels with a deliberate error in dk (a kernel wrong on some driver), which the
self-check must catch. Importing this module registers it (as rank processes do)."""

from __future__ import annotations

from charm_megatron.kernels.registry import backend_names, make_backend, register_backend


class WrongDk:
    """The torch backend, but its dk is 3 % too large."""

    name = "toy-wrong-dk"

    def forward(self, q, k, v, causal, scale):
        return make_backend("torch").forward(q, k, v, causal, scale)

    def backward(self, dout, q, k, v, out, lse, causal, scale):
        dq, dk, dv = make_backend("torch").backward(dout, q, k, v, out, lse, causal, scale)
        return dq, dk * 1.03, dv


if WrongDk.name not in backend_names():
    register_backend(WrongDk.name, WrongDk)  # the one line
