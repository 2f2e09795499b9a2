"""Model configuration: one frozen dataclass for OPT, Llama and Qwen2, built from a Hugging Face config.json."""

from __future__ import annotations

import dataclasses
import json
import pathlib
from typing import Any

from specjax.errors import SpecjaxError

ARCHS = ("opt", "llama", "qwen2")


@dataclasses.dataclass(frozen=True)
class ModelConfig:
    """Static shape and behaviour of a decoder-only transformer (hashable: usable as a jit static arg)."""

    arch: str  # "opt" | "llama" | "qwen2"
    vocab_size: int
    hidden_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    intermediate_size: int
    max_positions: int
    norm_eps: float = 1e-5
    activation: str = "silu"  # "relu" (OPT), "gelu", "silu" (Llama/Qwen2 SwiGLU)
    tie_embeddings: bool = False
    # Llama / Qwen2
    rope_theta: float = 10000.0
    qkv_bias: bool = False  # Qwen2
    # OPT
    pre_layer_norm: bool = True  # OPT's do_layer_norm_before (False for opt-350m)
    word_embed_proj_dim: int = 0  # != hidden_size -> project_in / project_out (opt-350m)
    final_layer_norm: bool = True
    bos_token_id: int | None = None
    eos_token_id: int | None = None

    @property
    def embed_dim(self) -> int:
        """Width of the token embedding table (OPT may embed narrower than hidden_size)."""
        return self.word_embed_proj_dim or self.hidden_size

    @property
    def has_projections(self) -> bool:
        return self.arch == "opt" and self.embed_dim != self.hidden_size

    @property
    def q_per_kv(self) -> int:
        return self.num_heads // self.num_kv_heads

    @property
    def uses_rope(self) -> bool:
        return self.arch in ("llama", "qwen2")

    def kv_bytes_per_token(self, dtype_bytes: int = 2) -> int:
        """Bytes of K and V for one token over all layers (what the prefix store holds)."""
        return 2 * self.num_layers * self.num_kv_heads * self.head_dim * dtype_bytes

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> "ModelConfig":
        fields = {f.name for f in dataclasses.fields(cls)}
        unknown = set(d) - fields
        if unknown:
            raise SpecjaxError(f"unknown model config fields {sorted(unknown)}")
        return cls(**d)


def _first_id(value) -> int | None:
    if isinstance(value, list):
        return value[0] if value else None
    return value


def from_hf_config(hf: dict[str, Any]) -> ModelConfig:
    """Translate a Hugging Face config.json dict (OPT, Llama, Qwen2) into a ModelConfig."""
    model_type = hf.get("model_type")
    if model_type == "opt":
        return _opt_config(hf)
    if model_type in ("llama", "qwen2"):
        return _llama_config(hf, model_type)
    raise SpecjaxError(
        f"unsupported model_type {model_type!r} in config.json; specjax supports {', '.join(ARCHS)}"
    )


def _opt_config(hf: dict[str, Any]) -> ModelConfig:
    hidden = hf["hidden_size"]
    heads = hf["num_attention_heads"]
    pre_ln = hf.get("do_layer_norm_before", True)
    activation = hf.get("activation_function", "relu")
    if activation not in ("relu", "gelu", "gelu_new"):
        raise SpecjaxError(f"OPT activation_function {activation!r} is not supported (relu, gelu)")
    return ModelConfig(
        arch="opt",
        vocab_size=hf["vocab_size"],
        hidden_size=hidden,
        num_layers=hf["num_hidden_layers"],
        num_heads=heads,
        num_kv_heads=heads,
        head_dim=hidden // heads,
        intermediate_size=hf["ffn_dim"],
        max_positions=hf["max_position_embeddings"],
        norm_eps=1e-5,
        activation="gelu" if activation.startswith("gelu") else "relu",
        tie_embeddings=hf.get("tie_word_embeddings", True),
        pre_layer_norm=pre_ln,
        word_embed_proj_dim=hf.get("word_embed_proj_dim") or hidden,
        # transformers builds the decoder's final norm only for pre-LN models.
        final_layer_norm=pre_ln and not hf.get("_remove_final_layer_norm", False),
        bos_token_id=_first_id(hf.get("bos_token_id")),
        eos_token_id=_first_id(hf.get("eos_token_id")),
    )


def _llama_config(hf: dict[str, Any], model_type: str) -> ModelConfig:
    rope = hf.get("rope_scaling") or hf.get("rope_parameters") or {}  # older / newer transformers
    if rope.get("rope_type", rope.get("type", "default")) != "default":
        raise SpecjaxError(f"RoPE scaling {rope!r} is not supported yet; only plain RoPE (rope_theta) is implemented")
    if model_type == "llama" and (hf.get("attention_bias") or hf.get("mlp_bias")):
        raise SpecjaxError("Llama checkpoints with attention_bias or mlp_bias are not supported")
    if hf.get("use_sliding_window"):
        raise SpecjaxError("sliding-window attention (use_sliding_window=true) is not supported")
    hidden = hf["hidden_size"]
    heads = hf["num_attention_heads"]
    act = hf.get("hidden_act", "silu")
    if act != "silu":
        raise SpecjaxError(f"hidden_act {act!r} is not supported for {model_type} (only silu)")
    rope_theta = hf.get("rope_theta", (hf.get("rope_parameters") or {}).get("rope_theta", 10000.0))
    return ModelConfig(
        arch=model_type,
        vocab_size=hf["vocab_size"],
        hidden_size=hidden,
        num_layers=hf["num_hidden_layers"],
        num_heads=heads,
        num_kv_heads=hf.get("num_key_value_heads") or heads,
        head_dim=hf.get("head_dim") or hidden // heads,
        intermediate_size=hf["intermediate_size"],
        max_positions=hf.get("max_position_embeddings", 4096),
        norm_eps=hf.get("rms_norm_eps", 1e-6),
        activation="silu",
        tie_embeddings=hf.get("tie_word_embeddings", False),
        rope_theta=float(rope_theta),
        qkv_bias=model_type == "qwen2",
        bos_token_id=_first_id(hf.get("bos_token_id")),
        eos_token_id=_first_id(hf.get("eos_token_id")),
    )


def save_config(cfg: ModelConfig, path: pathlib.Path) -> None:
    path.write_text(json.dumps(cfg.to_dict(), indent=2) + "\n")


def load_config(path: pathlib.Path) -> ModelConfig:
    try:
        return ModelConfig.from_dict(json.loads(path.read_text()))
    except (OSError, json.JSONDecodeError, TypeError) as e:
        raise SpecjaxError(f"cannot read model config {path}: {e}") from e
