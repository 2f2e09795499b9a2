"""I/O and cache counters shared by the store, caches and prefetcher; every reported number is counted here."""

from __future__ import annotations

import dataclasses
import threading


@dataclasses.dataclass
class StoreMetrics:
    disk_bytes: int = 0            # bytes read from the KV array (whole chunks)
    probe_disk_bytes: int = 0      # of which probe keys
    chunks_read: int = 0
    read_requests: int = 0         # reads the scheduler issued (a coalesced run of adjacent chunks counts once)
    bad_chunks: int = 0            # checksum or read failures, served as misses
    disk_bytes_written: int = 0
    host_to_device_bytes: int = 0
    host_to_device_transfers: int = 0  # host->device copies (one batched copy counts once)
    device_page_bytes: int = 0     # of host_to_device_bytes, whole chunks written into the device tier's pages
    device_hits: int = 0           # chunk lookups answered by the device tier
    host_hits: int = 0
    misses: int = 0                # chunk lookups that had to go to disk
    used_token_bytes: int = 0      # bytes of the token vectors a caller actually asked for
    chosen_on_device_bytes: int = 0  # of those, rows a device step chose that the device took from the caches' pages

    def __post_init__(self):
        self._lock = threading.Lock()
        self._device_bytes: list[int] = []  # per device of a mesh whose heads split the reads (ChunkReader.split_reads)

    def add_device_bytes(self, per_device: list[int]) -> None:
        """Bytes each device's reader read of its own heads (one entry per device of the mesh)."""
        with self._lock:
            if len(self._device_bytes) < len(per_device):
                self._device_bytes += [0] * (len(per_device) - len(self._device_bytes))
            for i, n in enumerate(per_device):
                self._device_bytes[i] += n

    def device_bytes(self) -> list[int]:
        """Disk bytes read per device in head parts (empty when no read was split); reads of heads every device
        holds (replicated: a few probe heads, KV heads that do not divide the mesh) are read once, in `disk_bytes`
        only."""
        with self._lock:
            return list(self._device_bytes)

    def add(self, **counts: int) -> None:
        with self._lock:
            for name, value in counts.items():
                setattr(self, name, getattr(self, name) + value)

    def reset(self) -> None:
        with self._lock:
            for field in dataclasses.fields(self):
                setattr(self, field.name, 0)
            self._device_bytes = []

    def snapshot(self) -> dict:
        with self._lock:
            counts = {f.name: getattr(self, f.name) for f in dataclasses.fields(self)}
        lookups = counts["device_hits"] + counts["host_hits"] + counts["misses"]
        counts["device_hit_ratio"] = counts["device_hits"] / lookups if lookups else 0.0
        counts["host_hit_ratio"] = counts["host_hits"] / lookups if lookups else 0.0
        counts["read_amplification"] = (counts["disk_bytes"] / counts["used_token_bytes"]
                                        if counts["used_token_bytes"] else 0.0)
        return counts
