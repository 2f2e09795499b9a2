"""Host memory: freed blocks are reused, not mapped afresh on every call (Linux with glibc).

XLA:CPU gives each call of a compiled step its temporaries as one block, tens of MiB for a layer at thousands of
tokens. glibc serves a block that large with a fresh mmap and unmaps it when it is freed, so every call page-faults
its temporaries in again and the kernel zeroes them: system time that grows a forward's wall time (docs/models.md;
`python benchmarks/prefill.py --against transformers`, whose transformers worker sees no such faults).
`reuse_freed_blocks` sets glibc so that such blocks come from the heap and go back to it: no mmap, no trimming, one
arena (XLA's threads would otherwise each get an arena of their own, whose heaps come and go as mappings). The
heap grows a few times at first (a block freed just after the next call began is not free for it), then calls stop
faulting.

It must run before XLA's threads first allocate, since a thread keeps the arena it got: `import specjax` runs it.
The cost is that freed memory stays with the process until `release_free_memory` (called after a model is loaded,
so the loader's transient copies do not stay). $SPECJAX_HOST_MALLOC=system leaves glibc's defaults.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import os

ENV_VAR = "SPECJAX_HOST_MALLOC"
CHOICES = ("reuse", "system")
# mallopt parameters (glibc's malloc.h)
M_TRIM_THRESHOLD, M_MMAP_MAX, M_ARENA_MAX = -1, -4, -8
NEVER_TRIM = 2**31 - 1

_state = {"applied": None}


def _glibc():
    """glibc's C library, or None (another libc, another system)."""
    name = ctypes.util.find_library("c")
    if name is None:
        return None
    try:
        libc = ctypes.CDLL(name)
        libc.gnu_get_libc_version  # only glibc has it
    except (OSError, AttributeError):
        return None
    return libc


def choice() -> str:
    """$SPECJAX_HOST_MALLOC: "reuse" (the default) or "system"."""
    chosen = os.environ.get(ENV_VAR, "reuse").strip().lower() or "reuse"
    if chosen not in CHOICES:
        raise ValueError(f"${ENV_VAR}={chosen!r} is not one of {CHOICES}; unset it or pick one.")
    return chosen


def reuse_freed_blocks() -> bool:
    """Set glibc's malloc to keep and reuse freed blocks (see the module doc), once per process. Returns whether
    the settings are in force: False under $SPECJAX_HOST_MALLOC=system or without glibc."""
    if _state["applied"] is None:
        libc = _glibc() if choice() == "reuse" else None
        _state["applied"] = bool(libc) and all(
            libc.mallopt(param, value) == 1
            for param, value in ((M_ARENA_MAX, 1), (M_MMAP_MAX, 0), (M_TRIM_THRESHOLD, NEVER_TRIM)))
    return _state["applied"]


def release_free_memory() -> None:
    """Give the heap's free memory back to the system (malloc_trim); a no-op unless the settings are in force."""
    if _state["applied"]:
        _glibc().malloc_trim(0)
