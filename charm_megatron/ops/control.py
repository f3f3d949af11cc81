"""The control channel of a CP group: fixed-size, self-describing messages on its gloo control
group, one exchange at a time, with an exchange that timed out kept for the next call.

Why each property (docs/api.md, failure model):

* **Fixed size.** gloo pairs the k-th collective of every rank with the k-th of the others and
  aborts the process (SIGABRT, "400 vs 8") when their sizes differ. A rank that is one exchange
  ahead or behind its peers must meet a message of the same size, so every message of every
  round is :data:`WORDS` int64 words.
* **Self-describing.** Each message says which round of which call it belongs to (and the
  sender's next call number), so a rank that meets a message of another round or call knows it
  is out of step and by how much, instead of reading garbage as agreement.
* **An exchange that timed out is kept** (:attr:`ControlChannel.pending`): gloo keeps the
  operation alive, and the late rank's next exchange will complete it. The next call on this
  rank first *settles* it (waits for it again, bounded), so that every rank has made the same
  number of exchanges before the next one is posted. Measured on gloo (torch 2.13): a second
  ``wait`` on a timed-out all-to-all completes once the late rank posts its own.

The control group's own timeout is long (:data:`CONTROL_PG_TIMEOUT_S`): every wait here is
bounded by the call's ``timeout_s`` instead, and a pending exchange must stay alive until the
late rank reaches it.
"""

from __future__ import annotations

import datetime
import enum
from dataclasses import dataclass, field

import torch
import torch.distributed as dist

WORDS = 256  # int64 words per message (2 KiB): header, signature codes, text
_MAGIC = 0x43484D31  # "CHM1": a message of this protocol
_HEADER = 10
MAX_CODES = 64
_TEXT_BYTES = (WORDS - _HEADER - MAX_CODES) * 8
CONTROL_PG_TIMEOUT_S = 24 * 3600.0


class Round(enum.IntEnum):
    """The exchanges of one call direction, in order."""

    AGREE = 1  # signature codes (or this rank's input error)
    VERDICT = 2  # go, or the values of the fields that differ
    STATUS = 3  # how the plan went on this rank
    TUNE = 4  # a measured auto's times, one exchange of a call number of its own


class Flag(enum.IntFlag):
    NONE = 0
    ERROR = 1  # this rank's own checks failed (text: the error)
    REBUILD = 2  # this rank's stream communicators must be rebuilt before data moves
    ABANDONED = 4  # sent on behalf of a call this rank gave up (timeout): the call is void


@dataclass(frozen=True)
class Message:
    """One rank's message of one round."""

    round: Round
    call: int  # the forward's call number on this CP group
    backward: bool
    next_call: int  # the sender's next call number (its call counter)
    flags: Flag = Flag.NONE
    status: int = 0
    codes: tuple[int, ...] = ()
    text: str = ""
    generation: int = 0  # the sender's stream-communicator generation

    def pack(self) -> torch.Tensor:
        if len(self.codes) > MAX_CODES:
            raise ValueError(f"a control message holds at most {MAX_CODES} codes")
        buf = torch.zeros(WORDS, dtype=torch.int64)
        raw = self.text.encode("utf-8", "replace")[:_TEXT_BYTES]
        buf[:_HEADER] = torch.tensor(
            [_MAGIC, int(self.round), self.call, int(self.backward), self.next_call,
             int(self.flags), self.status, len(self.codes), len(raw), self.generation],
            dtype=torch.int64)
        if self.codes:
            buf[_HEADER:_HEADER + len(self.codes)] = torch.tensor(self.codes, dtype=torch.int64)
        if raw:
            text = buf[_HEADER + MAX_CODES:].view(torch.uint8)
            text[:len(raw)] = torch.frombuffer(bytearray(raw), dtype=torch.uint8)
        return buf

    @staticmethod
    def unpack(buf: torch.Tensor) -> Message | None:
        """The message in ``buf``, or ``None`` if it is not one of this protocol's."""
        head = [int(x) for x in buf[:_HEADER].tolist()]
        if head[0] != _MAGIC or head[1] not in Round._value2member_map_:
            return None
        n_codes, n_text = head[7], head[8]
        if not (0 <= n_codes <= MAX_CODES and 0 <= n_text <= _TEXT_BYTES):
            return None
        codes = tuple(int(x) for x in buf[_HEADER:_HEADER + n_codes].tolist())
        raw = bytes(buf[_HEADER + MAX_CODES:].view(torch.uint8)[:n_text].tolist())
        return Message(Round(head[1]), head[2], bool(head[3]), head[4], Flag(head[5]),
                       head[6], codes, raw.decode("utf-8", "replace"), head[9])

    def position(self) -> tuple[int, int, bool]:
        """Where in the protocol the sender is: (round, call, direction)."""
        return int(self.round), self.call, self.backward

    def where(self) -> str:
        direction = "backward" if self.backward else "forward"
        return f"call {self.call} {direction}, {self.round.name.lower()} round"


class ControlTimeout(RuntimeError):
    """An exchange did not complete within its bound (it is kept as the pending exchange)."""


class ControlBroken(RuntimeError):
    """The control group itself failed (not a timeout): it must be made anew."""


@dataclass(eq=False)
class _Pending:
    work: object
    out: torch.Tensor
    sent: Message
    mirror: bool  # posted for a call already given up (settling it voids nothing new)


@dataclass(eq=False)
class ControlChannel:
    """Exchanges of one CP group's control group (every rank's message to every rank)."""

    group: dist.ProcessGroup
    size: int
    pending: _Pending | None = field(default=None, repr=False)

    def post(self, msg: Message, *, mirror: bool = False) -> _Pending:
        if self.pending is not None:
            raise RuntimeError("cp_attention internal error: a control exchange is posted "
                               "while an earlier one is still pending")
        flat = msg.pack()
        out = torch.empty(self.size * WORDS, dtype=torch.int64)
        try:
            work = dist.all_to_all_single(out, flat.repeat(self.size), group=self.group,
                                          async_op=True)
        except Exception as exc:  # noqa: BLE001 - the group itself is unusable
            raise ControlBroken(f"{type(exc).__name__}: {exc}") from exc
        self.pending = _Pending(work, out, msg, mirror)
        return self.pending

    def wait(self, timeout_s: float) -> list[Message | None]:
        """Wait for the pending exchange; every rank's message (``None``: unreadable).
        On timeout it stays pending (:class:`ControlTimeout`)."""
        p = self.pending
        assert p is not None
        try:
            p.work.wait(datetime.timedelta(seconds=timeout_s))
        except Exception as exc:  # noqa: BLE001 - classified below
            if "timed out" in str(exc).lower() or "timeout" in type(exc).__name__.lower():
                raise ControlTimeout(str(exc)) from exc
            self.pending = None
            raise ControlBroken(f"{type(exc).__name__}: {exc}") from exc
        self.pending = None
        return [Message.unpack(row) for row in p.out.chunk(self.size)]

    def exchange(self, msg: Message, timeout_s: float) -> list[Message | None]:
        self.post(msg)
        return self.wait(timeout_s)
