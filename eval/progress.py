"""A small progress bar with rate and ETA on stderr (no dependency)."""

from __future__ import annotations

import sys
import time


def _clock(seconds: float) -> str:
    seconds = int(max(0, seconds))
    h, rest = divmod(seconds, 3600)
    m, s = divmod(rest, 60)
    return f"{h}:{m:02d}:{s:02d}" if h else f"{m:02d}:{s:02d}"


class Progress:
    """`update(n)` after each unit of work; redraws in place on a terminal, else every ~10%."""

    def __init__(self, total: int, stream=None, width: int = 28, enabled: bool = True):
        self.total = max(1, total)
        self.done = 0
        self.label = ""
        self.stream = stream or sys.stderr
        self.width = width
        self.enabled = enabled
        self.start = time.monotonic()
        self.tty = hasattr(self.stream, "isatty") and self.stream.isatty()
        self._last_decile = -1

    def set_label(self, label: str) -> None:
        self.label = label

    def line(self) -> str:
        frac = min(1.0, self.done / self.total)
        elapsed = time.monotonic() - self.start
        eta = elapsed / self.done * (self.total - self.done) if self.done else float("nan")
        bar = "#" * int(frac * self.width) + "-" * (self.width - int(frac * self.width))
        eta_text = _clock(eta) if self.done else "--:--"
        return (f"{self.label:<24.24} [{bar}] {self.done}/{self.total} {frac:4.0%} "
                f"elapsed {_clock(elapsed)} eta {eta_text}")

    def update(self, n: int = 1) -> None:
        self.done += n
        if not self.enabled:
            return
        if self.tty:
            self.stream.write("\r" + self.line())
            self.stream.flush()
        else:
            decile = int(10 * self.done / self.total)
            if decile != self._last_decile:
                self._last_decile = decile
                self.stream.write(self.line() + "\n")
                self.stream.flush()

    def close(self) -> None:
        if self.enabled and self.tty:
            self.stream.write("\n")
            self.stream.flush()
