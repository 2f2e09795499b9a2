"""OPT / Llama / Qwen2 as pure functions over (config, params, hidden states).

Each layer is split so the prefill engine can act between projection and attention:
`project` gives position-encoded q, k, v; `attention` (specjax.models.attention: blocked, never the whole score
matrix) attends over the keys a token may see (the engine substitutes gathered attention over selected prefix KV
when it reuses one); `output_and_mlp` finishes the layer.
Shapes are per sequence: hidden `[T, D]`, heads-major q `[H, T, d]`, k/v `[H_kv, T, d]`.
Queries are returned unscaled; attention applies `head_dim ** -0.5`.

Every loop over layers (plain inference, the engine's schedules, observe) starts from `tokens_at`: the tokens it
computes as the layer steps take them (`Tokens`: embedded hidden states, positions, rotary table). What differs
between the model families (learned or rotary positions, norms, biases) is decided here, from the config.
"""

from __future__ import annotations

import functools
from collections.abc import Sequence
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from specjax.config import ModelConfig
from specjax.models.attention import attention
from specjax.shapes import padded


def layer_norm(x, scale, bias, eps):
    x32 = x.astype(jnp.float32)
    mean = x32.mean(-1, keepdims=True)
    var = jnp.square(x32 - mean).mean(-1, keepdims=True)
    y = (x32 - mean) * jax.lax.rsqrt(var + eps)
    return (y * scale.astype(jnp.float32) + bias.astype(jnp.float32)).astype(x.dtype)


def rms_norm(x, scale, eps):
    # As transformers: normalise in fp32, cast back, then scale in the input dtype.
    x32 = x.astype(jnp.float32)
    y = x32 * jax.lax.rsqrt(jnp.square(x32).mean(-1, keepdims=True) + eps)
    return scale * y.astype(x.dtype)


def norm(cfg: ModelConfig, x, lp: dict, name: str):
    if cfg.arch == "opt":
        return layer_norm(x, lp[name], lp[name + "_bias"], cfg.norm_eps)
    return rms_norm(x, lp[name], cfg.norm_eps)


def rotary_angles(positions, d: int, theta: float):
    """cos and sin [T, d] (float32) of the rotary angles at positions [T], in transformers' rotate-half layout."""
    inv_freq = 1.0 / (theta ** (jnp.arange(0, d, 2, dtype=jnp.float32) / d))
    freqs = positions.astype(jnp.float32)[:, None] * inv_freq[None, :]
    angles = jnp.concatenate([freqs, freqs], axis=-1)
    return jnp.cos(angles), jnp.sin(angles)


