"""A stand-in tokenizer for models without one (random weights of a registered shape).

Only token counts and reuse patterns matter for timing runs with random weights, so words
and punctuation are hashed to ids: lengths are close to a BPE tokenizer's on English text.
"""

from __future__ import annotations

import re
import zlib

_PIECES = re.compile(r" ?[A-Za-z]+| ?[0-9]| ?[^\sA-Za-z0-9]+|\s+")


class HashWordTokenizer:
    name = "hash-word (fallback: the model has no tokenizer)"

    def __init__(self, vocab_size: int, bos_id: int | None = None, eos_id: int | None = None):
        self.vocab_size = vocab_size
        self.bos_id = bos_id
        self.eos_id = eos_id
        self._text: dict[int, str] = {}

    def encode(self, text: str) -> list[int]:
        ids = []
        for piece in _PIECES.findall(text):
            i = 4 + zlib.crc32(piece.encode("utf-8")) % max(1, self.vocab_size - 4)
            self._text.setdefault(i, piece)
            ids.append(i)
        return ids

    def decode(self, ids) -> str:
        return "".join(self._text.get(int(i), "<?>") for i in ids)


def tokenizer_for(model):
    """The model's tokenizer, or the hash-word stand-in when it has none; (tokenizer, description)."""
    try:
        return model.tokenizer, "model"
    except Exception:  # specjax raises SpecjaxError for random weights; any model without one falls back
        cfg = model.config
        tok = HashWordTokenizer(cfg.vocab_size, getattr(cfg, "bos_token_id", None), getattr(cfg, "eos_token_id", None))
        return tok, tok.name
