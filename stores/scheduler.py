"""One read queue per disk: demand reads before speculative ones (and among them, those of the earliest layer first),
bounded bytes in flight, and the disk's delivered rate measured online. An emulated disk (`bytes_per_s`) is a `Link`
inside the same queue, the one model of an emulated link (the device pool's host-to-device copies use it too).

A read waits in the queue until the bytes in flight leave room for it; only then is it issued to the disk. So a
speculative read that is superseded while it waits (`withdraw`) is never read, and one that becomes needed
(`expedite`) joins the demand queue. A read already issued is never interrupted.

A speculative read may be `background`: it is issued only when the disk would otherwise idle (nothing in flight,
nothing else queued), so it never holds back another read by more than one read's time.
"""

from __future__ import annotations

import collections
import concurrent.futures
import dataclasses
import heapq
import itertools
import logging
import threading
import time
from typing import Callable

log = logging.getLogger(__name__)

QUEUED, ISSUED, DONE, WITHDRAWN = "queued", "issued", "done", "withdrawn"
MIN_INFLIGHT_BYTES = 32 << 20  # a real disk: at least this much in flight (large reads at a deep queue)...
INFLIGHT_S = 0.05  # ...or as much as the disk delivers in this long at its measured rate, if more
MAX_READ_BYTES = 8 << 20  # one read of adjacent chunks is at most this large (a segment's layer: a few MiB)...
MAX_READ_S = 0.002  # ...and on an emulated link, which moves one read at a time, holds it at most this long


class Link:
    """An emulated link of `bytes_per_s` that moves transfers one after another: each is booked from when it is ready
    (or when the previous one has crossed, if later) for its bytes' time at that rate."""

    def __init__(self, bytes_per_s: float):
        if bytes_per_s <= 0:
            raise ValueError(f"link bandwidth must be > 0 bytes/s, got {bytes_per_s}")
        self.bytes_per_s = float(bytes_per_s)
        self._free_at = 0.0
        self._lock = threading.Lock()

    def book(self, nbytes: int, ready_at: float | None = None) -> float:
        """Book the link for `nbytes` ready at monotonic time `ready_at` (default: now); returns the monotonic time at
        which they have crossed it."""
        with self._lock:
            start = max(time.monotonic() if ready_at is None else ready_at, self._free_at)
            self._free_at = start + nbytes / self.bytes_per_s
            return self._free_at

    def consume(self, nbytes: int) -> None:
        """Block the calling thread until `nbytes`, ready now, have crossed the link."""
        delay = self.book(nbytes) - time.monotonic()
        if delay > 0:
            time.sleep(delay)


@dataclasses.dataclass(eq=False)
class Read:
    """One disk request: `issue()` starts it and returns a concurrent future of its data."""

    issue: Callable[[], concurrent.futures.Future]
    nbytes: int
    speculative: bool
    background: bool = False  # speculative, and issued only while the disk has nothing else to do
    future: concurrent.futures.Future = dataclasses.field(default_factory=concurrent.futures.Future)
    state: str = QUEUED
    deliver_at: float = 0.0  # emulated link: monotonic time its bytes have crossed
    queued_at: float = dataclasses.field(default_factory=time.monotonic)  # when it joined the queue
    order: int = 0  # demand reads go out lowest order first (the layer that needs them), then first come


class _ByOrder:
    """The demand queue: reads by (order, arrival), so a layer's reads go before a later layer's however late they
    were asked (a request plans every layer's certain reads at its start; its selective reads come later)."""

    def __init__(self):
        self._heap: list = []
        self._seq = itertools.count()

    def append(self, read: Read) -> None:
        heapq.heappush(self._heap, (read.order, next(self._seq), read))

    def __bool__(self) -> bool:
        return bool(self._heap)

    def __getitem__(self, i: int) -> Read:
        if i != 0:
            raise IndexError("only the head of the demand queue is looked at")
        return self._heap[0][2]

    def popleft(self) -> Read:
        return heapq.heappop(self._heap)[2]

    def __iter__(self):
        return (read for _, _, read in self._heap)


