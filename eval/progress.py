"""A small progress bar with rate and ETA on stderr (no dependency).

The units of an evaluation are of two kinds: warm-up units (a run's store writes, warm-up passes and untimed compile
requests, which JIT-compile) and timed requests, which are much faster. The time between two updates is booked to
the kind of unit the second one finishes, and the ETA is each kind's units still to do at that kind's measured
seconds per unit. Until both kinds have been measured (the first timed request done) there is no ETA ("--:--"):
one rate over the first run's warm-up alone would make the first ETA several times the real one.
"""

from __future__ import annotations

import sys
import time


def _clock(seconds: float) -> str:
    seconds = int(max(0, seconds))
    h, rest = divmod(seconds, 3600)
    m, s = divmod(rest, 60)
    return f"{h}:{m:02d}:{s:02d}" if h else f"{m:02d}:{s:02d}"


WARMUP, TIMED = "warm-up", "timed"


class Progress:
    """`update(n)` after each unit of work; redraws in place on a terminal, else (a log file) one line per ~10%
    and at least one every `every_s` seconds, so a log of a run of hours still shows it moving.

    `warmup_total`: how many of the `total` units are warm-up units (`set_label(..., warmup=True)` marks the units
    that follow as such); None: all units are taken to be alike (one rate)."""

    def __init__(self, total: int, stream=None, width: int = 28, enabled: bool = True, every_s: float = 120.0,
                 clock=time.monotonic, warmup_total: int | None = None):
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
        self.kind = TIMED  # the kind of the units being worked on (`set_label`)
        split = warmup_total is not None
        self._left = ({WARMUP: warmup_total, TIMED: self.total - warmup_total} if split else {TIMED: self.total})
        self._measured = {kind: [0.0, 0] for kind in self._left}  # kind -> [seconds, units] of this process
        self._split = split
        self._mark = self.start  # when the last unit (or skip) ended

    def set_label(self, label: str, warmup: bool = False) -> None:
        """Name the work under way; `warmup`: its units are warm-up units (store writes, warm-up, compiles)."""
        self.label = label
        self.kind = WARMUP if warmup and self._split else TIMED

    def eta_s(self) -> float | None:
        """Seconds left: each kind's units to do at its measured seconds per unit; None while a kind that has units
        left has none measured yet."""
        eta = 0.0
        for kind, left in self._left.items():
            seconds, units = self._measured[kind]
            if left > 0:
                if not units:
                    return None
                eta += seconds / units * left
        return eta

    def line(self) -> str:
        frac = min(1.0, self.done / self.total)
        elapsed = self.clock() - self.start
        eta = self.eta_s()
        bar = "#" * int(frac * self.width) + "-" * (self.width - int(frac * self.width))
        eta_text = _clock(eta) if eta is not None else "--:--"
        return (f"{self.label:<24.24} [{bar}] {self.done}/{self.total} {frac:4.0%} "
                f"elapsed {_clock(elapsed)} eta {eta_text}")

    def skip(self, n: int, warmup: int = 0) -> None:
        """`n` units an earlier process already did (`warmup` of them warm-up units): counted as done, left out of
        the rates behind the ETA."""
        self.skipped += n
        if self._split:
            self._left[WARMUP] -= warmup
            self._left[TIMED] -= n - warmup
        else:
            self._left[TIMED] -= n
        self._mark = self.clock()
        self._count(n)

    def update(self, n: int = 1) -> None:
        now = self.clock()
        measured = self._measured[self.kind]
        measured[0] += now - self._mark
        measured[1] += n
        self._left[self.kind] -= n
        self._mark = now
        self._count(n)

    def _count(self, n: int) -> None:
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
