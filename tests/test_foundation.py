"""Registered shapes, random init, model resolution and the clear errors users get for bad input."""

import json
import math
import re
import subprocess
import sys

import jax
import numpy as np
import pytest

import specjax
from specjax import paths
from specjax.checkpoint import save_model_dir
from specjax.config import from_hf_config
from specjax.configs.models import MODEL_SHAPES, TIMING_SHAPES
from specjax.errors import CheckpointError, ModelNotFoundError, SpecjaxError
from specjax.models.params import init_params, is_spec, param_specs


@pytest.mark.parametrize(
    "name, billions",
    [("opt-125m", 0.125), ("opt-1.3b", 1.3), ("opt-6.7b", 6.7), ("opt-13b", 13), ("opt-30b", 30), ("opt-66b", 66),
     ("llama2-7b", 6.7), ("llama2-13b", 13), ("qwen2.5-7b", 7.6), ("qwen2.5-14b", 14.7), ("qwen2.5-32b", 32.5),
     ("smollm2-135m", 0.135)],
)
def test_registered_shapes_have_published_sizes(name, billions):
    specs = jax.tree.leaves(param_specs(from_hf_config(MODEL_SHAPES[name])), is_leaf=is_spec)
    assert sum(math.prod(s.shape) for s in specs) / 1e9 == pytest.approx(billions, rel=0.04)


@pytest.mark.parametrize("timing, real", sorted(TIMING_SHAPES.items()))
def test_timing_shapes_have_their_models_kv_geometry_and_head_counts(timing, real):
    """A timing shape moves its model's KV and groups its query heads as that model does (spec_gqa is measured on
    the grouping it is for), with a small fraction of its compute."""
    t, r = from_hf_config(MODEL_SHAPES[timing]), from_hf_config(MODEL_SHAPES[real])
    assert (t.num_layers, t.num_heads, t.num_kv_heads, t.head_dim) == (r.num_layers, r.num_heads, r.num_kv_heads,
                                                                       r.head_dim)
    assert t.kv_bytes_per_token(2) == r.kv_bytes_per_token(2)
    count = lambda cfg: sum(math.prod(s.shape) for s in jax.tree.leaves(param_specs(cfg), is_leaf=is_spec))
    assert count(t) < 0.05 * count(r)


def test_opt350m_shape_is_post_ln_with_projections():
    cfg = from_hf_config(MODEL_SHAPES["opt-350m"])
    assert not cfg.pre_layer_norm and cfg.has_projections and not cfg.final_layer_norm


def test_random_init_is_labelled_and_runs():
    model = specjax.load_model("tiny-llama", init="random", seed=3)
    assert model.weights == "random"
    logits = model.logits([1, 2, 3])
    assert logits.shape == (3, model.config.vocab_size) and np.isfinite(logits).all()
    other = specjax.load_model("tiny-llama", init="random", seed=4)
    assert not np.allclose(other.logits([1, 2, 3]), logits)
    with pytest.raises(SpecjaxError, match="no tokenizer"):
        model.generate("hello")


def test_random_init_from_a_hugging_face_config_json(tmp_path):
    """A directory holding only a Hugging Face config.json gives random weights of its shape (here OPT with its
    position table extended), as a converted model's config.json does."""
    (tmp_path / "config.json").write_text(json.dumps(MODEL_SHAPES["tiny-opt"] | {"max_position_embeddings": 1024}))
    model = specjax.load_model(str(tmp_path), init="random")
    assert model.config == from_hf_config(MODEL_SHAPES["tiny-opt"] | {"max_position_embeddings": 1024})
    assert model.config.max_positions == 1024 and model.params["pos_embed"].shape == (1026, 64)
    assert np.isfinite(model.logits(list(range(600)))).all()  # beyond tiny-opt's own 512 positions
    (tmp_path / "config.json").write_text("{not json")
    with pytest.raises(SpecjaxError, match="cannot read model config"):
        specjax.load_model(str(tmp_path), init="random")


def test_unknown_model_lists_known_names():
    with pytest.raises(ModelNotFoundError, match="known names: .*opt-6.7b"):
        specjax.load_model("gpt-5")


def test_unconverted_model_says_how_to_convert(tmp_path, monkeypatch):
    monkeypatch.setenv("SPECJAX_HOME", str(tmp_path))
    with pytest.raises(ModelNotFoundError, match=r"python -m specjax.convert --hf_dir .* --out"):
        specjax.load_model("tiny-llama")  # a registered shape with no hub repo (opt-6.7b would be downloaded)


def test_missing_model_directory(tmp_path):
    with pytest.raises(ModelNotFoundError, match="does not exist"):
        specjax.load_model(str(tmp_path / "nowhere" / "model"))


def test_bad_init_and_dtype():
    with pytest.raises(SpecjaxError, match="unknown init"):
        specjax.load_model("tiny-llama", init="zeros")
    with pytest.raises(SpecjaxError, match="unknown dtype"):
        specjax.load_model("tiny-llama", init="random", dtype="int8")


@pytest.fixture
def tiny_model_dir(tmp_path):
    cfg = from_hf_config(MODEL_SHAPES["tiny-llama"])
    out = tmp_path / "tiny"
    params = init_params(cfg, seed=0, dtype=np.float32)
    save_model_dir(out, cfg, params, tokenizer_json=None, source="test")
    return out


