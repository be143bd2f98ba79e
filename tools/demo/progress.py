"""A plain-text progress bar on stderr: redrawn in place on a terminal, one line per report in logs."""

from __future__ import annotations

import sys
import time
from typing import TextIO


class Progress:
    """``update`` redraws the bar; off a terminal only ``update(..., force=True)`` prints a line."""

    def __init__(self, label: str, total: int, stream: TextIO | None = None, width: int = 30):
        self.label, self.total, self.width = label, total, width
        self.stream = sys.stderr if stream is None else stream
        self.tty = self.stream.isatty()
        self.start = time.perf_counter()

    def update(self, done: int, info: str = "", force: bool = False) -> None:
        """Show ``done`` of ``total`` steps with ``info``; ``force`` marks a line worth logging."""
        if not (self.tty or force):
            return
        filled = self.width * done // max(1, self.total)
        bar = "#" * filled + "." * (self.width - filled)
        elapsed = time.perf_counter() - self.start
        line = f"{self.label} [{bar}] {done}/{self.total} {info} {elapsed:.1f}s"
        # "\x1b[K" clears what a longer previous line left behind.
        self.stream.write(f"\r{line}\x1b[K" if self.tty else line + "\n")
        self.stream.flush()

    def close(self) -> None:
        """End the bar's line on a terminal."""
        if self.tty:
            self.stream.write("\n")
            self.stream.flush()
