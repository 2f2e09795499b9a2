"""What the engine tells measurements, instead of their patching its code: named events, emitted with keyword
arguments to every subscriber (in the order they subscribed; none: one dictionary lookup).

- `selection` (io, layer, chosen): a layer's token set is chosen, before `LayerIO.after_selection` keeps what the
  speculation made for it (`io.prefetched[layer]` is still there). Return nothing.
- `blend_layer` (layer, reused_k, reused_v, rotation, rows, deviation): cacheblend has recomputed `rows` of a layer
  over the reused K/V and measured their `deviation`; a subscriber may return a deviation [rows] to rank by instead
  (an oracle, `benchmarks/cacheblend_oracle.py`), else None.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable

NAMES = ("selection", "blend_layer")
_subscribers: dict[str, list[Callable]] = {name: [] for name in NAMES}


@contextlib.contextmanager
def subscribed(name: str, callback: Callable):
    """Within the block, `callback(**arguments)` is called at every `name` event of every engine in the process."""
    if name not in _subscribers:
        raise ValueError(f"no engine event {name!r}; the events are {', '.join(NAMES)}")
    _subscribers[name].append(callback)
    try:
        yield
    finally:
        _subscribers[name].remove(callback)


def emit(name: str, **arguments) -> list:
    """Every subscriber's answer, in order."""
    return [callback(**arguments) for callback in _subscribers[name]]
