"""`python benchmarks/prefill.py --against transformers`: the transformers model built from specjax params computes
specjax's function (tiny random OPT / Llama / Qwen2), and the side-by-side benchmark returns a record per length."""

import os

import jax
import numpy as np
import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

import specjax  # noqa: E402
from specjax import host_memory, torch_ref  # noqa: E402
from specjax.api import Model  # noqa: E402
from specjax.config import from_hf_config  # noqa: E402
from specjax.convert import hf_params  # noqa: E402
from specjax.errors import SpecjaxError  # noqa: E402
from specjax.models.params import init_params  # noqa: E402

import bench_scripts  # noqa: E402  (tests/bench_scripts.py)

bench = bench_scripts.load("prefill.py", "prefill")
TOL = 1e-4
SHAPES = {  # beyond the registered tiny-llama / tiny-opt: the other mapping branches
    "tiny-qwen2": {"model_type": "qwen2", "vocab_size": 96, "hidden_size": 32, "num_hidden_layers": 2,
                   "num_attention_heads": 4, "num_key_value_heads": 2, "intermediate_size": 48,
                   "max_position_embeddings": 64, "rope_theta": 500.0},
    "tiny-opt-post-ln-project": {"model_type": "opt", "vocab_size": 96, "hidden_size": 32, "num_hidden_layers": 2,
                                 "ffn_dim": 64, "num_attention_heads": 4, "max_position_embeddings": 64,
                                 "word_embed_proj_dim": 16, "do_layer_norm_before": False},
}


def _randomize_vectors(params, seed):
    """init_params sets norms to 1 and biases to 0; random values exercise every vector's mapping."""
    leaves, tree = jax.tree.flatten(params)
    rng = np.random.default_rng(seed)
    return jax.tree.unflatten(tree, [x + 0.1 * rng.standard_normal(x.shape).astype(np.float32) if x.ndim == 1 else x
                                     for x in leaves])


def _model(name):
    if name in SHAPES:
        cfg = from_hf_config(SHAPES[name])
        return Model(name, cfg, _randomize_vectors(init_params(cfg, seed=1, dtype=np.float32), 2), "random")
    model = specjax.load_model(name, init="random", seed=1)
    model.params = _randomize_vectors(model.params, 2)
    return model


@pytest.fixture(scope="module", params=["tiny-llama", "tiny-opt", *SHAPES])
def pair(request):
    model = _model(request.param)
    return model, torch_ref.transformers_model(model.config, model.params)


def test_mapping_is_the_inverse_of_conversion(pair):
    model, _ = pair
    assert from_hf_config(torch_ref.hf_config(model.config)) == model.config
    back = hf_params(model.config, torch_ref.hf_tensors(model.config, model.params).__getitem__)
    assert jax.tree.structure(back) == jax.tree.structure(model.params)
    for a, b in zip(jax.tree.leaves(back), jax.tree.leaves(model.params)):
        np.testing.assert_array_equal(a, np.asarray(b))


def _same_function(model, hf_model, tol: float = 1e-3) -> float:
    """The bench's check, in one process: max |first-token logits of specjax - of transformers| in float32, or a
    SpecjaxError."""
    ours = bench._check_logits(model)
    theirs = bench.torch_prefill_logits(hf_model, bench.prompt_ids(model.config.vocab_size, bench.CHECK_TOKENS))
    return bench._agreement(ours, theirs.float().numpy(), tol, model.name, model.config.arch)


def test_transformers_model_gives_specjax_logits(pair):
    model, hf_model = pair
    assert hf_model.config._attn_implementation == "sdpa"
    ids = np.random.default_rng(0).integers(0, model.config.vocab_size, 23)
    with torch.inference_mode():
        ref = hf_model(torch.as_tensor(ids)[None]).logits[0].numpy()
    np.testing.assert_allclose(model.logits(ids), ref, atol=TOL, rtol=0)
    assert _same_function(model, hf_model, tol=TOL) <= TOL


