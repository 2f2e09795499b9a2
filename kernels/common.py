"""Shared pieces of the kernels: Pallas-vs-reference dispatch, argument checks, and the
online-softmax and column-sum steps that both kernels run on their tiles."""

from __future__ import annotations

import dataclasses
import math

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.experimental import pallas as pl

from specjax.impl_choice import ImplChoice

IMPLS = ("auto", "pallas", "reference")
IMPL_ENV_VAR = "SPECJAX_KERNEL_IMPL"

# Finite, so that fully masked rows never produce inf - inf = NaN.
MASK_VALUE = -0.7 * float(np.finfo(np.float32).max)
# Older/newer Pallas spell a squeezed block dimension differently; both accept this.
SQUEEZED = getattr(pl, "squeezed", None)

CHOICE = ImplChoice("kernel", IMPLS, IMPL_ENV_VAR, lambda backend: "pallas" if backend == "gpu" else "reference")
kernel_impl = CHOICE.using  # within the block, kernels called with impl="auto" use the given impl


@dataclasses.dataclass(frozen=True)
class Dispatch:
    use_pallas: bool
    interpret: bool  # Pallas runs compiled only on GPU; elsewhere it is interpreted.


def resolve_impl(impl: str) -> Dispatch:
    """impl argument > kernel_impl() context > $SPECJAX_KERNEL_IMPL > Pallas on GPU only."""
    return Dispatch(use_pallas=CHOICE.resolve(impl) == "pallas", interpret=jax.default_backend() != "gpu")


# ----------------------------------------------------------------------------- checks


def check_block_size(name: str, value: int, *, interpret: bool) -> None:
    """Triton tiles must be powers of two, and tl.dot needs every dimension >= 16."""
    if not isinstance(value, int) or value < 1 or value & (value - 1):
        raise ValueError(f"{name}={value!r} must be a positive power of two.")
    if not interpret and value < 16:
        raise ValueError(f"{name}={value} is below 16, the smallest GPU dot tile.")


def check_head_dim(head_dim: int, *, interpret: bool) -> None:
    if not interpret and (head_dim < 16 or head_dim & (head_dim - 1)):
        raise ValueError(
            f"head_dim={head_dim}: the GPU kernels need a power of two >= 16 "
            "(pad the head dimension with zeros, or use impl='reference').")


def check_rank(name: str, x, rank: int, layout: str) -> None:
    if jnp.ndim(x) != rank:
        raise ValueError(f"{name} must be {layout}, got shape {jnp.shape(x)}.")


def concrete_value(x):
    """x as a numpy array when it is known now (not traced), else None."""
    if x is None:
        return None
    try:
        return np.asarray(x)
    except (jax.errors.TracerArrayConversionError, jax.errors.ConcretizationTypeError):
        return None


def check_length(name: str, value, upper: int) -> None:
    concrete = concrete_value(value)
    if concrete is None:
        return
    if concrete.ndim != 0 or not 0 <= int(concrete) <= upper:
        raise ValueError(f"{name}={concrete} must be a scalar in [0, {upper}].")


def length_or_full(value, full: int) -> jax.Array:
    """A valid length as int32, clipped so a bad traced value cannot read out of bounds."""
    if value is None:
        return jnp.int32(full)
    return jnp.clip(jnp.asarray(value, jnp.int32), 0, full)


def default_scale(head_dim: int, scale: float | None) -> float:
    return head_dim ** -0.5 if scale is None else scale


