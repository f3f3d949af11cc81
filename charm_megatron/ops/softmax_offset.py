"""A softmax offset (an attention *sink*): one extra logit per query head in every softmax
denominator, ``p_ij = exp(s_ij - L_i)`` with ``L_i = log(sum_j exp(s_ij) + exp(o_h))``.

gpt-oss's learnable sinks and "off-by-one" (``o = 0``) attention (megatron-core's
``softmax_type``). Under context parallelism the offset must enter each query row's
denominator once, not once per tile or per rank: a plan merges every tile of a row into one
``(out, lse)``, so the offset is applied here, on this rank's own complete rows, after the
forward plan. No communication is needed:

* forward: ``L = logaddexp(lse, o)``, ``out *= exp(lse - L)``;
* backward: the plans' tile backward with ``L`` and the rescaled ``out`` gives dq, dk, dv
  exactly (the sink has no value vector, so ``delta = rowsum(dout * out)`` is unchanged by it),
  and ``d o_h = -sum_i exp(o_h - L_i) * delta_i`` over this rank's rows: its tokens' share of
  the gradient, which Megatron's gradient all-reduce over DP x CP sums.

Works on the internal ``[s, b, h, d]`` blocks of either layout (THD: ``b = 1``).
"""

from __future__ import annotations

import torch

__all__ = ["apply_forward", "offset_grad"]


def apply_forward(out_acc: torch.Tensor, lse: torch.Tensor,
                  offset: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``(out, lse)`` of the rows with the offset in their denominators; ``out_acc`` is the
    plan's accumulator ``[s, b, h, d]`` (fp32, or float64), ``lse`` ``[s, b, h]``."""
    o = offset.to(lse.dtype).view(1, 1, -1)
    final = torch.logaddexp(lse, o.expand_as(lse))
    return out_acc * torch.exp(lse - final).unsqueeze(-1).to(out_acc.dtype), final


def offset_grad(lse: torch.Tensor, delta: torch.Tensor, offset: torch.Tensor) -> torch.Tensor:
    """``d offset`` ``[h]`` from this rank's rows: ``lse`` the final ``[s, b, h]``, ``delta``
    ``rowsum(dout * out)`` ``[s, b, h]`` (unscaled, in lse's precision or wider)."""
    wide = torch.float64 if lse.dtype == torch.float64 else torch.float32
    p_sink = torch.exp(offset.to(wide).view(1, 1, -1) - lse.to(wide))
    return (-(p_sink * delta.to(wide)).sum(dim=(0, 1))).to(offset.dtype)
