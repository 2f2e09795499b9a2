"""Convert Hugging Face checkpoints (safetensors, sharded or not; pytorch_model*.bin) and llama-architecture
GGUF files into specjax model directories (orbax params + config + tokenizer).

    python -m specjax.convert --hf_dir /ckpt/opt-6.7b --out ~/.cache/specjax/models/opt-6.7b
    python -m specjax.convert --gguf model.gguf --out DIR [--dtype float32]

--out must be a new or empty folder, or hold nothing but a converted model (its files are replaced once the new one
is written); a folder holding any other file is refused and left as it is.

Weights are stored in the checkpoint's own dtype unless --dtype asks for another: for a Hugging Face checkpoint
the torch_dtype (or dtype) its config.json declares, else the dtype most of its tensors have; for a GGUF file the
type most of its weights have, F32, F16 and BF16 as they are and quantized types as float32 (their dequantized
values are exact there and not in 16 bits). Other float types become float32. The manifest records both the
source dtype and the stored one.
"""

from __future__ import annotations

import collections
import json
import pathlib
from typing import Callable

import numpy as np
from absl import flags

from specjax.config import ModelConfig, from_hf_config
from specjax.cli import run
from specjax.errors import CheckpointError, SpecjaxError
from specjax.models.params import Params
from specjax.tokenizer import tokenizer_json_from_gguf, tokenizer_json_from_hf_dir

DTYPES = ("float32", "float16", "bfloat16")

Getter = Callable[[str], np.ndarray]  # tensor name -> array in PyTorch layout


def _np_dtype(name: str):
    import ml_dtypes

    if name not in DTYPES:
        raise SpecjaxError(f"unknown --dtype {name!r}; choose one of {', '.join(DTYPES)}")
    return ml_dtypes.bfloat16 if name == "bfloat16" else np.dtype(name)


def _most_elements(sizes: collections.Counter) -> str:
    """The dtype holding most parameters: checkpoints sometimes keep small tensors (norms) wider than the rest."""
    dtype = max(sizes, key=sizes.get) if sizes else "float32"
    return dtype if dtype in DTYPES else "float32"


def _contiguous(params: Params, dtype) -> Params:
    import jax

    return jax.tree.map(lambda x: np.ascontiguousarray(x, dtype=dtype), params)


# ---- Hugging Face layout -> specjax layout ----------------------------------------------------


def _linear_in_heads(w: np.ndarray, heads: int, head_dim: int) -> np.ndarray:
    """Linear weight [heads*head_dim, D] -> [D, heads, head_dim]."""
    return w.T.reshape(w.shape[1], heads, head_dim)


def _hf_layer(cfg: ModelConfig, get: Getter, p: str) -> dict:
    H, K, d = cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
    if cfg.arch == "opt":
        a, names = f"{p}.self_attn", {"o": "out_proj", "ln1": "self_attn_layer_norm", "ln2": "final_layer_norm"}
        layer = {
            "attn_norm": get(f"{p}.{names['ln1']}.weight"),
            "attn_norm_bias": get(f"{p}.{names['ln1']}.bias"),
            "mlp_norm": get(f"{p}.{names['ln2']}.weight"),
            "mlp_norm_bias": get(f"{p}.{names['ln2']}.bias"),
            "w_up": get(f"{p}.fc1.weight").T,
            "b_up": get(f"{p}.fc1.bias"),
            "w_down": get(f"{p}.fc2.weight").T,
            "b_down": get(f"{p}.fc2.bias"),
            "bo": get(f"{a}.out_proj.bias"),
        }
    else:
        a, names = f"{p}.self_attn", {"o": "o_proj"}
        layer = {
            "attn_norm": get(f"{p}.input_layernorm.weight"),
            "mlp_norm": get(f"{p}.post_attention_layernorm.weight"),
            "w_gate": get(f"{p}.mlp.gate_proj.weight").T,
            "w_up": get(f"{p}.mlp.up_proj.weight").T,
            "w_down": get(f"{p}.mlp.down_proj.weight").T,
        }
    layer["wq"] = _linear_in_heads(get(f"{a}.q_proj.weight"), H, d)
    layer["wk"] = _linear_in_heads(get(f"{a}.k_proj.weight"), K, d)
    layer["wv"] = _linear_in_heads(get(f"{a}.v_proj.weight"), K, d)
    wo = get(f"{a}.{names['o']}.weight")  # [D, H*d]
    layer["wo"] = wo.T.reshape(H, d, wo.shape[0])
    if cfg.arch == "opt" or cfg.qkv_bias:
        layer["bq"] = get(f"{a}.q_proj.bias").reshape(H, d)
        layer["bk"] = get(f"{a}.k_proj.bias").reshape(K, d)
        layer["bv"] = get(f"{a}.v_proj.bias").reshape(K, d)
    return layer


