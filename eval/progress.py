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
    """`update(n)` after each unit of work; redraws in place on a terminal, else (a log file) one line per ~10%
    and at least one every `every_s` seconds, so a log of a run of hours still shows it moving."""

    def __init__(self, total: int, stream=None, width: int = 28, enabled: bool = True, every_s: float = 120.0,
                 clock=time.monotonic):
        self.total = max(1, total)
        self.done = 0
        self.label = ""
        self.stream = stream or sys.stderr
        self.width = width
        self.enabled = enabled
        self.clock = clock
        self.start = clock()
        self.tty = hasattr(self.stream, "isatty") and self.stream.isatty()
        self.every_s = every_s
        self._last_decile = -1
        self._last_line_at = self.start
        self.skipped = 0  # units done by an earlier process (a resumed run): they do not set the rate

    def set_label(self, label: str) -> None:
        self.label = label

    def line(self) -> str:
        frac = min(1.0, self.done / self.total)
        elapsed = self.clock() - self.start
        worked = self.done - self.skipped
        eta = elapsed / worked * (self.total - self.done) if worked else float("nan")
        bar = "#" * int(frac * self.width) + "-" * (self.width - int(frac * self.width))
        eta_text = _clock(eta) if worked else "--:--"
        return (f"{self.label:<24.24} [{bar}] {self.done}/{self.total} {frac:4.0%} "
                f"elapsed {_clock(elapsed)} eta {eta_text}")

    def skip(self, n: int) -> None:
        """`n` units an earlier process already did: counted as done, left out of the rate behind the ETA."""
        self.skipped += n
        self.update(n)

    def update(self, n: int = 1) -> None:
        self.done += n
        if not self.enabled:
            return
        if self.tty:
            self.stream.write("\r" + self.line())
            self.stream.flush()
        else:
            decile, now = int(10 * self.done / self.total), self.clock()
            if decile != self._last_decile or now - self._last_line_at >= self.every_s:
                self._last_decile, self._last_line_at = decile, now
                self.stream.write(self.line() + "\n")
                self.stream.flush()

    def close(self) -> None:
        if self.enabled and self.tty:
            self.stream.write("\n")
            self.stream.flush()