class ReadScheduler:
    """Issues queued reads in priority order while at most `max_inflight_bytes` are in flight (at least one read
    always may be); with `bytes_per_s` the link moves one read's bytes after another at that rate."""

    def __init__(self, *, max_inflight_bytes: int | None = None, bytes_per_s: float | None = None):
        if max_inflight_bytes is not None and max_inflight_bytes < 0:
            raise ValueError(f"max_inflight_bytes must be >= 0, got {max_inflight_bytes}")
        # An emulated link moves one read at a time by default, so queued reads keep their order and stay
        # withdrawable until the link takes them, as a host-side submission queue in front of a slow disk. A real
        # disk keeps max(MIN_INFLIGHT_BYTES, INFLIGHT_S at its measured rate) in flight (`inflight_limit`).
        self._fixed_inflight = int(max_inflight_bytes) if max_inflight_bytes is not None else (0 if bytes_per_s else None)
        self.max_inflight_bytes = self._fixed_inflight if self._fixed_inflight is not None else MIN_INFLIGHT_BYTES
        self._demand = _ByOrder()
        self._speculative: collections.deque = collections.deque()
        self._background: collections.deque = collections.deque()
        self._lock = threading.Lock()
        self._inflight = 0          # reads issued, not yet delivered
        self._inflight_bytes = 0
        self.link = Link(bytes_per_s) if bytes_per_s is not None else None  # an emulated disk
        self._busy_since: float | None = None  # rate: delivered bytes over the time reads were in flight
        self._busy_s = 0.0
        self._busy_log: collections.deque = collections.deque(maxlen=4096)  # recent (start, end) with reads in flight
        self._delivered_bytes = 0
        self._timer = _Timer() if self.link is not None else None
        self._local = threading.local()  # per thread: the reads landed while it delivers one (`_delivering`)

    # -- the queue -----------------------------------------------------------------------------

    def submit(self, read: Read) -> Read:
        if read.background and not read.speculative:
            raise ValueError("a background read must be speculative")
        with self._lock:
            self._queue_of(read).append(read)
            ready = self._take_ready()
        self._issue(ready)
        return read

    def _queue_of(self, read: Read) -> collections.deque:
        if not read.speculative:
            return self._demand
        return self._background if read.background else self._speculative

    def expedite(self, read: Read) -> None:
        """The read is needed now: a queued speculative read joins the demand queue."""
        with self._lock:
            if read.speculative and read.state == QUEUED:
                self._queue_of(read).remove(read)
                self._demand.append(read)
            read.speculative = read.background = False
            ready = self._take_ready()
        self._issue(ready)

    def withdraw(self, read: Read) -> bool:
        """Drop a speculative read that has not been issued (its future is cancelled); False if it was issued."""
        with self._lock:
            if not (read.speculative and read.state == QUEUED):
                return False
            self._queue_of(read).remove(read)
            read.state = WITHDRAWN
        read.future.cancel()
        return True

    def waiting(self, read: Read) -> bool:
        """Is the read still in the queue (not issued to the disk, not withdrawn)?"""
        return read.state == QUEUED

    def _next_queue(self):
        """The queue whose head goes next: demand, then speculative, then background once the disk is idle."""
        if self._demand or self._speculative:
            return self._demand or self._speculative
        if self._background and self._inflight == 0:
            return self._background
        return None

    def _take_ready(self) -> list[Read]:
        """Reads to issue now, in priority order, within the in-flight bound (called with the lock held)."""
        ready = []
        while (queue := self._next_queue()) is not None:
            read = queue[0]
            if self._inflight and self._inflight_bytes + read.nbytes > self.max_inflight_bytes:
                break
            queue.popleft()
            read.state = ISSUED
            if self._inflight == 0:
                self._busy_since = time.monotonic()
            self._inflight += 1
            self._inflight_bytes += read.nbytes
            if self.link is not None:
                # The link moves queued reads back to back, as a device working through its queue: a read
                # waiting when the previous one's bytes crossed starts then, not when the host got to it.
                read.deliver_at = self.link.book(read.nbytes, ready_at=read.queued_at)
            ready.append(read)
        return ready

    def _issue(self, reads: list[Read]) -> None:
        for read in reads:
            try:
                disk = read.issue()
            except BaseException as e:  # noqa: BLE001 -- delivered to the reader
                disk = concurrent.futures.Future()
                disk.set_exception(e)
            disk.add_done_callback(lambda f, read=read: self._landed(read, f))

    def _landed(self, read: Read, disk: concurrent.futures.Future) -> None:
        if self._timer is not None and read.deliver_at > time.monotonic():
            self._timer.at(read.deliver_at, lambda: self._delivering(read, disk))
        else:
            self._delivering(read, disk)

    def _delivering(self, read: Read, disk: concurrent.futures.Future) -> None:
        """Deliver a landed read, and every read that lands on this thread while it does, one after another: a read
        that completes as it is issued (an in-memory store) lands inside its predecessor's delivery, and delivering
        it there would nest one call per queued read until the stack overflows."""
        pending = getattr(self._local, "pending", None)
        if pending is not None:  # this thread is delivering already: its loop takes the read next
            pending.append((read, disk))
            return
        self._local.pending = pending = collections.deque([(read, disk)])
        try:
            while pending:
                try:
                    self._deliver(*pending.popleft())
                except BaseException:  # noqa: BLE001 -- the reads after it must still be delivered
                    log.exception("read scheduler: a delivery failed")
        finally:
            self._local.pending = None

    def _deliver(self, read: Read, disk: concurrent.futures.Future) -> None:
        with self._lock:
            read.state = DONE
            self._inflight -= 1
            self._inflight_bytes -= read.nbytes
            self._delivered_bytes += read.nbytes
            if self._inflight == 0:
                now = time.monotonic()
                self._busy_s += now - self._busy_since
                self._busy_log.append((self._busy_since, now))
                self._busy_since = None
                if self._busy_s > 2.0:  # a window of about the last few seconds of reading
                    self._busy_s, self._delivered_bytes = self._busy_s / 2, self._delivered_bytes // 2
                if self._fixed_inflight is None:
                    self.max_inflight_bytes = self._inflight_limit()
            ready = self._take_ready()
        self._issue(ready)
        if read.future.done():  # cancelled by its reader: nobody waits for it
            return
        try:
            read.future.set_result(disk.result())
        except BaseException as e:  # noqa: BLE001 -- the reader's miss, never the scheduler's failure
            read.future.set_exception(e)

    # -- what the disk delivers ------------------------------------------------------------------

    def rate_bytes_per_s(self) -> float | None:
        """Bytes delivered per second of time with reads in flight, over recent reading; None before any."""
        with self._lock:
            busy = self._busy_s + (time.monotonic() - self._busy_since if self._busy_since is not None else 0.0)
            if self._delivered_bytes == 0 or busy <= 0:
                return None
            return self._delivered_bytes / busy

    def _inflight_limit(self) -> int:
        """A real disk's bound on bytes in flight: MIN_INFLIGHT_BYTES, or INFLIGHT_S of its measured rate if more
        (called with the lock held, when nothing is in flight)."""
        if self._delivered_bytes == 0 or self._busy_s <= 0:
            return MIN_INFLIGHT_BYTES
        return int(max(MIN_INFLIGHT_BYTES, self._delivered_bytes / self._busy_s * INFLIGHT_S))

    def busy_intervals(self, since: float) -> list[tuple[float, float]]:
        """The (start, end) monotonic intervals since `since` during which reads were in flight (the current one
        ends now)."""
        with self._lock:
            out = [(max(a, since), b) for a, b in self._busy_log if b > since]
            if self._busy_since is not None:
                out.append((max(self._busy_since, since), time.monotonic()))
        return out

    def max_read_bytes(self) -> int:
        """How large one read may be: MAX_READ_BYTES; on an emulated link, which moves one read at a time, less where
        it would spend more than MAX_READ_S on it (callers still read at least one chunk)."""
        if self.link is not None:
            return int(min(MAX_READ_BYTES, self.link.bytes_per_s * MAX_READ_S))
        return MAX_READ_BYTES

    def queued_bytes(self) -> int:
        """Bytes of demand and speculative reads waiting: what a new speculative read queues behind."""
        with self._lock:
            return sum(r.nbytes for r in self._demand) + sum(r.nbytes for r in self._speculative)


