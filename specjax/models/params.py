"""Parameters declared once per architecture: shape, logical axes and initializer of every tensor.

Random init, checkpoint conversion and checkpoint loading are all derived from `param_specs`,
so a shape mismatch anywhere is reported against the same names.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np

from specjax.config import ModelConfig
from specjax.errors import CheckpointError

Params = dict  # {"embed": ..., "layers": [ {...}, ... ], ...}; leaves are arrays


@dataclasses.dataclass(frozen=True)
class ParamSpec:
    shape: tuple[int, ...]
    axes: tuple[str, ...]  # logical axis names, for sharding tables
    init: str = "normal"  # "normal" | "ones" | "zeros"


def is_spec(x) -> bool:
    return isinstance(x, ParamSpec)


def _layer_specs(cfg: ModelConfig) -> dict[str, ParamSpec]:
    D, H, K, d, F = cfg.hidden_size, cfg.num_heads, cfg.num_kv_heads, cfg.head_dim, cfg.intermediate_size
    specs = {
        "attn_norm": ParamSpec((D,), ("embed",), "ones"),
        "wq": ParamSpec((D, H, d), ("embed", "q_heads", "head_dim")),
        "wk": ParamSpec((D, K, d), ("embed", "kv_heads", "head_dim")),
        "wv": ParamSpec((D, K, d), ("embed", "kv_heads", "head_dim")),
        "wo": ParamSpec((H, d, D), ("q_heads", "head_dim", "embed")),
        "mlp_norm": ParamSpec((D,), ("embed",), "ones"),
        "w_up": ParamSpec((D, F), ("embed", "ffw")),
        "w_down": ParamSpec((F, D), ("ffw", "embed")),
    }
    if cfg.arch == "opt":
        specs |= {
            "attn_norm_bias": ParamSpec((D,), ("embed",), "zeros"),
            "mlp_norm_bias": ParamSpec((D,), ("embed",), "zeros"),
            "bo": ParamSpec((D,), ("embed",), "zeros"),
            "b_up": ParamSpec((F,), ("ffw",), "zeros"),
            "b_down": ParamSpec((D,), ("embed",), "zeros"),
        }
    else:
        specs["w_gate"] = ParamSpec((D, F), ("embed", "ffw"))
    if cfg.arch == "opt" or cfg.qkv_bias:
        specs |= {
            "bq": ParamSpec((H, d), ("q_heads", "head_dim"), "zeros"),
            "bk": ParamSpec((K, d), ("kv_heads", "head_dim"), "zeros"),
            "bv": ParamSpec((K, d), ("kv_heads", "head_dim"), "zeros"),
        }
    return specs


def param_specs(cfg: ModelConfig) -> Params:
    """The full parameter tree of `cfg`, with a ParamSpec at every leaf."""
    D, E = cfg.hidden_size, cfg.embed_dim
    specs: Params = {"embed": ParamSpec((cfg.vocab_size, E), ("vocab", "embed"))}
    if cfg.arch == "opt":
        # OPT's learned positions are offset by 2 (rows 0-1 are never used for real positions).
        specs["pos_embed"] = ParamSpec((cfg.max_positions + 2, D), ("positions", "embed"))
        if cfg.has_projections:
            specs["project_in"] = ParamSpec((E, D), ("embed_proj", "embed"))
            specs["project_out"] = ParamSpec((D, E), ("embed", "embed_proj"))
    if cfg.final_layer_norm:
        specs["final_norm"] = ParamSpec((D,), ("embed",), "ones")
        if cfg.arch == "opt":
            specs["final_norm_bias"] = ParamSpec((D,), ("embed",), "zeros")
    if not cfg.tie_embeddings:
        specs["lm_head"] = ParamSpec((E, cfg.vocab_size), ("embed", "vocab"))
    specs["layers"] = [_layer_specs(cfg) for _ in range(cfg.num_layers)]
    return specs


def init_params(cfg: ModelConfig, seed: int = 0, dtype=jnp.bfloat16, std: float = 0.02) -> Params:
    """Random weights of the declared shapes (for timing runs and tests; accuracy is meaningless)."""
    specs = param_specs(cfg)
    leaves, treedef = jax.tree.flatten(specs, is_leaf=is_spec)
    keys = jax.random.split(jax.random.key(seed), len(leaves))

    def make(spec: ParamSpec, key):
        if spec.init == "ones":
            return jnp.ones(spec.shape, dtype)
        if spec.init == "zeros":
            return jnp.zeros(spec.shape, dtype)
        return (std * jax.random.normal(key, spec.shape, jnp.float32)).astype(dtype)

    return jax.tree.unflatten(treedef, [make(s, k) for s, k in zip(leaves, keys)])


def leaf_names(tree: Params) -> list[str]:
    """Dotted names of the leaves in flatten order, e.g. 'layers.3.wq'."""
    paths, _ = jax.tree_util.tree_flatten_with_path(tree, is_leaf=is_spec)
    return [_path_name(p) for p, _ in paths]


def _path_name(path) -> str:
    parts = []
    for entry in path:
        key = getattr(entry, "key", getattr(entry, "idx", None))
        parts.append(str(key))
    return ".".join(parts)


def check_params(cfg: ModelConfig, params: Params, source: str) -> None:
    """Raise CheckpointError naming the first tensor that is missing, extra or mis-shaped."""
    want = dict(zip(leaf_names(param_specs(cfg)), jax.tree.leaves(param_specs(cfg), is_leaf=is_spec)))
    have = dict(zip(leaf_names(params), jax.tree.leaves(params)))
    missing = sorted(set(want) - set(have))
    extra = sorted(set(have) - set(want))
    if missing:
        raise CheckpointError(f"{source}: missing tensor(s) {missing[:5]} for this {cfg.arch} config")
    if extra:
        raise CheckpointError(f"{source}: unexpected tensor(s) {extra[:5]} for this {cfg.arch} config")
    for name, spec in want.items():
        shape = tuple(np.shape(have[name]))
        if shape != spec.shape:
            raise CheckpointError(
                f"{source}: tensor {name} has shape {shape} but the config needs {spec.shape}"
            )


