"""Where token positions of a stored prefix live in the store: the chunk and the row inside it, per position."""

from __future__ import annotations

import dataclasses
import functools

import numpy as np

from specjax.idsets import distinct


@dataclasses.dataclass(frozen=True)
class Locations:
    """Where requested token positions live: chunk id and slot offset inside it, per position."""
    chunks: np.ndarray
    offsets: np.ndarray

    @functools.cached_property
    def chunk_index(self) -> tuple[np.ndarray, np.ndarray]:
        """(the distinct chunks, sorted; each position's index among them), computed once per Locations."""
        return distinct(self.chunks, return_inverse=True)

    def unique_chunks(self) -> np.ndarray:
        return self.chunk_index[0]

    @classmethod
    def whole(cls, chunks, chunk_tokens: int) -> "Locations":
        """Every row of each of `chunks`, in order (a chunk's padding rows too): what a take of their key ranges
        reads (`K_RANGE`)."""
        chunks = np.asarray(chunks)
        return cls(np.repeat(chunks, chunk_tokens), np.tile(np.arange(chunk_tokens), len(chunks)))
