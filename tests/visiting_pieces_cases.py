"""Rank functions for tests/test_visiting_pieces.py (module level so the forkserver can
pickle them)."""

from __future__ import annotations

import torch

from charm_megatron import CPOptions, cp_attention
from charm_megatron.ops import streams


def home_streams_made(rank: int, world: int) -> list[list[str]]:
    """The stream groups this rank's CP group holds after a call without split visiting kv
    and after one with quarters (whose backward posts on the home streams)."""
    seen = []
    for split in ("off", "quarters"):
        g = torch.Generator().manual_seed(rank)
        q, k, v = (torch.randn(8, 1, 4, 8, generator=g).requires_grad_() for _ in range(3))
        out = cp_attention(q, k, v, algo="charm", topology="2x2", causal=True,
                           options=CPOptions(split_visiting=split, roles="kv"))
        out.sum().backward()
        seen.append(sorted(str(s) for s in streams.stream_groups(None).groups))
    return seen
