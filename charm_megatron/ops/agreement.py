"""The ranks of a ``cp_attention`` call agree on it before any data moves, and report how it
went after (docs/api.md, failure model).

Each call direction makes three exchanges on the CP group's control channel
(:mod:`charm_megatron.ops.control`):

1. **agree**: every rank's :class:`Signature` (the call's fields as int64 codes), or the error
   its own checks raised;
2. **verdict**: always sent after an agreement in step, so that a rank never runs a plan its
   peers gave up on: it carries "go", or this rank's values of the fields that differ;
3. **status** (after the plan): whether the plan worked here, and the error if not.

Every rank reads the same table of every exchange, so every rank reaches the same verdict and
raises the same error, naming the field and the ranks.

One more exchange stands alone: :func:`share` (a measured ``auto`` sharing its times,
ops/auto_tune.py), under a call number of its own.

Out of step. Calls pair by number (a rank's count of its forwards on the CP group; a backward
takes its forward's). A rank that reached a call after its peers gave up waiting
(``timeout_s``) meets an exchange they kept (``ControlChannel.pending``); their next call first
settles it and sends the late rank the rest of that call marked *abandoned*, so the late rank
never runs a plan alone, then goes on. A rank that meets a peer behind it posts its message
again and waits for the peer's next exchange (:func:`_exchange_in_step`); the peer raises. So a
rank that makes every call, even late, pairs right again from its next call; one that skips a
whole call cannot be told from a late one (docs/api.md) and pairs one call behind, which only a
tag naming the step catches.

Failed transfers mark the stream communicators for rebuilding; the next call's agreement
carries the mark, and every rank rebuilds them together before any data moves.
"""

from __future__ import annotations

import ast
import hashlib
import struct
import time
from collections.abc import Sequence
from dataclasses import dataclass

from charm_megatron.ops.control import (
    MAX_CODES,
    ControlBroken,
    ControlTimeout,
    Flag,
    Message,
    Round,
)

# Status codes of the after-call exchange.
OK, RAISED, BROKEN = 0, 1, 2
MAX_FIELDS = MAX_CODES
_TEXT_LIMIT = 1000


class CPAttentionError(RuntimeError):
    """A ``cp_attention`` call failed on some rank (raised on every rank of the CP group)."""


class CPMismatchError(CPAttentionError, ValueError):
    """The ranks of a ``cp_attention`` call disagree on its inputs or settings, or are out of
    step (different call numbers)."""


def _code(value) -> int:
    """An int64 standing for ``value`` (ints as themselves, everything else hashed)."""
    if isinstance(value, bool):
        return int(value)
    if isinstance(value, int) and -(2 ** 62) < value < 2 ** 62:
        return value
    if isinstance(value, float):
        return struct.unpack("<q", struct.pack("<d", value))[0]
    digest = hashlib.blake2b(repr(value).encode(), digest_size=8).digest()
    return struct.unpack("<q", digest)[0]


@dataclass(frozen=True)
class Signature:
    """What one rank is about to do: ordered ``(field, value)`` pairs, or its local error."""

    fields: tuple[tuple[str, object], ...]
    error: str = ""  # this rank's own check failed: "TypeName: message"

    def codes(self) -> tuple[int, ...]:
        if len(self.fields) > MAX_FIELDS:
            raise ValueError(f"a signature holds at most {MAX_FIELDS} fields")
        return tuple(_code(v) for _, v in self.fields)

    def names(self) -> list[str]:
        return [name for name, _ in self.fields]


def _ranks(ranks: Sequence[int]) -> str:
    return ("rank " if len(ranks) == 1 else "ranks ") + ", ".join(map(str, ranks))


def _by_value(values: Sequence[object]) -> str:
    groups: dict[str, list[int]] = {}
    for r, val in enumerate(values):
        groups.setdefault(str(val), []).append(r)
    return ", ".join(f"{_ranks(rs)}: {val}" for val, rs in groups.items())


# ------------------------------------------------------------------------- the exchanges
def _exchange(sg, msg: Message, timeout_s: float, what: str,
              wait_s: float | None = None) -> list[Message | None]:
    """One exchange of ``msg``, waited for ``wait_s`` (default: the bound ``timeout_s``)."""
    try:
        return sg.channel.exchange(msg, timeout_s if wait_s is None else wait_s)
    except ControlTimeout as exc:
        raise CPAttentionError(
            f"cp_attention: the {what} exchange of the CP group ({msg.where()}) did not "
            f"complete within {timeout_s:.0f} s ({exc}). Likely causes: a rank died or stopped "
            "calling cp_attention, or ranks make different numbers of cp_attention calls; the "
            "next call first waits for the late rank once more") from None
    except ControlBroken as exc:
        sg.parent = None  # the control group failed: make every group anew at the next call
        raise CPAttentionError(
            f"cp_attention: the control group of the CP group failed during the {what} "
            f"exchange ({msg.where()}): {exc}; its communicators are made anew from the CP "
            "group at the next call") from None


