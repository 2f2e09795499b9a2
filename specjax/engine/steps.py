"""The engine's jitted device steps: a layer's projections, its attention over the selected prefix (gathered) or
over plain rows, the probe heads' scores, buffer writes and gathers, and the context a continuation attends to.

Every engine (the layer loop, Cake's schedule, CacheBlend's blending) composes these; none has device code of its
own for the same job.
"""

from __future__ import annotations

import functools
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import PartitionSpec

from specjax import sharding as sh
from specjax.distributed import to_host
from specjax.engine import state as st
from specjax.engine.types import LayerKV
from specjax.kernels import PerHeadIndices, SharedIndices, attention_over_logits, gathered_attention, probe_scores
from specjax.models import transformer as T
from specjax.models.inference import bucket


def project(cfg, lp, h, positions, rotary_table=None):
    """A layer's q, k, v (T.project): one fused matmul, or three where the weights are split by head over devices.
    rotary_table: T.rotary_step(cfg, positions), computed once for every layer (None: computed here)."""
    return _project(cfg, lp, h, positions, rotary_table, fused=not T.split_over_devices(lp["wq"]))


@functools.partial(jax.jit, static_argnums=0, static_argnames=("fused",))
def _project(cfg, lp, h, positions, rotary_table, *, fused):
    return T.project(cfg, lp, h, positions, fused=fused, rotary_table=rotary_table)


class ScoredLogits(NamedTuple):
    """A scoring pass's unscaled logits f32 [H, n_q, M' + n_q] (`scores(..., with_logits=True)`) and, entry for entry
    with a layer's selection, the column of each selected row in them (a SharedIndices or PerHeadIndices)."""

    logits: jax.Array
    columns: Any


def finish(cfg, lp, h, q, own_k, own_v, prefix_k, prefix_v, selection, q_len, *, impl, logits=None):
    """A layer's tail over the selected prefix KV: gathered attention, output projection, MLP.

    `logits`: (every query head's logits from the layer's scoring, the columns of the selection's rows in them:
    `ScoredLogits`), or None. Given, and the prefix arrays whole and on one device, the attention weighs the
    selected values by those logits (`attention_over_logits`) and computes no key products again.

    With the prefix K/V split by KV head over a mesh (tensor parallel: specjax.sharding), each device attends
    with its own query heads over its own KV heads (the kernel runs per device, in a shard_map); the output
    projection's sum over heads is then the one collective."""
    mesh = sh.head_mesh(prefix_k)
    if logits is not None and (mesh is not None or prefix_v.ndim != 3):
        logits = None
    return _finish(cfg, lp, h, q, own_k, own_v, prefix_k, prefix_v, selection, q_len, logits, impl=impl, mesh=mesh)


@functools.partial(jax.jit, static_argnums=0, static_argnames=("impl", "mesh"))
def _finish(cfg, lp, h, q, own_k, own_v, prefix_k, prefix_v, selection, q_len, logits, *, impl, mesh):
    if logits is not None:
        attn = attention_over_logits(logits.logits, logits.columns, prefix_v, own_v, selection, q_len=q_len)
        return T.output_and_mlp(cfg, lp, h, attn.astype(q.dtype))

    def attend(q, prefix_k, prefix_v, own_k, own_v, selection, q_len):
        return gathered_attention(q, prefix_k, prefix_v, own_k, own_v, selection, q_len=q_len, impl=impl,
                                  check_indices=False)

    if mesh is not None:
        heads, whole = PartitionSpec(sh.TP), PartitionSpec()
        per_head = isinstance(selection, PerHeadIndices)  # its rows are query heads: split with them
        selection_spec = jax.tree.map(lambda x: heads if per_head and jnp.ndim(x) else whole, selection)
        attend = jax.shard_map(attend, mesh=mesh, in_specs=(heads,) * 5 + (selection_spec, whole),
                               out_specs=heads, check_vma=False)
    attn = attend(q, prefix_k, prefix_v, own_k, own_v, selection, q_len)
    return T.output_and_mlp(cfg, lp, h, attn)