def test_round_trip(tiny_model_dir):
    model = specjax.load_model(str(tiny_model_dir))
    ref = specjax.load_model("tiny-llama", init="random", seed=0)
    np.testing.assert_array_equal(model.logits([5, 6, 7]), ref.logits([5, 6, 7]))


def _largest_param_file(model_dir):
    return max((p for p in (model_dir / "params").rglob("*") if p.is_file()), key=lambda p: p.stat().st_size)


def test_truncated_checkpoint_is_reported(tiny_model_dir):
    path = _largest_param_file(tiny_model_dir)
    path.write_bytes(path.read_bytes()[:-100])
    with pytest.raises(CheckpointError, match="truncated"):
        specjax.load_model(str(tiny_model_dir))


def test_corrupt_checkpoint_is_reported(tiny_model_dir):
    path = _largest_param_file(tiny_model_dir)
    data = bytearray(path.read_bytes())
    data[len(data) // 2] ^= 0xFF
    path.write_bytes(bytes(data))
    with pytest.raises(CheckpointError, match="corrupt"):
        specjax.load_model(str(tiny_model_dir))


def test_not_a_model_directory(tmp_path):
    with pytest.raises(CheckpointError, match="not a converted specjax model"):
        specjax.load_model(str(tmp_path))


def test_shape_mismatch_names_the_tensor(tmp_path):
    cfg = from_hf_config(MODEL_SHAPES["tiny-llama"])
    params = init_params(cfg, seed=0, dtype=np.float32)
    params["layers"][1]["w_up"] = params["layers"][1]["w_up"][:, :-1]
    with pytest.raises(CheckpointError, match=r"layers\.1\.w_up has shape \(64, 127\)"):
        save_model_dir(tmp_path / "m", cfg, params, tokenizer_json=None, source="test")


def test_hf_config_weight_mismatch_names_the_tensor(tmp_path):
    transformers = pytest.importorskip("transformers")
    hf_cfg = transformers.LlamaConfig(vocab_size=64, hidden_size=32, num_hidden_layers=1, num_attention_heads=4,
                                      num_key_value_heads=2, intermediate_size=48)
    transformers.AutoModelForCausalLM.from_config(hf_cfg).save_pretrained(tmp_path / "hf")
    config = json.loads((tmp_path / "hf" / "config.json").read_text())
    config["intermediate_size"] = 40
    (tmp_path / "hf" / "config.json").write_text(json.dumps(config))
    proc = subprocess.run([sys.executable, "-m", "specjax.convert", f"--hf_dir={tmp_path / 'hf'}",
                           f"--out={tmp_path / 'out'}"], capture_output=True, text=True)
    assert proc.returncode == 2
    assert "Traceback" not in proc.stderr
    assert re.search(r"tensor layers\.0\.w_(down|gate|up) has shape \((32, 48|48, 32)\) but the config needs", proc.stderr)
    assert not (tmp_path / "out").exists()


def test_convert_cli_requires_a_source(tmp_path):
    proc = subprocess.run([sys.executable, "-m", "specjax.convert", f"--out={tmp_path / 'x'}"],
                          capture_output=True, text=True)
    assert proc.returncode == 2 and "exactly one of --hf_dir" in proc.stderr and "Traceback" not in proc.stderr


def test_unsupported_architecture():
    with pytest.raises(SpecjaxError, match="unsupported model_type 'gpt2'"):
        from_hf_config({"model_type": "gpt2"})


def test_home_override(tmp_path, monkeypatch):
    monkeypatch.setenv("SPECJAX_HOME", str(tmp_path / "h"))
    assert paths.models_dir() == tmp_path / "h" / "models"


def test_a_forward_rotates_every_layer_with_one_table(monkeypatch):
    """The rotary angles' cos / sin are computed once per forward and given to each layer step, whose compiled
    program then has no cos or sin of its own (inside it, XLA:CPU evaluates them once per element of every head);
    the rotation is the same either way, to float32 rounding (the fused cos may differ from the table's in the last
    bit)."""
    import jax.numpy as jnp

    from specjax.models import inference
    from specjax.models import transformer as T

    model = specjax.load_model("tiny-llama", init="random", seed=1)
    cfg, lp = model.config, model.params["layers"][0]
    positions = jnp.arange(16, dtype=jnp.int32)
    h = jax.random.normal(jax.random.key(0), (16, cfg.hidden_size), jnp.float32)
    table = T.rotary_step(cfg, positions)
    for given, computed in zip(T.project(cfg, lp, h, positions, rotary_table=table), T.project(cfg, lp, h, positions)):
        np.testing.assert_allclose(given, computed, rtol=1e-6, atol=1e-7)

    def trig(rotary_table):
        text = T._self_attention_layer.lower(cfg, lp, h, positions, positions < 16, rotary_table, fused=True).as_text()
        return "cosine" in text or "stablehlo.sine" in text

    assert trig(None) and not trig(table)
    tables = []
    layer = T.self_attention_layer
    monkeypatch.setattr(T, "self_attention_layer", lambda *a: tables.append(a[5]) or layer(*a))
    inference.forward_logits(cfg, model.params, [1, 2, 3])
    assert len(tables) == cfg.num_layers and tables[0] is not None and all(t is tables[0] for t in tables)
