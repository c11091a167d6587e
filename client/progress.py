"""A one-line progress bar on stderr (no dependency); silent when disabled, one final line when not a terminal."""

from __future__ import annotations

import sys
import time
from typing import TextIO

BAR_WIDTH = 30


class Progress:
    def __init__(self, total: int, label: str, *, enabled: bool = True, stream: TextIO | None = None):
        self.total = max(total, 1)
        self.label = label
        self.enabled = enabled
        self.stream = stream or sys.stderr
        self.done = 0
        self.failed = 0
        self.started = time.perf_counter()

    def advance(self, ok: bool = True) -> None:
        self.done += 1
        self.failed += 0 if ok else 1
        self._draw()

    def _draw(self) -> None:
        # Redraw in place on a terminal; into a log file, write only the final line.
        if not self.enabled or (self.done < self.total and not self.stream.isatty()):
            return
        filled = round(BAR_WIDTH * self.done / self.total)
        elapsed = time.perf_counter() - self.started
        failed = f" {self.failed} failed" if self.failed else ""
        line = f"\r{self.label:<26} [{'#' * filled}{'.' * (BAR_WIDTH - filled)}] {self.done}/{self.total} {elapsed:6.1f}s{failed}"
        self.stream.write(line)
        if self.done >= self.total:
            self.stream.write("\n")
        self.stream.flush()
