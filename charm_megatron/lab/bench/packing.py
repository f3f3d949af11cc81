"""The benchmark's packed mode: documents of random length packed into one THD sequence.

Distribution (stated, seeded): document lengths are drawn i.i.d. from a log-normal with
``sigma = 1`` and mean ``mean`` tokens (``mu = ln(mean) - 1/2``), rounded up to at least one
token; each document is padded to a multiple of ``2*cp`` (Megatron's THD CP layout). Documents
are drawn until the padded lengths fill the point's ``B*S`` tokens; the last document is cut to
the room left. The total (padded) token count is therefore exactly the unpacked run's ``B*S``,
so packed and unpacked timings of one point compare the same amount of data.
"""

from __future__ import annotations

import math
import random

import torch


def doc_lengths(total: int, cp: int, mean: int, seed: int) -> tuple[list[int], list[int]]:
    """(real lengths, padded lengths) of the documents filling ``total`` padded tokens."""
    unit = 2 * cp
    if total % unit:
        raise ValueError(f"packed mode needs B*S={total} divisible by 2*cp={unit}")
    if mean < 1:
        raise ValueError(f"--packed mean document length must be >= 1, got {mean}")
    rng = random.Random(seed)
    mu = math.log(mean) - 0.5
    real: list[int] = []
    padded: list[int] = []
    left = total
    while left > 0:
        n = max(1, math.ceil(rng.lognormvariate(mu, 1.0)))
        p = min(-(-n // unit) * unit, left)
        real.append(min(n, p))
        padded.append(p)
        left -= p
    return real, padded


def cumulative(lengths: list[int], device: torch.device) -> torch.Tensor:
    out = [0]
    for n in lengths:
        out.append(out[-1] + n)
    return torch.tensor(out, dtype=torch.int32, device=device)


def describe(mean: int) -> str:
    return (f"packed: document lengths ~ LogNormal(sigma=1, mean={mean} tokens), seeded, each "
            "padded to a multiple of 2*cp, filling B*S tokens")
