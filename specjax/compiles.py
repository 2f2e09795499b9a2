"""Counts XLA backend compiles with JAX's monitoring hooks.

JAX records the duration event `/jax/core/compile/backend_compile_duration` (`jax._src.dispatch.
BACKEND_COMPILE_EVENT`) once per backend compile, i.e. once per miss of its in-memory program caches (a hit in
the persistent compilation cache still counts: the program was not in memory). Same name and hooks in jax 0.10
and 0.11.
"""

from __future__ import annotations

import contextlib
import threading

from jax import monitoring

COMPILE_EVENT = "/jax/core/compile/backend_compile_duration"


class CompileCounter:
    """`with CompileCounter() as c:` counts the compiles of every thread in the block into `c.count`."""

    def __init__(self):
        self.count = 0
        self._lock = threading.Lock()

    def _listen(self, event: str, duration: float, **kwargs) -> None:
        if event == COMPILE_EVENT:
            with self._lock:
                self.count += 1

    def __enter__(self) -> CompileCounter:
        monitoring.register_event_duration_secs_listener(self._listen)
        return self

    def __exit__(self, *exc) -> None:
        # gone already if someone called jax.monitoring.clear_event_listeners() meanwhile
        with contextlib.suppress(AssertionError, ValueError):
            monitoring.unregister_event_duration_listener(self._listen)
