"""Run a function on ``n`` real CPU ranks (processes) joined by a gloo process group.

The package's local launcher: the operator demo, ``bench --ranks`` / ``--emulate``, the emulated
clusters (:func:`charm_megatron.lab.emulate.run_ranks_in_cluster`), the training demo and the
test-suite run their ranks with :func:`run_ranks`. Design choices, each for a measured reason
(see ``shared/docs/CPU-TESTBED.md``):

* processes come from a *forkserver* with torch preloaded: spawning re-imports torch in every
  child (~5 s each); forking the pytest process directly can hang when the parent used several
  intra-op threads;
* rendezvous goes through a ``FileStore`` in a fresh temporary directory, so concurrent tests
  never fight over a TCP port;
* every child runs with one intra-op thread (``n`` ranks share 2 cores) and a short process-group
  timeout, so a broken collective fails in seconds, not after the 30-minute default;
* failures come back with the child's traceback; stragglers are killed;
* each rank's result is a file renamed into place (never a shared pipe a dying rank can leave
  half-written), so a rank that gloo aborts is reported by its exit code, never waited on.
"""

from __future__ import annotations

import datetime
import multiprocessing as mp
import os
import pickle
import tempfile
import traceback
from collections.abc import Callable
from typing import Any

_CTX: mp.context.BaseContext | None = None
#: What every rank imports anyway, once in the forkserver instead of in each child: torch's
#: symbolic shapes (sympy, ~3 s of CPU per process) are imported lazily by the first
#: backward; the attention path by the first call. :func:`preload` adds to it.
_PRELOAD = ["torch", "torch.distributed", "torch.fx.experimental.symbolic_shapes",
            "charm_megatron", "charm_megatron.ops.attention", "charm_megatron.model"]


class RankFailure(RuntimeError):
    """Raised in the parent when a rank failed or the job timed out."""


def _context() -> mp.context.BaseContext:
    global _CTX
    if _CTX is None:
        ctx = mp.get_context("forkserver")
        ctx.set_forkserver_preload(list(_PRELOAD))
        _CTX = ctx
    return _CTX


def preload(*modules: str) -> None:
    """Have the forkserver import ``modules`` too, once, instead of every rank importing them
    (e.g. megatron-core, ~3 s of CPU per rank). Only before this process's first
    :func:`run_ranks` (which starts the server); a module that fails to import there is
    skipped (the ranks then import it themselves, or fail as they would have)."""
    if _CTX is not None:
        raise RuntimeError("local_ranks.preload after the first run_ranks: the forkserver "
                           "has its modules already")
    _PRELOAD.extend(m for m in modules if m not in _PRELOAD)


def _child(
    rank: int,
    world: int,
    store_path: str,
    fn: Callable[..., Any],
    args: tuple,
    env: dict[str, str],
    threads: int,
    pg_timeout_s: float,
    result_dir: str,
    setup: Callable[[int, int], None] | None = None,
) -> None:
    os.environ.update(env)
    try:
        if setup is not None:
            # Runs before torch.distributed opens any socket, e.g. to enter an emulated node's
            # network namespace (charm_megatron.lab.emulate).
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
        # Plain pickle copies tensor data into the file (no storage shared through file
        # descriptors that vanish when this process exits).
        _write_result(result_dir, rank, (True, pickle.dumps(out)))
    except BaseException as exc:  # noqa: BLE001 - report every failure to the parent
        _write_result(result_dir, rank,
                      (False, f"{type(exc).__name__}: {exc}\n{traceback.format_exc()}"))


def _write_result(result_dir: str, rank: int, value: tuple[bool, Any]) -> None:
    """Write this rank's result whole or not at all: to a private file, then renamed.

    Why files, not a shared queue or pipe: a rank that gloo aborts (SIGABRT) or the kernel
    kills part-way through writing a message leaves a shared pipe holding half a message (the
    reader then blocks on the rest, past every timeout) or a queue's shared lock taken. A
    rename is atomic: the parent sees a complete result or none, and a dead rank is told by
    its exit code."""
    part = os.path.join(result_dir, f"rank{rank}.part")
    with open(part, "wb") as f:
        pickle.dump(value, f)
    os.replace(part, os.path.join(result_dir, f"rank{rank}.result"))


def _read_result(result_dir: str, rank: int) -> tuple[bool, Any] | None:
    path = os.path.join(result_dir, f"rank{rank}.result")
    if not os.path.exists(path):
        return None
    with open(path, "rb") as f:
        return pickle.load(f)


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
    Raises :class:`RankFailure` with every failing rank's traceback, when a rank dies without
    a result (its exit code, e.g. ``-6`` for a gloo abort), or on timeout; it never waits
    past ``timeout_s`` (plus a few seconds to stop the ranks), whatever the ranks do.
    """
    ctx = _context()
    with tempfile.TemporaryDirectory(prefix="charm-ranks-") as tmp:
        store_path = os.path.join(tmp, "store")
        procs = [
            ctx.Process(
                target=_child,
                args=(r, world_size, store_path, fn, args, dict(env or {}), threads,
                      pg_timeout_s, tmp, setup),
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
                _collect(tmp, procs, got)
                if any(not ok for ok, _ in got.values()):
                    # One failure usually leaves the others blocked in a collective until the
                    # process-group timeout; collect briefly, then stop them.
                    _drain(tmp, procs, got, 5.0)
                    raise RankFailure(_dead_text(procs, got) + _failures_text(got))
                if len(got) == world_size:
                    break
                dead = [r for r, p in enumerate(procs) if r not in got and not p.is_alive()]
                if dead:
                    _collect(tmp, procs, got)  # a result renamed just before the exit
                    dead = [r for r in dead if r not in got]
                    if dead:
                        raise RankFailure(
                            f"ranks {dead} exited without a result (exit codes "
                            f"{[procs[r].exitcode for r in dead]})" + _failures_text(got))
                    continue
                if _now() >= deadline:
                    missing = sorted(set(range(world_size)) - set(got))
                    raise RankFailure(
                        f"ranks {missing} did not finish within {timeout_s:.0f} s"
                        + _failures_text(got)
                    )
                _sleep(0.05)
        finally:
            for p in procs:
                if p.is_alive():
                    p.kill()
            for p in procs:
                p.join(timeout=10)
    return [pickle.loads(got[r][1]) for r in range(world_size)]


def _collect(result_dir: str, procs: list, got: dict[int, tuple[bool, Any]]) -> None:
    for r in range(len(procs)):
        if r not in got:
            value = _read_result(result_dir, r)
            if value is not None:
                got[r] = value


def _drain(result_dir: str, procs: list, got: dict, seconds: float) -> None:
    deadline = _now() + seconds
    while len(got) < len(procs) and _now() < deadline:
        _collect(result_dir, procs, got)
        if all(r in got or not p.is_alive() for r, p in enumerate(procs)):
            _collect(result_dir, procs, got)
            return
        _sleep(0.1)


def _dead_text(procs: list, got: dict) -> str:
    """Ranks that exited without a result (a gloo abort is exit code -6), if any."""
    dead = [r for r, p in enumerate(procs) if r not in got and not p.is_alive()]
    if not dead:
        return ""
    return (f"ranks {dead} exited without a result (exit codes "
            f"{[procs[r].exitcode for r in dead]})")


def _failures_text(got: dict[int, tuple[bool, Any]]) -> str:
    parts = [f"\n--- rank {r} failed ---\n{v}" for r, (ok, v) in sorted(got.items()) if not ok]
    return "".join(parts)


def _now() -> float:
    import time

    return time.monotonic()


def _sleep(seconds: float) -> None:
    import time

    time.sleep(seconds)
