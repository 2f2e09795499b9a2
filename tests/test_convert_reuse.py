"""A local Hugging Face folder's conversion is reused only while the files it was converted from hold the same
content (not the same timestamps); `convert --out` never deletes a file its conversions did not write; and a
converted model's folder that lost its manifest is named as such, with the fix, in one line."""

import json
import os
import pathlib
import shutil
import subprocess
import sys
import time

import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

import specjax  # noqa: E402
from hf_checkpoints import write_hf_checkpoint  # noqa: E402
from specjax import checkpoint, convert  # noqa: E402
from specjax.checkpoint import MANIFEST  # noqa: E402
from specjax.errors import CheckpointError  # noqa: E402

DAY_AGO = time.time() - 86400


def _tokenizer_json() -> str:
    from tokenizers import Tokenizer, models, pre_tokenizers

    tok = Tokenizer(models.WordLevel({"<unk>": 0, "a": 1, "b": 2}, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    return tok.to_str()


@pytest.fixture(scope="module")
def hf(tmp_path_factory) -> dict:
    """Hugging Face folders of one Llama shape: "base" and "tuned" (other weights, files of the same sizes),
    "base+tok" (base with a tokenizer.json); each file's mtime a day old, as a checkpoint copied with cp -p has."""
    root = tmp_path_factory.mktemp("hf")
    folders = {"base": root / "base", "tuned": root / "tuned", "base+tok": root / "base+tok"}
    write_hf_checkpoint("llama_tied", folders["base"], seed=0)
    write_hf_checkpoint("llama_tied", folders["tuned"], seed=1)
    shutil.copytree(folders["base"], folders["base+tok"])
    (folders["base+tok"] / "tokenizer.json").write_text(_tokenizer_json())
    for path in root.rglob("*"):
        os.utime(path, (DAY_AGO, DAY_AGO))
    return folders


@pytest.fixture
def digested(monkeypatch) -> list:
    """The names of the files whose content was digested during a test."""
    names = []
    real = checkpoint.xxh3_file

    def counting(path):
        names.append(pathlib.Path(path).name)
        return real(path)

    monkeypatch.setattr(checkpoint, "xxh3_file", counting)
    return names


def _manifest(model_dir: pathlib.Path) -> dict:
    return json.loads((model_dir / MANIFEST).read_text())


def _weights_digest_of(hf_dir: pathlib.Path, out: pathlib.Path) -> str:
    convert.convert_hf_dir(hf_dir, out)
    return _manifest(out)["weights_digest"]


def _cp_p(src: pathlib.Path, dst: pathlib.Path) -> None:
    shutil.copy2(src, dst)  # as cp -p: the same file rewritten in place, the source's mtime set on it


def _rsync_a(src: pathlib.Path, dst: pathlib.Path) -> None:
    tmp = dst.with_name(f".{dst.name}.tmp")  # as rsync -a: a new file beside it, the source's mtime, renamed over
    shutil.copy2(src, tmp)
    os.replace(tmp, dst)


@pytest.mark.parametrize("copy", [_cp_p, _rsync_a], ids=["cp-p", "rsync-a"])
def test_weights_replaced_with_an_older_mtime_are_converted_again(hf, tmp_path, specjax_home, conversions, capsys,
                                                                  copy):
    folder = tmp_path / "ckpt"
    shutil.copytree(hf["base"], folder)
    first = specjax.load_model(str(folder))
    weights = folder / "model.safetensors"
    assert weights.stat().st_size == (hf["tuned"] / "model.safetensors").stat().st_size  # size alone cannot tell
    capsys.readouterr()
    copy(hf["tuned"] / "model.safetensors", weights)
    assert weights.stat().st_mtime < (first.path / MANIFEST).stat().st_mtime  # older than the conversion
    second = specjax.load_model(str(folder))
    assert conversions == [folder, folder] and second.path == first.path
    assert second.weights_digest == _weights_digest_of(hf["tuned"], tmp_path / "tuned") != first.weights_digest
    lines = capsys.readouterr().err.splitlines()
    assert len(lines) == 1 and "model.safetensors has other content): converting it again ->" in lines[0], lines


def test_a_tokenizer_copied_in_with_an_older_mtime_is_converted_with_the_model(hf, tmp_path, specjax_home,
                                                                               conversions, capsys):
    folder = tmp_path / "ckpt"
    shutil.copytree(hf["base"], folder)
    specjax.load_model(str(folder))
    capsys.readouterr()
    _cp_p(hf["base+tok"] / "tokenizer.json", folder / "tokenizer.json")
    model = specjax.load_model(str(folder))
    assert len(conversions) == 2 and model.tokenizer is not None  # converted without one, it would raise
    lines = capsys.readouterr().err.splitlines()
    assert len(lines) == 1 and "(tokenizer.json is new): converting it again" in lines[0], lines


def test_unchanged_files_are_not_read_again_and_a_touch_is_not_a_change(hf, tmp_path, specjax_home, conversions,
                                                                        digested, monkeypatch):
    folder = tmp_path / "ckpt"
    shutil.copytree(hf["base"], folder)  # fresh files: ctimes of now
    out = specjax.load_model(str(folder)).path
    sources = _manifest(out)["source_files"]
    assert sorted(sources) == ["config.json", "model.safetensors"] and sorted(digested) == sorted(sources)
    assert {r["stat"] is None for r in sources.values()} == {True}  # too fresh for the stat to stand for them
    monkeypatch.setattr(checkpoint, "_SETTLED_NS", 0)  # from here on every stat is old enough
    digested.clear()
    specjax.load_model(str(folder))
    assert sorted(digested) == sorted(sources)  # digested again, and now their stats are kept
    digested.clear()
    specjax.load_model(str(folder))
    assert digested == []  # an unchanged stat: nothing read
    os.utime(folder / "model.safetensors")  # touched: new mtime and ctime, the same bytes
    specjax.load_model(str(folder))
    assert digested == ["model.safetensors"] and conversions == [folder]
    digested.clear()
    specjax.load_model(str(folder))
    assert digested == [] and conversions == [folder]


def test_a_conversion_without_source_digests_is_converted_again(hf, tmp_path, specjax_home, conversions, capsys):
    folder = tmp_path / "ckpt"
    shutil.copytree(hf["base"], folder)
    out = specjax.load_model(str(folder)).path
    manifest = _manifest(out)
    del manifest["source_files"]  # as converted by code that kept none
    (out / MANIFEST).write_text(json.dumps(manifest))
    capsys.readouterr()
    specjax.load_model(str(folder))
    specjax.load_model(str(folder))
    assert conversions == [folder, folder]
    assert "kept no digests of the files it read): converting it again" in capsys.readouterr().err


def test_conversion_reads_only_the_files_its_reuse_checks(hf, tmp_path):
    """Every file of the folder that converting opens is one whose content decides the conversion's reuse."""
    folder = tmp_path / "ckpt"
    shutil.copytree(hf["base+tok"], folder)
    for name in ("README.md", "tokenizer_config.json", "special_tokens_map.json"):
        (folder / name).write_text("{}")
    opened, listening = set(), [True]

    def hook(event, args):
        if listening[0] and event == "open" and isinstance(args[0], (str, bytes, os.PathLike)):
            path = pathlib.Path(os.fsdecode(args[0]))
            if path.parent == folder:
                opened.add(path.name)

    sys.addaudithook(hook)  # cannot be removed: it stops listening instead
    try:
        convert.convert_hf_dir(folder, tmp_path / "out")
    finally:
        listening[0] = False
    checked = {p.name for p in convert.hf_source_files(folder)}
    assert checked == {"config.json", "tokenizer.json", "model.safetensors"}
    assert {"config.json", "tokenizer.json"} <= opened <= checked


def _tree(folder: pathlib.Path) -> dict:
    return {str(p.relative_to(folder)): p.read_bytes() if p.is_file() else None for p in sorted(folder.rglob("*"))}


def _convert_cli(*args) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "specjax.convert", *args], capture_output=True, text=True,
                          env=dict(os.environ, JAX_PLATFORMS="cpu"), timeout=300)


