"""Converted-model directories: an orbax checkpoint of the params, config.json, tokenizer.json and a
checksum manifest so that a truncated or corrupt file is reported instead of loaded.

Layout of a model directory:
    config.json          specjax ModelConfig
    params/              orbax StandardCheckpointer tree (the param_specs tree of the config)
    tokenizer.json       Hugging Face tokenizers file (optional)
    specjax_model.json   {"format": 1, "weights": "pretrained", "source": ..., "dtype": ..., "source_dtype": ...,
                          "weights_digest": sha256, "tokenizer_digest": sha256 | null,
                          "files": {relpath: [size, sha256]},
                          "source_files": {name: {"size", "xxh3_128", "stat"}} | null}
                         dtype: as stored; source_dtype: the checkpoint's own; source_files: the Hugging Face
                         folder's files the conversion read (`source_record`; null for a GGUF file)

The weights digest (every tensor's name, dtype, shape and bytes, `params_digest`) names the weights a prefix-KV
store was written by. It is computed once, when the model is converted; a folder converted by older code gets it
on its first load (from the params that load reads anyway) and keeps it, so later loads hash nothing.
"""

from __future__ import annotations

import contextlib
import errno
import hashlib
import json
import logging
import os
import pathlib
import shutil
import time

import jax
import numpy as np

from specjax.config import ModelConfig, load_config, save_config
from specjax.errors import CheckpointError
from specjax.models.params import Params, check_params, param_specs

MANIFEST = "specjax_model.json"
FORMAT = 1
# A file's stat is trusted to stand for its content only once its ctime is this much in the past (see source_record)
_SETTLED_NS = 2_000_000_000

log = logging.getLogger(__name__)


def _digest_file(path: pathlib.Path, h, block_bytes: int) -> str:
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(block_bytes), b""):
            h.update(block)
    return h.hexdigest()


def sha256_file(path: pathlib.Path) -> str:
    return _digest_file(path, hashlib.sha256(), 1 << 22)


def xxh3_file(path: pathlib.Path) -> str:
    import xxhash

    return _digest_file(path, xxhash.xxh3_128(), 1 << 24)


def _stat_key(path: pathlib.Path) -> list[int]:
    st = path.stat()
    return [st.st_size, st.st_mtime_ns, st.st_ctime_ns, st.st_ino, st.st_dev]


def source_record(path: pathlib.Path) -> dict:
    """What a conversion keeps of a file it read: size, xxh3-128 digest of the content, and the file's stat
    [size, mtime_ns, ctime_ns, inode, device] when that may stand for the content (else None).

    Any replacement of a file changes its ctime, which no user call can set back (cp -p and rsync -a keep the
    mtime, not the ctime; rsync and tar also give a new inode), so an unchanged stat means unchanged content and
    `source_unchanged` reads nothing. The stat is kept only when it was the same before and after digesting and
    the ctime is _SETTLED_NS old: a write within the filesystem's timestamp granularity of the read could
    otherwise leave the stat as it was."""
    before = _stat_key(path)
    digest = xxh3_file(path)
    settled = time.time_ns() - before[2] > _SETTLED_NS and _stat_key(path) == before
    return {"size": before[0], "xxh3_128": digest, "stat": before if settled else None}


def source_unchanged(path: pathlib.Path, record: dict) -> tuple[bool, dict]:
    """(whether `path` holds the content `record` was made of, its record now): the stat when it matches the one
    kept, else the size and the digest of the content."""
    if not path.is_file() or path.stat().st_size != record["size"]:
        return False, record
    if record.get("stat") is not None and _stat_key(path) == record["stat"]:
        return True, record
    now = source_record(path)
    return now["xxh3_128"] == record["xxh3_128"], now


def params_digest(params: Params) -> str:
    """sha256 over every tensor's path in the tree, dtype, shape and bytes, in the tree's (sorted) order."""
    h = hashlib.sha256()
    for path, leaf in jax.tree_util.tree_flatten_with_path(params)[0]:
        a = np.ascontiguousarray(np.asarray(leaf))
        h.update(f"{jax.tree_util.keystr(path)}|{a.dtype.name}|{a.shape};".encode())
        h.update(a.reshape(-1).view(np.uint8).data)
    return h.hexdigest()


def text_digest(text: str | None) -> str | None:
    """sha256 of a tokenizer file's text (None: no tokenizer)."""
    return None if text is None else hashlib.sha256(text.encode("utf-8")).hexdigest()


def _data_files(root: pathlib.Path) -> list[pathlib.Path]:
    return sorted(p for p in root.rglob("*") if p.is_file() and p.name != MANIFEST)


