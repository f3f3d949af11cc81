"""A softmax offset (an attention *sink*): one extra logit per query head in every softmax
denominator, ``p_ij = exp(s_ij - L_i)`` with ``L_i = log(sum_j exp(s_ij) + exp(o_h))``.

gpt-oss's learnable sinks and "off-by-one" (``o = 0``) attention (megatron-core's
``softmax_type``). Under context parallelism the offset must enter each query row's
denominator once, not once per tile or per rank: a plan merges every tile of a row into one
``(out, lse)``, so the offset is applied here, on this rank's own complete rows, after the
forward plan. It needs no message of its own (after a head all-to-all, the backward's per-row
shares below go home with dq, so a rank's gradient is its own rows' under every algorithm):

* forward: ``L = logaddexp(lse, o)``, ``out *= exp(lse - L)``;
* backward: the plans' tile backward with ``L`` and the rescaled ``out`` gives dq, dk, dv
  exactly (the sink has no value vector, so ``delta = rowsum(dout * out)`` is unchanged by it),
  and ``d o_h = -sum_i exp(o_h - L_i) * delta_i`` over this rank's rows: its tokens' share of
  the gradient, which Megatron's gradient all-reduce over DP x CP sums.

A row that saw no key (a padding row of packed THD: no query there) keeps ``lse = -inf``, a
zero output and no share of the offset's gradient: the sink enters only the denominators of
real rows.

Works on the internal ``[s, b, h, d]`` blocks of either layout (THD: ``b = 1``).
"""

from __future__ import annotations

import torch

__all__ = ["apply_forward", "offset_grad", "row_shares"]


def apply_forward(out_acc: torch.Tensor, lse: torch.Tensor,
                  offset: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``(out, lse)`` of the rows with the offset in their denominators; ``out_acc`` is the
    plan's accumulator ``[s, b, h, d]`` (fp32, or float64), ``lse`` ``[s, b, h]``."""
    o = offset.to(lse.dtype).view(1, 1, -1)
    empty = lse == float("-inf")  # rows that saw no key (padding): no sink, lse stays -inf
    final = torch.where(empty, lse, torch.logaddexp(lse, o.expand_as(lse)))
    scale = torch.exp(lse - final).masked_fill(empty, 0.0)
    return out_acc * scale.unsqueeze(-1).to(out_acc.dtype), final


def offset_grad(lse: torch.Tensor, delta: torch.Tensor, offset: torch.Tensor) -> torch.Tensor:
    """``d offset`` ``[h]`` from this rank's rows: ``lse`` the final ``[s, b, h]``, ``delta``
    ``rowsum(dout * out)`` ``[s, b, h]`` (unscaled, in lse's precision or wider)."""
    return (-row_shares(lse, delta, offset).sum(dim=(0, 1))).to(offset.dtype)


def row_shares(lse: torch.Tensor, delta: torch.Tensor, offset: torch.Tensor) -> torch.Tensor:
    """``exp(o_h - L_i) * delta_i`` ``[s, b, h]`` per row (``-d offset`` is their sum), in
    lse's precision or wider; zero at rows that saw no key (``lse = -inf``: padding)."""
    wide = torch.float64 if lse.dtype == torch.float64 else torch.float32
    lse = lse.to(wide)
    p_sink = torch.exp(offset.to(wide).view(1, 1, -1) - lse)
    return (p_sink * delta.to(wide)).masked_fill(lse == float("-inf"), 0.0)
