"""--model as a Hugging Face hub id, a registered name or a local Hugging Face folder: converted once into
$SPECJAX_HOME/models, loaded from there afterwards, atomically, and one clear line when the hub cannot help.

The hub is never contacted: end-to-end runs use HF_HUB_OFFLINE=1 and a Hugging Face cache laid out by hand in
a temporary HF_HOME, as huggingface_hub lays it out (hub/models--ORG--NAME/{refs/main, snapshots/COMMIT/...}).
"""

import json
import os
import pathlib
import shutil
import subprocess
import sys

import numpy as np
import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

import specjax  # noqa: E402
from hf_checkpoints import write_gguf  # noqa: E402
from specjax import convert, hub, paths, resolve  # noqa: E402
from specjax.errors import ModelNotFoundError, SpecjaxError  # noqa: E402

REPO = pathlib.Path(__file__).resolve().parents[1]
COMMIT = "0123456789abcdef0123456789abcdef01234567"


def _tokenizer_json() -> str:
    """A byte-level BPE tokenizer.json trained on a few sentences (the eval's needle task encodes text)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=300, initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
                                  special_tokens=["<unk>", "<s>", "</s>"])
    tok.train_from_iterator(["The value of key 12 is 345. What is the value of key 12? Answer:"] * 20, trainer)
    return tok.to_str()


@pytest.fixture(scope="module")
def hf_checkpoint(tmp_path_factory) -> pathlib.Path:
    """A tiny random Llama saved by transformers in float16, with a tokenizer.json."""
    folder = tmp_path_factory.mktemp("tiny_llama_fp16")
    config = transformers.LlamaConfig(vocab_size=300, hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
                                      num_key_value_heads=2, intermediate_size=48, max_position_embeddings=4096,
                                      bos_token_id=1, eos_token_id=2)
    torch.manual_seed(0)
    transformers.AutoModelForCausalLM.from_config(config).to(torch.float16).save_pretrained(folder)
    (folder / "tokenizer.json").write_text(_tokenizer_json())
    return folder


def _put_in_hf_cache(hf_home: pathlib.Path, repo_id: str, files: list[pathlib.Path]) -> pathlib.Path:
    """Place files in a Hugging Face cache as a snapshot of repo_id's main branch; returns the snapshot folder."""
    repo = hf_home / "hub" / f"models--{repo_id.replace('/', '--')}"
    snapshot = repo / "snapshots" / COMMIT
    snapshot.mkdir(parents=True)
    (repo / "refs").mkdir()
    (repo / "refs" / "main").write_text(COMMIT)
    for f in files:
        shutil.copy(f, snapshot / f.name)
    return snapshot


def _offline_env(tmp_path: pathlib.Path) -> dict:
    return dict(os.environ, HF_HOME=str(tmp_path / "hf"), HF_HUB_OFFLINE="1", SPECJAX_HOME=str(tmp_path / "sj"),
                JAX_PLATFORMS="cpu")


def _eval(env: dict, model: str, out: pathlib.Path) -> subprocess.CompletedProcess:
    args = [f"--model={model}", "--task=needle", "--limit=4", "--systems=recompute", "--needle_facts=4",
            "--noprogress", f"--output_dir={out}"]
    return subprocess.run([sys.executable, "-m", "specjax.eval", *args], capture_output=True, text=True, cwd=REPO,
                          env=env, timeout=300)


def test_eval_converts_a_hub_model_once(tmp_path, hf_checkpoint):
    _put_in_hf_cache(tmp_path / "hf", "acme/tiny-llama", sorted(hf_checkpoint.iterdir()))
    env = _offline_env(tmp_path)
    first = _eval(env, "acme/tiny-llama", tmp_path / "out1")
    assert first.returncode == 0, first.stderr[-2000:]
    assert "converting acme/tiny-llama" in first.stderr
    converted = tmp_path / "sj" / "models" / "hf" / "acme--tiny-llama" / "main"
    manifest = json.loads((converted / "specjax_model.json").read_text())
    assert (manifest["source_dtype"], manifest["dtype"]) == ("float16", "float16")
    assert COMMIT in manifest["source"]
    results = json.loads((tmp_path / "out1" / "results.json").read_text())
    assert results["model"] == "acme/tiny-llama" and results["systems"]["recompute"]["accuracy"]["n"] == 4
    assert results["config"]["tokenizer"] == "model"  # the checkpoint's tokenizer.json was converted with it

    converted_at = (converted / "specjax_model.json").stat().st_mtime_ns
    shutil.rmtree(tmp_path / "hf")  # the second run must not need the hub cache (nor the hub)
    second = _eval(env, "acme/tiny-llama", tmp_path / "out2")
    assert second.returncode == 0, second.stderr[-2000:]
    assert "converting" not in second.stderr
    assert (converted / "specjax_model.json").stat().st_mtime_ns == converted_at


