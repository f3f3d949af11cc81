"""Low-level network-namespace plumbing: ``ip`` / ``tc`` calls, ``setns``, availability, cleanup.

Linux only, root only. Every namespace this package creates is named ``cmemu-<pid>-<n>-...``
with the pid of the creating process, so parallel runs never collide and :func:`cleanup_stale`
can remove what a killed run (SIGKILL skips every clean-up hook) left behind.
"""

from __future__ import annotations

import ctypes
import os
import shutil
import subprocess
from functools import lru_cache

__all__ = [
    "CLONE_NEWNET",
    "CLONE_NEWUTS",
    "NETNS_DIR",
    "PREFIX",
    "available",
    "cleanup_stale",
    "list_netns",
    "netns_path",
    "run_ip",
    "setns",
    "unshare",
]

PREFIX = "cmemu-"
NETNS_DIR = "/var/run/netns"
CLONE_NEWNET = 0x40000000
CLONE_NEWUTS = 0x04000000
_CMD_TIMEOUT_S = 30.0


def netns_path(name: str) -> str:
    """File that ``ip netns add`` bind-mounts for namespace ``name``."""
    return os.path.join(NETNS_DIR, name)


def run_ip(args: list[str], *, tool: str = "ip", input_text: str | None = None,
           check: bool = True) -> subprocess.CompletedProcess:
    """Run ``ip``/``tc`` with ``args``; raise with its stderr on failure (when ``check``)."""
    exe = shutil.which(tool) or tool
    proc = subprocess.run([exe, *args], input=input_text, capture_output=True, text=True,
                          timeout=_CMD_TIMEOUT_S)
    if check and proc.returncode != 0:
        shown = " ".join([tool, *args])
        if input_text:
            shown += f" <<EOF\n{input_text}EOF"
        raise RuntimeError(f"`{shown}` failed ({proc.returncode}): {proc.stderr.strip()}")
    return proc


def list_netns() -> list[str]:
    """Names of all named network namespaces (``ip netns list``)."""
    proc = run_ip(["netns", "list"], check=False)
    if proc.returncode != 0:
        return []
    return [line.split()[0] for line in proc.stdout.splitlines() if line.strip()]


@lru_cache(maxsize=1)
def _libc() -> ctypes.CDLL:
    return ctypes.CDLL(None, use_errno=True)


def setns(path: str, nstype: int) -> None:
    """Move the *calling thread* into the namespace at ``path`` (``os.setns`` is Python 3.12+).

    Namespaces are per thread: threads created afterwards inherit it, existing ones do not, so
    call this before anything opens sockets or starts threads.
    """
    fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
    try:
        if _libc().setns(fd, nstype) != 0:
            err = ctypes.get_errno()
            raise OSError(err, f"setns({path}): {os.strerror(err)}")
    finally:
        os.close(fd)


def unshare(flags: int) -> None:
    """``unshare(2)`` for the calling thread (``os.unshare`` is Python 3.12+)."""
    if _libc().unshare(flags) != 0:
        err = ctypes.get_errno()
        raise OSError(err, f"unshare({flags:#x}): {os.strerror(err)}")


@lru_cache(maxsize=1)
def available() -> tuple[bool, str]:
    """Whether this process can build an emulated cluster here, and if not, why not.

    Checks: Linux, root, ``ip`` and ``tc`` present, and a throw-away namespace with a veth pair
    and a ``tbf`` qdisc can really be created (containers often forbid it).
    """
    if not os.path.isdir("/proc/self/ns"):
        return False, "not Linux (no /proc/self/ns)"
    if os.geteuid() != 0:
        return False, "needs root (network namespaces and tc); fall back to LinkModel"
    for tool in ("ip", "tc"):
        if shutil.which(tool) is None:
            return False, f"`{tool}` not found (install iproute2)"
    name = f"{PREFIX}{os.getpid()}-probe"
    try:
        run_ip(["netns", "add", name])
    except (RuntimeError, OSError, subprocess.SubprocessError) as exc:
        return False, f"cannot create a network namespace: {exc}"
    try:
        run_ip(["-n", name, "link", "add", "a0", "type", "veth", "peer", "name", "b0"])
        run_ip(["-n", name, "qdisc", "add", "dev", "a0", "root", "tbf", "rate", "1gbit",
                "burst", "65536", "latency", "100ms"], tool="tc")
    except (RuntimeError, OSError, subprocess.SubprocessError) as exc:
        return False, f"cannot create veth pairs or tbf qdiscs in a namespace: {exc}"
    finally:
        run_ip(["netns", "del", name], check=False)
    return True, "ok"


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def cleanup_stale() -> list[str]:
    """Delete namespaces this package created in processes that no longer exist; return them.

    Namespaces of live processes are left alone (they may belong to a parallel run).
    """
    removed = []
    for name in list_netns():
        if not name.startswith(PREFIX):
            continue
        pid_text = name[len(PREFIX):].split("-", 1)[0]
        if pid_text.isdigit() and not _pid_alive(int(pid_text)):
            run_ip(["netns", "del", name], check=False)
            removed.append(name)
    return removed
