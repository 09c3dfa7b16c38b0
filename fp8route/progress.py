"""Progress reports: the callback type long jobs take, and a dependency-free bar on stderr
(redrawn in place on a terminal, every 10% in a log)."""

from __future__ import annotations

import sys
import time
from collections.abc import Callable
from typing import TextIO

# done, total, what is being worked on now
Progress = Callable[[int, int, str], None]


class TextProgress:
    def __init__(self, title: str, stream: TextIO | None = None, width: int = 30) -> None:
        self.title, self.width = title, width
        self.stream = stream or sys.stderr
        self.start: float | None = None  # the first report starts the clock
        self._last_decile = -1
        self._tty = hasattr(self.stream, "isatty") and self.stream.isatty()

    def __call__(self, done: int, total: int, what: str) -> None:
        if self.start is None:
            self.start = time.perf_counter()
        frac = done / total if total else 1.0
        filled = int(frac * self.width)
        bar = "#" * filled + "." * (self.width - filled)
        line = f"{self.title} [{bar}] {done}/{total} {time.perf_counter() - self.start:5.1f}s {what}"
        if self._tty:
            end = "\n" if done >= total else ""
            self.stream.write(f"\r\x1b[2K{line}{end}")
        elif int(frac * 10) != self._last_decile or done >= total:
            self._last_decile = int(frac * 10)
            self.stream.write(line + "\n")
        self.stream.flush()