def hf_params(cfg: ModelConfig, get: Getter) -> Params:
    """Params tree from Hugging Face tensor names (prefix 'model.' already stripped)."""
    if cfg.arch == "opt":
        params = {
            "embed": get("decoder.embed_tokens.weight"),
            "pos_embed": get("decoder.embed_positions.weight"),
        }
        if cfg.has_projections:
            params["project_in"] = get("decoder.project_in.weight").T
            params["project_out"] = get("decoder.project_out.weight").T
        if cfg.final_layer_norm:
            params["final_norm"] = get("decoder.final_layer_norm.weight")
            params["final_norm_bias"] = get("decoder.final_layer_norm.bias")
        layer_prefix = "decoder.layers"
    else:
        params = {"embed": get("embed_tokens.weight"), "final_norm": get("norm.weight")}
        layer_prefix = "layers"
    if not cfg.tie_embeddings:
        params["lm_head"] = get("lm_head.weight").T
    params["layers"] = [_hf_layer(cfg, get, f"{layer_prefix}.{i}") for i in range(cfg.num_layers)]
    return params


# The files besides the weights that converting a Hugging Face folder reads: its config and what
# specjax.tokenizer.tokenizer_json_from_hf_dir reads.
_HF_METADATA = ("config.json", "tokenizer.json", "vocab.json", "merges.txt")


def hf_weight_files(d: pathlib.Path) -> list[pathlib.Path]:
    """The weight files a conversion of Hugging Face folder `d` reads: a shard index and its shards, or one file."""
    for index_name in ("model.safetensors.index.json", "pytorch_model.bin.index.json"):
        index = d / index_name
        if index.is_file():
            try:
                shards = sorted(set(json.loads(index.read_text())["weight_map"].values()))
            except (OSError, ValueError, KeyError, TypeError, AttributeError) as e:
                raise CheckpointError(f"{index}: unreadable shard index ({type(e).__name__}: {e})") from e
            missing = [s for s in shards if not (d / s).is_file()]
            if missing:
                raise CheckpointError(f"{d}: shard(s) {missing} named in {index_name} are missing")
            return [index] + [d / s for s in shards]
    for name in ("model.safetensors", "pytorch_model.bin"):
        if (d / name).is_file():
            return [d / name]
    raise CheckpointError(f"{d}: no model.safetensors, model.safetensors.index.json or pytorch_model*.bin found")


def hf_source_files(hf_dir: pathlib.Path) -> list[pathlib.Path]:
    """Every file converting `hf_dir` reads (config, tokenizer, weights): what its conversion's reuse depends on."""
    return [hf_dir / n for n in _HF_METADATA if (hf_dir / n).is_file()] + hf_weight_files(hf_dir)


def read_hf_config(hf_dir: pathlib.Path) -> dict:
    """config.json of a Hugging Face checkpoint folder. A converted model's folder that lost its manifest has
    specjax's config.json instead (no model_type): refused in one line that names the fix."""
    from specjax.checkpoint import MANIFEST

    path = hf_dir / "config.json"
    if not path.is_file():
        raise CheckpointError(f"{hf_dir}: no config.json; is this a Hugging Face checkpoint directory?")
    try:
        config = json.loads(path.read_text())
    except (OSError, ValueError) as e:
        raise CheckpointError(f"{path} is unreadable ({e}); is this a Hugging Face checkpoint directory?") from e
    if not isinstance(config, dict):
        raise CheckpointError(f"{path} is not a JSON object; is this a Hugging Face checkpoint directory?")
    if "model_type" not in config and "arch" in config:
        raise CheckpointError(
            f"{hf_dir} is neither a converted specjax model (no {MANIFEST}) nor a Hugging Face checkpoint "
            f"(its config.json is specjax's): convert the checkpoint into a new folder with `python -m specjax.convert "
            f"--hf_dir HF_DIR --out NEW_DIR` and pass that folder, or point --model at the Hugging Face folder")
    return config


