"""A toy transport (ops/transport.py): torch.distributed underneath, every op's bytes counted
per peer. The whole extension is this file plus one line,
``register_transport("counting", CountingTransport)`` (tests/test_transport.py)."""

from __future__ import annotations

from collections import Counter

from charm_megatron.ops.transport import TorchTransport


class CountingTransport:
    name = "counting"

    def __init__(self) -> None:
        self.inner = TorchTransport()
        self.sent: Counter[int] = Counter()  # global peer rank -> bytes sent to it
        self.received: Counter[int] = Counter()  # global peer rank -> bytes received from it

    def post(self, ops):
        for op in ops:
            (self.sent if op.send else self.received)[op.peer] += op.nbytes
        return self.inner.post(ops)