def when_all(futures: list, combine) -> concurrent.futures.Future:
    """A future of `combine(results)` once every future is done, without blocking a thread."""
    out: concurrent.futures.Future = concurrent.futures.Future()
    remaining = [len(futures)]
    lock = threading.Lock()

    def finish():
        try:
            out.set_result(combine([f.result() for f in futures]))
        except BaseException as e:  # noqa: BLE001 -- delivered to the waiter
            out.set_exception(e)

    def one_done(_):
        with lock:
            remaining[0] -= 1
            last = remaining[0] == 0
        if last:
            finish()

    if not futures:
        finish()
    for f in futures:
        f.add_done_callback(one_done)
    return out


class _Timer:
    """One thread that runs callbacks at given monotonic times (an emulated link's deliveries)."""

    def __init__(self):
        self._heap: list = []
        self._seq = itertools.count()
        self._cv = threading.Condition()
        threading.Thread(target=self._run, name="kv-disk-link", daemon=True).start()

    def at(self, when: float, fn) -> None:
        with self._cv:
            heapq.heappush(self._heap, (when, next(self._seq), fn))
            self._cv.notify()

    def _run(self) -> None:
        while True:
            with self._cv:
                while not self._heap or self._heap[0][0] > time.monotonic():
                    self._cv.wait(None if not self._heap else self._heap[0][0] - time.monotonic())
                _, _, fn = heapq.heappop(self._heap)
            try:
                fn()
            except BaseException:  # noqa: BLE001 -- the link must outlive one delivery's failure, or every later
                log.exception("emulated disk link: a delivery failed")  # read would wait forever