# safetensors' codes of the dtypes specjax stores as they are
_SAFETENSORS_DTYPES = {"F32": "float32", "F16": "float16", "BF16": "bfloat16"}


class _HFTensors:
    """Lazy access to the tensors of a Hugging Face checkpoint directory, by name without 'model.'."""

    def __init__(self, hf_dir: pathlib.Path):
        self.hf_dir = hf_dir
        self._torch: dict[pathlib.Path, dict] = {}
        self._where: dict[str, tuple[pathlib.Path, str]] = {}
        self.dtype_sizes: collections.Counter = collections.Counter()  # dtype name -> elements stored in it
        for path in self._weight_files():
            for name in self._names(path):
                self._where[name.removeprefix("model.")] = (path, name)

    def _weight_files(self) -> list[pathlib.Path]:
        return [p for p in hf_weight_files(self.hf_dir) if not p.name.endswith(".index.json")]

    def _names(self, path: pathlib.Path) -> list[str]:
        if path.suffix == ".safetensors":
            from safetensors import safe_open

            try:
                with safe_open(path, framework="flax") as f:
                    names = list(f.keys())
                    for name in names:  # from the header: no tensor is read
                        tensor = f.get_slice(name)
                        dtype = tensor.get_dtype()
                        self.dtype_sizes[_SAFETENSORS_DTYPES.get(dtype, dtype)] += int(np.prod(tensor.get_shape()))
                    return names
            except Exception as e:
                raise CheckpointError(f"{path}: unreadable safetensors file ({e})") from e
        state = self._torch_state(path)
        for tensor in state.values():
            self.dtype_sizes[str(tensor.dtype).removeprefix("torch.")] += tensor.numel()
        return list(state)

    def _torch_state(self, path: pathlib.Path) -> dict:
        if path not in self._torch:
            try:
                import torch
            except ImportError as e:
                raise SpecjaxError(f"{path} is a PyTorch .bin checkpoint: install torch to convert it") from e
            try:
                self._torch[path] = torch.load(path, map_location="cpu", weights_only=True, mmap=True)
            except Exception as e:
                raise CheckpointError(f"{path}: unreadable PyTorch checkpoint ({e})") from e
        return self._torch[path]

    def __call__(self, name: str) -> np.ndarray:
        """The tensor in its stored dtype (float32 for PyTorch files: numpy has no bfloat16, and float32
        holds every float16 and bfloat16 value exactly)."""
        if name not in self._where:
            if name == "lm_head.weight":
                raise CheckpointError(f"{self.hf_dir}: lm_head.weight is missing and embeddings are not tied")
            raise CheckpointError(f"{self.hf_dir}: tensor {name!r} not found in the checkpoint")
        path, full = self._where[name]
        if path.suffix != ".safetensors":
            return self._torch_state(path)[full].float().numpy()
        from safetensors import safe_open

        try:
            with safe_open(path, framework="flax") as f:
                return np.asarray(f.get_tensor(full))
        except Exception as e:
            raise CheckpointError(f"{path}: cannot read tensor {full} ({e})") from e


def hf_source_dtype(hf_config: dict, tensors: _HFTensors) -> str:
    """The checkpoint's own dtype: what config.json declares (torch_dtype, or dtype since transformers 4.56),
    else the dtype most of its tensors are stored in."""
    declared = str(hf_config.get("torch_dtype") or hf_config.get("dtype") or "").removeprefix("torch.")
    return declared if declared in DTYPES else _most_elements(tensors.dtype_sizes)


def convert_hf_dir(hf_dir: pathlib.Path, out: pathlib.Path, dtype: str | None = None) -> ModelConfig:
    """Convert a Hugging Face checkpoint folder into `out`; dtype None keeps the checkpoint's own. The manifest
    records the size and digest of every file read (`hf_source_files`), taken before they are read for the
    conversion: a file changed meanwhile shows as changed on the next reuse."""
    from specjax.checkpoint import save_model_dir, source_record

    hf_dir = pathlib.Path(hf_dir).expanduser()
    hf_config = read_hf_config(hf_dir)
    cfg = from_hf_config(hf_config)
    sources = {p.name: source_record(p) for p in hf_source_files(hf_dir)}
    tensors = _HFTensors(hf_dir)
    source_dtype = hf_source_dtype(hf_config, tensors)
    target = _np_dtype(dtype or source_dtype)
    # Cast each tensor as it is read, so the whole model is never held in float32 on the way.
    params = _contiguous(hf_params(cfg, lambda name: tensors(name).astype(target)), target)
    tok = tokenizer_json_from_hf_dir(hf_dir)
    if tok is None:
        print(f"note: {hf_dir} has no tokenizer files; the converted model will accept token ids only")
    save_model_dir(out, cfg, params, tokenizer_json=tok, source=f"hf:{hf_dir.resolve()}", source_dtype=source_dtype,
                   source_files=sources)
    return cfg