@functools.partial(jax.jit, static_argnums=0, static_argnames=("self_causal",))
def finish_plain(cfg, lp, h, q, keys, values, positions, visible, *, self_causal=False):
    """A layer's tail when nothing is reused: its tokens (at `positions`) attend causally to rows [0, visible) of
    keys / values [H_kv, W, d], row i holding position i, through the model's own attention (as the plain forward)."""
    slots = jnp.arange(keys.shape[1], dtype=jnp.int32)
    return T.attend_and_mlp(cfg, lp, h, q, keys, values, positions, slots, slots < visible, self_causal=self_causal)


def layer_over_buffers(cfg, lp, h, positions, rotary_table, keys, values, lo: int, count: int):
    """One layer of new tokens at token `lo` (`count` valid rows) over a layer's buffers keys / values [H_kv, W, d]
    (row i holding position i): its K/V rows are written into them in place, and it attends causally to rows
    [0, lo + count) of them. Returns (next hidden, keys, values)."""
    q, own_k, own_v = project(cfg, lp, h, positions, rotary_table)
    keys, values = put_rows(keys, own_k, lo), put_rows(values, own_v, lo)
    return finish_plain(cfg, lp, h, q, keys, values, positions, lo + count), keys, values


# the most a scoring pass's logits may hold to be kept for the layer's attention (`scores(..., with_logits=True)`):
# the reference scoring makes them anyway; kept, they live until the layer's attention has used them
LOGITS_KEPT_BYTES = 256 << 20


@functools.partial(jax.jit, static_argnames=("kv_head_of_probe", "impl", "q_heads", "kv_heads", "with_logits"))
def scores(q, prefix_k, own_k, prefix_len, q_len, *, kv_head_of_probe, impl, q_heads=None, kv_heads=None,
           with_logits=False):
    """Scores of the prefix keys from query heads `q_heads` of q (None: all), each against KV head
    kv_head_of_probe[i] of prefix_k and of own_k's heads `kv_heads` (None: all); the heads are taken inside the
    jitted step, so a probe layer dispatches no gather of its own.

    `with_logits`: (scores, logits), the logits f32 [heads, n_q, M + n_q] where the reference scoring made them and
    they fit LOGITS_KEPT_BYTES, else None (Pallas never holds them)."""
    if q_heads is not None:
        q = q[np.asarray(q_heads)]
    if kv_heads is not None:
        own_k = own_k[np.asarray(kv_heads)]
    keep = with_logits and 4 * q.shape[0] * q.shape[1] * (prefix_k.shape[1] + q.shape[1]) <= LOGITS_KEPT_BYTES
    got = probe_scores(q, prefix_k, own_k, kv_head_of_probe=kv_head_of_probe, prefix_len=prefix_len,
                       q_len=q_len, impl=impl, with_logits=keep)
    if not with_logits:
        return got
    return got if keep else (got, None)


def put(buf, rows, start):
    return jax.lax.dynamic_update_slice_in_dim(buf, rows.astype(buf.dtype), start, axis=1)


@functools.partial(jax.jit, donate_argnums=0)
def put_rows(buf, rows, start):
    """buf [H, M, d] with rows [H, C, d] written at token `start`, in place."""
    return put(buf, rows, start)


@functools.partial(jax.jit, static_argnums=(0, 1, 2))
def zero_buffers(count: int, shape: tuple, dtype):
    return [jnp.zeros(shape, dtype) for _ in range(count)]


@functools.partial(jax.jit, static_argnums=0)
def head_row(cfg, params, h, row):
    return T.head(cfg, params, jax.lax.dynamic_slice_in_dim(h, row, 1))[0]


@jax.jit
def scatter_tokens(like, idx, rows):
    """Zeros shaped like `like` [heads, M, d] with rows[:, i] at token idx[i] (idx >= M is padding, dropped)."""
    return jnp.zeros_like(like).at[:, idx].set(rows.astype(like.dtype), mode="drop")


