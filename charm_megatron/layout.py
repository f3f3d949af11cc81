"""Megatron's load-balanced context-parallel layout (``get_batch_on_this_cp_rank``).

The sequence is cut into ``2·cp`` equal chunks; CP rank ``r`` holds chunk ``r`` followed by
chunk ``2·cp−1−r``. Under a causal mask every rank then has the same amount of work.

Packed sequences (THD) apply the same cut to every document separately: ``thd_shard`` /
``thd_unshard`` / ``thd_index``, and ``thd_pad`` / ``thd_unpad`` to lay documents out padded.
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


# ------------------------------------------------------------------------------ packed (THD)
# Megatron / TransformerEngine THD context parallelism: every document's *padded* length is cut
# into 2·cp equal chunks and rank r holds chunks r and 2·cp−1−r of every document, documents in
# order. ``cu_seqlens_padded`` are the global cumulative padded lengths (int, N+1 entries).


def _padded_lengths(cu_seqlens_padded, cp_size: int) -> list[int]:
    if cp_size < 1:
        raise ValueError(f"cp_size must be >= 1, got {cp_size}")
    cu = [int(c) for c in (cu_seqlens_padded.tolist() if isinstance(cu_seqlens_padded,
                                                                    torch.Tensor)
                           else cu_seqlens_padded)]
    if len(cu) < 1 or cu[0] != 0:
        raise ValueError(f"cu_seqlens_padded must start at 0, got {cu[:3]}...")
    lengths = [b - a for a, b in zip(cu, cu[1:])]
    for i, n in enumerate(lengths):
        if n < 0 or n % (2 * cp_size):
            raise ValueError(f"document {i}: padded length {n} is not a non-negative multiple "
                             f"of 2*cp_size={2 * cp_size}")
    return lengths


def thd_index(cp_rank: int, cp_size: int, cu_seqlens_padded) -> torch.Tensor:
    """Global (padded) token indices held by ``cp_rank`` in the THD layout, in local order."""
    if not 0 <= cp_rank < cp_size:
        raise ValueError(f"cp_rank {cp_rank} is outside [0, {cp_size})")
    parts, start = [], 0
    for n in _padded_lengths(cu_seqlens_padded, cp_size):
        c = n // (2 * cp_size)
        parts.append(torch.arange(start + cp_rank * c, start + (cp_rank + 1) * c))
        j = 2 * cp_size - 1 - cp_rank
        parts.append(torch.arange(start + j * c, start + (j + 1) * c))
        start += n
    return torch.cat(parts) if parts else torch.zeros(0, dtype=torch.long)


def thd_shard(x: torch.Tensor, cu_seqlens_padded, cp_rank: int, cp_size: int,
              seq_dim: int = 0) -> torch.Tensor:
    """CP rank ``cp_rank``'s part of the packed, padded sequence ``x`` (THD layout)."""
    idx = thd_index(cp_rank, cp_size, cu_seqlens_padded)
    if x.shape[seq_dim] != int(idx.numel()) * cp_size:
        raise ValueError(f"sequence length {x.shape[seq_dim]} != cu_seqlens_padded[-1]="
                         f"{int(idx.numel()) * cp_size}")
    return x.index_select(seq_dim, idx.to(x.device))


def thd_unshard(parts: Sequence[torch.Tensor], cu_seqlens_padded,
                seq_dim: int = 0) -> torch.Tensor:
    """The packed, padded sequence from every rank's THD part (inverse of :func:`thd_shard`)."""
    n = len(parts)
    if n == 0:
        raise ValueError("thd_unshard needs at least one part")
    shape = list(parts[0].shape)
    shape[seq_dim] = sum(p.shape[seq_dim] for p in parts)
    full = parts[0].new_empty(shape)
    for r, p in enumerate(parts):
        full.index_copy_(seq_dim, thd_index(r, n, cu_seqlens_padded).to(p.device), p)
    return full


def thd_pad(x: torch.Tensor, cu_seqlens, cu_seqlens_padded, seq_dim: int = 0,
            value: float = 0.0) -> torch.Tensor:
    """Unpadded packed documents ``x`` (lengths from ``cu_seqlens``) laid out padded: each
    document's tokens first, ``value`` after them up to its padded length."""
    cu = [int(c) for c in torch.as_tensor(cu_seqlens).tolist()]
    cup = [int(c) for c in torch.as_tensor(cu_seqlens_padded).tolist()]
    shape = list(x.shape)
    shape[seq_dim] = cup[-1]
    out = x.new_full(shape, value)
    for a, b, p in zip(cu, cu[1:], cup):
        out.narrow(seq_dim, p, b - a).copy_(x.narrow(seq_dim, a, b - a))
    return out


def thd_unpad(x: torch.Tensor, cu_seqlens, cu_seqlens_padded, seq_dim: int = 0) -> torch.Tensor:
    """The real tokens of a padded packed sequence (inverse of :func:`thd_pad`)."""
    cu = [int(c) for c in torch.as_tensor(cu_seqlens).tolist()]
    cup = [int(c) for c in torch.as_tensor(cu_seqlens_padded).tolist()]
    return torch.cat([x.narrow(seq_dim, p, b - a) for a, b, p in zip(cu, cu[1:], cup)],
                     dim=seq_dim)
