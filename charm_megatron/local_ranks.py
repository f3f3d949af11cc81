"""Run a function on ``n`` real CPU ranks (processes) joined by a gloo process group.

The package's local launcher: the operator demo, ``bench --ranks`` / ``--emulate``, the emulated
clusters (:func:`charm_megatron.emulate.run_ranks_in_cluster`), the training demo and the
test-suite run their ranks with :func:`run_ranks`. Design choices, each for a measured reason
(see ``shared/docs/CPU-TESTBED.md``):

* processes come from a *forkserver* with torch preloaded: spawning re-imports torch in every
  child (~5 s each); forking the pytest process directly can hang when the parent used several
  intra-op threads;
* rendezvous goes through a ``FileStore`` in a fresh temporary directory, so concurrent tests
  never fight over a TCP port;
* every child runs with one intra-op thread (``n`` ranks share 2 cores) and a short process-group
  timeout, so a broken collective fails in seconds, not after the 30-minute default;
* failures come back with the child's traceback; stragglers are killed.
"""

from __future__ import annotations

import datetime
import multiprocessing as mp
import os
import pickle
import queue
import tempfile
import traceback
from collections.abc import Callable
from typing import Any

_CTX: mp.context.BaseContext | None = None


class RankFailure(RuntimeError):
    """Raised in the parent when a rank failed or the job timed out."""


def _context() -> mp.context.BaseContext:
    global _CTX
    if _CTX is None:
        ctx = mp.get_context("forkserver")
        # What every rank imports anyway, once in the server instead of in each child:
        # torch's symbolic shapes (sympy, ~3 s of CPU per process) are imported lazily by the
        # first backward; the attention path by the first call.
        ctx.set_forkserver_preload(["torch", "torch.distributed",
                                    "torch.fx.experimental.symbolic_shapes", "charm_megatron",
                                    "charm_megatron.ops.attention", "charm_megatron.model"])
        _CTX = ctx
    return _CTX


def _child(
    rank: int,
    world: int,
    store_path: str,
    fn: Callable[..., Any],
    args: tuple,
    env: dict[str, str],
    threads: int,
    pg_timeout_s: float,
    results: Any,
    setup: Callable[[int, int], None] | None = None,
) -> None:
    os.environ.update(env)
    try:
        if setup is not None:
            # Runs before torch.distributed opens any socket, e.g. to enter an emulated node's
            # network namespace (charm_megatron.emulate).
            setup(rank, world)
        import torch
        import torch.distributed as dist

        torch.set_num_threads(threads)
        store = dist.FileStore(store_path, world)
        dist.init_process_group(
            "gloo",
            store=store,
            rank=rank,
            world_size=world,
            timeout=datetime.timedelta(seconds=pg_timeout_s),
        )
        try:
            out = fn(rank, world, *args)
        finally:
            # Destroying a group whose peers already died can itself block; the parent kills
            # stragglers, so a best-effort destroy is enough here.
            try:
                dist.destroy_process_group()
            except Exception:  # noqa: BLE001
                pass
        # Plain pickle copies tensor data into the message; the queue's own pickler would
        # share storage through file descriptors that vanish when this process exits.
        results.put((rank, True, pickle.dumps(out)))
    except BaseException as exc:  # noqa: BLE001 - report every failure to the parent
        results.put((rank, False, f"{type(exc).__name__}: {exc}\n{traceback.format_exc()}"))


def run_ranks(
    fn: Callable[..., Any],
    world_size: int,
    *args: Any,
    timeout_s: float = 300.0,
    pg_timeout_s: float = 60.0,
    threads: int = 1,
    env: dict[str, str] | None = None,
    setup: Callable[[int, int], None] | None = None,
) -> list[Any]:
    """Run ``fn(rank, world_size, *args)`` on ``world_size`` gloo ranks; return the results.

    ``fn`` must be a module-level (picklable) function; its return value must be picklable.
    ``setup(rank, world_size)``, if given (picklable too), runs in each child first, before the
    process group exists.
    Raises :class:`RankFailure` with every failing rank's traceback, or on timeout.
    """
    ctx = _context()
    results = ctx.Queue()
    with tempfile.TemporaryDirectory(prefix="charm-ranks-") as tmp:
        store_path = os.path.join(tmp, "store")
        procs = [
            ctx.Process(
                target=_child,
                args=(r, world_size, store_path, fn, args, dict(env or {}), threads,
                      pg_timeout_s, results, setup),
                daemon=True,
            )
            for r in range(world_size)
        ]
        for p in procs:
            p.start()
        got: dict[int, tuple[bool, Any]] = {}
        deadline = _now() + timeout_s
        try:
            while len(got) < world_size:
                remaining = deadline - _now()
                if remaining <= 0:
                    missing = sorted(set(range(world_size)) - set(got))
                    raise RankFailure(
                        f"ranks {missing} did not finish within {timeout_s:.0f} s"
                        + _failures_text(got)
                    )
                try:
                    rank, ok, value = results.get(timeout=min(remaining, 1.0))
                except queue.Empty:
                    dead = [r for r, p in enumerate(procs) if not p.is_alive() and r not in got]
                    if dead and all(not procs[r].is_alive() for r in dead):
                        # A rank that died without reporting (segfault, os._exit): give the
                        # queue a moment to drain, then fail.
                        try:
                            rank, ok, value = results.get(timeout=2.0)
                        except queue.Empty:
                            raise RankFailure(
                                f"ranks {dead} exited without a result (exit codes "
                                f"{[procs[r].exitcode for r in dead]})" + _failures_text(got)
                            ) from None
                    else:
                        continue
                got[rank] = (ok, value)
                if not ok:
                    # One failure usually leaves the others blocked in a collective until the
                    # process-group timeout; collect briefly, then stop them.
                    _drain(results, got, world_size, 5.0)
                    raise RankFailure(_failures_text(got))
        finally:
            for p in procs:
                if p.is_alive():
                    p.kill()
            for p in procs:
                p.join(timeout=10)
    return [pickle.loads(got[r][1]) for r in range(world_size)]


def _drain(results: Any, got: dict, world_size: int, seconds: float) -> None:
    deadline = _now() + seconds
    while len(got) < world_size and _now() < deadline:
        try:
            rank, ok, value = results.get(timeout=0.2)
            got[rank] = (ok, value)
        except queue.Empty:
            pass


def _failures_text(got: dict[int, tuple[bool, Any]]) -> str:
    parts = [f"\n--- rank {r} failed ---\n{v}" for r, (ok, v) in sorted(got.items()) if not ok]
    return "".join(parts)


def _now() -> float:
    import time

    return time.monotonic()
