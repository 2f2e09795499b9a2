"""The weights digest a prefix-KV store is bound to: computed once when a checkpoint is converted and kept in its
manifest (a later load hashes nothing), added on the first load of a folder converted without one, derived from seed
and shapes for random weights; and conversion never deletes a folder that is not a converted model."""

import json
import logging
import os
import shutil
import subprocess
import sys

import jax
import numpy as np
import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

import specjax  # noqa: E402
from hf_checkpoints import convert_two_llamas  # noqa: E402
from specjax import api, checkpoint  # noqa: E402
from specjax.checkpoint import MANIFEST, load_model_dir  # noqa: E402
from specjax.convert import convert_hf_dir  # noqa: E402
from specjax.errors import CheckpointError  # noqa: E402


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    """Two Llama checkpoints of one shape, other weights (a base model and a fine-tune): (hf dirs, converted dirs)."""
    return convert_two_llamas(tmp_path_factory.mktemp("two_llamas"))


def _manifest(model_dir):
    return json.loads((model_dir / MANIFEST).read_text())


def _no_hashing(monkeypatch):
    """Make any digest of the weights fail the test; returns the list of attempts."""
    attempts = []

    def refuse(params):
        attempts.append(1)
        raise AssertionError("the weights were hashed")

    monkeypatch.setattr(checkpoint, "params_digest", refuse)
    monkeypatch.setattr(api, "params_digest", refuse)
    return attempts


def test_conversion_keeps_the_digest_and_a_later_load_hashes_no_weights(checkpoints, monkeypatch):
    _, (model0, model1) = checkpoints
    digest = _manifest(model0)["weights_digest"]
    _, params, _ = load_model_dir(model0)
    assert digest == checkpoint.params_digest(params)  # the digest of exactly the weights stored
    assert _manifest(model1)["weights_digest"] != digest  # other weights, same shapes
    attempts = _no_hashing(monkeypatch)
    model = specjax.load_model(str(model0), verify_checksums=False)
    assert attempts == [] and model.weights_digest == digest and model.tokenizer_digest is None


def test_a_folder_converted_without_a_digest_gets_it_once_on_first_load(checkpoints, tmp_path, monkeypatch):
    _, (model0, _) = checkpoints
    old = tmp_path / "old"
    shutil.copytree(model0, old)
    manifest = _manifest(old)
    digest = manifest.pop("weights_digest")
    manifest.pop("tokenizer_digest")
    (old / MANIFEST).write_text(json.dumps(manifest))
    assert specjax.load_model(str(old)).weights_digest == digest  # hashed the params it loaded, stored it
    assert _manifest(old)["weights_digest"] == digest and "tokenizer_digest" in _manifest(old)
    attempts = _no_hashing(monkeypatch)
    assert specjax.load_model(str(old)).weights_digest == digest and attempts == []


def test_a_read_only_folder_without_a_digest_derives_it_and_says_so(checkpoints, tmp_path, monkeypatch, caplog):
    _, (model0, _) = checkpoints
    old = tmp_path / "old"
    shutil.copytree(model0, old)
    manifest = _manifest(old)
    digest = manifest.pop("weights_digest")
    (old / MANIFEST).write_text(json.dumps(manifest))
    before = (old / MANIFEST).read_bytes()

    def read_only(src, dst):
        raise PermissionError(30, "Read-only file system")

    monkeypatch.setattr(checkpoint.os, "replace", read_only)
    with caplog.at_level(logging.WARNING):
        assert specjax.load_model(str(old)).weights_digest == digest  # never "any weights"
    assert "without a weights digest; derived" in caplog.text and "Read-only file system" in caplog.text
    assert (old / MANIFEST).read_bytes() == before
    assert not [p for p in old.iterdir() if ".partial-" in p.name]


def test_random_weights_are_named_by_seed_shapes_and_dtype():
    a = specjax.load_model("tiny-llama", init="random", seed=0)
    assert a.weights_digest == specjax.load_model("tiny-llama", init="random", seed=0).weights_digest
    assert a.weights_digest != specjax.load_model("tiny-llama", init="random", seed=1).weights_digest
    assert a.weights_digest != specjax.load_model("tiny-opt", init="random", seed=0).weights_digest
    assert a.weights_digest != specjax.load_model("tiny-llama", init="random", seed=0,
                                                  dtype="bfloat16").weights_digest


def test_a_model_built_by_hand_is_named_by_its_params():
    a = specjax.load_model("tiny-llama", init="random", seed=0)
    by_hand = api.Model("by-hand", a.config, a.params, "pretrained")
    assert by_hand.weights_digest == checkpoint.params_digest(jax.tree.map(np.asarray, a.params))
    changed = jax.tree.map(lambda x: x, a.params)
    changed["embed"] = a.params["embed"] + 1
    assert api.Model("other", a.config, changed, "pretrained").weights_digest != by_hand.weights_digest


def _convert(*args):
    return subprocess.run([sys.executable, "-m", "specjax.convert", *args], capture_output=True, text=True,
                          env=dict(os.environ, JAX_PLATFORMS="cpu"), timeout=300)


def test_convert_refuses_a_folder_that_is_not_a_converted_model(checkpoints, tmp_path):
    (hf0, _), _ = checkpoints
    out = tmp_path / "my-folder"
    out.mkdir()
    (out / "thesis.tex").write_text("years of work")
    proc = _convert(f"--hf_dir={hf0}", f"--out={out}")
    assert proc.returncode == 2 and "Traceback" not in proc.stderr
    errors = [line for line in proc.stderr.splitlines() if line.startswith("error:")]
    assert len(errors) == 1 and f"{out} holds files and is not a converted specjax model; nothing was written or " \
        "deleted: give the converted model a new or empty folder" in errors[0]
    assert [p.name for p in out.iterdir()] == ["thesis.tex"] and (out / "thesis.tex").read_text() == "years of work"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["my-folder"]  # no partial conversion left beside it
    with pytest.raises(CheckpointError, match="holds files and is not a converted specjax model"):
        convert_hf_dir(hf0, out)  # the Python API refuses too
    assert [p.name for p in out.iterdir()] == ["thesis.tex"]


def test_convert_replaces_a_converted_model_and_says_so(checkpoints, tmp_path):
    (hf0, hf1), (_, model1) = checkpoints
    out = tmp_path / "model"
    convert_hf_dir(hf0, out)
    proc = _convert(f"--hf_dir={hf1}", f"--out={out}")
    assert proc.returncode == 0, proc.stderr
    assert f"note: {out} holds a converted model; it is replaced" in proc.stdout
    assert _manifest(out)["weights_digest"] == _manifest(model1)["weights_digest"]


def test_a_folder_that_is_not_a_model_is_not_told_to_be_converted_over(tmp_path):
    folder = tmp_path / "notes"
    folder.mkdir()
    (folder / "todo.txt").write_text("keep me")
    with pytest.raises(CheckpointError) as e:
        specjax.load_model(str(folder))
    assert "is not a converted specjax model" in str(e.value) and f"--out {folder}" not in str(e.value)
    assert "--out NEW_DIR" in str(e.value)
