"""Bytes a plan moves, per rank and link class, for a concrete problem size."""

from __future__ import annotations

import argparse
import functools
from collections.abc import Sequence
from dataclasses import dataclass, replace

from charm_megatron.plan.core import Kind, Plan, Xfer
from charm_megatron.plan.roles import ROLE_MIXES
from charm_megatron.plan.tile_rule import TileRule, WindowGeometry, window_rule
from charm_megatron.plan.vocab import Dtype, block_sizes


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


ELEM_BYTES = {"bf16": 2, "fp16": 2, "fp32": 4}


def add_problem_args(parser: argparse.ArgumentParser) -> None:
    """The problem-size options shared by ``charm-megatron plan`` and ``model``."""
    parser.add_argument("--batch", type=int, default=1)
    parser.add_argument("--seq", type=int, default=131072, help="global sequence length")
    parser.add_argument("--heads", type=int, default=32)
    parser.add_argument("--kv-heads", type=int, default=None, help="default: --heads")
    parser.add_argument("--head-dim", type=int, default=128)
    parser.add_argument("--v-head-dim", type=int, default=None,
                        help="v (and output) head dim, e.g. 128 for MLA's 192 / 128; default: "
                             "--head-dim")
    parser.add_argument("--dtype", choices=sorted(ELEM_BYTES), default="bf16")
    parser.add_argument("--window", type=parse_window, default=None, metavar="LEFT[,RIGHT]",
                        help="sliding window (flash-attn's window_size): query i sees keys "
                             "i-LEFT .. i+RIGHT (-1: unbounded; RIGHT defaults to 0); plans "
                             "then hold only the tiles and messages it needs")
    parser.add_argument("--partials", choices=[d.value for d in Dtype], default="input",
                        help="the dtype partial results (out, dq, dkv) travel in: input "
                             "(default) or fp32 (CPOptions.partials; ring-flash-attention's "
                             "and the paper's ring send gradient partials in fp32)")
    parser.add_argument("--roles", choices=ROLE_MIXES, default="bytes",
                        help="what the rmplus / charm exchanges move: bytes (default: per "
                             "exchange the role moving fewer bytes for this shape), paper "
                             "(Algorithm 1: alternating kv / q pairs, queries across groups), "
                             "kv or q (forced for every exchange)")


def parse_window(text: str) -> tuple[int, int]:
    """``"LEFT"`` or ``"LEFT,RIGHT"`` as ``(left, right)`` (``-1``: unbounded)."""
    parts = text.split(",")
    try:
        values = [int(p) for p in parts]
    except ValueError:
        values = []
    if len(values) not in (1, 2) or any(v < -1 for v in values):
        raise argparse.ArgumentTypeError(
            f"--window {text!r}: give LEFT or LEFT,RIGHT as integers >= -1 (-1: unbounded)")
    return (values[0], values[1] if len(values) == 2 else 0)


def problem_from_args(args: argparse.Namespace, seq: int | None = None) -> Problem:
    """The :class:`Problem` those options describe (``seq`` overrides ``--seq``)."""
    dv = getattr(args, "v_head_dim", None)
    window = getattr(args, "window", None)
    return Problem(args.batch, args.seq if seq is None else seq, args.heads,
                   args.kv_heads or args.heads, args.head_dim, ELEM_BYTES[args.dtype],
                   0 if dv in (None, args.head_dim) else dv,
                   None if window in (None, (-1, -1)) else tuple(window),
                   Dtype(getattr(args, "partials", "input")) is Dtype.FP32)


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