def test_convert_out_keeps_files_it_did_not_write(hf, tmp_path):
    out = tmp_path / "model"
    convert.convert_hf_dir(hf["base"], out)
    (out / "notes.txt").write_text("what I found")
    (out / "params" / "mine.txt").write_text("mine too")
    (out / "runs").mkdir()
    before = _tree(out)
    proc = _convert_cli(f"--hf_dir={hf['tuned']}", f"--out={out}")
    assert proc.returncode == 2 and "Traceback" not in proc.stderr
    errors = [line for line in proc.stderr.splitlines() if line.startswith("error:")]
    assert len(errors) == 1 and errors[0] == (
        f"error: {out} holds a converted model and files its conversion did not write (notes.txt, params/mine.txt, "
        f"runs); nothing was written or deleted: move them out of {out} or give the converted model a new folder")
    with pytest.raises(CheckpointError, match="files its conversion did not write"):
        convert.convert_hf_dir(hf["tuned"], out)  # the Python API refuses too
    assert _tree(out) == before and sorted(p.name for p in tmp_path.iterdir()) == ["model"]


def test_convert_out_replaces_every_file_of_the_converted_model_there(hf, tmp_path):
    out = tmp_path / "model"
    convert.convert_hf_dir(hf["base+tok"], out)
    assert (out / "tokenizer.json").is_file()
    convert.convert_hf_dir(hf["tuned"], out)
    assert not (out / "tokenizer.json").exists()  # the old conversion's, not the new one's: gone
    assert sorted(str(p.relative_to(out)) for p in out.rglob("*") if p.is_file()) == sorted(
        [MANIFEST, *_manifest(out)["files"]])
    model = specjax.load_model(str(out))
    assert model.weights_digest == _weights_digest_of(hf["tuned"], tmp_path / "tuned")


def test_convert_out_never_deletes_through_a_symlinked_folder(hf, tmp_path):
    out, elsewhere = tmp_path / "model", tmp_path / "elsewhere"
    convert.convert_hf_dir(hf["base"], out)
    shutil.move(out / "params", elsewhere)
    (out / "params").symlink_to(elsewhere, target_is_directory=True)
    before = _tree(elsewhere)
    with pytest.raises(CheckpointError, match=r"files its conversion did not write \(params\)"):
        convert.convert_hf_dir(hf["tuned"], out)
    assert _tree(elsewhere) == before


def test_a_converted_model_without_its_manifest_says_so_and_how_to_fix_it(hf, tmp_path, specjax_home, capsys):
    folder = tmp_path / "copied-model"
    convert.convert_hf_dir(hf["base"], folder)
    (folder / MANIFEST).unlink()  # as a copy that left it behind
    capsys.readouterr()
    with pytest.raises(CheckpointError) as e:
        specjax.load_model(str(folder))
    message = str(e.value)
    assert "\n" not in message and message.startswith(
        f"{folder} is neither a converted specjax model (no {MANIFEST}) nor a Hugging Face checkpoint")
    assert "python -m specjax.convert --hf_dir HF_DIR --out NEW_DIR" in message
    assert "point --model at the Hugging Face folder" in message and "model_type" not in message
    assert capsys.readouterr().err == "" and not (specjax_home / "models").exists()  # nothing converted
    with pytest.raises(CheckpointError, match="is neither a converted specjax model"):
        convert.convert_hf_dir(folder, tmp_path / "out")