def save_model_dir(
    out: pathlib.Path,
    cfg: ModelConfig,
    params: Params,
    *,
    tokenizer_json: str | None,
    source: str,
    source_dtype: str | None = None,
    weights: str = "pretrained",
    source_files: dict | None = None,
) -> None:
    """Write a model directory atomically: everything goes to a temp dir beside `out`, renamed over it at the
    end, so an interrupted conversion never leaves a directory that looks finished (loading needs the manifest,
    written last). The temp dir's name holds the process id, so two processes converting at once do not share it.
    A converted model already in `out` is replaced by deleting only the files its conversion wrote."""
    out = pathlib.Path(out).expanduser().resolve()
    replaces_model(out)  # refuses a folder of other files before anything is written
    check_params(cfg, params, source)
    tmp = out.with_name(f"{out.name}.partial-{os.getpid()}")
    shutil.rmtree(tmp, ignore_errors=True)  # left by a killed process that had this id
    tmp.mkdir(parents=True)
    try:
        _write_model_files(tmp, cfg, params, tokenizer_json, source, source_dtype, weights, source_files)
        if replaces_model(out):  # asked again: files may have arrived while converting
            _remove_conversion(out)
        _move_into_place(tmp, out)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def replaces_model(out: pathlib.Path) -> bool:
    """Whether writing a model into `out` replaces a converted model there. Only a missing or empty folder or a
    folder holding nothing but a converted model (its manifest and the files it names) may be written: a folder
    holding anything else is refused, nothing deleted."""
    out = pathlib.Path(out).expanduser()
    if not out.exists():
        return False
    if not out.is_dir():
        raise CheckpointError(f"{out} is a file, not a folder; give the converted model a new folder")
    if (out / MANIFEST).is_file():
        others = _conversion_entries(out)[1]
        if others:
            shown = ", ".join(others[:3]) + (f" and {len(others) - 3} more" if len(others) > 3 else "")
            raise CheckpointError(f"{out} holds a converted model and files its conversion did not write ({shown}); "
                                  f"nothing was written or deleted: move them out of {out} or give the converted "
                                  f"model a new folder")
        return True
    if any(out.iterdir()):
        raise CheckpointError(f"{out} holds files and is not a converted specjax model; nothing was written or "
                              f"deleted: give the converted model a new or empty folder")
    return False


def _conversion_entries(out: pathlib.Path) -> tuple[list[pathlib.Path], list[str]]:
    """(the files and folders in `out` its conversion wrote, by its manifest, each folder before its contents;
    the relative paths of everything else there). A symlinked folder is never the conversion's."""
    try:
        listed = set(read_manifest(out)["files"]) | {MANIFEST}
    except (CheckpointError, KeyError, TypeError) as e:
        raise CheckpointError(f"{out / MANIFEST} is unreadable, so which files in {out} its conversion wrote is "
                              f"unknown; nothing was written or deleted: give the converted model a new folder") from e
    folders = {str(d) for rel in listed for d in pathlib.PurePosixPath(rel).parents}
    ours, others = [], []
    for root, dirs, names in os.walk(out):
        base = pathlib.PurePosixPath(pathlib.Path(root).relative_to(out).as_posix())
        for d in list(dirs):
            if str(base / d) in folders and not os.path.islink(os.path.join(root, d)):
                ours.append(pathlib.Path(root, d))
            else:
                others.append(str(base / d))
                dirs.remove(d)  # not walked: reported as a whole
        for n in names:
            left_by_a_kill = str(base) == "." and n.startswith(f"{MANIFEST}.partial-")  # store_manifest's temp file
            if str(base / n) in listed or left_by_a_kill:
                ours.append(pathlib.Path(root, n))
            else:
                others.append(str(base / n))
    return ours, sorted(others)


def _remove_conversion(out: pathlib.Path) -> None:
    """Delete what the conversion in `out` wrote: its manifest first, so what is left never looks finished, then
    its files and the folders they leave empty."""
    ours = _conversion_entries(out)[0]
    (out / MANIFEST).unlink()
    for path in reversed(ours):  # contents before their folder
        if path.is_dir() and not path.is_symlink():
            with contextlib.suppress(OSError):  # not empty: something arrived since; it stays
                path.rmdir()
        else:
            path.unlink(missing_ok=True)


def _move_into_place(tmp: pathlib.Path, out: pathlib.Path) -> None:
    """Rename the finished `tmp` to `out`, which is missing or empty by now."""
    try:
        os.replace(tmp, out)
    except OSError as e:
        if e.errno not in (errno.ENOTEMPTY, errno.EEXIST):
            raise
        raise CheckpointError(f"{out}: files arrived in it while the model was converted; they were kept and the "
                              f"converted model was not written: move them out of {out} and convert again") from e