def test_compare_prefill_records():
    """Each framework in a process of its own, the same weights rebuilt there from the model's spec."""
    records = bench.compare_prefill(bench.ModelSpec("tiny-llama", init="random", seed=1), [8, 24], repeats=2,
                                    threads=1)
    assert [r["tokens"] for r in records] == [8, 24]
    for r in records:
        assert len(r["specjax_seconds"]) == len(r["transformers_seconds"]) == 2
        assert min(r["specjax_seconds"]) > 0 and min(r["transformers_seconds"]) > 0
        assert r["dtype"] == "float32" and r["threads"] == 1 and r["torch"] == torch.__version__
        assert r["time_ratio"] > 0 and r["max_abs_logit_diff_fp32"] <= 1e-3
        # transformers runs with glibc's malloc as its users have it; specjax with its own settings where glibc is
        assert r["transformers_host_malloc"] == "system"
        assert r["specjax_host_malloc"] == ("reuse" if host_memory._glibc() else "system")
    table = bench.markdown_table(records)
    assert "| tokens | specjax tok/s | transformers tok/s | specjax time / transformers time |" in table
    assert table.count("\n| 8 |") == 1 and table.count("\n| 24 |") == 1


def test_workers_share_one_gpu(monkeypatch):
    """The transformers worker's JAX stays on the host; with torch on the GPU the specjax worker's JAX grows on
    demand under a cap instead of taking 75% of the GPU at start (which left transformers out of memory on an
    H100 with OPT-6.7B). Each pool's environment is set only while it spawns."""
    assert bench.worker_environment("transformers", "cuda") == {"JAX_PLATFORMS": "cpu", host_memory.ENV_VAR: "system"}
    gpu = bench.worker_environment("specjax", "cuda")
    assert gpu["XLA_PYTHON_CLIENT_PREALLOCATE"] == "false" and 0 < float(gpu["XLA_PYTHON_CLIENT_MEM_FRACTION"]) < 0.75
    assert bench.worker_environment("specjax", "cpu") == {}
    monkeypatch.setenv("XLA_PYTHON_CLIENT_PREALLOCATE", "true")
    monkeypatch.delenv("XLA_PYTHON_CLIENT_MEM_FRACTION", raising=False)
    with bench._environment(gpu):
        assert os.environ["XLA_PYTHON_CLIENT_MEM_FRACTION"] == gpu["XLA_PYTHON_CLIENT_MEM_FRACTION"]
    assert os.environ["XLA_PYTHON_CLIENT_PREALLOCATE"] == "true" and "XLA_PYTHON_CLIENT_MEM_FRACTION" not in os.environ


def test_prefill_flops_count_matrices_attention_and_head():
    """2 FLOPs per weight per token in the layer matrices, attention over the causally visible pairs, the LM
    head once; checked against a hand count of tiny-opt (D=64, F=128, 4 heads of 16, 2 layers, vocab 512)."""
    cfg = specjax.load_model("tiny-opt", init="random").config
    n = 10
    layer = 2 * n * (4 * 64 * 64 + 2 * 64 * 128) + 2 * 2 * 4 * 16 * (n * (n + 1) / 2)
    assert bench.prefill_flops(cfg, n) == 2 * layer + 2 * 64 * 512


def test_wrong_weights_are_refused():
    model = _model("tiny-llama")
    hf_model = torch_ref.transformers_model(model.config, model.params)
    with torch.no_grad():
        hf_model.model.layers[0].mlp.up_proj.weight.mul_(1.5)
    with pytest.raises(SpecjaxError, match="disagrees with specjax"):
        _same_function(model, hf_model)


def test_missing_torch_is_a_clear_error(monkeypatch):
    import builtins

    real_import = builtins.__import__

    def no_torch(name, *args, **kwargs):
        if name in ("torch", "transformers"):
            raise ImportError(f"No module named {name!r}")
        return real_import(name, *args, **kwargs)

    monkeypatch.setattr(builtins, "__import__", no_torch)
    with pytest.raises(SpecjaxError, match="needs torch and transformers"):
        torch_ref.require_torch()
