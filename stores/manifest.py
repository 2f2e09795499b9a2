"""The store's manifest: radix tree, segments, mapping lists, chunk checksums and model fingerprint.

It is written whole to a temporary name, fsynced and renamed over `manifest.json` (then the directory is
fsynced), only after the chunk data it names is durable; a reader therefore sees one committed generation.
"""

from __future__ import annotations

import base64
import json
import os
import zlib

import numpy as np
import tensorstore as ts

from specjax.stores.errors import ManifestError, StoreMismatchError

FORMAT = "specjax-kvstore/1"
MANIFEST_KEY = "manifest.json"


def chunk_checksum(chunk: np.ndarray) -> int:
    """crc32 of a chunk's little-endian bytes as stored (the zarr `bytes` codec writes exactly these)."""
    return zlib.crc32(np.ascontiguousarray(chunk).view(np.uint8).data)


def encode_array(a: np.ndarray | None) -> dict | None:
    if a is None:
        return None
    a = np.ascontiguousarray(a)
    return {"dtype": a.dtype.str, "shape": list(a.shape), "b64": base64.b64encode(a.tobytes()).decode()}


def decode_array(d: dict | None) -> np.ndarray | None:
    if d is None:
        return None
    return np.frombuffer(base64.b64decode(d["b64"]), dtype=np.dtype(d["dtype"])).reshape(d["shape"]).copy()


def canonical(obj) -> str:
    return json.dumps(obj, sort_keys=True, separators=(",", ":"))


def check_fingerprint(stored: dict, given: dict, where: str) -> None:
    """Refuse a store written for another model or layout, naming the keys that differ."""
    if canonical(stored) == canonical(given):
        return
    keys = sorted(set(stored) | set(given))
    diffs = [f"{k}: store={stored.get(k)!r} model={given.get(k)!r}" for k in keys if stored.get(k) != given.get(k)]
    raise StoreMismatchError(
        f"the KV store at {where} was written for another model or layout ({'; '.join(diffs)}); "
        f"use a different store directory or delete this one")


def _fsync_dir(path: str) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


class ManifestIO:
    """Reads and atomically replaces the manifest, on a local directory or any TensorStore kvstore."""

    def __init__(self, kvstore: dict, context: ts.Context):
        self.kvstore_spec = kvstore
        self.local_dir = kvstore.get("path") if kvstore.get("driver") == "file" else None
        self._kvs = None if self.local_dir else ts.KvStore.open(kvstore, context=context).result()

    @property
    def where(self) -> str:
        return self.local_dir or canonical(self.kvstore_spec)

    def read(self) -> dict | None:
        """The committed manifest body, or None when the store is new."""
        if self.local_dir:
            path = os.path.join(self.local_dir, MANIFEST_KEY)
            if not os.path.exists(path):
                return None
            with open(path, "rb") as f:
                raw = f.read()
        else:
            result = self._kvs.read(MANIFEST_KEY).result()
            if result.state != "value":
                return None
            raw = result.value
        return self._parse(raw)

    def _parse(self, raw: bytes) -> dict:
        try:
            doc = json.loads(raw)
            body, crc = doc["body"], doc["crc32"]
        except (ValueError, KeyError, TypeError) as e:
            raise ManifestError(f"manifest of the KV store at {self.where} is unreadable ({e}); "
                                f"run `python -m specjax.stores.fsck` on it or delete the store") from None
        if zlib.crc32(canonical(body).encode()) != crc:
            raise ManifestError(f"manifest of the KV store at {self.where} fails its checksum; "
                                f"the store is damaged: delete it (its KV can be recomputed)")
        if body.get("format") != FORMAT:
            raise ManifestError(f"the KV store at {self.where} has format {body.get('format')!r}, "
                                f"expected {FORMAT!r}; delete it to rebuild")
        return body

    def write(self, body: dict) -> None:
        """Durably replace the manifest with `body` in one atomic step."""
        raw = json.dumps({"body": body, "crc32": zlib.crc32(canonical(body).encode())}).encode()
        if not self.local_dir:
            self._kvs.write(MANIFEST_KEY, raw).result()
            return
        os.makedirs(self.local_dir, exist_ok=True)
        path = os.path.join(self.local_dir, MANIFEST_KEY)
        tmp = f"{path}.tmp.{os.getpid()}"
        with open(tmp, "wb") as f:
            f.write(raw)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
        _fsync_dir(self.local_dir)