# ---- GGUF (llama architecture) ---------------------------------------------------------------


def _gguf_field(field):
    """Decode a GGUF metadata field to a Python value (str, number, or list of them)."""
    from gguf import GGUFValueType

    if field.types and field.types[0] == GGUFValueType.ARRAY:
        sub = field.types[-1]
        if sub == GGUFValueType.STRING:
            return [bytes(field.parts[i]).decode("utf-8") for i in field.data]
        return [field.parts[i].tolist()[0] for i in field.data]
    if field.types and field.types[0] == GGUFValueType.STRING:
        return bytes(field.parts[field.data[0]]).decode("utf-8")
    return field.parts[field.data[0]].tolist()[0]


def _unpermute_rope_rows(w: np.ndarray, heads: int) -> np.ndarray:
    """Undo llama.cpp's per-head row interleave of Q/K weights (its RoPE pairs adjacent dims)."""
    rows = w.shape[0]
    return w.reshape(heads, rows // heads // 2, 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


# GGUF tensor types stored as they are; every other (quantized) type is dequantized to float32
_GGUF_DTYPES = {"F32": "float32", "F16": "float16", "BF16": "bfloat16"}


def gguf_source_dtype(tensors) -> str:
    """The type most of a GGUF's weights have, as a dtype name (quantized types: float32, see the module doc)."""
    sizes = collections.Counter()
    for t in tensors:
        sizes[_GGUF_DTYPES.get(t.tensor_type.name, "float32")] += int(t.n_elements)
    return _most_elements(sizes)


def _gguf_hf_config(fields: dict, tensors: dict) -> dict:
    """The Hugging Face config.json fields of a llama GGUF file, from its metadata and tensor names."""
    return {
        "model_type": "llama",
        "vocab_size": int(tensors["token_embd.weight"].shape[-1]),
        "hidden_size": fields["llama.embedding_length"],
        "num_hidden_layers": fields["llama.block_count"],
        "num_attention_heads": fields["llama.attention.head_count"],
        "num_key_value_heads": fields.get("llama.attention.head_count_kv", fields["llama.attention.head_count"]),
        "intermediate_size": fields["llama.feed_forward_length"],
        "max_position_embeddings": fields.get("llama.context_length", 4096),
        "rms_norm_eps": fields.get("llama.attention.layer_norm_rms_epsilon", 1e-5),
        "rope_theta": fields.get("llama.rope.freq_base", 10000.0),
        "tie_word_embeddings": "output.weight" not in tensors,
        "bos_token_id": fields.get("tokenizer.ggml.bos_token_id"),
        "eos_token_id": fields.get("tokenizer.ggml.eos_token_id"),
    }


def _gguf_getter(path: pathlib.Path, tensors: dict) -> Getter:
    """A getter that dequantizes a named GGUF tensor to float32; a missing or undecodable one is a CheckpointError."""
    from gguf.quants import dequantize

    def get(name: str) -> np.ndarray:
        if name not in tensors:
            raise CheckpointError(f"{path}: tensor {name} is missing")
        t = tensors[name]
        try:
            return np.asarray(dequantize(t.data, t.tensor_type), np.float32)
        except NotImplementedError as e:
            raise CheckpointError(f"{path}: cannot dequantize {name} of type {t.tensor_type.name}: {e}") from e

    return get


def _gguf_layer(cfg: ModelConfig, get: Getter, i: int) -> dict:
    """Layer i's params in specjax layout: rope rows un-permuted (llama.cpp interleaves them), heads split out."""
    H, K, d = cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
    b = f"blk.{i}"
    wo = get(f"{b}.attn_output.weight")
    return {
        "attn_norm": get(f"{b}.attn_norm.weight"),
        "wq": _linear_in_heads(_unpermute_rope_rows(get(f"{b}.attn_q.weight"), H), H, d),
        "wk": _linear_in_heads(_unpermute_rope_rows(get(f"{b}.attn_k.weight"), K), K, d),
        "wv": _linear_in_heads(get(f"{b}.attn_v.weight"), K, d),
        "wo": wo.T.reshape(H, d, wo.shape[0]),
        "mlp_norm": get(f"{b}.ffn_norm.weight"),
        "w_gate": get(f"{b}.ffn_gate.weight").T,
        "w_up": get(f"{b}.ffn_up.weight").T,
        "w_down": get(f"{b}.ffn_down.weight").T,
    }


def read_gguf(path: pathlib.Path) -> tuple[ModelConfig, Params, dict, str]:
    """(config, float32 params, metadata fields, source dtype) from a llama-architecture GGUF file."""
    from gguf import GGUFReader

    try:
        reader = GGUFReader(str(path))
    except Exception as e:
        raise CheckpointError(f"{path}: not a readable GGUF file ({type(e).__name__}: {e})") from e
    fields = {k: _gguf_field(f) for k, f in reader.fields.items() if not k.startswith("GGUF.")}
    arch = fields.get("general.architecture")
    if arch != "llama":
        raise SpecjaxError(f"{path}: GGUF architecture {arch!r} is not supported (only 'llama')")
    tensors = {t.name: t for t in reader.tensors}
    cfg = from_hf_config(_gguf_hf_config(fields, tensors))
    get = _gguf_getter(path, tensors)
    params = {"embed": get("token_embd.weight"), "final_norm": get("output_norm.weight")}
    if not cfg.tie_embeddings:
        params["lm_head"] = get("output.weight").T
    params["layers"] = [_gguf_layer(cfg, get, i) for i in range(cfg.num_layers)]
    return cfg, params, fields, gguf_source_dtype(reader.tensors)


def convert_gguf(path: pathlib.Path, out: pathlib.Path, dtype: str | None = None,
                 tokenizer: pathlib.Path | None = None) -> ModelConfig:
    """Convert a llama-architecture GGUF file into `out`; dtype None keeps the file's own (see the module doc)."""
    from specjax.checkpoint import save_model_dir

    path = pathlib.Path(path).expanduser()
    if not path.is_file():
        raise CheckpointError(f"GGUF file {path} does not exist")
    cfg, params, fields, source_dtype = read_gguf(path)
    tok = pathlib.Path(tokenizer).read_text() if tokenizer else tokenizer_json_from_gguf(fields)
    params = _contiguous(params, _np_dtype(dtype or source_dtype))
    save_model_dir(out, cfg, params, tokenizer_json=tok, source=f"gguf:{path.name}", source_dtype=source_dtype)
    return cfg


# ---- command line -----------------------------------------------------------------------------

FLAGS = flags.FLAGS


def define_flags() -> None:
    """Flags of this command; defined only when it runs, so importing the module defines none."""
    flags.DEFINE_string("hf_dir", None, "Hugging Face checkpoint directory (config.json + safetensors or .bin).")
    flags.DEFINE_string("gguf", None, "llama-architecture GGUF file to convert instead of --hf_dir.")
    flags.DEFINE_string("out", None, "Output model directory (e.g. ~/.cache/specjax/models/NAME).")
    flags.DEFINE_enum("dtype", None, list(DTYPES), "Stored parameter dtype; default: the checkpoint's own.")
    flags.DEFINE_string("tokenizer", None, "tokenizer.json to use instead of the GGUF's embedded vocabulary.")


def main(argv):
    from specjax.checkpoint import read_manifest, replaces_model

    del argv
    if not FLAGS.out:
        raise SpecjaxError("--out DIR is required")
    if bool(FLAGS.hf_dir) == bool(FLAGS.gguf):
        raise SpecjaxError("give exactly one of --hf_dir DIR or --gguf FILE")
    out = pathlib.Path(FLAGS.out).expanduser()
    if replaces_model(out):
        print(f"note: {out} holds a converted model; it is replaced when this conversion has finished")
    if FLAGS.hf_dir:
        cfg = convert_hf_dir(pathlib.Path(FLAGS.hf_dir), out, FLAGS.dtype)
    else:
        cfg = convert_gguf(pathlib.Path(FLAGS.gguf), out, FLAGS.dtype, FLAGS.tokenizer)
    manifest = read_manifest(out)
    print(f"converted {cfg.arch} ({cfg.num_layers} layers, hidden {cfg.hidden_size}; {manifest['source_dtype']} "
          f"checkpoint stored as {manifest['dtype']}) -> {out}")


if __name__ == "__main__":
    define_flags()
    run(main)
