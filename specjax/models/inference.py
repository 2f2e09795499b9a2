"""Plain inference over the layer steps: full forward, prefill into a KV cache, token-by-token decode.

Sequences are padded at the end to a small set of bucket lengths so each shape compiles once;
padding never changes real tokens' results because attention is causal.
"""

from __future__ import annotations

import dataclasses

import jax.numpy as jnp
import numpy as np

from specjax import sharding
from specjax.config import ModelConfig
from specjax.distributed import to_host
from specjax.errors import SpecjaxError
from specjax.models import transformer as T
from specjax.shapes import bucket, padded  # noqa: F401 -- re-exported: the models' and engine's buckets


def log_softmax(x) -> np.ndarray:
    """Log-probabilities over the last axis, in float64 on the host (no device program per shape)."""
    x = np.asarray(x, dtype=np.float64)
    x = x - x.max(-1, keepdims=True)
    return x - np.log(np.exp(x).sum(-1, keepdims=True))


def _check_length(cfg: ModelConfig, n: int) -> None:
    if n > cfg.max_positions:
        raise SpecjaxError(f"sequence of {n} tokens exceeds the model's {cfg.max_positions} positions")


def forward_hidden(cfg: ModelConfig, params: dict, ids) -> tuple[jnp.ndarray, int]:
    """Last hidden states [bucket(T), D] of a plain causal forward, and the real length T."""
    ids = np.asarray(ids, np.int32)
    n = len(ids)
    if n == 0:
        raise SpecjaxError("cannot run the model on an empty token sequence")
    _check_length(cfg, n)
    h, positions, rotary = T.tokens_at(cfg, params, ids, width=bucket(n))
    valid = positions < n
    pace = sharding.Pace(h)  # on a CPU mesh, at most a layer ahead of the devices (sharding.Pace)
    for lp in params["layers"]:
        h, _, _ = T.self_attention_layer(cfg, lp, h, positions, valid, rotary)
        pace.step(h)
    return h, n


def forward_logits(cfg: ModelConfig, params: dict, ids) -> np.ndarray:
    h, n = forward_hidden(cfg, params, ids)
    return to_host(T.head_step(cfg, params, h)[:n])


def logits_at(cfg: ModelConfig, params: dict, ids, rows) -> np.ndarray:
    """Logits only at the given row indices (saves the vocab projection of every other row)."""
    h, _ = forward_hidden(cfg, params, ids)
    rows = np.asarray(rows, np.int32)
    padded = np.zeros(bucket(len(rows), minimum=4), np.int32)
    padded[: len(rows)] = rows
    return to_host(T.head_rows(cfg, params, h, jnp.asarray(padded))[: len(rows)])


@dataclasses.dataclass
class KVCache:
    """Per-layer keys and values [H_kv, capacity, d] and how many positions are filled."""

    k: list
    v: list
    length: int

    @property
    def capacity(self) -> int:
        return self.k[0].shape[1]


def empty_cache(cfg: ModelConfig, capacity: int, dtype) -> KVCache:
    shape = (cfg.num_kv_heads, capacity, cfg.head_dim)
    return KVCache(
        k=[jnp.zeros(shape, dtype) for _ in range(cfg.num_layers)],
        v=[jnp.zeros(shape, dtype) for _ in range(cfg.num_layers)],
        length=0,
    )


def extend(cfg: ModelConfig, params: dict, cache: KVCache, ids) -> np.ndarray:
    """Run new tokens through the model on top of `cache` (updated in place); fp32 logits [n, vocab]."""
    ids = np.asarray(ids, np.int32)
    n = len(ids)
    start = cache.length
    if start + n > cache.capacity:
        raise SpecjaxError(f"KV cache of {cache.capacity} positions cannot hold {start + n} tokens")
    _check_length(cfg, start + n)
    width = min(bucket(n, minimum=1 if n == 1 else 16), cache.capacity - start)
    h, positions, rotary = T.tokens_at(cfg, params, ids, start, width)
    pace = sharding.Pace(h)  # as forward_hidden's
    for i, lp in enumerate(params["layers"]):
        h, cache.k[i], cache.v[i] = T.cached_layer(
            cfg, lp, h, positions, cache.k[i], cache.v[i], start, start + n, rotary
        )
        pace.step(h)
    cache.length = start + n
    return to_host(T.head_step(cfg, params, h[:n]))


def greedy_generate(cfg: ModelConfig, params: dict, prompt_ids, max_new_tokens: int, stop_ids=()) -> list[int]:
    """Greedy decoding with a KV cache: prefill the prompt, then one token per step."""
    capacity = min(cfg.max_positions, bucket(len(prompt_ids) + max_new_tokens))
    cache = empty_cache(cfg, capacity, params["embed"].dtype)
    logits = extend(cfg, params, cache, prompt_ids)[-1]
    out: list[int] = []
    for _ in range(max_new_tokens):
        token = int(np.argmax(logits))
        if token in stop_ids:
            break
        out.append(token)
        if cache.length >= capacity:
            break
        logits = extend(cfg, params, cache, [token])[-1]
    return out