@jax.jit
def record_and_place_union(state, layer, positions, count, keys, slots, rows):
    """A per-head layer's union in one device step: recorded in the state (`positions` [m_pad] of the prefix, -1
    after the `count` valid ones: state.record_union) and its values `rows` [heads, U, d] placed at token slots
    `slots` [U] of zeros shaped like `keys` (scatter_tokens). The index arrays go in as host arrays, with no transfer
    step of their own."""
    return st.record_union(state, layer, positions, count), scatter_tokens(keys, slots, rows)


@jax.jit
def gather_tokens(x, idx):
    """x [heads, M, d] rows at idx (positions >= M are padding and give zeros)."""
    return jnp.take(x, idx, axis=1, mode="fill", fill_value=0)


def normalised_importance(scores, m: int) -> np.ndarray:
    """Per-token importance of R averaged over heads, each head normalised to sum 1 (for reordering)."""
    s = to_host(scores).astype(np.float64)[:, :m]
    return (s / np.maximum(s.sum(1, keepdims=True), 1e-30)).mean(0).astype(np.float32)


@functools.partial(jax.jit, static_argnums=2)
def join(prefix, own, width: int):
    """[H, M, d] and [H, n, d] side by side, zero-padded to `width` tokens."""
    joined = jnp.concatenate([prefix, own], axis=1)
    return jnp.pad(joined, ((0, 0), (0, width - joined.shape[1]), (0, 0)))


def with_head(head_k, head_v, head: int, prefix_k, prefix_v, selection):
    """The computed first `head` stored tokens (rows [0, head) of head_k / head_v [H, W, d]) in front of a layer's
    loaded prefix arrays, with a selection that keeps every head row and the loaded rows `selection` keeps."""
    width = head_k.shape[1] + prefix_k.shape[1]
    keys, values = join(head_k, prefix_k, width), join(head_v, prefix_v, width)
    count = selection.idx.shape[-1] if selection.count is None else selection.count
    return keys, values, type(selection)(_head_rows(selection.idx, head, head_k.shape[1]), head + count)


@functools.partial(jax.jit, static_argnums=(1, 2))
def _head_rows(idx, head: int, offset: int):
    """Selection rows [k] or [H, k] (positions of the loaded arrays) behind 0..head-1, moved by `offset`."""
    front = jnp.arange(head, dtype=jnp.int32)
    if idx.ndim == 2:
        front = jnp.broadcast_to(front, (idx.shape[0], head))
    return jnp.concatenate([front, jnp.asarray(idx, jnp.int32) + offset], axis=-1)


def context_for_continuation(kv: LayerKV, n: int):
    """Prefix arrays + selection for tokens after the computed ones: the computed tokens join the selection.

    The arrays are padded to a bucket of their joint width and the selection to that same width, so scoring a
    continuation compiles once per (continuation bucket, context bucket), not per combination of the prefix's,
    the computed tokens' and the selection's sizes."""
    M = kv.prefix_k.shape[1]
    width = bucket(M + kv.own_k.shape[1])
    if width == M and not kv.own_k.shape[1]:  # the computed tokens are in the prefix arrays already (a bucket wide)
        keys, values = kv.prefix_k, kv.prefix_v
    else:
        keys, values = join(kv.prefix_k, kv.own_k, width), join(kv.prefix_v, kv.own_v, width)
    own = np.arange(M, M + n, dtype=np.int32)
    sel = kv.selection
    count = int(np.max(to_host(sel.count))) if sel.count is not None else sel.idx.shape[-1]
    rows = np.atleast_2d(to_host(sel.idx))[:, :count]
    idx = np.concatenate([rows, np.broadcast_to(own, (rows.shape[0], n))], axis=1)
    padded = np.zeros((idx.shape[0], width), np.int32)
    padded[:, : idx.shape[1]] = idx
    if isinstance(sel, PerHeadIndices):
        return keys, values, PerHeadIndices(jnp.asarray(padded), idx.shape[1])
    return keys, values, SharedIndices(jnp.asarray(padded[0]), idx.shape[1])