def _exchange_in_step(sg, msg: Message, timeout_s: float, what: str) -> list[Message | None]:
    """One exchange of ``msg`` whose table is in step, or a raise.

    Calls pair by number. A rank that meets a peer *behind* it (a lower call number or an
    earlier part of the call: it is late for, or skipped, a call this rank has finished or
    given up) is ahead: that peer's call is void (it raises there), and this rank posts its
    message again and waits, within its bound, for the peer's next exchange, which is the
    call this rank is in. A rank behind a peer raises: its call is one the others moved past.
    """
    deadline = time.monotonic() + timeout_s
    while True:
        table = _exchange(sg, msg, timeout_s, what, max(deadline - time.monotonic(), 0.0))
        if _in_step(table, msg):
            return table
        mine = msg.position()
        readable = all(m is not None for m in table)
        if readable and all(m.position() <= mine for m in table) \
                and not any(m.flags & Flag.ABANDONED for m in table):
            sg.needs_rebuild = True  # a peer's call was void: no stale transfer may pair
            if time.monotonic() < deadline:
                continue
        raise _out_of_step(sg, table, msg)


def _in_step(table: Sequence[Message | None], mine: Message) -> bool:
    return all(m is not None and m.position() == mine.position() for m in table)


def _out_of_step(sg, table: Sequence[Message | None], mine: Message) -> CPMismatchError:
    sg.needs_rebuild = True  # cheap, and no stale transfer can ever pair afterwards
    where = _by_value([m.where() if m is not None else "an unreadable message"
                       for m in table])
    counters = _by_value([m.next_call - 1 if m is not None else "?" for m in table])
    return CPMismatchError(
        f"cp_attention: the ranks of the CP group are out of step ({where}; last call "
        f"numbers {counters}): a rank reached this call after the others gave up waiting for "
        f"it (timeout_s), or skipped a call or a backward. This call ({mine.where()}) is "
        "void on this rank. Calls pair by number (each rank's count of its calls): a rank "
        "that makes every call, even late, pairs with the right calls again from its next "
        "call; a rank that skipped a call pairs one call behind from then on, which only a "
        "tag naming the step can tell (docs/api.md, failure model)")


def settle(sg, timeout_s: float) -> None:
    """Before a call posts anything: complete the exchange this rank gave up on earlier (if
    any), so that every rank has made the same number of exchanges. If a late rank completed
    it, that rank is inside a call this rank abandoned: send it the rest of that call marked
    abandoned (it raises there). This call then goes on: the late rank's next call is this
    one (calls pair by number; a peer still behind is waited for by the agreement)."""
    ch = sg.channel
    while ch is not None and ch.pending is not None:
        p = ch.pending
        try:
            table = ch.wait(timeout_s)
        except ControlTimeout:
            raise CPAttentionError(
                f"cp_attention: still waiting for the CP group's exchange of {p.sent.where()}, "
                f"which timed out before: a rank has not reached it within {timeout_s:.0f} s "
                "more (it died, stopped calling cp_attention, or is far behind). This call is "
                "abandoned; the next call waits for it again") from None
        except ControlBroken as exc:
            sg.parent = None
            raise CPAttentionError(f"cp_attention: the control group failed while completing "
                                   f"an earlier exchange ({exc}); its communicators are made "
                                   "anew at the next call") from None
        sg.needs_rebuild = True  # the late rank may have transfers of a void call in flight
        if p.mirror or not _in_step(table, p.sent) or \
                p.sent.round not in (Round.AGREE, Round.VERDICT):
            continue  # nothing more owed: a late rank out of step raises on its own
        # The late rank continues that call: owe it the call's remaining rounds.
        nxt = Round.VERDICT if p.sent.round is Round.AGREE else Round.STATUS
        ch.post(Message(nxt, p.sent.call, p.sent.backward, sg.calls, Flag.ABANDONED,
                        status=RAISED, text="abandoned after a timeout",
                        generation=sg.generation), mirror=True)


def open_call(sg, timeout_s: float, forward_call: int | None = None) -> int:
    """Start one call direction on this rank: its call number (a new one for a forward, the
    forward's for its backward ``forward_call``), after settling any exchange given up on
    earlier (:func:`settle`, which may raise)."""
    if forward_call is None:
        call = sg.calls
        sg.calls += 1
    else:
        call = forward_call
    settle(sg, timeout_s)
    return call


