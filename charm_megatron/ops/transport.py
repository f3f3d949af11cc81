"""How the executor moves bytes: a :class:`Transport`, chosen per call.

The executor (ops/executor.py) never calls ``torch.distributed``'s point-to-point functions
itself: each ``Comm`` op (and each head all-to-all batch) becomes one :meth:`Transport.post`
of the batch's sends and receives, and a ``Wait`` waits on the handles it returned. A call
picks its transport with ``CPOptions(transport=...)`` / ``CHARM_TRANSPORT``: ``None``
(:class:`TorchTransport`, torch.distributed), a name given to :func:`register_transport`, or
a transport object. The emulator's software links are one (lab/emulate/linkmodel.py
``LinkTransport``: every op booked on its modelled link); tests add a counting one
(tests/toy_transport.py).

Adding one: a class with a ``name`` and a ``post`` (usually wrapping :class:`TorchTransport`),
then ``register_transport("mine", Mine)`` in every rank process, then
``CPOptions(transport="mine")`` or ``CHARM_TRANSPORT=mine``. Every rank of a call must run the
same transport (the agreement check compares the names).
"""

from __future__ import annotations

import datetime
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, Protocol, runtime_checkable

import torch
import torch.distributed as dist

__all__ = ["P2P", "TorchTransport", "Transport", "Work", "get_transport", "register_transport",
           "transport_name", "transport_names"]


@dataclass(frozen=True)
class P2P:
    """One point-to-point operation of a batch: send ``tensor`` to, or receive it from,
    global rank ``peer`` on process group ``group`` (a stream's communicator; ``None``: the
    default group)."""

    send: bool
    tensor: torch.Tensor
    peer: int
    group: Any = None

    @property
    def nbytes(self) -> int:
        return self.tensor.numel() * self.tensor.element_size()


@runtime_checkable
class Work(Protocol):
    """A handle of posted operations (torch's ``Work`` is one)."""

    def wait(self, timeout: datetime.timedelta = ...) -> Any:
        """Block until the operations completed: a received tensor holds its data, a sent one
        may be reused. The executor passes its bound (``CPOptions.timeout_s``) on CPU and
        raises :class:`~charm_megatron.ops.executor.CommError` from any exception; on CUDA
        it calls ``wait()`` (NCCL: the current stream waits, no host synchronisation; the
        communicator's own timeout bounds it)."""
        ...


@runtime_checkable
class Transport(Protocol):
    """What the executor needs to move bytes."""

    #: What the ranks' agreement check compares (and error messages name).
    name: str

    def post(self, ops: Sequence[P2P]) -> Sequence[Work]:
        """Start every operation of ``ops`` (never empty) without blocking, and return handles
        whose waits together cover them all.

        One call per batch because the batch is the unit a plan orders its traffic in: its
        sends and receives are posted together so that two ranks exchanging in both
        directions cannot deadlock, and so that on NCCL they are one grouped launch on the
        communicator's stream. On gloo torch gives one handle per op, which lets a wrapper
        attribute each op to its peer (the software links book it on the peer's link). The
        tensors must stay alive and untouched until their handles are waited (the executor
        holds them)."""
        ...


class TorchTransport:
    """torch.distributed's ``batch_isend_irecv`` (the default): on NCCL one grouped launch per
    batch (torch returns a handle for the group), on gloo one async handle per op progressing
    in gloo's threads. ``batch_isend_irecv`` is looked up at each call."""

    name = "torch"

    def post(self, ops: Sequence[P2P]) -> list[Work]:
        return dist.batch_isend_irecv([dist.P2POp(dist.isend if op.send else dist.irecv,
                                                  op.tensor, op.peer, op.group)
                                       for op in ops])

    def __repr__(self) -> str:
        return "TorchTransport()"


# name -> factory, and the instance made of it (each name's factory runs once per process,
# at its first use: a transport that keeps state, e.g. counters, keeps it across calls).
_FACTORIES: dict[str, Callable[[], Transport]] = {"torch": TorchTransport}
_INSTANCES: dict[str, Transport] = {}


def register_transport(name: str, factory: Callable[[], Transport]) -> None:
    """Make ``factory`` (a class or a zero-argument callable returning a :class:`Transport`)
    the transport called ``name`` in this process: ``CPOptions(transport=name)`` /
    ``CHARM_TRANSPORT=name`` select it. Registering a name again replaces it (its old
    instance is dropped); ``torch`` is the default and cannot be replaced. Each rank process
    registers its own (the setup hook of :func:`charm_megatron.local_ranks.run_ranks`, or
    the module a rank function lives in)."""
    if not isinstance(name, str) or not name.strip() or name != name.strip() or "," in name:
        raise ValueError(f"register_transport: bad name {name!r}")
    if name == "torch":
        raise ValueError("register_transport: 'torch' is the default transport; choose another "
                         "name")
    if not callable(factory):
        raise TypeError(f"register_transport: factory of {name!r} must be callable, got "
                        f"{type(factory).__name__}")
    _FACTORIES[name] = factory
    _INSTANCES.pop(name, None)


def transport_names() -> tuple[str, ...]:
    """The transports registered in this process (``torch`` first)."""
    return tuple(_FACTORIES)


def check_transport(value: Any) -> str | Transport | None:
    """``value`` as a ``CPOptions.transport``: ``None``, a registered name, or an object with
    a ``post``; ``ValueError`` / ``TypeError`` naming ``CHARM_TRANSPORT`` and the choices."""
    if value is None:
        return None
    if isinstance(value, str):
        name = value.strip()
        if name not in _FACTORIES:
            raise ValueError(f"cp_attention: transport={value!r} (CHARM_TRANSPORT) is not "
                             f"registered in this process; registered: "
                             f"{', '.join(transport_names())} (register_transport)")
        return name
    if not callable(getattr(value, "post", None)):
        raise TypeError(f"cp_attention: transport={value!r} is neither a registered name nor "
                        "a transport (an object with post(ops))")
    return value


def transport_name(value: str | Transport | None) -> str:
    """What the agreement check compares for a ``CPOptions.transport``."""
    if value is None or isinstance(value, str):
        return value or "torch"
    return str(getattr(value, "name", type(value).__name__))


def get_transport(value: str | Transport | None = None) -> Transport:
    """The transport ``value`` stands for: ``None`` the default (torch), a registered name its
    instance in this process, an object itself."""
    value = check_transport(value)
    if value is None:
        value = "torch"
    if not isinstance(value, str):
        return value
    inst = _INSTANCES.get(value)
    if inst is None:
        inst = _INSTANCES[value] = _FACTORIES[value]()
    return inst