def test_missing_hub_repo_is_one_line(tmp_path):
    proc = _eval(_offline_env(tmp_path), "acme/no-such-model", tmp_path / "out")
    assert proc.returncode == 2
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1, proc.stderr
    assert lines[0].startswith("error: ") and "'acme/no-such-model'" in lines[0]
    assert "HF_HUB_OFFLINE" in lines[0] and "local folder" in lines[0]


def test_hub_gguf_repo_is_converted_from_its_gguf(tmp_path):
    write_gguf(tmp_path / "tiny.F16.gguf", "F16")
    _put_in_hf_cache(tmp_path / "hf", "acme/tiny-gguf", [tmp_path / "tiny.F16.gguf"])
    code = "import specjax; m = specjax.load_model('acme/tiny-gguf'); print(m.dtype, m.path)"
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=_offline_env(tmp_path),
                          timeout=120)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert proc.stdout.split()[0] == "float16" and proc.stdout.strip().endswith("hf/acme--tiny-gguf/main")


def test_registered_names_resolve_to_their_hub_repo(specjax_home, monkeypatch):
    asked = []
    monkeypatch.setattr(hub, "from_hub", lambda repo_id, revision=None: asked.append((repo_id, revision)))
    resolve.resolve_model_dir("opt-6.7b")
    resolve.resolve_model_dir("llama2-7b", revision="abc123")
    resolve.resolve_model_dir("qwen2.5-7b")
    assert asked == [("facebook/opt-6.7b", None), ("meta-llama/Llama-2-7b-hf", "abc123"), ("Qwen/Qwen2.5-7B", None)]
    with pytest.raises(SpecjaxError, match="--revision is for Hugging Face hub models"):
        resolve.resolve_model_dir("tiny-llama", revision="abc123")
    assert hub.hub_model_dir("acme/x", "refs/pr/1") == specjax_home / "models" / "hf" / "acme--x" / "refs--pr--1"


def test_local_hf_folder_is_converted_once_and_again_after_a_change(tmp_path, hf_checkpoint, specjax_home,
                                                                     conversions):
    folder = tmp_path / "my-checkpoint"
    shutil.copytree(hf_checkpoint, folder)
    model = specjax.load_model(str(folder))
    assert model.name == "my-checkpoint" and np.dtype(model.dtype).name == "float16"
    assert model.path.parent == specjax_home / "models" / "local" and model.path.name.startswith("my-checkpoint-")
    specjax.load_model(str(folder))
    assert conversions == [folder]
    later = (model.path / "specjax_model.json").stat().st_mtime + 10
    os.utime(folder / "model.safetensors", (later, later))  # newer, the same bytes: nothing to convert again
    specjax.load_model(str(folder))
    assert conversions == [folder]
    weights = bytearray((folder / "model.safetensors").read_bytes())
    weights[-1] ^= 1  # as a new training run writing its weights
    (folder / "model.safetensors").write_bytes(weights)
    specjax.load_model(str(folder))
    assert conversions == [folder, folder]


def test_interrupted_conversion_is_never_taken_for_a_finished_one(tmp_path, hf_checkpoint, specjax_home,
                                                                  conversions, monkeypatch):
    from specjax import checkpoint

    folder = tmp_path / "ckpt"
    shutil.copytree(hf_checkpoint, folder)
    out = hub.local_model_dir(folder)
    out.parent.mkdir(parents=True)
    (out.parent / f"{out.name}.partial-999999").mkdir()  # what a killed conversion leaves behind
    real = checkpoint._write_model_files

    def interrupted(tmp, *args):
        real(tmp, *args)  # every file written, manifest included, but not yet renamed into place
        raise KeyboardInterrupt

    monkeypatch.setattr(checkpoint, "_write_model_files", interrupted)
    with pytest.raises(KeyboardInterrupt):
        specjax.load_model(str(folder))
    assert not out.exists() and not list(out.parent.glob(f"{out.name}.partial-{os.getpid()}"))
    monkeypatch.setattr(checkpoint, "_write_model_files", real)
    model = specjax.load_model(str(folder))
    assert model.path == out and len(conversions) == 2


