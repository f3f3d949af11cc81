"""Measured TCP rates between the emulated ranks' namespaces, with plain sockets (no torch):
what :meth:`charm_megatron.lab.emulate.cluster.EmulatedCluster.measure_rates` reports."""

from __future__ import annotations

import socket
import threading
import time
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any

from charm_megatron.lab.emulate.netns import CLONE_NEWNET, setns

if TYPE_CHECKING:  # for annotations only (the cluster module imports this one)
    from charm_megatron.lab.emulate.cluster import RankPlace


def _in_netns(place: RankPlace, fn: Callable[[], Any]) -> Any:
    """Run ``fn`` on a helper thread that entered ``place``'s network namespace."""
    out: dict[str, Any] = {}

    def body() -> None:
        try:
            setns(place.netns_path, CLONE_NEWNET)
            out["v"] = fn()
        except BaseException as exc:  # noqa: BLE001 - re-raised in the caller
            out["e"] = exc

    t = threading.Thread(target=body, daemon=True)
    t.start()
    t.join(timeout=30)
    if "e" in out:
        raise out["e"]
    if t.is_alive():
        raise TimeoutError(f"creating a socket in {place.netns} timed out")
    return out["v"]


def transfer(places: Sequence[RankPlace], pairs: list[tuple[int, int]], seconds: float) -> list[float]:
    """Stream bytes for ``seconds`` over each (src, dst) pair at once; receiver-side rates."""
    chunk = bytes(1 << 20)
    listeners, clients = [], []
    for _src, dst in pairs:
        def listen(d: int = dst) -> socket.socket:
            s = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
            s.bind((places[d].address, 0))
            s.listen(1)
            return s
        listeners.append(_in_netns(places[dst], listen))
    for src, _dst in pairs:
        # A socket belongs to the namespace it was created in, whichever thread uses it later.
        clients.append(_in_netns(places[src], lambda: socket.socket(socket.AF_INET, socket.SOCK_STREAM)))
    results: list[float] = [0.0] * len(pairs)
    errors: list[BaseException] = []

    def receive(i: int, lst: socket.socket) -> None:
        try:
            lst.settimeout(10)
            conn, _ = lst.accept()
            conn.settimeout(10)
            buf = bytearray(1 << 20)
            total, first, last = 0, None, None
            with conn:
                while True:
                    n = conn.recv_into(buf)
                    if n == 0:
                        break
                    now = time.perf_counter()
                    if first is None:
                        first = now
                        n = 0  # the first read starts the clock; count what follows
                    total += n
                    last = now
            results[i] = total / (last - first) if first is not None and last and last > first else 0.0
        except BaseException as exc:  # noqa: BLE001
            errors.append(exc)

    def send(i: int, cli: socket.socket) -> None:
        try:
            cli.settimeout(10)
            cli.connect(listeners[i].getsockname())
            end = time.perf_counter() + seconds
            with cli:
                while time.perf_counter() < end:
                    cli.sendall(chunk)
        except BaseException as exc:  # noqa: BLE001
            errors.append(exc)

    threads = [threading.Thread(target=receive, args=(i, lst), daemon=True) for i, lst in enumerate(listeners)]
    threads += [threading.Thread(target=send, args=(i, c), daemon=True) for i, c in enumerate(clients)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=seconds + 30)
    for s in listeners:
        s.close()
    if errors:
        raise RuntimeError(f"rate measurement failed: {errors[0]!r}") from errors[0]
    if any(t.is_alive() for t in threads):
        raise TimeoutError("rate measurement did not finish")
    return results
