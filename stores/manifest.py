"""The store's manifest: radix tree, segments, mapping lists, per-head chunk checksums, writers and model fingerprint.

It is written whole, only after the chunk data it names is durable, and replaces the previous generation in one
atomic step, so a reader always sees one committed generation. Publishing is conditional on the generation the
writer last read (compare-and-swap), so processes sharing a store never overwrite each other's commits:

- a local directory: under `flock` on `manifest.lock` (released by the kernel when a holder dies), the new
  manifest is written to a temporary name, fsynced and renamed over `manifest.json`, then the directory is
  fsynced. A handle keeps the manifest file it last read open, so its inode cannot be reused: the path naming
  another inode (one `stat`) is exactly "another generation was published";
- any other TensorStore kvstore (object stores, OCDBT, memory): a conditional write `if_equal` the storage
  generation read (the write fails if another landed first) and conditional reads `if_not_equal` it.
"""

from __future__ import annotations

import base64
import json
import contextlib
import fcntl
import os
import weakref
import zlib

import numpy as np
import tensorstore as ts
import xxhash

from specjax.stores.errors import ManifestError, StoreMismatchError, unopenable
from specjax.stores.kvarray import Layout

FORMAT = "specjax-kvstore/3"  # 3: one extent per segment, layer and kind, xxh3 checksums (2: a file per chunk, crc32)
OLDER_FORMATS = {"specjax-kvstore/1": "one file and one checksum per chunk",
                 "specjax-kvstore/2": "one file per chunk"}
MANIFEST_KEY = "manifest.json"
LOCK_KEY = "manifest.lock"


def chunk_checksums(chunks: np.ndarray) -> np.ndarray:
    """`[n, heads]` uint32 checksums of chunks `[n, heads, chunk_tokens, head_dim]`: the low 32 bits of each head's
    xxh3-64 (a maintained hash library, on one core far faster than the reads it checks; the manifest keeps 32 bits
    per head). Per head, since a
    chunk holds its heads one after another: a reader of some heads' byte range can check them."""
    chunks = np.ascontiguousarray(chunks)
    n, heads = chunks.shape[:2]
    flat = chunks.view(np.uint8).reshape(n * heads, -1)
    digest = xxhash.xxh3_64_intdigest
    return (np.fromiter((digest(row) for row in flat), np.uint64, n * heads) & 0xFFFFFFFF).astype(
        np.uint32).reshape(n, heads)


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


# Fingerprint keys that describe rather than identify (where the weights came from): kept, shown, never compared.
DESCRIPTIVE_KEYS = ("weights_source",)


def identity(fingerprint: dict) -> dict:
    return {k: v for k, v in fingerprint.items() if k not in DESCRIPTIVE_KEYS}


def describe_weights(fingerprint: dict) -> str:
    """The weights a fingerprint names, for people: a short digest and where they came from."""
    digest = fingerprint.get("weights")
    if not digest:
        return "unrecorded weights"
    source = fingerprint.get("weights_source")
    return f"weights {str(digest)[:12]}" + (f" of {source}" if source else "")


def layout_from_fingerprint(fingerprint: dict) -> Layout:
    """The store layout a model's fingerprint describes (its KV shapes, dtype, chunk size and probe heads)."""
    missing = [k for k in ("num_layers", "kv_heads", "head_dim") if k not in fingerprint]
    if missing:
        raise ValueError(f"model fingerprint lacks {missing}; it needs num_layers, kv_heads, head_dim "
                         f"(and optionally dtype, chunk_tokens, probe_heads, kv_bits, kv_group)")
    probe = fingerprint.get("probe_heads", 0)
    head_dim = int(fingerprint["head_dim"])
    return Layout(num_layers=int(fingerprint["num_layers"]), kv_heads=int(fingerprint["kv_heads"]),
                  head_dim=int(fingerprint["head_dim"]),
                  probe_heads=len(probe) if isinstance(probe, (list, tuple)) else int(probe),
                  chunk_tokens=int(fingerprint.get("chunk_tokens", Layout.chunk_tokens)),
                  dtype=str(fingerprint.get("dtype", "float32")), bits=tuple(fingerprint.get("kv_bits", ())),
                  group_channels=int(fingerprint.get("kv_group", min(Layout.group_channels, head_dim))))