class _FakeHub:
    """snapshot_download over a fixed set of repo files: returns a snapshot holding those matching the patterns,
    as huggingface_hub does, and records each call's allow_patterns."""

    def __init__(self, root: pathlib.Path, names: list[str]):
        self.root, self.names, self.calls = root, names, []

    def __call__(self, repo_id, *, revision=None, allow_patterns=None, ignore_patterns=None):
        import fnmatch

        self.calls.append(allow_patterns)
        snapshot = self.root / "snapshot"
        snapshot.mkdir(exist_ok=True)
        for name in self.names:
            if any(fnmatch.fnmatch(name, p) for p in allow_patterns):
                (snapshot / name).write_text("x")
        return str(snapshot)


@pytest.mark.parametrize("files, wanted, calls", [
    (["config.json", "model.safetensors", "pytorch_model.bin", "tokenizer.json"], "snapshot", 1),
    (["config.json", "pytorch_model-00001-of-00002.bin", "pytorch_model.bin.index.json"], "snapshot", 2),
    (["model.Q8_0.gguf", "README.md"], "snapshot/model.Q8_0.gguf", 3),
])
def test_hub_download_prefers_safetensors_then_bin_then_gguf(tmp_path, specjax_home, monkeypatch, files, wanted,
                                                              calls):
    import huggingface_hub

    fake = _FakeHub(tmp_path, files)
    monkeypatch.setattr(huggingface_hub, "snapshot_download", fake)
    monkeypatch.setattr(huggingface_hub, "list_repo_files", lambda repo_id, revision=None: files)
    converted = []
    monkeypatch.setattr(hub, "_convert", lambda source, out, label: converted.append(source))
    hub.from_hub("acme/x")
    assert converted == [tmp_path / wanted] and len(fake.calls) == calls
    assert not any(p.endswith(".bin") for p in fake.calls[0])  # safetensors are asked for first
    assert "README.md" not in os.listdir(tmp_path / "snapshot")


def test_hub_repo_with_several_ggufs_asks_which(tmp_path, specjax_home, monkeypatch):
    import huggingface_hub

    monkeypatch.setattr(huggingface_hub, "snapshot_download", _FakeHub(tmp_path, ["a.Q4_0.gguf", "a.Q8_0.gguf"]))
    (tmp_path / "snapshot").mkdir()
    for name in ("a.Q4_0.gguf", "a.Q8_0.gguf"):  # already in the cache, so the hub is not asked for the list
        (tmp_path / "snapshot" / name).write_text("x")
    with pytest.raises(ModelNotFoundError, match=r"several \.gguf files \(a\.Q4_0\.gguf, a\.Q8_0\.gguf\).*--gguf"):
        hub.from_hub("acme/a")


def _hub_error(name: str):
    """One of huggingface_hub's errors, made without the HTTP response its constructor wants."""
    from huggingface_hub import errors

    cls = getattr(errors, name)
    error = cls.__new__(cls)
    Exception.__init__(error, f"{name} from the hub")
    return error


@pytest.mark.parametrize("error, says", [
    ("GatedRepoError", "is gated: accept its terms on https://huggingface.co/acme/x and set HF_TOKEN"),
    ("RepositoryNotFoundError", "was not found (a private repo needs HF_TOKEN)"),
    ("RevisionNotFoundError", "has no revision 'v2'; check --revision"),
])
def test_hub_errors_say_what_to_do(specjax_home, monkeypatch, error, says):
    import huggingface_hub

    def refuse(*args, **kwargs):
        raise _hub_error(error)

    monkeypatch.setattr(huggingface_hub, "snapshot_download", refuse)
    with pytest.raises(ModelNotFoundError) as e:
        specjax.load_model("acme/x", revision="v2")
    assert says in str(e.value) and "\n" not in str(e.value)
