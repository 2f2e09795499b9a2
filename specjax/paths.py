"""Where specjax keeps converted models and fetched files, and how a model name resolves to a directory."""

from __future__ import annotations

import os
import pathlib

from specjax.configs.models import FETCHABLE, MODEL_SHAPES
from specjax.errors import ModelNotFoundError


def home() -> pathlib.Path:
    """~/.cache/specjax, or $SPECJAX_HOME."""
    return pathlib.Path(os.environ.get("SPECJAX_HOME", pathlib.Path.home() / ".cache" / "specjax")).expanduser()


def models_dir() -> pathlib.Path:
    return home() / "models"


def downloads_dir() -> pathlib.Path:
    return home() / "downloads"


def known_names() -> list[str]:
    return sorted(MODEL_SHAPES)


def resolve_model_dir(name_or_path: str, *, fetch_missing: bool = True) -> pathlib.Path:
    """A converted model directory for a registered name or a path; fetches smollm2-135m on first use."""
    path = pathlib.Path(name_or_path).expanduser()
    if path.is_dir():
        return path
    if name_or_path not in MODEL_SHAPES:
        if os.sep in name_or_path or name_or_path.startswith("."):
            raise ModelNotFoundError(f"model directory {path} does not exist")
        raise ModelNotFoundError(
            f"unknown model {name_or_path!r}; known names: {', '.join(known_names())} (or give a converted model directory)"
        )
    local = models_dir() / name_or_path
    if local.is_dir():
        return local
    if name_or_path in FETCHABLE and fetch_missing:
        from specjax.fetch import fetch

        return fetch(name_or_path)
    raise ModelNotFoundError(
        f"model {name_or_path!r} is not converted yet (looked in {local}). Convert your Hugging Face "
        f"checkpoint with `python -m specjax.convert --hf_dir /path/to/{name_or_path} --out {local}`, "
        f"or use random weights of its shape for timing runs (--init random)."
    )
