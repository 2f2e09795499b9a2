"""Tokenizers behind one interface: a Hugging Face tokenizer.json, or a byte-level BPE vocabulary
rebuilt from a GGUF file (or from GPT-2 style vocab.json + merges.txt) as a tokenizer.json."""

from __future__ import annotations

import json
import pathlib

import tokenizers
from tokenizers import AddedToken, decoders, models, pre_tokenizers

from specjax.errors import SpecjaxError

# llama.cpp's pre-tokenizer names (tokenizer.ggml.pre) -> the split regex its merges were learned with.
_GPT2_SPLIT = r"'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+"
_LLAMA3_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_CONTROL = 3  # llama.cpp token type of special tokens such as <|endoftext|>


class Tokenizer:
    """encode(text) -> ids without special tokens; decode(ids) -> text; bos_id / eos_id."""

    def __init__(self, tok: tokenizers.Tokenizer, bos_id: int | None, eos_id: int | None):
        self._tok = tok
        self.bos_id = bos_id
        self.eos_id = eos_id

    @classmethod
    def from_file(cls, path: pathlib.Path, bos_id: int | None, eos_id: int | None) -> "Tokenizer":
        try:
            tok = tokenizers.Tokenizer.from_file(str(path))
        except Exception as e:
            raise SpecjaxError(f"cannot read tokenizer {path}: {e}") from e
        return cls(tok, bos_id, eos_id)

    @property
    def vocab_size(self) -> int:
        return self._tok.get_vocab_size(with_added_tokens=True)

    def encode(self, text: str) -> list[int]:
        return self._tok.encode(text, add_special_tokens=False).ids

    def decode(self, ids) -> str:
        return self._tok.decode([int(i) for i in ids], skip_special_tokens=False)


def _byte_level_bpe(vocab: dict[str, int], merges: list[tuple[str, str]], split_regex: str, digits: bool):
    tok = tokenizers.Tokenizer(models.BPE(vocab=vocab, merges=merges, fuse_unk=False))
    steps = [pre_tokenizers.Digits(individual_digits=True)] if digits else []
    steps += [
        pre_tokenizers.Split(tokenizers.Regex(split_regex), behavior="isolated"),
        pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
    ]
    tok.pre_tokenizer = pre_tokenizers.Sequence(steps)
    tok.decoder = decoders.ByteLevel()
    return tok


def tokenizer_json_from_gguf(fields: dict) -> str:
    """tokenizer.json text for a GGUF's embedded byte-level BPE vocabulary.

    `fields` maps GGUF keys (tokenizer.ggml.*) to decoded values. SmolLM2 ("smollm") splits digits
    one by one before the GPT-2 pattern, as its original tokenizer.json and llama.cpp do.
    """
    kind = fields.get("tokenizer.ggml.model")
    if kind != "gpt2":
        raise SpecjaxError(
            f"GGUF tokenizer model {kind!r} is not supported (only byte-level BPE, 'gpt2'); "
            "pass the model's tokenizer.json with --tokenizer FILE"
        )
    pre = fields.get("tokenizer.ggml.pre", "default")
    if pre in ("llama3", "llama-v3", "llama-bpe", "smaug-bpe", "dbrx"):
        split, digits = _LLAMA3_SPLIT, False
    elif pre in ("smollm", "starcoder", "refact"):
        split, digits = _GPT2_SPLIT, True
    elif pre in ("default", "gpt2", "gpt-2"):
        split, digits = _GPT2_SPLIT, False
    else:
        raise SpecjaxError(
            f"GGUF pre-tokenizer {pre!r} is not supported; pass the model's tokenizer.json with --tokenizer FILE"
        )
    tokens = fields["tokenizer.ggml.tokens"]
    merges = [tuple(m.split(" ", 1)) for m in fields["tokenizer.ggml.merges"]]
    tok = _byte_level_bpe({t: i for i, t in enumerate(tokens)}, merges, split, digits)
    types = fields.get("tokenizer.ggml.token_type") or []
    specials = [AddedToken(t, special=True, normalized=False) for t, ty in zip(tokens, types) if ty == _CONTROL]
    tok.add_special_tokens(specials)
    return tok.to_str()


def tokenizer_json_from_hf_dir(hf_dir: pathlib.Path) -> str | None:
    """tokenizer.json text of a Hugging Face checkpoint directory, or None when it has no tokenizer."""
    if (hf_dir / "tokenizer.json").is_file():
        return (hf_dir / "tokenizer.json").read_text()
    vocab_file, merges_file = hf_dir / "vocab.json", hf_dir / "merges.txt"
    if vocab_file.is_file() and merges_file.is_file():  # GPT-2 style (OPT) without a fast tokenizer file
        vocab = json.loads(vocab_file.read_text())
        lines = [l for l in merges_file.read_text().splitlines() if l and not l.startswith("#version")]
        tok = _byte_level_bpe(vocab, [tuple(l.split(" ", 1)) for l in lines], _GPT2_SPLIT, digits=False)
        return tok.to_str()
    return None