def full_fingerprint(fingerprint: dict, layout: Layout | None = None) -> dict:
    """The caller's fingerprint plus the layout fields it left to defaults, so both sides compare fully."""
    layout = layout_from_fingerprint(fingerprint) if layout is None else layout
    full = dict(fingerprint)
    full.setdefault("chunk_tokens", layout.chunk_tokens)
    full.setdefault("dtype", layout.dtype)
    full.setdefault("probe_heads", layout.probe_heads)
    if "kv_bits" in full:  # a set, in one order (the caller's, not the store's: they are compared)
        full["kv_bits"] = sorted({int(b) for b in full["kv_bits"]}, reverse=True)
    return full


def check_fingerprint(stored: dict, given: dict, where: str) -> None:
    """Refuse a store written for other weights, another model or layout, naming what differs."""
    stored, described = identity(stored), stored
    given, asked = identity(given), given
    if canonical(stored) == canonical(given):
        return
    if stored.get("weights") != given.get("weights"):
        raise StoreMismatchError(_other_weights(described, asked, where))
    if stored.get("kv_bits") and given.get("kv_bits") and stored.get("kv_format") != given.get("kv_format"):
        held = stored.get("kv_format", 1)
        raise StoreMismatchError(f"the KV store at {where} holds low-bit KV in an earlier format of specjax (format "
                                 f"{held}: {_LOW_BIT_FORMATS.get(held, 'unknown')}), not format "
                                 f"{given.get('kv_format', 1)}; use another store directory")
    if {**stored, "kv_bits": None, "kv_format": None} == {**given, "kv_bits": None, "kv_format": None}:
        raise StoreMismatchError(f"the KV store at {where} holds K and V at {_precisions(stored)}, not at "
                                 f"{_precisions(given)} as asked; a store's precisions are fixed when it is made: "
                                 f"use another store directory")
    keys = sorted(set(stored) | set(given))
    diffs = [f"{k}: store={stored.get(k)!r} model={given.get(k)!r}" for k in keys if stored.get(k) != given.get(k)]
    raise StoreMismatchError(
        f"the KV store at {where} was written for another model or layout ({'; '.join(diffs)}); "
        f"use a different store directory or delete this one")


# what the low-bit formats before `kvarray.LOW_BIT_FORMAT` held
_LOW_BIT_FORMATS = {1: "K and V only, no low-bit probe keys",
                    2: "K in rows that decode alone, not per channel over a chunk"}


def _precisions(fingerprint: dict) -> str:
    bits = fingerprint.get("kv_bits")
    dtype = fingerprint.get("dtype", "float32")
    return f"{dtype} and {', '.join(map(str, bits))} bits" if bits else f"{dtype} only"


def _other_weights(stored: dict, given: dict, where: str) -> str:
    if not stored.get("weights"):
        return (f"the KV store at {where} was written by an older specjax that did not record whose weights its KV "
                f"is, so it is not served to {describe_weights(given)}; use a new store directory or delete this one")
    return (f"the KV store at {where} holds the KV of {describe_weights(stored)}, not of this model's "
            f"{describe_weights(given)}; load those weights to use it, or use another store directory")


def _fsync_dir(path: str) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _file_key(st: os.stat_result) -> tuple:
    # the inode alone names the file exactly while it is held open (locally); size and mtime guard a file
    # system whose inode numbers another host may reuse
    return st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns


class FileStamp:
    """The manifest file a handle last read or wrote, held open so that its inode cannot be reused."""

    def __init__(self, fd: int):
        self.key = _file_key(os.fstat(fd))
        self._close = weakref.finalize(self, os.close, fd)

    def close(self) -> None:
        self._close()


def _read_fd(fd: int) -> bytes:
    parts = []
    while chunk := os.read(fd, 1 << 20):
        parts.append(chunk)
    return b"".join(parts)


