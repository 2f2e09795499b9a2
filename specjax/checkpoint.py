"""Converted-model directories: an orbax checkpoint of the params, config.json, tokenizer.json and a
checksum manifest so that a truncated or corrupt file is reported instead of loaded.

Layout of a model directory:
    config.json          specjax ModelConfig
    params/              orbax StandardCheckpointer tree (the param_specs tree of the config)
    tokenizer.json       Hugging Face tokenizers file (optional)
    specjax_model.json   {"format": 1, "weights": "pretrained", "source": ..., "dtype": ..., "source_dtype": ...,
                          "weights_digest": sha256, "tokenizer_digest": sha256 | null,
                          "files": {relpath: [size, sha256]}}   dtype: as stored; source_dtype: the checkpoint's own

The weights digest (every tensor's name, dtype, shape and bytes, `params_digest`) names the weights a prefix-KV
store was written by. It is computed once, when the model is converted; a folder converted by older code gets it
on its first load (from the params that load reads anyway) and keeps it, so later loads hash nothing.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import logging
import os
import pathlib
import shutil

import jax
import numpy as np

from specjax.config import ModelConfig, load_config, save_config
from specjax.errors import CheckpointError
from specjax.models.params import Params, check_params, param_specs

MANIFEST = "specjax_model.json"
FORMAT = 1

log = logging.getLogger(__name__)


def sha256_file(path: pathlib.Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 22), b""):
            h.update(block)
    return h.hexdigest()


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
) -> None:
    """Write a model directory atomically: everything goes to a temp dir beside `out`, renamed over it at the
    end, so an interrupted conversion never leaves a directory that looks finished (loading needs the manifest,
    written last). The temp dir's name holds the process id, so two processes converting at once do not share it."""
    out = pathlib.Path(out).expanduser().resolve()
    replaces_model(out)  # refuses a folder of other files before anything is written
    check_params(cfg, params, source)
    tmp = out.with_name(f"{out.name}.partial-{os.getpid()}")
    shutil.rmtree(tmp, ignore_errors=True)  # left by a killed process that had this id
    tmp.mkdir(parents=True)
    try:
        _write_model_files(tmp, cfg, params, tokenizer_json, source, source_dtype, weights)
        if out.exists():
            shutil.rmtree(out)
        os.replace(tmp, out)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def replaces_model(out: pathlib.Path) -> bool:
    """Whether writing a model into `out` replaces a converted model there. Only a missing or empty folder or a
    converted model (its manifest) may be written: a folder of anything else is refused, nothing deleted."""
    out = pathlib.Path(out).expanduser()
    if not out.exists():
        return False
    if not out.is_dir():
        raise CheckpointError(f"{out} is a file, not a folder; give the converted model a new folder")
    if (out / MANIFEST).is_file():
        return True
    if any(out.iterdir()):
        raise CheckpointError(f"{out} holds files and is not a converted specjax model; nothing was written or "
                              f"deleted: give the converted model a new or empty folder")
    return False


def _write_model_files(tmp: pathlib.Path, cfg: ModelConfig, params: Params, tokenizer_json: str | None,
                       source: str, source_dtype: str | None, weights: str) -> None:
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
                "tokenizer_digest": text_digest(tokenizer_json), "files": files}
    (tmp / MANIFEST).write_text(json.dumps(manifest, indent=1) + "\n")


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
    tmp = model_dir / f"{MANIFEST}.partial-{os.getpid()}"
    try:
        tmp.write_text(json.dumps(manifest, indent=1) + "\n")
        os.replace(tmp, model_dir / MANIFEST)
    except OSError as e:
        with contextlib.suppress(OSError):
            tmp.unlink(missing_ok=True)
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
