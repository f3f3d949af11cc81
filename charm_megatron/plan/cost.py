"""Bytes a plan moves, per rank and link class, for a concrete problem size."""

from __future__ import annotations

import functools
from collections.abc import Sequence
from dataclasses import dataclass, replace

from charm_megatron.plan.core import Kind, Plan, Xfer
from charm_megatron.plan.tile_rule import TileRule, WindowGeometry, window_rule
from charm_megatron.plan.vocab import block_sizes


@dataclass(frozen=True)
class Problem:
    """One attention call: global sequence ``s`` over ``n`` ranks; element size in bytes."""

    b: int
    s: int
    hq: int
    hkv: int
    d: int
    elem: int = 2  # bf16
    dv: int = 0  # v / output head dim; 0: as d (MLA has its own)
    window: tuple[int, int] | None = None  # sliding window (left, right); None: full
    wide_partials: bool = False  # partials (out, dq, dkv) travel in fp32, not the input dtype

    def geometry(self, n: int, causal: bool, group: int = 1) -> WindowGeometry | None:
        """Where the window's rows lie on ``n`` ranks (``None``: no window); ``group``: the
        plan's head all-to-all group, with ``self`` the problem as its blocks see it
        (:meth:`for_plan`)."""
        if self.window is None:
            return None
        return WindowGeometry(self.window[0], self.window[1], n, self.s // n, causal, group)

    def tiles(self, n: int, causal: bool) -> TileRule | None:
        """The tiles the window needs on ``n`` ranks (``None``: every tile)."""
        geometry = self.geometry(n, causal)
        return None if geometry is None else window_rule(geometry)

    @property
    def v_dim(self) -> int:
        return self.dv or self.d

    def block_bytes(self, kind: Kind, n: int) -> float:
        """Bytes of a whole block of ``kind`` held by one rank (``s / n`` rows), as it travels
        (:data:`charm_megatron.plan.vocab.BLOCKS`: partials in the input dtype, lse fp32)."""
        return _block_bytes(self, Kind(kind), n)

    def local_bytes(self, kind: Kind, n: int) -> float:
        """Bytes of a whole block of ``kind`` as a kernel makes it and the executor folds or
        copies it: partials in the input dtype whatever ``wide_partials`` sends them in."""
        narrow = replace(self, wide_partials=False) if self.wide_partials else self
        return _block_bytes(narrow, Kind(kind), n)

    def xfer_bytes(self, x: Xfer, n: int) -> float:
        """Bytes of one message of a plan over ``n`` ranks (a head slice: its share)."""
        return self.block_bytes(x.kind, n) * x.half.fraction / x.parts

    def for_plan(self, plan: Plan) -> Problem:
        """The problem as ``plan``'s blocks see it: after a head all-to-all in groups of
        ``a`` (``plan.head_group``) every block holds ``a`` times the rows and ``1/a`` of the
        heads, which is the problem of ``a`` times the sequence and ``1/a`` of the heads on
        as many ranks (the same bytes per block, ``a`` times the work per tile)."""
        a = plan.head_group
        if a == 1:
            return self
        return Problem(self.b, self.s * a, self.hq // a, self.hkv // a, self.d, self.elem,
                       self.dv, self.window, self.wide_partials)


@functools.lru_cache(maxsize=4096)  # the simulator asks for every message it times
def _block_bytes(problem: Problem, kind: Kind, n: int) -> float:
    sizes = block_sizes(problem.b, problem.hq, problem.hkv, problem.d, problem.dv)
    return problem.s / n * kind.spec.row_bytes(sizes, problem.elem, problem.wide_partials)


@dataclass
class Traffic:
    intra: list[float]  # bytes each rank sends to ranks of its own topology group
    cross: list[float]  # bytes each rank sends to other groups

    @property
    def max_cross(self) -> float:
        return max(self.cross)

    @property
    def total_cross(self) -> float:
        return sum(self.cross)


def call_parts(plan: Plan, problem: Problem) -> list[tuple[Plan, Problem]]:
    """The plans one call of ``plan`` runs, each with the problem its messages are sized on:
    the plan on its blocks (:meth:`Problem.for_plan`) and, after a head all-to-all
    (``plan.head_group > 1``), the two all-to-alls on the call's own blocks."""
    parts = [(plan, problem.for_plan(plan))]
    if plan.head_group > 1:
        from charm_megatron.plan.head_stage import stage_plans

        parts += [(p, problem) for p in stage_plans(plan.n, plan.head_group, plan.direction,
                                                    plan.causal)]
    return parts


def traffic(plan: Plan, problem: Problem, groups: Sequence[Sequence[int]]) -> Traffic:
    """Bytes sent by each rank, split by whether the peer is in the sender's group of
    ``groups`` (the *hardware* topology, whatever groups the algorithm itself used). A plan
    after a head all-to-all (``plan.head_group > 1``) counts the all-to-alls too."""
    group_of = {r: gi for gi, g in enumerate(groups) for r in g}
    intra = [0.0] * plan.n
    cross = [0.0] * plan.n
    for part, prob in call_parts(plan, problem):
        for r in range(part.n):
            for op in part.comms(r):
                for x in op.sends:
                    nbytes = prob.xfer_bytes(x, part.n)
                    if group_of[x.peer] == group_of[r]:
                        intra[r] += nbytes
                    else:
                        cross[r] += nbytes
    return Traffic(intra, cross)
