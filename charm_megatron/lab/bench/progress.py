"""A dependency-free text progress bar (rank 0 / the parent prints it)."""

from __future__ import annotations

import sys
import time
from typing import TextIO


def _clock(seconds: float) -> str:
    seconds = max(0, int(seconds))
    h, rest = divmod(seconds, 3600)
    m, s = divmod(rest, 60)
    return f"{h}:{m:02d}:{s:02d}" if h else f"{m}:{s:02d}"


class Progress:
    """``[#####-----]  12/30  40%  0:42 elapsed, ~1:03 left  <text>``.

    On a terminal the bar redraws one line; otherwise (logs, pytest) it prints a line only when
    it has advanced by at least ``every`` of the total, so logs stay short.
    """

    def __init__(self, total: int, *, enabled: bool = True, stream: TextIO | None = None,
                 width: int = 24, every: float = 0.1) -> None:
        self.total = max(1, total)
        self.done = 0
        self.enabled = enabled
        self.stream = stream or sys.stdout
        self.width = width
        self.every = every
        self.start = time.monotonic()
        self._last_printed = -1.0
        self._tty = bool(getattr(self.stream, "isatty", lambda: False)())
        self._drawn = False

    def line(self, text: str = "") -> str:
        frac = min(1.0, self.done / self.total)
        filled = int(round(frac * self.width))
        elapsed = time.monotonic() - self.start
        eta = elapsed / frac - elapsed if frac > 0 else float("nan")
        left = f", ~{_clock(eta)} left" if frac > 0 and frac < 1 else ""
        return (f"[{'#' * filled}{'-' * (self.width - filled)}] {self.done}/{self.total} "
                f"{frac:4.0%}  {_clock(elapsed)} elapsed{left}  {text}").rstrip()

    def update(self, n: int = 1, text: str = "") -> None:
        self.done += n
        if not self.enabled:
            return
        frac = self.done / self.total
        if self._tty:
            self.stream.write("\r\x1b[2K" + self.line(text))
            self._drawn = True
        elif frac - self._last_printed >= self.every or self.done >= self.total:
            self.stream.write(self.line(text) + "\n")
            self._last_printed = frac
        self.stream.flush()

    def close(self) -> None:
        if self.enabled and self._tty and self._drawn:
            self.stream.write("\n")
            self.stream.flush()
            self._drawn = False
