"""Errors a store user can cause; each message names the fix. `stores` stays independent of `specjax`."""


class StoreError(Exception):
    """Base class: a store problem with a one-line, actionable message."""


class StoreMismatchError(StoreError):
    """The store on disk was written for another model or layout."""


class DiskFullError(StoreError):
    """A write found no room (device full or the configured disk capacity reached)."""


class ManifestError(StoreError):
    """The manifest is missing, unreadable or fails its own checksum."""
