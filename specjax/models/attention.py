"""Prefill attention: every computed token over the keys it may see, without a [heads, n, n] score matrix.

One function, `attention`, serves the plain forward, the engine's recompute and chunked prefill, cached decode and
CacheBlend's recompute. Implementations, chosen like the kernels' (argument > `attention_impl` context >
$SPECJAX_ATTENTION_IMPL > by platform):

- "blocked": online softmax over key blocks inside query blocks (flash attention's schedule in plain jnp). Key
  blocks no query of a block can see are never visited, and only blocks that straddle the visibility boundary
  are masked. The default on CPU.
- "cudnn": `jax.nn.dot_product_attention(implementation="cudnn")`, cuDNN's fused flash attention, for a causal
  self-attention in bfloat16 / float16 on a GPU (what cuDNN supports); anything else falls back to "blocked". The
  default on GPU.
- "reference": the materialised masked softmax, for tests and as the definition.

A key is visible to a query when its position is not later and `kv_valid` allows it; softmax in float32.
"""

from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp
from jax import lax

from specjax.impl_choice import ImplChoice
from specjax.kernels import online_softmax_step

NEG_INF = -1e30  # finite, so fully masked padded rows stay NaN-free
IMPLS = ("auto", "blocked", "cudnn", "reference")
IMPL_ENV_VAR = "SPECJAX_ATTENTION_IMPL"
BLOCK_Q, BLOCK_K = 256, 512  # the blocked attention's query / key tiles; on a CPU any of 128-512 serves about as well
_LOG2_E = 1.4426950408889634

CHOICE = ImplChoice("attention", IMPLS, IMPL_ENV_VAR, lambda backend: "cudnn" if backend == "gpu" else "blocked")
attention_impl = CHOICE.using  # within the block, attention(impl="auto") uses the given impl


def resolve_impl(impl: str = "auto") -> str:
    """impl argument > attention_impl() context > $SPECJAX_ATTENTION_IMPL > cudnn on GPU, blocked elsewhere."""
    return CHOICE.resolve(impl)


def attention(q, k, v, q_positions, kv_positions, kv_valid=None, *, self_causal: bool = False, impl: str = "auto"):
    """Masked attention with grouped-query heads, causal by absolute position.

    q [H, Tq, d]; k, v [H_kv, Tk, d] (query head h reads KV head h // (H // H_kv)); q_positions int [Tq],
    kv_positions int [Tk]; kv_valid bool [Tk] or None. `self_causal`: q and k are the same tokens in the same
    order (q_positions == kv_positions), which is what cuDNN's causal mask expresses. Returns [H, Tq, d] in q's
    dtype.
    """
    chosen = resolve_impl(impl)
    if chosen == "reference":
        return reference_attention(q, k, v, q_positions, kv_positions, kv_valid)
    if (chosen == "cudnn" and self_causal and q.dtype in (jnp.bfloat16, jnp.float16)
            and jax.default_backend() == "gpu"):
        return _cudnn_causal(q, k, v, kv_valid)
    return blocked_attention(q, k, v, q_positions, kv_positions, kv_valid)


