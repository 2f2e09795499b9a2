"""Errors a store user can cause; each message names the fix. `stores` stays independent of `specjax`."""

import errno
import os


class StoreError(Exception):
    """Base class: a store problem with a one-line, actionable message."""


class StoreMismatchError(StoreError):
    """The store on disk was written for another model or layout."""


class DiskFullError(StoreError):
    """A write found no room (device full, its inodes exhausted, or the configured disk capacity reached)."""


class ManifestError(StoreError):
    """The manifest is missing, unreadable or fails its own checksum."""


def is_disk_full(e: BaseException) -> bool:
    return (isinstance(e, OSError) and e.errno == errno.ENOSPC) or "No space left" in str(e) or "ENOSPC" in str(e)


def disk_full_message(doing: str, path, fix: str) -> str:
    """The one-line message of a write that found no room while `doing` (e.g. "writing the KV store at DIR"): disk
    full and `fix`, or, where `os.statvfs(path)` shows free bytes but no free inodes, that the file system's inodes
    are exhausted and how to get some back. `path` need not be local (then the message says disk full)."""
    free = free_bytes_without_inodes(path)
    if free is None:
        return f"disk full while {doing}; {fix}"
    return (f"inodes exhausted while {doing}: its file system has {free / 1e6:.1f} MB free but no free inodes (too "
            f"many files, not too many bytes); remove files you no longer need from that file system or move the "
            f"store to one with more inodes (reads still work)")


def free_bytes_without_inodes(path) -> int | None:
    """The bytes free to this process on the file system at `path` if no inode is free there, else None (inodes left, an
    inode count it does not report, no bytes free either, or no such local path)."""
    try:
        st = os.statvfs(path)
    except (OSError, TypeError, ValueError):
        return None
    free = st.f_bavail * st.f_frsize
    return free if st.f_files and not st.f_favail and free else None


def unopenable(path, error: OSError) -> str:
    """How a lock file at `path` failed to open, for a message: it is a folder, or why it cannot be opened."""
    if isinstance(error, IsADirectoryError):
        return f"{path} is a folder"
    return f"{path} cannot be opened ({error.strerror or error})"
