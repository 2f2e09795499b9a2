"""Random tiny OPT / Llama / Qwen2 checkpoints written by transformers, converted by specjax.convert,
compared logit for logit with the PyTorch model (plain forward and prefill-then-decode)."""

import json
import subprocess
import sys

import numpy as np
import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

import specjax  # noqa: E402
from hf_checkpoints import CASES, VOCAB, write_hf_checkpoint  # noqa: E402
from specjax.convert import convert_hf_dir  # noqa: E402
from specjax.models import inference  # noqa: E402

TOL = 1e-4


@pytest.fixture(scope="module", params=list(CASES))
def converted(request, tmp_path_factory):
    hf_dir = tmp_path_factory.mktemp(request.param + "_hf")
    hf_model = write_hf_checkpoint(request.param, hf_dir)
    out = tmp_path_factory.mktemp(request.param + "_sj") / "model"
    convert_hf_dir(hf_dir, out, dtype="float32")
    return request.param, hf_model, hf_dir, specjax.load_model(str(out))


def _torch_logits(hf_model, ids):
    with torch.no_grad():
        return hf_model(torch.tensor([ids])).logits[0].numpy()


def test_layout_variant_written(converted):
    name, _, hf_dir, _ = converted
    if name == "llama_gqa_sharded":
        assert (hf_dir / "model.safetensors.index.json").is_file()
    if name == "opt_post_ln_project":
        assert (hf_dir / "pytorch_model.bin").is_file()


def test_forward_matches_pytorch(converted):
    _, hf_model, _, model = converted
    rng = np.random.default_rng(0)
    for n in (1, 7, 37):
        ids = rng.integers(0, VOCAB, n).tolist()
        ours = model.logits(ids)
        ref = _torch_logits(hf_model, ids)
        assert ours.shape == ref.shape
        np.testing.assert_allclose(ours, ref, atol=TOL, rtol=0)


def test_prefill_then_decode_matches_pytorch(converted):
    _, hf_model, _, model = converted
    rng = np.random.default_rng(1)
    ids = rng.integers(0, VOCAB, 20).tolist()
    ref = _torch_logits(hf_model, ids)
    cache = inference.empty_cache(model.config, 32, model.dtype)
    prefill = inference.extend(model.config, model.params, cache, ids[:12])
    np.testing.assert_allclose(prefill, ref[:12], atol=TOL, rtol=0)
    for i in range(12, 20):
        step = inference.extend(model.config, model.params, cache, [ids[i]])
        np.testing.assert_allclose(step[0], ref[i], atol=TOL, rtol=0)
    assert cache.length == 20


def test_loglikelihood_is_sum_of_log_softmax(converted):
    _, hf_model, _, model = converted
    rng = np.random.default_rng(2)
    ctx, cont = rng.integers(0, VOCAB, 9).tolist(), rng.integers(0, VOCAB, 4).tolist()
    full = model.logits(ctx + cont)
    logp = full - np.log(np.exp(full - full.max(-1, keepdims=True)).sum(-1, keepdims=True)) - full.max(-1, keepdims=True)
    rows = np.arange(len(ctx) - 1, len(ctx) + len(cont) - 1)
    expected = logp[rows, cont].sum()
    total, greedy = model.loglikelihood(ctx, cont)
    assert total == pytest.approx(expected, abs=1e-4)
    assert greedy == bool((full[rows].argmax(-1) == np.array(cont)).all())
    # The greedy continuation must be reported as greedy.
    greedy_cont = [int(full[len(ctx) - 1].argmax())]
    assert model.loglikelihood(ctx, greedy_cont)[1] is True


def _convert_cli(hf_dir, out, *flags):
    proc = subprocess.run([sys.executable, "-m", "specjax.convert", f"--hf_dir={hf_dir}", f"--out={out}", *flags],
                          capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr
    return json.loads((out / "specjax_model.json").read_text())


def test_convert_cli_casts_only_when_asked(tmp_path):
    hf_model = write_hf_checkpoint("llama_tied", tmp_path / "hf")
    kept = _convert_cli(tmp_path / "hf", tmp_path / "kept")
    assert (kept["source_dtype"], kept["dtype"]) == ("float32", "float32")
    cast = _convert_cli(tmp_path / "hf", tmp_path / "cast", "--dtype=bfloat16")
    assert (cast["source_dtype"], cast["dtype"]) == ("float32", "bfloat16")
    model = specjax.load_model(str(tmp_path / "cast"), dtype="float32")
    ids = list(range(10))
    ours, ref = model.logits(ids), _torch_logits(hf_model, ids)
    # bf16-stored weights: close to the fp32 model, but not equal to it.
    np.testing.assert_allclose(ours, ref, atol=5e-2)
    assert np.abs(ours - ref).max() > 1e-6