def reference_attention(q, k, v, q_positions, kv_positions, kv_valid=None):
    """The definition: the whole [H_kv, group, Tq, Tk] masked softmax."""
    H, Tq, d = q.shape
    H_kv = k.shape[0]
    qg = q.reshape(H_kv, H // H_kv, Tq, d)
    scores = jnp.einsum("kgqd,ksd->kgqs", qg, k, preferred_element_type=jnp.float32) * d**-0.5
    mask = _visible(q_positions, kv_positions, kv_valid)
    probs = jax.nn.softmax(jnp.where(mask, scores, NEG_INF), axis=-1)
    out = jnp.einsum("kgqs,ksd->kgqd", probs.astype(v.dtype), v, preferred_element_type=jnp.float32)
    return out.reshape(H, Tq, d).astype(q.dtype)


def _visible(q_positions, kv_positions, kv_valid):
    mask = kv_positions[None, :] <= q_positions[:, None]
    return mask if kv_valid is None else mask & kv_valid[None, :]


def blocked_attention(q, k, v, q_positions, kv_positions, kv_valid=None, *, block_q: int = BLOCK_Q,
                      block_k: int = BLOCK_K):
    """Flash attention's schedule in jnp: for each query block, an online softmax over the key blocks it can see.

    Each key block's earliest visible position decides whether a query block visits it at all (blocks are
    visited earliest first, so any key order works); a block whose keys are all visible to every query of the
    block skips the mask. A KV head's query heads share its tiles: scores are [H_kv, group * block_q, block_k],
    in base 2 (log2 e folded into the query scale; exp2 is cheaper than exp on CPU).
    """
    H, Tq, d = q.shape
    H_kv, Tk, _ = k.shape
    group = H // H_kv
    bq, bk = min(block_q, Tq), min(block_k, Tk)
    nq, nk = -(-Tq // bq), -(-Tk // bk)
    never = jnp.iinfo(jnp.int32).max
    valid = jnp.ones((Tk,), bool) if kv_valid is None else kv_valid
    # padding: queries at position -1 see nothing; keys are invalid
    q_pos = jnp.pad(q_positions.astype(jnp.int32), (0, nq * bq - Tq), constant_values=-1).reshape(nq, bq)
    kv_pos = jnp.pad(kv_positions.astype(jnp.int32), (0, nk * bk - Tk), constant_values=never).reshape(nk, bk)
    valid = jnp.pad(valid, (0, nk * bk - Tk)).reshape(nk, bk)
    q_blocks = (jnp.pad(q * (d**-0.5 * _LOG2_E), ((0, 0), (0, nq * bq - Tq), (0, 0)))
                .reshape(H_kv, group, nq, bq, d).transpose(2, 0, 1, 3, 4).reshape(nq, H_kv, group * bq, d))
    k_blocks = jnp.pad(k, ((0, 0), (0, nk * bk - Tk), (0, 0))).reshape(H_kv, nk, bk, d).transpose(1, 0, 2, 3)
    v_blocks = jnp.pad(v, ((0, 0), (0, nk * bk - Tk), (0, 0))).reshape(H_kv, nk, bk, d).transpose(1, 0, 2, 3)
    schedule = key_block_schedule(q_pos, kv_pos, valid)

    def query_block(args):
        qb, qp, visits = args  # [H_kv, group * bq, d], [bq], key blocks it sees
        earliest_query = jnp.where(qp >= 0, qp, never).min()

        def visit(t, carry):
            j = schedule.order[t]
            scores = jnp.einsum("kqd,ksd->kqs", qb, k_blocks[j], preferred_element_type=jnp.float32)
            unmasked = schedule.complete[j] & (schedule.last[j] <= earliest_query)
            return lax.cond(unmasked, _update, _masked_update, carry, scores, v_blocks[j], kv_pos[j], valid[j],
                            jnp.tile(qp, group))

        init = (jnp.full((H_kv, group * bq), NEG_INF, jnp.float32), jnp.zeros((H_kv, group * bq), jnp.float32),
                jnp.zeros((H_kv, group * bq, d), jnp.float32))
        _, total, acc = lax.fori_loop(0, visits, visit, init)
        return acc / jnp.where(total > 0, total, 1.0)[..., None]

    out = lax.map(query_block, (q_blocks, q_pos, schedule.visits)).reshape(nq, H_kv, group, bq, d)
    return out.transpose(1, 2, 0, 3, 4).reshape(H, nq * bq, d)[:, :Tq].astype(q.dtype)


class Schedule(NamedTuple):
    order: jax.Array  # key blocks, earliest visible position first
    last: jax.Array  # each key block's latest visible position
    complete: jax.Array  # each key block has no invalid key
    visits: jax.Array  # per query block: how many blocks of `order` it sees (those are the first ones)


def key_block_schedule(q_pos, kv_pos, valid) -> Schedule:
    """Which key blocks each query block visits: q_pos [nq, bq] (-1: padding), kv_pos / valid [nk, bk]."""
    never = jnp.iinfo(jnp.int32).max
    first = jnp.where(valid, kv_pos, never).min(-1)
    return Schedule(order=jnp.argsort(first), last=jnp.where(valid, kv_pos, -1).max(-1), complete=valid.all(-1),
                    visits=jnp.sum(first[None, :] <= q_pos.max(-1)[:, None], axis=-1))


def _update(carry, scores, values, kv_pos=None, valid=None, q_pos=None, mask=None):
    """The kernels' online-softmax step over a key block (base-2 scores [H_kv, rows, bk]), then the unnormalised
    output."""
    best, total, acc = carry
    best, total, correction, weights = online_softmax_step(best, total, scores, mask, exp=jnp.exp2)
    acc = acc * correction[..., None] + jnp.einsum("kqs,ksd->kqd", weights.astype(values.dtype), values,
                                                   preferred_element_type=jnp.float32)
    return best, total, acc


def _masked_update(carry, scores, values, kv_pos, valid, q_pos):
    return _update(carry, scores, values, mask=((kv_pos[None, :] <= q_pos[:, None]) & valid[None, :])[None])


def _cudnn_causal(q, k, v, kv_valid):
    """cuDNN flash attention for a causal self-attention; padding after the valid tokens (kv_valid a prefix)."""
    lengths = None if kv_valid is None else jnp.sum(kv_valid.astype(jnp.int32))[None]
    out = jax.nn.dot_product_attention(q.transpose(1, 0, 2)[None], k.transpose(1, 0, 2)[None],
                                       v.transpose(1, 0, 2)[None], is_causal=True,
                                       query_seq_lengths=lengths, key_value_seq_lengths=lengths,
                                       implementation="cudnn")
    return out[0].transpose(1, 0, 2)
