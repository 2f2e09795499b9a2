"""Which prefix tokens gathered attention reads: one shared set, one set per head, or chunks.

Each selection is a small pytree over the token axis M of the prefix arrays (which may be
a device cache pool); the kernels see all three as token-index rows plus valid counts.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np

from specjax.kernels.common import concrete_value


@dataclasses.dataclass(frozen=True)
class SharedIndices:
    """One token-index set for every head (SPEC when the probe heads agree).

    idx: int[k] token positions; only the first `count` entries are used (None: all k).
    """

    idx: jax.Array
    count: jax.Array | int | None = None

    def token_indices(self, num_heads: int):
        """(idx int32[1, k], count int32[1]); one row serves every head."""
        idx = jnp.asarray(self.idx, jnp.int32)[None, :]
        return idx, _counts(self.count, idx.shape[1], rows=1)

    def check(self, num_heads: int, num_tokens: int, check_indices: bool = True) -> None:
        if jnp.ndim(self.idx) != 1:
            raise ValueError(f"SharedIndices.idx must be [k], got shape {jnp.shape(self.idx)}.")
        _check_rows("SharedIndices", self.idx, self.count, num_tokens, "token", check_indices)


@dataclasses.dataclass(frozen=True)
class PerHeadIndices:
    """A token-index set per query head (the fallback when probe heads disagree).

    idx: int[H, k]; the first `count` entries of each row are used (count: scalar or [H]).
    """

    idx: jax.Array
    count: jax.Array | int | None = None

    def token_indices(self, num_heads: int):
        idx = jnp.asarray(self.idx, jnp.int32)
        return idx, _counts(self.count, idx.shape[1], rows=idx.shape[0])

    def check(self, num_heads: int, num_tokens: int, check_indices: bool = True) -> None:
        if jnp.ndim(self.idx) != 2 or jnp.shape(self.idx)[0] != num_heads:
            raise ValueError(f"PerHeadIndices.idx must be [H={num_heads}, k], "
                             f"got shape {jnp.shape(self.idx)}.")
        _check_rows("PerHeadIndices", self.idx, self.count, num_tokens, "token", check_indices)


@dataclasses.dataclass(frozen=True)
class BlockTable:
    """Whole chunks of `chunk_tokens` tokens shared by all heads (ContiguousKV, SPEC's store).

    blocks: int[n] chunk numbers; chunk b holds tokens [b * chunk_tokens, (b+1) * chunk_tokens)
    of the prefix arrays. The first `count` blocks are used (None: all n).
    """

    blocks: jax.Array
    count: jax.Array | int | None = None
    chunk_tokens: int = 64

    def token_indices(self, num_heads: int):
        """Chunks expanded to token positions, in table order: idx[1, n * chunk_tokens]."""
        blocks = jnp.asarray(self.blocks, jnp.int32)
        offsets = jnp.arange(self.chunk_tokens, dtype=jnp.int32)
        idx = (blocks[:, None] * self.chunk_tokens + offsets[None, :]).reshape(1, -1)
        return idx, _counts(self.count, blocks.shape[0], rows=1) * self.chunk_tokens

    def check(self, num_heads: int, num_tokens: int, check_indices: bool = True) -> None:
        if not isinstance(self.chunk_tokens, int) or self.chunk_tokens < 1:
            raise ValueError(f"BlockTable.chunk_tokens={self.chunk_tokens!r} must be a "
                             "positive int (16 for ContiguousKV, 64 for SPEC).")
        if num_tokens % self.chunk_tokens:
            raise ValueError(f"the prefix arrays hold {num_tokens} tokens, not a multiple of "
                             f"BlockTable.chunk_tokens={self.chunk_tokens}.")
        if jnp.ndim(self.blocks) != 1:
            raise ValueError(f"BlockTable.blocks must be [n], got shape {jnp.shape(self.blocks)}.")
        _check_rows("BlockTable", self.blocks, self.count, num_tokens // self.chunk_tokens,
                    "chunk", check_indices)


Selection = SharedIndices | PerHeadIndices | BlockTable

for _cls in (SharedIndices, PerHeadIndices):
    jax.tree_util.register_dataclass(_cls, data_fields=["idx", "count"], meta_fields=[])
jax.tree_util.register_dataclass(BlockTable, data_fields=["blocks", "count"],
                                 meta_fields=["chunk_tokens"])


def _counts(count, capacity: int, *, rows: int) -> jax.Array:
    """Valid entries per row as int32[rows], clipped so padding can never be read as valid."""
    if count is None:
        return jnp.full((rows,), capacity, jnp.int32)
    count = jnp.clip(jnp.asarray(count, jnp.int32), 0, capacity)
    return jnp.broadcast_to(count, (rows,))


def _check_rows(name, idx, count, upper, unit, check_indices) -> None:
    """Range and uniqueness of the valid entries, when they are concrete (not traced).

    Pulling indices to the host syncs with the device: hot paths pass check_indices=False.
    """
    capacity = jnp.shape(idx)[-1]
    counts = concrete_value(count)
    if counts is not None:
        if counts.ndim > 1 or (counts.ndim == 1 and counts.shape[0] != jnp.shape(idx)[0]) \
                or np.any(counts < 0) or np.any(counts > capacity):
            raise ValueError(f"{name}.count={counts.tolist()} must be a scalar (or one per "
                             f"row) in [0, {capacity}].")
    if not check_indices:
        return
    values = concrete_value(idx)
    if values is None:
        return
    values = np.atleast_2d(values)
    counts = np.broadcast_to(capacity if counts is None else counts, (values.shape[0],))
    for row, (entries, n) in enumerate(zip(values, counts)):
        _check_row(name, row, entries[: int(n)], upper, unit)


def _check_row(name, row, entries, upper, unit) -> None:
    bad = entries[(entries < 0) | (entries >= upper)]
    if bad.size:
        raise ValueError(f"{name}: {unit} index {int(bad[0])} (row {row}) is out of range "
                         f"[0, {upper}); the prefix arrays hold {upper} {unit}s.")
    unique, seen = np.unique(entries, return_counts=True)
    if np.any(seen > 1):
        raise ValueError(f"{name}: {unit} index {int(unique[seen > 1][0])} appears more than "
                         f"once (row {row}); a {unit} may be selected once, or its weight "
                         "would be counted twice.")
