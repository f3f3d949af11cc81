"""One rank's program as a builder writes it: the op list and its batch handles.

Shared by the ring and the RM+ / CHARM+ builders. Plan layer: no torch.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from charm_megatron.plan.core import Comm, Merge, Op, Stream, Wait, Xfer

__all__ = ["Program", "Return"]


@dataclass(frozen=True)
class Return:
    """Partials on their way back to this rank in batch ``handle``: complete by waiting and
    applying ``merges``. ``unit``: the RM+ unit that posted it (-1: a cross return, which is
    completed pass by pass instead)."""

    unit: int
    handle: int
    merges: tuple[Merge, ...]


class Program:
    """Accumulates one rank's ops and hands out batch handles."""

    def __init__(self) -> None:
        self.ops: list[Op] = []
        self._next = 0

    def comm(self, stream: Stream, sends: Sequence[Xfer] = (),
             recvs: Sequence[Xfer] = ()) -> int:
        handle = self._next
        self._next += 1
        self.ops.append(Comm(handle, stream, tuple(sends), tuple(recvs)))
        return handle

    def add(self, op: Op) -> None:
        self.ops.append(op)

    def finish(self, ret: Return) -> None:
        """Complete partials coming back: wait for their batch, merge each into its acc."""
        self.ops.append(Wait(ret.handle))
        self.ops.extend(ret.merges)
