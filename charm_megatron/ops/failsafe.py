"""Keep a plan's transfers whole when a kernel raises on one rank.

A rank that stops half-way through a plan leaves its peers waiting for transfers that never
come, and its own posted transfers dangling: the CP group is unusable afterwards. So the
kernels run behind :class:`GuardedBackend`: the first exception is recorded and every kernel
call from then on returns zeros of the right shapes (an empty partial: output 0, lse -inf), so
the rank still posts and completes every transfer of the plan. After the plan, the status
exchange (ops/agreement.py) tells every rank that this one failed; they all raise, and the
communicators stay healthy for the next call.
"""

from __future__ import annotations

import torch

from charm_megatron.kernels.base import AttentionBackend


class GuardedBackend:
    """A kernel backend whose first exception is recorded instead of raised (see module)."""

    def __init__(self, inner: AttentionBackend) -> None:
        self.inner = inner
        self.name = inner.name
        self.error: Exception | None = None

    def forward(self, q, k, v, causal, scale):
        if self.error is None:
            try:
                return self.inner.forward(q, k, v, causal, scale)
            except Exception as exc:  # noqa: BLE001 - reported after the plan, on every rank
                self.error = exc
        lse_dtype = torch.float64 if q.dtype == torch.float64 else torch.float32
        lse = torch.full((q.shape[1], q.shape[2], q.shape[0]), float("-inf"), dtype=lse_dtype,
                         device=q.device)
        return q.new_zeros((*q.shape[:-1], v.shape[-1])), lse  # out has v's head dim

    def __getattr__(self, name: str):
        # The inner backend's optional hooks (a timed device's posted / waited / merged /
        # problem_scale): what it does not have, this one does not either.
        if name.startswith("__") or name == "inner":
            raise AttributeError(name)
        return getattr(self.inner, name)

    def forward_cut(self, q, k, causal):
        # How the inner backend would cut a tile (its optional forward_cut), else whole.
        cut = getattr(self.inner, "forward_cut", None)
        return cut(q, k, causal) if cut is not None else None

    def backward(self, dout, q, k, v, out, lse, causal, scale):
        if self.error is None:
            try:
                return self.inner.backward(dout, q, k, v, out, lse, causal, scale)
            except Exception as exc:  # noqa: BLE001 - reported after the plan, on every rank
                self.error = exc
        return torch.zeros_like(q), torch.zeros_like(k), torch.zeros_like(v)
