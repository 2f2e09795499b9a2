"""Parsing of flag values: sizes (10GB, 512MiB, 15%), bandwidths (5GB/s), retention lists, few-shot ranges."""

from __future__ import annotations

import math
import re

_UNITS = {"": 1, "b": 1, "kb": 10**3, "mb": 10**6, "gb": 10**9, "tb": 10**12,
          "kib": 2**10, "mib": 2**20, "gib": 2**30, "tib": 2**40, "k": 10**3, "m": 10**6, "g": 10**9}
_NUMBER_UNIT = re.compile(r"^\s*([0-9]*\.?[0-9]+(?:e[+-]?[0-9]+)?)\s*([a-z]*)\s*$", re.IGNORECASE)


def parse_size(text: str) -> tuple[float, bool]:
    """(value, is_fraction): "10GB" -> (1e10, False); "15%" -> (0.15, True)."""
    text = str(text).strip()
    if text.endswith("%"):
        value = float(text[:-1])
        if not 0 <= value <= 100:
            raise ValueError(f"percentage {text} outside 0-100")
        return value / 100, True
    m = _NUMBER_UNIT.match(text)
    if not m or m.group(2).lower() not in _UNITS:
        raise ValueError(f"not a size: {text!r}")
    value = float(m.group(1)) * _UNITS[m.group(2).lower()]
    if not math.isfinite(value):
        raise ValueError(f"{text!r} is too large to be a size")
    return value, False


def parse_bytes(text: str) -> int:
    """A size in bytes, not a percentage: "4MiB" -> 4194304."""
    value, is_fraction = parse_size(text)
    if is_fraction:
        raise ValueError(f"{text!r}: give bytes, not a percentage")
    return int(value)


def parse_bandwidth(text: str) -> float:
    """Bytes per second: "5GB/s" -> 5e9. A bare number is refused: 200 would be 200 B/s, which looks like a hang."""
    text = str(text).strip()
    if text.lower().endswith("/s"):
        text = text[:-2]
    m = _NUMBER_UNIT.match(text)
    if m and not m.group(2):
        raise ValueError(f"{text!r} has no unit; give a rate with one, e.g. {m.group(1)}MB/s or {m.group(1)}GB/s")
    value, is_fraction = parse_size(text)
    if is_fraction or value <= 0:
        raise ValueError(f"not a bandwidth: {text!r}")
    return value


def cache_bytes(spec: str, store_bytes: int) -> int:
    """A cache budget (`parse_size`: bytes, or a percentage of the `store_bytes` of stored prefix KV) in bytes."""
    value, is_fraction = parse_size(spec)
    return int(round(value * store_bytes)) if is_fraction else int(value)


def parse_retentions(text: str) -> list[float]:
    values = [float(v) for v in str(text).split(",") if v.strip()]
    if not values or any(not 0 < v <= 1 for v in values):
        raise ValueError(f"retention must be in (0, 1]: {text!r}")
    return sorted(set(values))


def parse_fewshot(text) -> tuple[int, int]:
    text = str(text).strip()
    lo, _, hi = text.partition("-")
    lo_n, hi_n = int(lo), int(hi or lo)
    if lo_n < 0 or hi_n < lo_n:
        raise ValueError(f"few-shot range {text!r}")
    return lo_n, hi_n
