"""Checkpoints from the Hugging Face hub or a local Hugging Face folder, converted once into specjax's models folder.

A hub id ORG/NAME is downloaded by huggingface_hub (which honours HF_HOME, HF_HUB_OFFLINE and HF_TOKEN and shows
its own progress), converted into models_dir()/hf/ORG--NAME/REVISION and from then on loaded from there without
asking the hub. A local folder is converted into models_dir()/local/NAME-HASH of its absolute path, and again
when a file the conversion read has other content now, or the conversion would read other files (`_stale`).
"""

from __future__ import annotations

import contextlib
import hashlib
import pathlib
import re
import sys

from specjax import paths
from specjax.checkpoint import MANIFEST, read_manifest, source_unchanged, store_manifest
from specjax.errors import ModelNotFoundError

_HUB_ID = re.compile(r"[A-Za-z0-9][\w.-]*/[\w.-]+")
# Everything is read from the repo's top level; subfolders (original/, onnx/, ...) hold other formats.
_METADATA = ["config.json", "tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "vocab.json",
             "merges.txt"]
# Weight files in order of preference: a repo with safetensors does not need its PyTorch pickles.
_WEIGHT_FORMATS = (["model*.safetensors", "model.safetensors.index.json"],
                   ["pytorch_model*.bin", "pytorch_model.bin.index.json"])
_ELSEWHERE = "or give a local folder (--model /path/to/checkpoint with config.json and weights)"


def _say(msg: str) -> None:
    print(f"[specjax] {msg}", file=sys.stderr, flush=True)


def is_hub_id(name: str) -> bool:
    return _HUB_ID.fullmatch(name) is not None


def hub_model_dir(repo_id: str, revision: str | None) -> pathlib.Path:
    """Where the conversion of `repo_id` at `revision` lives (one folder per repo and revision)."""
    return paths.models_dir() / "hf" / repo_id.replace("/", "--") / (revision or "main").replace("/", "--")


def local_model_dir(hf_dir: pathlib.Path) -> pathlib.Path:
    """Where the conversion of a local Hugging Face folder lives, keyed by its absolute path."""
    hf_dir = hf_dir.resolve()
    key = hashlib.sha256(str(hf_dir).encode()).hexdigest()[:12]
    return paths.models_dir() / "local" / f"{hf_dir.name}-{key}"


def from_hub(repo_id: str, revision: str | None = None) -> pathlib.Path:
    """The converted model of a hub repo; downloads and converts it the first time only."""
    out = hub_model_dir(repo_id, revision)
    if (out / MANIFEST).is_file():
        return out
    snapshot, gguf = _download(repo_id, revision)
    _convert(gguf or snapshot, out, f"{repo_id} ({snapshot.name})")
    return out


def from_local_folder(hf_dir: pathlib.Path) -> pathlib.Path:
    """The converted model of a local Hugging Face folder; converts it when new, and again when changed since."""
    from specjax.convert import read_hf_config

    read_hf_config(hf_dir)  # a converted model without its manifest is refused before anything is converted
    out = local_model_dir(hf_dir)
    label = str(hf_dir.resolve())
    if not (out / MANIFEST).is_file():
        _convert(hf_dir, out, label)
    elif why := _stale(hf_dir, out):
        _convert(hf_dir, out, label, changed=why)
    return out


def _stale(hf_dir: pathlib.Path, out: pathlib.Path) -> str | None:
    """Why the conversion in `out` does not hold what converting `hf_dir` now gives (None: it does).

    Decided by content, never by timestamps (cp -p, rsync -a and tar keep an older checkpoint's mtime): the files
    a conversion reads now must be the ones it read, each of the recorded size and xxh3-128 digest. A file whose
    stat (size, mtime, ctime, inode, device) is the one recorded is not read again: replacing or rewriting a file
    changes its ctime (see checkpoint.source_record). A digest that matches under a new stat (a touch, a copy of
    the same bytes) is recorded in the conversion's manifest, so the next check reads nothing."""
    from specjax.convert import hf_source_files

    manifest = read_manifest(out)
    recorded = manifest.get("source_files")
    if not recorded:
        return "its conversion kept no digests of the files it read"
    now = {p.name: p for p in hf_source_files(hf_dir)}
    added, gone = sorted(set(now) - set(recorded)), sorted(set(recorded) - set(now))
    if added or gone:
        return ", ".join([f"{name} is new" for name in added] + [f"{name} is gone" for name in gone])
    records = {}
    for name, path in now.items():
        same, records[name] = source_unchanged(path, recorded[name])
        if not same:
            return f"{name} has other content"
    if records != recorded:
        with contextlib.suppress(OSError):  # read-only: the digests are taken again next time
            store_manifest(out, dict(manifest, source_files=records))
    return None


