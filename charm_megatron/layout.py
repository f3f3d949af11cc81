"""Megatron's load-balanced context-parallel layout (``get_batch_on_this_cp_rank``).

The sequence is cut into ``2·cp`` equal chunks; CP rank ``r`` holds chunk ``r`` followed by
chunk ``2·cp−1−r``. Under a causal mask every rank then has the same amount of work.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch


def _check(length: int, cp_size: int, what: str) -> None:
    if cp_size < 1:
        raise ValueError(f"cp_size must be >= 1, got {cp_size}")
    if length % (2 * cp_size):
        raise ValueError(
            f"{what} length {length} is not divisible by 2*cp_size={2 * cp_size}; "
            "pad the sequence or choose a sequence length that is a multiple of 2*cp_size"
        )


def shard(x: torch.Tensor, cp_rank: int, cp_size: int, seq_dim: int = 0) -> torch.Tensor:
    """CP rank ``cp_rank``'s part of the full sequence ``x`` (chunks ``r`` and ``2n-1-r``)."""
    if not 0 <= cp_rank < cp_size:
        raise ValueError(f"cp_rank {cp_rank} is outside [0, {cp_size})")
    _check(x.shape[seq_dim], cp_size, "sequence")
    chunks = x.chunk(2 * cp_size, dim=seq_dim)
    return torch.cat([chunks[cp_rank], chunks[2 * cp_size - 1 - cp_rank]], dim=seq_dim)


def unshard(parts: Sequence[torch.Tensor], seq_dim: int = 0) -> torch.Tensor:
    """The full sequence from every rank's part (inverse of :func:`shard`), parts in rank order."""
    n = len(parts)
    if n == 0:
        raise ValueError("unshard needs at least one part")
    halves: list[torch.Tensor | None] = [None] * (2 * n)
    for r, p in enumerate(parts):
        if p.shape[seq_dim] % 2:
            raise ValueError(f"part {r} has odd length {p.shape[seq_dim]}; it is not a CP shard")
        first, second = p.chunk(2, dim=seq_dim)
        halves[r], halves[2 * n - 1 - r] = first, second
    return torch.cat(halves, dim=seq_dim)  # type: ignore[arg-type]


def positions(cp_rank: int, cp_size: int, seq_len: int) -> torch.Tensor:
    """Global token positions held by ``cp_rank`` (useful for RoPE and for checking masks)."""
    return shard(torch.arange(seq_len), cp_rank, cp_size)
