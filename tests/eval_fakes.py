"""A small deterministic stand-in for specjax.load_model's model, for eval tests that need no weights."""

from __future__ import annotations

import dataclasses
import re
import time

import numpy as np

from specjax.eval.systems import Outcome
from specjax.models.inference import log_softmax


@dataclasses.dataclass(frozen=True)
class FakeConfig:
    arch: str = "llama"
    num_layers: int = 2
    num_heads: int = 2
    num_kv_heads: int = 1
    head_dim: int = 8
    hidden_size: int = 16
    vocab_size: int = 512
    max_positions: int = 100_000

    def kv_bytes_per_token(self, dtype_bytes: int = 2) -> int:
        return 2 * self.num_layers * self.num_kv_heads * self.head_dim * dtype_bytes


class FakeTokenizer:
    """Word-level: each word / punctuation / whitespace run (with a leading space) is one id."""

    bos_id = 1
    eos_id = 2

    def __init__(self, vocab_size: int = 512):
        self.vocab_size = vocab_size
        self.pieces: dict[str, int] = {}
        self.inverse: dict[int, str] = {}

    def encode(self, text: str) -> list[int]:
        ids = []
        for piece in re.findall(r" ?\w+| ?[^\w\s]|\s+", text):
            if piece not in self.pieces:
                i = 3 + len(self.pieces) % (self.vocab_size - 3)
                self.pieces[piece] = i
                self.inverse.setdefault(i, piece)
            ids.append(self.pieces[piece])
        return ids

    def decode(self, ids) -> str:
        return "".join(self.inverse.get(int(i), "?") for i in ids)


class FakeModel:
    """Logits that copy: the token that followed the last earlier occurrence of the current token
    gets a high score (an induction head), so needle and few-shot copying work."""

    def __init__(self, name: str = "fake", weights: str = "random"):
        self.name = name
        self.weights = weights
        self.config = FakeConfig()
        self.dtype = np.dtype(np.float32)
        self.tokenizer = FakeTokenizer(self.config.vocab_size)
        self.calls = 0

    def logits(self, ids) -> np.ndarray:
        self.calls += 1
        ids = [int(i) for i in ids]
        out = np.zeros((len(ids), self.config.vocab_size), np.float32)
        last_seen: dict[int, int] = {}
        for t, tok in enumerate(ids):
            out[t, (tok * 7 + 3) % self.config.vocab_size] += 1.0
            if tok in last_seen and last_seen[tok] + 1 < len(ids):
                out[t, ids[last_seen[tok] + 1]] += 5.0
            last_seen[tok] = t
        return out

    def loglikelihood(self, context_ids, continuation_ids) -> tuple[float, bool]:
        ids = list(context_ids) + list(continuation_ids)
        logits = self.logits(ids).astype(np.float64)
        total, greedy = 0.0, True
        for k, tok in enumerate(continuation_ids):
            row = logits[len(context_ids) - 1 + k]
            lse = row.max() + np.log(np.exp(row - row.max()).sum())
            total += row[tok] - lse
            greedy &= int(np.argmax(row)) == tok
        return float(total), bool(greedy)

    def generate(self, prompt: str, max_new_tokens: int) -> str:
        return ""


class PlainRecompute:
    """A recompute system on a model's plain `logits` (eval.systems' interface without the engine): the base of the
    fake systems the eval tests plug in (`registry.PLUGINS`)."""

    name = "recompute"
    needs_store = False

    def __init__(self, model, settings):
        self.model = model
        self.settings = settings

    def populate(self, store_path, prefixes):
        raise AssertionError("recompute does not use a store")

    def open(self, store_path):
        pass

    def warm(self, requests):
        for r in requests:
            self.model.logits(list(r.context_ids))

    def run(self, request) -> Outcome:
        context = list(request.context_ids)
        start = time.perf_counter()
        last = np.asarray(self.model.logits(context)[-1])
        ttft_ms = (time.perf_counter() - start) * 1e3
        first = log_softmax(last)
        logprobs, greedy = [], []
        for choice in request.choice_ids:
            if len(choice) == 1:  # one-token continuations come from the prefill itself
                logprobs.append(float(first[choice[0]]))
                greedy.append(bool(int(np.argmax(first)) == choice[0]))
            else:
                ll, is_greedy = self.model.loglikelihood(context, list(choice))
                logprobs.append(float(ll))
                greedy.append(bool(is_greedy))
        breakdown = {"probe_io": 0.0, "identify": 0.0, "kv_io_stall": 0.0, "compute": ttft_ms}
        return Outcome(logprobs, greedy, ttft_ms, breakdown, {"prefix_tokens": len(request.prefix_ids)})

    def close(self):
        pass
