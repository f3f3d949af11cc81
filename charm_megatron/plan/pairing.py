"""Who meets whom, round by round, inside a group (RM+) and across groups (CHARM+).

A *round* is a matching: every rank meets at most one partner, and all pairs of a round have
the same role (``kv`` or ``q``), so each stream sees the same sequence of rounds on every rank
(which is what makes the posted order deadlock-free, also under NCCL's serial streams).
"""

from __future__ import annotations

from dataclasses import dataclass

from charm_megatron.plan.vocab import Role


@dataclass(frozen=True)
class Round:
    """One matching: ``partner[i]`` is local index ``i``'s partner (absent: idle this round)."""

    role: Role
    partner: dict[int, int]


def is_power_of_two(m: int) -> bool:
    return m >= 1 and m & (m - 1) == 0


def rmplus_rounds(m: int) -> list[Round]:
    """Every unordered pair of ``0..m-1`` exactly once, as rounds.

    Power of two: the paper's Algorithm 1. Level ``i`` meets the peers ``x XOR j`` for
    ``2^(i-1) <= j < 2^i``; the peer with ``j``'s bit ``i-2`` clear is a kv-pair, the other a
    q-pair (level 1 is kv), which is exactly the paper's lower/upper-half split by position.

    Other sizes: the circle method (a round-robin 1-factorisation; one rank idles per round
    when ``m`` is odd), rounds alternating kv and q.

    Order: kv and q rounds alternate (``kv q kv q ... kv``), levels in order within each role.
    Every exchange carries original blocks, so the order of rounds is free; alternating keeps
    both streams busy and lets each stream get by with one receive buffer (a unit's buffers
    are free again by the time the same stream's next round is posted).
    """
    if m < 1:
        raise ValueError(f"group size must be >= 1, got {m}")
    if m == 1:
        return []
    if not is_power_of_two(m):
        return [Round(Role.KV if r % 2 == 0 else Role.Q, partner)
                for r, partner in enumerate(_circle(m))]
    kv_js: list[int] = []
    q_js: list[int] = []
    level_start = 1
    while level_start < m:
        quarter = level_start // 2  # level 1: the single peer is a kv-pair
        for j in range(level_start, 2 * level_start):
            (kv_js if j < level_start + max(quarter, 1) else q_js).append(j)
        level_start *= 2
    rounds: list[Round] = []
    for idx in range(len(kv_js)):
        for role, js in ((Role.KV, kv_js), (Role.Q, q_js)):
            if idx < len(js):
                rounds.append(Round(role, {x: x ^ js[idx] for x in range(m)}))
    return rounds


def group_rounds(num_groups: int) -> list[dict[int, int]]:
    """Cross-group rounds for CHARM+: ``G-1`` matchings of groups (``G`` if ``G`` is odd)."""
    if num_groups <= 1:
        return []
    return _circle(num_groups)


def _circle(m: int) -> list[dict[int, int]]:
    """Round-robin matchings of ``0..m-1`` (circle method): every pair exactly once.

    A dummy player makes the count even; whoever meets it idles that round.
    """
    players = m + (m % 2)
    rounds = []
    for r in range(players - 1):
        pairs = [(players - 1, r)] + [
            ((r + k) % (players - 1), (r - k) % (players - 1)) for k in range(1, players // 2)
        ]
        partner: dict[int, int] = {}
        for a, b in pairs:
            if a < m and b < m:
                partner[a], partner[b] = b, a
        rounds.append(partner)
    return rounds
