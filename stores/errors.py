"""Errors a store user can cause; each message names the fix. `stores` stays independent of `specjax`."""

import errno


class StoreError(Exception):
    """Base class: a store problem with a one-line, actionable message."""


class StoreMismatchError(StoreError):
    """The store on disk was written for another model or layout."""


class DiskFullError(StoreError):
    """A write found no room (device full or the configured disk capacity reached)."""


class ManifestError(StoreError):
    """The manifest is missing, unreadable or fails its own checksum."""


def is_disk_full(e: BaseException) -> bool:
    return (isinstance(e, OSError) and e.errno == errno.ENOSPC) or "No space left" in str(e) or "ENOSPC" in str(e)
