"""The clock that splits a request's time into the TTFT breakdown (`Clock`), and the watcher thread that notes when
device work the host went on past was done."""

from __future__ import annotations

import queue
import threading
import time

import jax


class Clock:
    """Splits a request's wall time into the TTFT breakdown phases, one discipline for every engine, and adds no
    synchronisation of its own: a timed request waits for the device exactly where an untimed one does.

    probe_io / kv_io_stall: the host waiting for bytes (the prefetcher's take). identify: the device choosing a set,
    from when its step was dispatched (or the device work handed over before it was done, if later) until a watcher
    thread sees its results ready; `compute` is the rest of the time to first token.

    It also keeps when the device was busy, so that `exposed_host_ms` can tell the host time that neither a disk read
    nor device work overlapped: the intervals the host spent blocked on the device (`device_wait`), and the device
    work it went on past (`device_work`: each layer's compute and identification, and each take's copy to the device
    and gather from the time they were dispatched, which a CPU device runs within the dispatch on the request's own
    thread).

    `cpu_ms` (after `finish`): the CPU time every thread of the process spent from the start to the first token: the
    request's own thread, the disk threads, the I/O worker and, on a CPU device, XLA's compute. One request runs at a
    time, so it is the request's work (plus what little the previous one left running); above the TTFT, threads ran
    in parallel."""

    def __init__(self):
        self.start = time.perf_counter()
        self.start_monotonic = time.monotonic()
        self.start_cpu = time.process_time()
        self.cpu_ms: float | None = None
        self.ms = {"probe_io": 0.0, "identify": 0.0, "kv_io_stall": 0.0}
        self._device_waits: list[tuple[float, float]] = []  # monotonic (start, end) blocked on the device
        self._device_busy: list[tuple[float, float]] = []  # monotonic (start, end) of device work not waited for
        self._last_done = self.start_monotonic
        self._watched = 0  # device work handed to the watcher and not yet noted done
        self._all_noted = threading.Condition()

    def restart(self) -> None:
        """Start again from now, with nothing recorded (e.g. after compiling, which is no request's time)."""
        self.__init__()

    def timed(self, phase: str, fn, *args, **kwargs):
        """fn(*args, **kwargs), its time added to `phase`: the host's time in it for the I/O phases; for "identify"
        the device's, noted by the watcher (`device_work`) without waiting here."""
        t = time.perf_counter()
        dispatched = time.monotonic()
        out = fn(*args, **kwargs)
        if phase == "identify":
            self.device_work(dispatched, out, phase=phase)
        else:
            self.ms[phase] += (time.perf_counter() - t) * 1e3
        return out

    def device_wait(self, tree):
        """Block until `tree`'s device work is done, recording the wait; returns `tree`."""
        t = time.monotonic()
        jax.block_until_ready(tree)
        self._device_waits.append((t, time.monotonic()))
        return tree

    def device_work(self, dispatched_at: float, tree, *, phase: str | None = None) -> None:
        """Device work dispatched at monotonic time `dispatched_at` (taken before the call that dispatched it) whose
        results are `tree`; the host does not wait for it. A watcher thread notes when it is done: the device counts
        as busy from `dispatched_at` (or from when the work handed over before it was done, if later) until then,
        and that time is added to `phase` if one is given.

        Device work queued before `dispatched_at` and not handed over (a layer's projections, its takes' device
        steps) counts as this work's while it still runs, which errs toward more identify time and less exposed host
        time; for the latter, the other way: the watcher needs the GIL to note the time, so a note comes late by as
        long as another thread then holds it (Python hands it over within its switch interval, 5 ms, unless a C
        call keeps it). The host's final wait for the first token needs no note."""
        with self._all_noted:
            self._watched += 1
        _WATCHER.watch(self, dispatched_at, tree, phase)

    def _noted(self, dispatched_at: float, done: float | None, phase: str | None = None) -> None:
        """The watcher's report: work dispatched at `dispatched_at` was done at `done` (None: it failed)."""
        with self._all_noted:
            if done is not None:
                start = max(dispatched_at, self._last_done)
                self._device_busy.append((start, done))
                self._last_done = max(self._last_done, done)
                if phase is not None:
                    self.ms[phase] += max(0.0, done - start) * 1e3
            self._watched -= 1
            self._all_noted.notify_all()

    def _all_work_noted(self) -> None:
        """Wait for the watcher's notes of the work handed over (done by the first token, which waited for it)."""
        with self._all_noted:
            self._all_noted.wait_for(lambda: self._watched == 0, timeout=60.0)

    def finish(self) -> tuple[float, dict]:
        self.end_monotonic = time.monotonic()
        ttft = (time.perf_counter() - self.start) * 1e3
        self.cpu_ms = (time.process_time() - self.start_cpu) * 1e3
        self._all_work_noted()
        return ttft, dict(self.ms, compute=max(0.0, ttft - sum(self.ms.values())))

    def exposed_host_ms(self, io_busy: list[tuple[float, float]]) -> float:
        """Time from the request's start to its first token during which no disk read was in flight (`io_busy`,
        the read scheduler's intervals), the host was not blocked on the device and the device was not busy with
        work handed to `device_work`: host work nothing overlapped. Call after `finish`."""
        self._all_work_noted()
        with self._all_noted:
            busy = list(self._device_busy)
        start, end = self.start_monotonic, self.end_monotonic
        covered = sorted((max(a, start), min(b, end)) for a, b in io_busy + self._device_waits + busy
                         if b > start and a < end)
        total, reach = 0.0, start
        for a, b in covered:
            if b > reach:
                total += b - max(a, reach)
                reach = b
        return max(0.0, (end - start) - total) * 1e3


class _Watcher:
    """One daemon thread that waits, in the order handed over, for device work the host went on past, and tells each
    Clock when its work was done (`Clock.device_work`)."""

    def __init__(self):
        self._queue: queue.SimpleQueue = queue.SimpleQueue()
        self._thread: threading.Thread | None = None
        self._lock = threading.Lock()

    def watch(self, clock: Clock, dispatched_at: float, tree, phase: str | None) -> None:
        with self._lock:
            if self._thread is None:
                self._thread = threading.Thread(target=self._run, name="specjax-device-watch", daemon=True)
                self._thread.start()
        self._queue.put((clock, dispatched_at, tree, phase))

    def _run(self) -> None:
        while True:
            clock, dispatched_at, tree, phase = self._queue.get()
            try:
                jax.block_until_ready(tree)
                done = time.monotonic()
            except Exception:  # noqa: BLE001 -- the request that dispatched it sees the failure itself
                done = None
            del tree
            clock._noted(dispatched_at, done, phase)


_WATCHER = _Watcher()
