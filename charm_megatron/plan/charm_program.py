"""One rank's CHARM+ (or, with one group, RM+) program: the pass order and the assembly of the
passes (docs/algorithm.md, *CHARM+*).

Plan layer: no torch.
"""

from __future__ import annotations

from charm_megatron.plan.charm_pass_kv import PassKv
from charm_megatron.plan.charm_pass_q import PassQ
from charm_megatron.plan.core import Kind, Op, Plan, Reset, Wait
from charm_megatron.plan.rmplus import Pass
from charm_megatron.plan.vocab import PassOrder, Role

__all__ = ["CharmRank"]


class CharmRank(PassQ, PassKv):
    """Builds one rank's CHARM+ (or, with one group, RM+) forward or backward program.

    Structure: *passes* run the RM+ rounds of the group for the q blocks a rank holds
    (:mod:`~charm_megatron.plan.rmplus`); a cross round is pass-q
    (:mod:`~charm_megatron.plan.charm_pass_q`) or pass-kv
    (:mod:`~charm_megatron.plan.charm_pass_kv`), each block crossing one pass ahead of the
    pass that uses it; a counterpart's partial goes home at the end of its pass.

    Pass order (``variant.order``):

    * ``split`` (default): the own q's first rounds while the counterpart's q crosses the slow
      link; then one pass per counterpart q (all rounds), each sent home as soon as it is done;
      then the own q's remaining rounds, which hide the last slow return. A forward pass whose
      cross rounds are all pass-kv has no slow return to hide: all own rounds come first. kv
      blocks of the rounds are fetched once per pass that needs them (intra-group links are
      the fast ones).
    * ``joint``: the paper's single pass with own and counterpart q side by side (kv fetched
      once for both), the own q's last tile deferred until the counterpart's partial is sent.
    """

    def build(self) -> list[Op]:
        p, r = self.p, self.rank
        if self.bwd:
            p.add(Reset(Plan.DQ, Kind.DQ, r))
            p.add(Reset(Plan.DKV, Kind.DKV, r))
        else:
            p.add(Reset(Plan.OUT, Kind.OUT, r))
        if self.cross:
            self._post_cross_exchange(0)
        for ps in self._passes():
            self._run_pass(ps)
        for rets in self.going_home:
            for ret in rets:
                p.finish(ret)
        for h in self.trailing:
            p.add(Wait(h))
        return p.ops

    def _passes(self) -> list[Pass]:
        """The passes in the order of ``self.order``, and which q blocks each holds."""
        every = tuple(range(len(self.rounds)))
        if not self.cross:
            return [Pass(True, None, every, True)]

        def cross_pass(k: int) -> Pass:
            if self.cross_roles[k] is Role.KV:  # pass-kv: own q against the visiting kv
                return Pass(True, k, every, True, visiting=True)
            return Pass(False, k, every, True)

        if self.order is PassOrder.JOINT and self.cross_roles[0] is Role.Q:
            return [Pass(True, 0, every, True)] + [cross_pass(k)
                                                    for k in range(1, len(self.cross))]
        if self.order is PassOrder.JOINT:  # a pass-kv first round: own kv, then the visitors
            return [Pass(True, None, every, True)] + [cross_pass(k)
                                                       for k in range(len(self.cross))]
        # Forward pass-kv brings nothing home across the slow link, so no own rounds need to
        # be kept back to hide a return: all of them go first, hiding the visiting kv's trip
        # (measured on 2x4 with one NIC per node: 315 vs 347 ms forward, docs/performance.md).
        # Pass-q, and backward (the visitors' dK, dV go home), keep half the rounds for last.
        paired = [r for k, r in enumerate(self.cross_roles) if self.g in self.cross[k]]
        if not self.bwd and paired and all(r is Role.KV for r in paired):
            head = every
        else:
            head = every[: len(every) // 2]
        tail = every[len(head):]
        passes = [Pass(True, None, head, True)]
        passes += [cross_pass(k) for k in range(len(self.cross))]
        if tail:
            passes.append(Pass(True, None, tail, False))
        return passes

    def _post_cross_exchange(self, k: int) -> None:
        """Swap blocks with the counterpart of cross round ``k`` (if our group has one): our kv
        (pass-kv, it visits the counterpart's group) or our q (pass-q)."""
        partner = self.cross[k].get(self.g) if k < len(self.cross) else None
        if partner is None:
            return
        cp, other = self.groups[partner][self.local], self.groups[partner]
        if self.cross_roles[k] is Role.KV:
            self._post_visiting_kv(k, cp, other)
        else:
            self._post_counterpart_q(k, cp, other)

    def _run_pass(self, ps: Pass) -> None:
        """One pass, its cross round's next block posted first to travel during it."""
        if ps.cross_round is not None:
            self._post_cross_exchange(ps.cross_round + 1)
        if ps.visiting:
            self._run_visiting_pass(ps)
        else:
            self._run_q_pass(ps)
