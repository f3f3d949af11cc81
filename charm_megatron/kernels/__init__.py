"""Block attention kernels with log-sum-exp: one interface, several backends.

Every backend computes, for one block whose q and kv lengths may differ (``[s, b, h, d]``,
Megatron's sbhd layout; GQA allowed: ``h_q`` a multiple of ``h_kv``)::

    forward(q, k, v, causal, scale)                        -> (out [sq, b, hq, d], lse [b, hq, sq] fp32)
    backward(dout, q, k, v, out, lse, causal, scale)       -> (dq, dk, dv)

``lse`` is the natural-log log-sum-exp of each query row. ``causal`` masks key ``j`` from query
``i`` when ``j > i`` and requires ``sq == sk`` (alignment of unequal causal blocks differs between
backends, and CP never needs it). Backward with the *global* (merged) ``out`` and ``lse`` gives a
tile's exact contribution to the full-sequence gradients. Outputs may be strided views.

Backends: ``torch`` (aten flash kernels), ``flash_attn`` (when importable), ``reference``
(plain math, for tests). :func:`get_backend` chooses by device and availability;
``CHARM_ATTN_BACKEND`` overrides (``cp_attention`` reads it once, into its options).
float64 blocks are computed in float64 by every CPU backend.
"""

from charm_megatron.kernels.base import AttentionBackend, check_block_shapes, check_qkv
from charm_megatron.kernels.registry import available_backends, get_backend

__all__ = [
    "AttentionBackend", "available_backends", "check_block_shapes", "check_qkv", "get_backend",
]