class ManifestIO:
    """Reads and conditionally replaces the manifest, on a local directory or any TensorStore kvstore.

    A *stamp* names the generation a handle last saw: a `FileStamp` (local), a TensorStore storage generation
    (kvstore), or None (no manifest yet, local).
    """

    def __init__(self, kvstore: dict, context: ts.Context):
        self.kvstore_spec = kvstore
        self.local_dir = kvstore.get("path") if kvstore.get("driver") == "file" else None
        root = dict(kvstore)
        if root.get("path") and not root["path"].endswith("/"):
            root["path"] += "/"  # keys are appended to the path as they are: the store is a folder
        self.kvs = ts.KvStore.open(root, context=context).result()  # listing, heartbeats; a kvstore's manifest
        self._lock_fd: int | None = None
        self._lock_pid = 0

    @property
    def where(self) -> str:
        return self.local_dir or canonical(self.kvstore_spec)

    @property
    def _path(self) -> str:
        return os.path.join(self.local_dir, MANIFEST_KEY)

    def read(self) -> tuple[dict | None, object]:
        """(committed manifest body or None when the store is new, its stamp)."""
        if self.local_dir:
            try:
                fd = os.open(self._path, os.O_RDONLY)
            except FileNotFoundError:
                return None, None
            stamp = FileStamp(fd)
            return self._parse(_read_fd(fd)), stamp
        result = self.kvs.read(MANIFEST_KEY).result()
        if result.state != "value":
            return None, result.stamp.generation
        return self._parse(result.value), result.stamp.generation

    def read_if_changed(self, stamp) -> tuple[dict, object] | None:
        """The newest manifest and its stamp if another than `stamp` was published since, else None."""
        if self.local_dir:
            try:
                st = os.stat(self._path)
            except FileNotFoundError:
                return None
            if stamp is not None and _file_key(st) == stamp.key:
                return None
            body, new = self.read()
            return None if body is None else (body, new)
        result = self.kvs.read(MANIFEST_KEY, if_not_equal=stamp).result() if stamp else \
            self.kvs.read(MANIFEST_KEY).result()
        if result.state != "value":
            return None
        return self._parse(result.value), result.stamp.generation

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
            older = OLDER_FORMATS.get(body.get("format"))
            why = f" (an older specjax's layout: {older})" if older else ""
            raise ManifestError(f"the KV store at {self.where} has format {body.get('format')!r}{why}, "
                                f"expected {FORMAT!r}; delete it (or use another store folder): its KV is "
                                f"recomputed and stored again")
        return body

    @contextlib.contextmanager
    def locked(self):
        """Exclusive against every other handle's publish (local directory); a no-op on a kvstore, whose
        publish is conditional instead. Not reentrant; the caller serializes its own threads."""
        if not self.local_dir:
            yield
            return
        if self._lock_fd is None or self._lock_pid != os.getpid():  # a forked child must not share the lock
            os.makedirs(self.local_dir, exist_ok=True)
            path = os.path.join(self.local_dir, LOCK_KEY)
            try:
                self._lock_fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
            except OSError as e:
                raise ManifestError(f"the store's lock file {unopenable(path, e)}: writers lock the manifest there; "
                                    "move it away (the store's data is not in it)") from None
            self._lock_pid = os.getpid()
            weakref.finalize(self, os.close, self._lock_fd)
        fcntl.flock(self._lock_fd, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(self._lock_fd, fcntl.LOCK_UN)

    def publish(self, body: dict, expect) -> object | None:
        """Durably replace the manifest with `body` in one atomic step if it still is generation `expect`;
        the new stamp, or None if another was published first (local: call under `locked()`)."""
        raw = json.dumps({"body": body, "crc32": zlib.crc32(canonical(body).encode())}).encode()
        if not self.local_dir:
            generation = self.kvs.write(MANIFEST_KEY, raw, if_equal=expect).result().generation
            return generation or None  # an empty generation: the condition failed
        try:
            current = _file_key(os.stat(self._path))
        except FileNotFoundError:
            current = None
        if current != (expect.key if expect is not None else None):
            return None
        tmp = f"{self._path}.tmp"  # one publisher at a time (the lock); a dead one's leftover is replaced
        with contextlib.suppress(FileNotFoundError):
            os.unlink(tmp)
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
        stamp = FileStamp(fd)
        try:
            view = memoryview(raw)
            while view:
                view = view[os.write(fd, view):]
            os.fsync(fd)
            os.replace(tmp, self._path)
            stamp.key = _file_key(os.fstat(fd))  # as renamed (a rename may touch it)
        except BaseException:
            stamp.close()
            with contextlib.suppress(OSError):
                os.unlink(tmp)
            raise
        _fsync_dir(self.local_dir)
        return stamp

    def create(self, body: dict) -> tuple[dict, object]:
        """Publish the first generation unless another process created the store first; what is there then."""
        with self.locked():
            existing, stamp = self.read()
            if existing is not None:
                return existing, stamp
            new = self.publish(body, stamp)
        if new is None:
            existing, stamp = self.read()
            return existing, stamp
        return json.loads(canonical(body)), new

    # -- small keys beside the manifest (writers' heartbeats) ------------------------------------

    def put(self, key: str, value: bytes) -> None:
        self.kvs.write(key, value).result()

    def get(self, key: str) -> bytes | None:
        result = self.kvs.read(key).result()
        return result.value if result.state == "value" else None

    def delete(self, key: str) -> None:
        self.kvs.write(key, None).result()
