"""One critical section at a time across the threads of a process and, through an ``flock``
on a shared file, every process of the machine that opens it: the software links'
reservations and mailboxes (:mod:`.linkmodel`), the ranks' floors (:mod:`.floors`) and the
queue of messages waiting to be served in start order (:mod:`.link_order`)."""

from __future__ import annotations

import fcntl
import os
import threading
from collections.abc import Iterator
from contextlib import contextmanager


class Locked:
    """A thread lock plus, with ``path``, an ``flock`` on that file: one section at a time
    among the threads of this process and every process that opens the same file."""

    keep_open = True  # False: open the file for each section (a mailbox per pair and channel)

    def __init__(self, path: str | None) -> None:
        self.path = path
        self._lock = threading.Lock()
        self._fd: int | None = None
        self._pid = 0

    def __getstate__(self) -> dict:
        state = dict(self.__dict__)
        state["_lock"] = None
        state["_fd"] = None
        return state

    def __setstate__(self, state: dict) -> None:
        self.__dict__.update(state)
        self._lock = threading.Lock()

    @contextmanager
    def _held(self) -> Iterator[int | None]:
        with self._lock:
            if self.path is None:
                yield None
                return
            if self._fd is None or self._pid != os.getpid():  # a forked copy: own description
                self._fd = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o600)
                self._pid = os.getpid()
            fd = self._fd
            fcntl.flock(fd, fcntl.LOCK_EX)
            try:
                yield fd
            finally:
                fcntl.flock(fd, fcntl.LOCK_UN)
                if not self.keep_open:
                    os.close(fd)
                    self._fd = None