def agree(sg, sig: Signature, call: int, backward: bool, timeout_s: float,
          local_error: BaseException | None = None) -> None:
    """Raise on every rank unless every rank has the same signature and no local error; then
    rebuild the stream communicators if any rank asks (all together).

    A rank whose own checks failed re-raises its own exception (the others raise
    :class:`CPMismatchError` quoting it), so an input error keeps its type and message."""
    flags = (Flag.ERROR if local_error is not None else Flag.NONE) | (
        Flag.REBUILD if sg.needs_rebuild else Flag.NONE)
    error_text = sig.error[:_TEXT_LIMIT] if local_error is not None else ""
    mine = Message(Round.AGREE, call, backward, sg.calls, flags, codes=sig.codes(),
                   text=error_text, generation=sg.generation)
    table = _exchange_in_step(sg, mine, timeout_s, "agreement")
    failed = [r for r, m in enumerate(table) if m.flags & Flag.ERROR]
    diffs = [] if failed else _differences(table, sig.names())
    values = ""
    if diffs:
        # The field values (not just their codes) travel only now, to name them.
        own = dict(sig.fields)
        values = repr([(n, repr(own.get(n))) for n in diffs])[:_TEXT_LIMIT]
    verdict = Message(Round.VERDICT, call, backward, sg.calls, Flag.NONE, text=values,
                      generation=sg.generation)
    vtable = _exchange(sg, verdict, timeout_s, "verdict")
    if any(m is not None and m.flags & Flag.ABANDONED for m in vtable):
        raise _out_of_step(sg, vtable, verdict)
    if not _in_step(vtable, verdict):
        raise _out_of_step(sg, vtable, verdict)
    if failed:
        if local_error is not None:
            raise local_error
        detail = "; ".join(f"rank {r}: {table[r].text}" for r in failed)
        raise CPMismatchError(f"cp_attention: the call failed its input checks on "
                              f"{_ranks(failed)} before any data moved ({detail})")
    if diffs:
        raise CPMismatchError(_mismatch_text(diffs, [m.text for m in vtable]))
    if any(m.flags & Flag.REBUILD for m in table):
        from charm_megatron.ops.streams import rebuild

        rebuild(sg, max(m.generation for m in table) + 1)


def share(sg, codes: Sequence[int], timeout_s: float, what: str) -> list[tuple[int, ...]]:
    """Every rank's ``codes`` (at most ``MAX_CODES`` int64s), in one exchange with a call
    number of its own (ops/auto_tune.py shares its measured times so). Bounded by
    ``timeout_s``; a rank out of step raises :class:`CPMismatchError` on every rank."""
    call = open_call(sg, timeout_s)
    mine = Message(Round.TUNE, call, False, sg.calls, Flag.NONE, codes=tuple(codes),
                   generation=sg.generation)
    table = _exchange_in_step(sg, mine, timeout_s, what)
    return [m.codes for m in table]


def report_status(sg, call: int, backward: bool, code: int, message: str,
                  timeout_s: float) -> tuple[list[int], list[str]]:
    """Every rank's status code (``OK``, ``RAISED``, ``BROKEN``) and message after the plan.
    A rank whose peers gave up on the call (it was late) raises here."""
    mine = Message(Round.STATUS, call, backward, sg.calls, Flag.NONE, status=code,
                   text=message[:_TEXT_LIMIT], generation=sg.generation)
    try:
        table = _exchange(sg, mine, timeout_s, "status")
    except CPAttentionError:
        sg.needs_rebuild = True  # transfers may still be in flight somewhere
        raise
    if not _in_step(table, mine) or any(m.flags & Flag.ABANDONED for m in table):
        raise _out_of_step(sg, table, mine)
    return [m.status for m in table], [m.text for m in table]


def _differences(table: Sequence[Message], names: list[str]) -> list[str]:
    """Every field whose code differs between ranks."""
    if len({len(m.codes) for m in table}) > 1:
        return ["number of signature fields (different charm_megatron versions?)"]
    base = table[0].codes
    return [name for i, name in enumerate(names)
            if any(m.codes[i] != base[i] for m in table[1:])]


def _mismatch_text(diffs: list[str], texts: list[str]) -> str:
    values = []
    for t in texts:
        try:
            values.append(dict(ast.literal_eval(t)))
        except (ValueError, SyntaxError):
            values.append({})
    parts = [f"{name} ({_by_value([v.get(name, '?') for v in values])})" for name in diffs]
    return ("cp_attention: the ranks of the CP group disagree on " + "; ".join(parts)
            + ". Every rank of a CP group must make the same call (same shapes, dtype, algo, "
            "topology, causal, softmax_scale, options) in the same order; nothing was sent")