def _write_model_files(tmp: pathlib.Path, cfg: ModelConfig, params: Params, tokenizer_json: str | None,
                       source: str, source_dtype: str | None, weights: str, source_files: dict | None) -> None:
    import orbax.checkpoint as ocp

    save_config(cfg, tmp / "config.json")
    if tokenizer_json is not None:
        (tmp / "tokenizer.json").write_text(tokenizer_json)
    with ocp.StandardCheckpointer() as ckpt:
        ckpt.save(tmp / "params", jax.tree.map(np.asarray, params))
    dtype = str(np.asarray(params["embed"]).dtype)
    files = {str(p.relative_to(tmp)): [p.stat().st_size, sha256_file(p)] for p in _data_files(tmp)}
    manifest = {"format": FORMAT, "weights": weights, "source": source, "dtype": dtype,
                "source_dtype": source_dtype or dtype, "weights_digest": params_digest(params),
                "tokenizer_digest": text_digest(tokenizer_json), "files": files, "source_files": source_files}
    (tmp / MANIFEST).write_text(json.dumps(manifest, indent=1) + "\n")


def store_manifest(model_dir: pathlib.Path, manifest: dict) -> None:
    """Replace the manifest of `model_dir` atomically; an OSError (a read-only folder) leaves it as it was."""
    tmp = model_dir / f"{MANIFEST}.partial-{os.getpid()}"
    try:
        tmp.write_text(json.dumps(manifest, indent=1) + "\n")
        os.replace(tmp, model_dir / MANIFEST)
    except OSError:
        with contextlib.suppress(OSError):
            tmp.unlink(missing_ok=True)
        raise


def read_manifest(model_dir: pathlib.Path) -> dict:
    path = model_dir / MANIFEST
    if not path.is_file():
        raise CheckpointError(
            f"{model_dir} is not a converted specjax model (no {MANIFEST}); convert a checkpoint into a new "
            f"folder with `python -m specjax.convert --hf_dir HF_DIR --out NEW_DIR` and pass that folder"
        )
    try:
        return json.loads(path.read_text())
    except json.JSONDecodeError as e:
        raise CheckpointError(f"{path} is corrupt ({e}); convert the model again") from e


def verify_files(model_dir: pathlib.Path, manifest: dict, *, checksums: bool = True) -> None:
    """Check every file the manifest names: present, same size and (optionally) same sha256."""
    for rel, (size, digest) in manifest["files"].items():
        path = model_dir / rel
        if not path.is_file():
            raise CheckpointError(f"{model_dir}: file {rel} is missing; convert the model again")
        actual = path.stat().st_size
        if actual != size:
            raise CheckpointError(
                f"{model_dir}: file {rel} is truncated or altered ({actual} bytes, expected {size}); "
                "convert the model again"
            )
        if checksums and sha256_file(path) != digest:
            raise CheckpointError(f"{model_dir}: file {rel} is corrupt (sha256 mismatch); convert the model again")


def load_model_dir(model_dir: pathlib.Path, *, checksums: bool = True) -> tuple[ModelConfig, Params, dict]:
    """Load (config, params as numpy, manifest) from a converted model directory, verified first."""
    import orbax.checkpoint as ocp

    model_dir = pathlib.Path(model_dir)
    manifest = read_manifest(model_dir)
    verify_files(model_dir, manifest, checksums=checksums)
    cfg = load_config(model_dir / "config.json")
    try:
        with ocp.StandardCheckpointer() as ckpt:
            params = ckpt.restore((model_dir / "params").resolve())
    except Exception as e:  # orbax raises many types; any of them means the same to the user
        raise CheckpointError(f"{model_dir}: cannot read params ({type(e).__name__}: {e})") from e
    params = _restore_lists(params, param_specs(cfg))
    check_params(cfg, params, str(model_dir))
    if "weights_digest" not in manifest:
        manifest = _add_digests(model_dir, manifest, params)
    return cfg, params, manifest


def _add_digests(model_dir: pathlib.Path, manifest: dict, params: Params) -> dict:
    """A folder converted before digests were kept: digest the params just loaded (no extra read) and the
    tokenizer, and store both in its manifest (atomically) so later loads hash nothing. A read-only folder keeps
    its manifest; this process uses the derived digest and says so."""
    tok = model_dir / "tokenizer.json"
    manifest = dict(manifest, weights_digest=params_digest(params),
                    tokenizer_digest=text_digest(tok.read_text()) if tok.is_file() else None)
    try:
        store_manifest(model_dir, manifest)
    except OSError as e:
        log.warning("%s: converted by older specjax, without a weights digest; derived %s for this run but "
                    "could not store it (%s), so every load derives it again", model_dir,
                    manifest["weights_digest"][:12], e.strerror or e)
    return manifest


def _restore_lists(tree, like):
    """Orbax may give back lists as {'0': ..} dicts; rebuild the declared structure (check_params
    then reports any difference by tensor name)."""
    if isinstance(like, list):
        items = tree if isinstance(tree, list) else [tree[k] for k in sorted(tree, key=int)]
        if len(items) != len(like):
            return items
        return [_restore_lists(t, l) for t, l in zip(items, like)]
    if isinstance(like, dict) and isinstance(tree, dict):
        return {k: _restore_lists(v, like[k]) if k in like else v for k, v in tree.items()}
    return tree
