"""The one state an RM+ / CHARM+ rank builder's functions share: :class:`RankState`.

The builder is functions over this state, one module per job (docs/design.md, *plan/*):
:mod:`~charm_megatron.algorithms.charm.rmplus` (RM+ units and passes), :mod:`~charm_megatron.plan.
charm_cross` (the cross exchange), :mod:`~charm_megatron.algorithms.charm.pass_q` (pass-q),
:mod:`~charm_megatron.algorithms.charm.pass_kv` (pass-kv), :mod:`~charm_megatron.plan.
charm_program` (the pass order), entered from :mod:`~charm_megatron.algorithms.charm.entry`. Every field
is declared here once, with who writes it and who reads it. This module imports none of
them, so they import it without a circle; the settings arrive as plain values (the entry
unpacks its variant), so RM+ reads no CHARM+ type.

Plan layer: no torch.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from charm_megatron.plan.core import Half, Kind, Loc, Op, Plan
from charm_megatron.plan.entries import Groups
from charm_megatron.plan.pairing import Round, group_rounds, rmplus_rounds
from charm_megatron.plan.program import Program, Return
from charm_megatron.plan.roles import Decision, RoleChoice
from charm_megatron.plan.vocab import Direction, PassOrder

__all__ = ["OWN_KV", "KvHeld", "RankState"]

OWN_KV = Loc.own(Kind.KV)


@dataclass(frozen=True)
class KvHeld:
    """The kv block a rank holds in a pass: whose, where, where its dkv accumulates."""

    owner: int
    loc: Loc
    dkv: Loc


@dataclass(eq=False)
class RankState:
    """One rank's RM+ / CHARM+ forward or backward program while it is built.

    Given (fixed for the build): the rank, the groups, the mask, the direction and the
    settings as plain values. Derived from them in ``__post_init__`` (fixed too). Then the
    program being built and the mutable pass state, each field's writers and readers named.
    """

    rank: int
    groups: Groups
    causal: bool
    direction: Direction
    # How the exchanges pick their roles (the mix and the shape its bytes are weighed for):
    # read by the RM+ pairs (rmplus) and the cross rounds (charm_cross).
    roles: RoleChoice = RoleChoice()
    # lean: a unit's exchange is posted only once the previous unit's tiles ran and its
    # partials came home (one unit's blocks in memory instead of two and its returns;
    # transfers no longer hide behind the previous unit's compute). The CHARM+ entry's
    # memory bound asks for it where the plan would otherwise hold more than
    # plan.memory.BOUND x ring's peak (plan.charm.within_memory_bound). Read by rmplus.
    lean: bool = False
    # early_returns: a unit's returns (forward: a q-pair's partials, the one served and the
    # one back; backward: also a kv-pair's dK, dV partials) are completed right after the
    # next unit's blocks arrived, before its tiles, so a tile never sees two units'
    # returns: less memory, but each return has only the next unit's transfer time to
    # travel and the peer's tile to finish, a wait with nothing to hide it on a rank with
    # its own device. Only where the memory bound needs it, in both directions: the
    # model predicts returns left in flight over the next unit's tiles up to ~10 % faster
    # backward on GPU clusters (h100 2x8, MHA, 32k: 7.2 -> 6.6 ms); on the CPU testbed the
    # two measure alike (CPU-bound; MHA 416 vs 415 ms, 8/2 heads within the noise), and
    # forward measured ~10 % slower with it. Read by rmplus.
    early_returns: bool = False
    # The pass order: read by charm_program (the passes) and charm_pass_q (the joint
    # order's first pass, which holds the own q too, is never split).
    order: PassOrder = PassOrder.SPLIT
    split_visiting: bool = False  # pass-kv's visiting kv in row pieces (charm_pass_kv)
    # How many row pieces a split visiting kv block crosses in: 2 (halves) or 4 (quarters).
    # Read by charm_pass_kv.
    visiting_pieces: int = 2
    # A split visiting pass's dK, dV pieces go home on the home streams (Stream.home: one
    # communicator per direction) instead of the cross stream, where each would queue behind
    # the round's later pieces still crossing and the return coming the other way. Read by
    # charm_pass_kv.
    home_stream: bool = False
    split_counterpart_q: bool = False  # pass-q's counterpart q in row halves (charm_pass_q)
    # Every pass-q partial goes home on the home streams (one communicator per direction),
    # so the next rounds' q blocks on the cross stream queue behind no return. Read by
    # charm_pass_q.
    q_home_stream: bool = False
    # split_diagonal: the own causal diagonal tile runs as its three sub-tiles
    # (plan.core.diagonal_sub_tiles), the two causal squares where the whole tile ran (before
    # the first cross block can have landed) and the unmasked block between them after the
    # last cross pass, where it hides that pass's trip home. Read by rmplus (the tile) and
    # charm_program (the rest).
    split_diagonal: bool = False
    # split_diagonal_all: every rank with a cross pass splits its diagonal tile, not only
    # those whose first cross block arrives whole (charm_program's rule); with one NIC per
    # GPU no rank's early returns share a link with another's blocks. Read by charm_program.
    split_diagonal_all: bool = False
    # super_tiles: adjacent kv units whose tiles share their q rows are fetched together and
    # their tiles written side by side (one super-tile per q block once fused, plan/fuse.py).
    # Read by rmplus.
    super_tiles: bool = False

    # -- derived ---------------------------------------------------------------------------
    bwd: bool = field(init=False)
    g: int = field(init=False)  # our group's index
    group: tuple[int, ...] = field(init=False)
    local: int = field(init=False)  # our index in the group
    rounds: list[Round] = field(init=False)  # the group's RM+ rounds
    cross: list[dict[int, int]] = field(init=False)  # cross rounds: group -> partner group
    qkind: Kind = field(init=False)  # what a q block is (q; backward, the q side)
    pkind: Kind = field(init=False)  # what comes back for a q block
    own_q: Loc = field(init=False)
    own_acc: Loc = field(init=False)  # where the own q's partials accumulate (the result)

    # -- built -----------------------------------------------------------------------------
    # The ops: every module adds to it; charm_program hands its ops to the entry.
    p: Program = field(init=False, default_factory=Program)
    # The role of every exchange, for printouts: charm_cross appends the cross rounds' (once,
    # before the first pass), rmplus every RM+ pair's; the entry returns them.
    decisions: list[Decision] = field(init=False, default_factory=list)

    # -- the current pass ------------------------------------------------------------------
    # The kv block held: our own (hold_own_kv, rmplus), or a visiting one, set by
    # charm_pass_kv for its pass; read by rmplus's units, tiles and messages.
    kv: KvHeld = field(init=False)
    # The rows of the kv (q) blocks held in the current (sub-)pass: a split visiting pass
    # (charm_pass_kv) holds one row piece of each visiting kv block at a time, a split pass-q
    # pass (charm_pass_q) one of the counterpart's q block, and sets these around each
    # sub-pass; every tile and message of the pass is restricted to them (rmplus).
    kv_rows: Half = field(init=False, default=Half.FULL)
    q_rows: Half = field(init=False, default=Half.FULL)

    # -- the cross exchange (charm_cross and the passes it leads to) ------------------------
    # cross round -> handle of its block's exchange: posted by charm_cross (for pass-q /
    # pass-kv), waited for by the pass of that round.
    cross_in: dict[int, int] = field(init=False, default_factory=dict)
    # cross round -> handles of its block's further row pieces, in row order (rounds sent in
    # pieces only): posted by charm_cross, each waited for by its sub-pass (charm_pass_q /
    # charm_pass_kv).
    cross_rest: dict[int, list[int]] = field(init=False, default_factory=dict)
    # Send-only further pieces: appended by charm_cross, waited for at the end
    # (charm_program).
    trailing: list[int] = field(init=False, default_factory=list)
    # Our partials coming home from counterparts, one list per cross pass (a split return is
    # a batch per piece): appended by charm_pass_q / charm_pass_kv, drained to one in flight by
    # charm_cross.keep_one_return, the rest at the end by charm_program.
    going_home: list[list[Return]] = field(init=False, default_factory=list)
    # Cross accumulators and return buffers alternate per pass that has a counterpart's q
    # (an idle group's rounds, when G is odd, do not count): counted by charm_pass_q /
    # charm_pass_kv.
    n_cross_done: int = field(init=False, default=0)
    # The own diagonal's sub-tiles held back (split_diagonal): appended by rmplus where the
    # diagonal tile would run, emitted by charm_program after the last cross pass.
    diagonal_rest: list[Op] = field(init=False, default_factory=list)

    def __post_init__(self) -> None:
        self.direction = direction = Direction(self.direction)
        self.order = PassOrder(self.order)  # a member: the builders compare by `is`
        self.bwd = direction is Direction.BACKWARD
        self.g = next(i for i, grp in enumerate(self.groups) if self.rank in grp)
        self.group = self.groups[self.g]
        self.local = self.group.index(self.rank)
        self.rounds = rmplus_rounds(len(self.group))
        self.cross = group_rounds(len(self.groups))
        self.qkind = direction.query
        self.pkind = direction.query_partial
        self.own_q = Loc.own(self.qkind)
        self.own_acc = Plan.DQ if self.bwd else Plan.OUT
        self.kv = KvHeld(self.rank, OWN_KV, Plan.DKV)
