"""Writers of a shared store: who they are, whether they still live, and their heartbeats.

A handle registers itself in the manifest (`writers[id]`: host, pid, process start time and the chunk-id ranges
reserved to it) in the commit that reserves its first chunk ids, before it writes a chunk. A chunk that no
committed segment owns may be deleted only when no live writer's range covers it. A writer on this host
(same host name, boot and pid namespace) lives while its process does (pid and start time, so a reused pid
is not mistaken for it); one on another host while its heartbeat key `writers/ID`, rewritten every
`lease_s / 4` seconds, is younger than `lease_s` (clocks must agree to well within `lease_s`). A writer found
dead is removed from the manifest by a commit before any of its chunks is deleted: if it was only slow, its
next commit finds itself gone and fails rather than publish deleted chunks.
"""

from __future__ import annotations

import functools
import json
import logging
import os
import socket
import threading
import time
import uuid

log = logging.getLogger(__name__)

LEASE_S = 300.0            # default: how long another host's writer lives without a heartbeat
HEARTBEAT_PREFIX = "writers/"


def _read_text(path: str) -> str | None:
    try:
        with open(path) as f:
            return f.read().strip()
    except OSError:
        return None


@functools.lru_cache(maxsize=1)
def host_key() -> str:
    """This machine, boot and pid namespace: where a pid names the same process."""
    ns = None
    try:
        ns = os.readlink("/proc/self/ns/pid")
    except OSError:
        pass
    return f"{socket.gethostname()}|{_read_text('/proc/sys/kernel/random/boot_id')}|{ns}"


def _proc_stat(pid: int) -> list[str] | None:
    """Fields of /proc/PID/stat after the command name (state first), None where unknown."""
    stat = _read_text(f"/proc/{pid}/stat")
    return stat.rsplit(")", 1)[1].split() if stat and ")" in stat else None


def process_start(pid: int) -> int | None:
    """The process's start time in clock ticks since boot (Linux), None where unknown."""
    fields = _proc_stat(pid)
    try:
        return int(fields[19]) if fields else None
    except (IndexError, ValueError):
        return None


def pid_alive(pid: int, start: int | None) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        pass
    fields = _proc_stat(pid)
    if fields is None:
        return True  # no /proc: the pid exists, assume it is the writer
    if fields[0] in ("Z", "X"):
        return False  # exited, not yet reaped
    return start is None or process_start(pid) in (None, start)


def new_writer() -> tuple[str, dict]:
    """A fresh writer id and its manifest entry (without ranges)."""
    pid = os.getpid()
    wid = f"{socket.gethostname()}-{pid}-{uuid.uuid4().hex[:12]}"
    return wid, {"host": host_key(), "pid": pid, "start": process_start(pid), "ranges": []}


def alive(wid: str, entry: dict, heartbeat, lease_s: float, now: float | None = None) -> bool:
    """Whether writer `wid` may still commit; `heartbeat(wid)` is its last heartbeat time (None if none)."""
    if entry.get("host") == host_key():
        return pid_alive(int(entry["pid"]), entry.get("start"))
    beat = heartbeat(wid)
    return beat is not None and (time.time() if now is None else now) - beat < lease_s


class Heartbeat:
    """Rewrites `writers/ID` with the time every `lease_s / 4` seconds until stopped (a daemon thread that
    holds only the manifest I/O, never the store)."""

    def __init__(self, io, wid: str, lease_s: float):
        self.io, self.key, self.interval = io, HEARTBEAT_PREFIX + wid, lease_s / 4
        self._stop = threading.Event()
        self.beat()
        self._thread = threading.Thread(target=self._loop, name="kv-heartbeat", daemon=True)
        self._thread.start()

    def beat(self) -> None:
        self.io.put(self.key, json.dumps({"time": time.time(), "pid": os.getpid()}).encode())

    def _loop(self) -> None:
        while not self._stop.wait(self.interval):
            try:
                self.beat()
            except Exception as e:  # noqa: BLE001 -- a missed beat only risks this writer's lease
                log.warning("KV store heartbeat failed: %s", e)

    def stop(self) -> None:
        self._stop.set()
        self._thread.join()
        try:
            self.io.delete(self.key)
        except Exception as e:  # noqa: BLE001 -- a stale heartbeat key is harmless
            log.warning("could not remove heartbeat %s: %s", self.key, e)


def read_heartbeat(io, wid: str) -> float | None:
    raw = io.get(HEARTBEAT_PREFIX + wid)
    try:
        return float(json.loads(raw)["time"]) if raw is not None else None
    except (ValueError, KeyError, TypeError):
        return None
