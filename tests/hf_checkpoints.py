"""Tiny random OPT / Llama / Qwen2 checkpoints written by transformers, for tests that convert and compare them.

Import after `pytest.importorskip("torch")` and `("transformers")`: this module needs both.
"""

import torch
import transformers

VOCAB = 96


def _opt_pre_ln():
    return transformers.OPTConfig(
        vocab_size=VOCAB, hidden_size=32, num_hidden_layers=2, ffn_dim=64, num_attention_heads=4,
        max_position_embeddings=64, word_embed_proj_dim=32, do_layer_norm_before=True,
    )


def _opt_post_ln_proj():
    # As opt-350m: post-LN and a narrower embedding with project_in / project_out.
    return transformers.OPTConfig(
        vocab_size=VOCAB, hidden_size=32, num_hidden_layers=2, ffn_dim=64, num_attention_heads=4,
        max_position_embeddings=64, word_embed_proj_dim=16, do_layer_norm_before=False,
    )


def _llama_gqa():
    return transformers.LlamaConfig(
        vocab_size=VOCAB, hidden_size=32, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
        intermediate_size=48, rope_theta=500.0, max_position_embeddings=64, tie_word_embeddings=False,
    )


def _llama_tied():
    return transformers.LlamaConfig(
        vocab_size=VOCAB, hidden_size=32, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=1,
        intermediate_size=48, max_position_embeddings=64, tie_word_embeddings=True,
    )


def _qwen2():
    return transformers.Qwen2Config(
        vocab_size=VOCAB, hidden_size=32, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
        intermediate_size=48, max_position_embeddings=64, tie_word_embeddings=False,
    )


CASES = {
    # name: (config factory, save_pretrained kwargs)
    "opt_pre_ln": (_opt_pre_ln, {}),
    "opt_post_ln_project": (_opt_post_ln_proj, {"bin": True}),  # pytorch_model.bin
    "llama_gqa_sharded": (_llama_gqa, {"max_shard_size": "20KB"}),  # model.safetensors.index.json
    "llama_tied": (_llama_tied, {}),
    "qwen2": (_qwen2, {}),
}


def _randomize(model, seed):
    """transformers inits biases and norms to 0/1; random values exercise every tensor's mapping."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if p.ndim == 1:
                base = 1.0 if "norm" in name else 0.0
                p.copy_(base + 0.1 * torch.randn(p.shape, generator=g))


def write_hf_checkpoint(name, hf_dir, dtype="float32", randomize=True, seed=0):
    """Write case `name` into hf_dir with its weights in `dtype`; returns the transformers model (in `dtype`).

    randomize=False keeps transformers' default init (zero biases, unit norms, weights of std 0.02). Another `seed`
    gives other weights of the same shapes (a fine-tuned model beside its base)."""
    factory, save_kwargs = CASES[name]
    torch.manual_seed(seed)
    hf_model = transformers.AutoModelForCausalLM.from_config(factory(), attn_implementation="eager").float().eval()
    if randomize:
        _randomize(hf_model, 1 + seed)
    hf_model = hf_model.to(getattr(torch, dtype))
    if save_kwargs.get("bin"):  # transformers 5 writes only safetensors; a .bin as older checkpoints have
        hf_model.config.save_pretrained(hf_dir)
        torch.save(hf_model.state_dict(), hf_dir / "pytorch_model.bin")
    else:
        hf_model.save_pretrained(hf_dir, **save_kwargs)
    return hf_model


def write_gguf(path, tensor_type="F16", vocab=16, hidden=32, ffn=64):
    """A one-layer llama GGUF with random weights of `tensor_type` (F16, BF16, F32 or a quantized type such as
    Q8_0) and float32 norms, as llama.cpp writes them; its vocabulary is a stub (conversion needs one)."""
    import gguf
    import ml_dtypes
    import numpy as np
    from gguf.quants import quantize

    kind = gguf.GGMLQuantizationType[tensor_type]
    rng = np.random.default_rng(0)
    w = gguf.GGUFWriter(str(path), "llama")
    w.add_block_count(1)
    w.add_embedding_length(hidden)
    w.add_head_count(2)
    w.add_feed_forward_length(ffn)
    w.add_context_length(64)
    w.add_layer_norm_rms_eps(1e-5)
    w.add_tokenizer_model("gpt2")
    w.add_token_list(["a", "b", "ab"] + [f"t{i}" for i in range(vocab - 3)])
    w.add_token_merges(["a b"])
    w.add_token_types([1] * vocab)

    def weight(name, rows, cols):
        x = (0.1 * rng.standard_normal((rows, cols))).astype(np.float32)
        floats = {"F16": np.float16, "F32": np.float32, "BF16": ml_dtypes.bfloat16}
        if tensor_type in floats:
            w.add_tensor(name, x.astype(floats[tensor_type]), raw_dtype=kind)
        else:
            w.add_tensor(name, quantize(x, kind), raw_dtype=kind)

    weight("token_embd.weight", vocab, hidden)
    weight("output.weight", vocab, hidden)
    w.add_tensor("output_norm.weight", np.ones(hidden, np.float32))
    for name in ("attn_norm", "ffn_norm"):
        w.add_tensor(f"blk.0.{name}.weight", np.ones(hidden, np.float32))
    for name in ("attn_q", "attn_k", "attn_v", "attn_output"):
        weight(f"blk.0.{name}.weight", hidden, hidden)
    weight("blk.0.ffn_gate.weight", ffn, hidden)
    weight("blk.0.ffn_up.weight", ffn, hidden)
    weight("blk.0.ffn_down.weight", hidden, ffn)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


def convert_two_llamas(root):
    """Two Llama checkpoints of one shape and (no) tokenizer but other weights, as a fine-tuned model beside its
    base, converted: ([hf dir, hf dir], [converted dir, converted dir])."""
    from specjax.convert import convert_hf_dir

    hf, converted = [], []
    for seed in (0, 1):
        hf.append(root / f"hf{seed}")
        hf[-1].mkdir()
        write_hf_checkpoint("llama_tied", hf[-1], seed=seed)
        converted.append(root / f"model{seed}")
        convert_hf_dir(hf[-1], converted[-1])
    return hf, converted