def rotate(x, cos, sin):
    """Rotary embedding of x [heads, T, d] by rotary_angles' cos / sin [T, d]."""
    d = x.shape[-1]
    x1, x2 = x[..., : d // 2], x[..., d // 2 :]
    rotated = jnp.concatenate([-x2, x1], axis=-1)
    return x * cos.astype(x.dtype) + rotated * sin.astype(x.dtype)


def rope(x, positions, theta: float):
    """Rotary embedding in transformers' rotate-half layout. x: [heads, T, d], positions: [T]."""
    return rotate(x, *rotary_angles(positions, x.shape[-1], theta))


def rotary(cfg: ModelConfig, positions):
    """The `rotary_table` a layer step takes: the angles' (cos, sin) at `positions`, or None for a model without
    rotary embeddings. A forward computes them once (`rotary_step`) and passes them to every layer: computed inside a
    layer step, XLA:CPU fuses cos and sin into each consumer and evaluates them for every element of every head, a
    cost several times that of applying a table (docs/models.md)."""
    return rotary_angles(positions, cfg.head_dim, cfg.rope_theta) if cfg.uses_rope else None


def embed(cfg: ModelConfig, params: dict, ids, positions):
    """Token ids [T] at absolute positions [T] -> hidden states [T, D]."""
    x = params["embed"][ids]
    if cfg.arch == "opt":
        if cfg.has_projections:
            x = x @ params["project_in"]
        x = x + params["pos_embed"][positions + 2]
    return x


def split_over_devices(x) -> bool:
    """Whether array `x` is split over several devices (tensor parallel: specjax.sharding). A traced value says
    nothing about its placement: False."""
    try:
        return len(x.sharding.device_set) > 1
    except AttributeError:
        return False


def project(cfg: ModelConfig, lp: dict, h, positions, *, fused: bool = True, rotary_table=None):
    """Hidden [T, D] -> q [H, T, d], k [H_kv, T, d], v [H_kv, T, d]; keys position-encoded.

    rotary_table: `rotary(cfg, positions)` computed beforehand (faster, see `rotary`); None computes it here.
    fused: one matmul for q, k and v (on a CPU faster than three); False: three, for weights split
    by head over devices (the fused weight's columns would not line up with each device's heads, and its
    product would be moved between devices)."""
    x = norm(cfg, h, lp, "attn_norm") if cfg.pre_layer_norm else h
    weights = [lp[name] for name in ("wq", "wk", "wv")]  # [D, heads, d] each
    if fused:  # then heads-major
        qkv = x @ jnp.concatenate([w.reshape(w.shape[0], -1) for w in weights], axis=1)
        if "bq" in lp:
            qkv = qkv + jnp.concatenate([lp[name].reshape(-1) for name in ("bq", "bk", "bv")])
        ends = np.cumsum([w.shape[1] * w.shape[2] for w in weights])[:2]
        q, k, v = (part.reshape(len(x), w.shape[1], w.shape[2]).transpose(1, 0, 2)
                   for part, w in zip(jnp.split(qkv, ends, axis=1), weights))
    else:
        q, k, v = (jnp.einsum("tD,Dhd->htd", x, w) for w in weights)
        if "bq" in lp:
            q, k, v = (y + lp[name][:, None, :] for y, name in zip((q, k, v), ("bq", "bk", "bv")))
    if cfg.uses_rope:
        cos, sin = rotary(cfg, positions) if rotary_table is None else rotary_table
        q, k = rotate(q, cos, sin), rotate(k, cos, sin)
    return q, k, v


def _mlp(cfg: ModelConfig, lp: dict, x):
    if cfg.arch == "opt":
        up = x @ lp["w_up"] + lp["b_up"]
        act = jax.nn.relu(up) if cfg.activation == "relu" else jax.nn.gelu(up, approximate=False)
        return act @ lp["w_down"] + lp["b_down"]
    return (jax.nn.silu(x @ lp["w_gate"]) * (x @ lp["w_up"])) @ lp["w_down"]


def output_and_mlp(cfg: ModelConfig, lp: dict, h, attn):
    """Attention output [H, T, d] -> out projection, residuals, norms, MLP -> next hidden [T, D]."""
    o = jnp.einsum("htd,hdD->tD", attn, lp["wo"])
    if "bo" in lp:
        o = o + lp["bo"]
    if cfg.pre_layer_norm:
        h = h + o
        return h + _mlp(cfg, lp, norm(cfg, h, lp, "mlp_norm"))
    h = norm(cfg, h + o, lp, "attn_norm")  # OPT post-LN (opt-350m)
    return norm(cfg, h + _mlp(cfg, lp, h), lp, "mlp_norm")


def attend_and_mlp(cfg: ModelConfig, lp: dict, h, q, k, v, q_positions, kv_positions, kv_valid=None, *,
                   self_causal: bool = False):
    """The rest of a layer after `project`, given the keys/values the queries may see (see attention.attention)."""
    return output_and_mlp(cfg, lp, h, attention(q, k, v, q_positions, kv_positions, kv_valid,
                                                self_causal=self_causal))


def final_hidden(cfg: ModelConfig, params: dict, h):
    if cfg.final_layer_norm:
        if cfg.arch == "opt":
            h = layer_norm(h, params["final_norm"], params["final_norm_bias"], cfg.norm_eps)
        else:
            h = rms_norm(h, params["final_norm"], cfg.norm_eps)
    if cfg.has_projections:
        h = h @ params["project_out"]
    return h


def head(cfg: ModelConfig, params: dict, h):
    """Hidden [T, D] -> fp32 logits [T, vocab]."""
    x = final_hidden(cfg, params, h)
    w = params["embed"].T if cfg.tie_embeddings else params["lm_head"]
    return jnp.einsum("tE,EV->tV", x, w, preferred_element_type=jnp.float32)


# ---- jitted steps used by the Model API and the engine --------------------------------------


@functools.partial(jax.jit, static_argnums=0)
def embed_step(cfg: ModelConfig, params: dict, ids, positions):
    return embed(cfg, params, ids, positions)


rotary_step = jax.jit(rotary, static_argnums=0)


class Tokens(NamedTuple):
    """Token rows as every layer step takes them: hidden states [W, D] out of the embedding, their absolute
    positions int32 [W], and the `rotary_table` at those positions, computed once for all layers (None for a model
    without rotary embeddings, or for a layer step that rotates by itself: `embed_rows(..., with_table=False)`)."""

    hidden: jax.Array
    positions: jax.Array
    rotary: tuple | None


def tokens_at(cfg: ModelConfig, params: dict, ids: Sequence[int] | np.ndarray, start: int = 0,
              width: int | None = None) -> Tokens:
    """The tokens a loop computes: host token ids at positions start, start + 1, ..., followed by id 0 up to `width`
    rows (None: as many as ids). Callers pad to a bucket (specjax.shapes.bucket) so each width compiles once; the
    padding rows come after every real token, so causal attention keeps them out of the real tokens' results."""
    width = len(ids) if width is None else width
    positions = jnp.asarray(np.arange(start, start + width, dtype=np.int32))
    return embed_rows(cfg, params, padded(ids, width, 0), positions)


def embed_rows(cfg: ModelConfig, params: dict, ids, positions, *, with_table: bool = True) -> Tokens:
    """Token ids [W] at any absolute positions [W] (host or device arrays) as `Tokens`. with_table=False leaves the
    rotary table out, for a layer step that rotates at these positions itself."""
    positions = jnp.asarray(positions)
    hidden = embed_step(cfg, params, jnp.asarray(ids), positions)
    return Tokens(hidden, positions, rotary_step(cfg, positions) if with_table else None)


def self_attention_layer(cfg: ModelConfig, lp: dict, h, positions, valid, rotary_table=None):
    """One full layer over the sequence itself (plain prefill). Returns next hidden and (k, v). rotary_table: see
    `project`."""
    return _self_attention_layer(cfg, lp, h, positions, valid, rotary_table, fused=not split_over_devices(lp["wq"]))


@functools.partial(jax.jit, static_argnums=0, static_argnames=("fused",))
def _self_attention_layer(cfg: ModelConfig, lp: dict, h, positions, valid, rotary_table, *, fused: bool):
    q, k, v = project(cfg, lp, h, positions, fused=fused, rotary_table=rotary_table)
    return attend_and_mlp(cfg, lp, h, q, k, v, positions, positions, valid, self_causal=True), k, v


@functools.partial(jax.jit, static_argnums=0, donate_argnums=(4, 5))
def cached_layer(cfg: ModelConfig, lp: dict, h, positions, cache_k, cache_v, start, cache_len, rotary_table=None):
    """Layer over new tokens at positions start.. with a KV cache [H_kv, S, d] updated in place."""
    q, k, v = project(cfg, lp, h, positions, rotary_table=rotary_table)
    cache_k = jax.lax.dynamic_update_slice(cache_k, k.astype(cache_k.dtype), (0, start, 0))
    cache_v = jax.lax.dynamic_update_slice(cache_v, v.astype(cache_v.dtype), (0, start, 0))
    slots = jnp.arange(cache_k.shape[1])
    h = attend_and_mlp(cfg, lp, h, q, cache_k, cache_v, positions, slots, slots < cache_len)
    return h, cache_k, cache_v


@functools.partial(jax.jit, static_argnums=0)
def head_step(cfg: ModelConfig, params: dict, h):
    return head(cfg, params, h)


@functools.partial(jax.jit, static_argnums=0)
def head_rows(cfg: ModelConfig, params: dict, h, rows):
    return head(cfg, params, h[rows])