def _convert(source: pathlib.Path, out: pathlib.Path, label: str, changed: str | None = None) -> None:
    """Convert `source` into `out`, saying so in one line; `changed`: why the conversion there is replaced."""
    from specjax.convert import convert_gguf, convert_hf_dir

    if changed:
        _say(f"{label} has changed since it was converted ({changed}): converting it again -> {out}")
    else:
        _say(f"converting {label} -> {out} (once; later runs load it from there)")
    if source.suffix == ".gguf":
        convert_gguf(source, out)
    else:
        convert_hf_dir(source, out)


def _download(repo_id: str, revision: str | None) -> tuple[pathlib.Path, pathlib.Path | None]:
    """(snapshot folder, its GGUF file or None): config, tokenizer and weights, safetensors when the repo has
    them, else PyTorch .bin files, else its one .gguf file."""
    for weights in _WEIGHT_FORMATS:
        snapshot = _snapshot(repo_id, revision, _METADATA + weights)
        if any(next(snapshot.glob(pattern), None) for pattern in weights):
            return snapshot, None
    names = [p.name for p in snapshot.glob("*.gguf")] or _gguf_names_on_hub(repo_id, revision)
    if len(names) != 1:
        found = f"several .gguf files ({', '.join(sorted(names))})" if names else "no .gguf file"
        raise ModelNotFoundError(
            f"Hugging Face repo {repo_id!r} has no model*.safetensors or pytorch_model*.bin weights and {found}; "
            f"convert the file you want with `python -m specjax.convert --gguf FILE --out DIR` and pass --model DIR")
    return snapshot, _snapshot(repo_id, revision, names) / names[0]


def _gguf_names_on_hub(repo_id: str, revision: str | None) -> list[str]:
    from huggingface_hub import list_repo_files

    try:
        files = list_repo_files(repo_id, revision=revision)
    except Exception as e:  # huggingface_hub's network errors have no common base; each gets one line
        raise ModelNotFoundError(_explain(e, repo_id, revision)) from None
    return [f for f in files if f.endswith(".gguf") and "/" not in f]


def _snapshot(repo_id: str, revision: str | None, patterns: list[str]) -> pathlib.Path:
    """The cached snapshot of these files of the repo, downloading what is missing when the hub can be reached."""
    try:
        from huggingface_hub import snapshot_download
    except ImportError:
        raise ModelNotFoundError(f"loading {repo_id!r} from the Hugging Face hub needs huggingface_hub "
                                 f"(pip install huggingface_hub), {_ELSEWHERE}") from None
    try:
        return pathlib.Path(snapshot_download(repo_id, revision=revision, allow_patterns=patterns,
                                              ignore_patterns=["*/*"]))
    except Exception as e:  # as above: map whatever the hub client raises to one line naming the fix
        raise ModelNotFoundError(_explain(e, repo_id, revision)) from None


def _explain(error: Exception, repo_id: str, revision: str | None) -> str:
    """One line saying why `repo_id` could not be had and what to do about it."""
    from huggingface_hub import constants, errors

    at = f" at revision {revision!r}" if revision else ""
    if isinstance(error, errors.GatedRepoError):
        return (f"Hugging Face repo {repo_id!r} is gated: accept its terms on https://huggingface.co/{repo_id} "
                f"and set HF_TOKEN, {_ELSEWHERE}")
    if isinstance(error, errors.RevisionNotFoundError):
        return f"Hugging Face repo {repo_id!r} has no revision {revision!r}; check --revision"
    if isinstance(error, errors.RepositoryNotFoundError):
        return (f"Hugging Face repo {repo_id!r} was not found (a private repo needs HF_TOKEN); check the name, "
                f"{_ELSEWHERE}")
    missing = f"Hugging Face repo {repo_id!r}{at} is not (fully) in the cache {constants.HF_HUB_CACHE}"
    pinned = f" --revision {revision}" if revision else ""
    download = f"download it with `hf download {repo_id}{pinned}`"
    if constants.HF_HUB_OFFLINE:
        return f"{missing} and HF_HUB_OFFLINE is set: unset it to download, {download}, {_ELSEWHERE}"
    detail = str(error).splitlines()[0] if str(error) else type(error).__name__
    return (f"{missing} and the hub could not be reached ({detail}): connect to the network (and set HF_TOKEN if "
            f"the repo needs it), {download}, {_ELSEWHERE}")