def round_up(n: int, multiple: int) -> int:
    return max(multiple, -(-n // multiple) * multiple)


def pad_axis(x: jax.Array, axis: int, size: int) -> jax.Array:
    """Zero-pad one axis up to `size` (no copy when it already has that size)."""
    extra = size - x.shape[axis]
    if extra == 0:
        return x
    widths = [(0, 0)] * x.ndim
    widths[axis] = (0, extra)
    return jnp.pad(x, widths)


def default_block_q(n_q: int, *, interpret: bool) -> int:
    """Smallest power of two covering n_q, within [16 on GPU | 1 interpreted, 64 | 128]."""
    low, high = (1, 128) if interpret else (16, 64)
    return min(high, max(low, 1 << max(n_q - 1, 0).bit_length()))


def default_block_k(*, interpret: bool) -> int:
    return 128 if interpret else 64  # interpreted runs want the fewest grid steps


def auto_k_splits(programs: int, key_blocks: int, *, interpret: bool) -> int:
    """Split the key loop when the other grid axes leave the GPU idle (flash-decoding).

    ~256 programs fill an H100's 132 SMs twice; interpreted runs want the fewest grid steps.
    """
    if interpret:
        return 1
    return max(1, min(key_blocks, math.ceil(256 / max(programs, 1))))


def triton_params(num_warps: int, num_stages: int):
    from jax.experimental.pallas import triton as plgpu
    return plgpu.CompilerParams(num_warps=num_warps, num_stages=num_stages)


# ----------------------------------------------------------------------------- tile math


def dot_nt(a: jax.Array, b: jax.Array) -> jax.Array:
    """a[x, d] @ b[y, d].T in fp32; fp32 inputs stay fp32 (no TF32) so tests can hold 1e-5."""
    precision = lax.Precision.HIGHEST if a.dtype == jnp.float32 else None
    return lax.dot_general(a, b, (((1,), (1,)), ((), ())),
                           preferred_element_type=jnp.float32, precision=precision)


def dot_nn(p: jax.Array, v: jax.Array) -> jax.Array:
    """p[x, y] @ v[y, d] in fp32, p cast to v's dtype as flash attention does."""
    precision = lax.Precision.HIGHEST if v.dtype == jnp.float32 else None
    return lax.dot_general(p.astype(v.dtype), v, (((1,), (0,)), ((), ())),
                           preferred_element_type=jnp.float32, precision=precision)


def online_softmax_step(m_prev, l_prev, scores, valid, *, exp=jnp.exp):
    """Fold one tile of scores [..., rows, keys] into the running row max and row sum.

    Returns (m_next, l_next, correction, p): multiply earlier accumulators by
    `correction`; `p` are this tile's unnormalised weights, exactly 0 where not valid.
    valid None: every score is (no masking work); exp: jnp.exp2 for base-2 scores.
    """
    if valid is not None:
        scores = jnp.where(valid, scores, MASK_VALUE)
    m_next = jnp.maximum(m_prev, scores.max(axis=-1))
    correction = exp(m_prev - m_next)
    p = exp(scores - m_next[..., None])
    if valid is not None:
        p = jnp.where(valid, p, 0.0)
    l_next = correction * l_prev + p.sum(axis=-1)
    return m_next, l_next, correction, p


def causal_valid(row_ids, col_ids, q_len):
    """Computed token i sees computed tokens 0..i; padded tokens see and are seen by none."""
    return ((col_ids[None, :] <= row_ids[:, None]) & (col_ids[None, :] < q_len)
            & (row_ids[:, None] < q_len))


def log_sum_exp(m, l):
    """Row log-sum-exp from running max and sum; finite even for rows with no valid key."""
    return m + jnp.log(jnp.maximum(l, jnp.finfo(jnp.float32).tiny))


def merge_splits(m, l, o=None):
    """Merge per-split (max, sum[, normalised output]) along axis 0 by log-sum-exp."""
    m_all = m.max(axis=0)
    weight = l * jnp.exp(m - m_all[None])
    l_all = weight.sum(axis=0)
    if o is None:
        return m_all, l_all
    safe_l = jnp.where(l_all > 0, l_all, 1.0)  # rows with no valid key give 0, not NaN
    out = (o * weight[..., None]).sum(axis=0) / safe_l[..., None]
    return m_all, l_all, out


def column_sums(q_ref, lse_ref, keys, col_valid, any_valid, q_len, *, scale, block_q):
    """Sum over valid query rows of softmax weights exp(q.k * scale - lse) for one key tile.

    Loops over query tiles so only a [block_q, block_k] tile is ever live; a tile with no
    valid column (`any_valid` false, i.e. padding) skips the loop.
    """
    num_q_blocks = jnp.where(any_valid, pl.cdiv(q_len, block_q), 0)

    def body(b, acc):
        rows = pl.ds(b * block_q, block_q)
        scores = dot_nt(q_ref[rows, :], keys) * scale
        row_valid = b * block_q + jnp.arange(block_q) < q_len
        weights = jnp.exp(scores - lse_ref[rows][:, None])
        weights = jnp.where(row_valid[:, None] & col_valid[None, :], weights, 0.0)
        return acc + weights.sum(axis=0)

    init = jnp.zeros((keys.shape[0],), jnp.float32)
    return lax.fori_loop(0, num_q_blocks, body, init)


def pallas_tiling(n_q: int, n_keys: int, rows: int, head_dim: int, block_q, block_k, k_splits, *,
                  interpret: bool) -> tuple[int, int, int]:
    """(block_q, block_k, k_splits) for a kernel with `rows` heads of n_q queries over n_keys keys:
    defaults filled in, every value checked, and the key loop split only as far as there are key blocks."""
    block_q = default_block_q(n_q, interpret=interpret) if block_q is None else block_q
    block_k = default_block_k(interpret=interpret) if block_k is None else block_k
    check_block_size("block_q", block_q, interpret=interpret)
    check_block_size("block_k", block_k, interpret=interpret)
    check_head_dim(head_dim, interpret=interpret)
    q_blocks, k_blocks = -(-n_q // block_q), max(1, -(-n_keys // block_k))
    if k_splits is None:
        k_splits = auto_k_splits(rows * q_blocks, k_blocks, interpret=interpret)
    if not isinstance(k_splits, int) or k_splits < 1:
        raise ValueError(f"k_splits={k_splits!r} must be a positive int.")
    return block_q, block_k, min(k_splits, k_blocks)
