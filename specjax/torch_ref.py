"""The same weights as a Hugging Face transformers (PyTorch) model: a specjax config and params mapped back to a
transformers config and state dict, the inverse of `specjax.config.from_hf_config` and `specjax.convert.hf_params`
(OPT, Llama, Qwen2). `python benchmarks/prefill.py --against transformers` times it beside specjax; torch and
transformers are imported only when a model is built.
"""

from __future__ import annotations

import contextlib
import importlib

import jax
import numpy as np

from specjax.config import ModelConfig
from specjax.errors import SpecjaxError
from specjax.models.params import Params


def require_torch():
    """(torch, transformers), or a SpecjaxError saying how to install them."""
    try:
        import torch
        import transformers
    except ImportError as e:
        raise SpecjaxError(f"comparing with transformers needs torch and transformers installed ({e}); "
                           "pip install torch transformers (or the project's [test] extra)") from e
    return torch, transformers


def hf_config(cfg: ModelConfig) -> dict:
    """A transformers config dict with the shape and behaviour of `cfg` (from_hf_config of it gives `cfg` back)."""
    common = {
        "vocab_size": cfg.vocab_size, "hidden_size": cfg.hidden_size, "num_hidden_layers": cfg.num_layers,
        "num_attention_heads": cfg.num_heads, "max_position_embeddings": cfg.max_positions,
        "tie_word_embeddings": cfg.tie_embeddings, "bos_token_id": cfg.bos_token_id, "eos_token_id": cfg.eos_token_id,
    }
    if cfg.arch == "opt":
        return common | {
            "model_type": "opt", "ffn_dim": cfg.intermediate_size, "word_embed_proj_dim": cfg.embed_dim,
            "do_layer_norm_before": cfg.pre_layer_norm, "activation_function": cfg.activation,
            "_remove_final_layer_norm": cfg.pre_layer_norm and not cfg.final_layer_norm,
        }
    if cfg.arch not in ("llama", "qwen2"):
        raise SpecjaxError(f"no transformers equivalent for architecture {cfg.arch!r}")
    return common | {
        "model_type": cfg.arch, "num_key_value_heads": cfg.num_kv_heads, "head_dim": cfg.head_dim,
        "intermediate_size": cfg.intermediate_size, "rms_norm_eps": cfg.norm_eps, "hidden_act": cfg.activation,
        "rope_theta": cfg.rope_theta, "rope_parameters": {"rope_type": "default", "rope_theta": cfg.rope_theta},
    }


def hf_tensors(cfg: ModelConfig, params: Params) -> dict[str, np.ndarray]:
    """float32 tensors in PyTorch layout by Hugging Face name without 'model.' (the names hf_params reads)."""
    p32 = jax.tree.map(lambda x: np.asarray(x, np.float32), params)
    D = cfg.hidden_size
    opt = cfg.arch == "opt"
    if opt:
        t = {"decoder.embed_tokens.weight": p32["embed"], "decoder.embed_positions.weight": p32["pos_embed"]}
        if cfg.has_projections:
            t["decoder.project_in.weight"] = p32["project_in"].T
            t["decoder.project_out.weight"] = p32["project_out"].T
        if cfg.final_layer_norm:
            t["decoder.final_layer_norm.weight"] = p32["final_norm"]
            t["decoder.final_layer_norm.bias"] = p32["final_norm_bias"]
        prefix = "decoder.layers"
    else:
        t = {"embed_tokens.weight": p32["embed"], "norm.weight": p32["final_norm"]}
        prefix = "layers"
    t["lm_head.weight"] = p32["embed"] if cfg.tie_embeddings else p32["lm_head"].T
    for i, lp in enumerate(p32["layers"]):
        p, a = f"{prefix}.{i}", f"{prefix}.{i}.self_attn"
        if opt:
            t |= {
                f"{p}.self_attn_layer_norm.weight": lp["attn_norm"], f"{p}.self_attn_layer_norm.bias": lp["attn_norm_bias"],
                f"{p}.final_layer_norm.weight": lp["mlp_norm"], f"{p}.final_layer_norm.bias": lp["mlp_norm_bias"],
                f"{p}.fc1.weight": lp["w_up"].T, f"{p}.fc1.bias": lp["b_up"],
                f"{p}.fc2.weight": lp["w_down"].T, f"{p}.fc2.bias": lp["b_down"],
                f"{a}.out_proj.bias": lp["bo"],
            }
        else:
            t |= {
                f"{p}.input_layernorm.weight": lp["attn_norm"], f"{p}.post_attention_layernorm.weight": lp["mlp_norm"],
                f"{p}.mlp.gate_proj.weight": lp["w_gate"].T, f"{p}.mlp.up_proj.weight": lp["w_up"].T,
                f"{p}.mlp.down_proj.weight": lp["w_down"].T,
            }
        for name in "qkv":  # [D, heads, head_dim] -> [heads*head_dim, D]
            t[f"{a}.{name}_proj.weight"] = lp[f"w{name}"].reshape(D, -1).T
            if f"b{name}" in lp:
                t[f"{a}.{name}_proj.bias"] = lp[f"b{name}"].reshape(-1)
        t[f"{a}.{'out_proj' if opt else 'o_proj'}.weight"] = lp["wo"].reshape(-1, D).T  # [H, d, D] -> [D, H*d]
    return {k: np.array(v, np.float32, order="C") for k, v in t.items()}  # own, writable copies for torch


def _no_init(transformers):
    """transformers' context that skips weight initialisation (its module moved between versions), or none."""
    for where in ("transformers.initialization", "transformers.modeling_utils"):
        try:
            return getattr(importlib.import_module(where), "no_init_weights")()
        except (ImportError, AttributeError):
            continue
    return contextlib.nullcontext()


def transformers_model(cfg: ModelConfig, params: Params, dtype: str = "float32", attn_implementation: str = "sdpa"):
    """A transformers causal LM (eval mode, on the CPU) computing with exactly these weights, cast to `dtype`."""
    torch, transformers = require_torch()
    hf_cfg = hf_config(cfg)
    config = transformers.AutoConfig.for_model(hf_cfg.pop("model_type"), **hf_cfg)
    with _no_init(transformers):  # every weight is loaded below: skip the random init (slow for a large model on a CPU)
        model = transformers.AutoModelForCausalLM.from_config(config, attn_implementation=attn_implementation,
                                                              dtype=torch.float32)
    state = {(k if k == "lm_head.weight" else f"model.{k}"): torch.from_numpy(v) for k, v in hf_tensors(cfg, params).items()}
    model.load_state_dict(state, strict=True)  # every tensor named, every shape checked
    return model.to(getattr(torch, dtype)).eval()
