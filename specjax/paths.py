"""Where specjax keeps converted models and fetched files (`specjax.resolve` turns a model name into a directory)."""

from __future__ import annotations

import os
import pathlib

from specjax.configs.models import MODEL_SHAPES


def home() -> pathlib.Path:
    """~/.cache/specjax, or $SPECJAX_HOME."""
    return pathlib.Path(os.environ.get("SPECJAX_HOME", pathlib.Path.home() / ".cache" / "specjax")).expanduser()


def models_dir() -> pathlib.Path:
    return home() / "models"


def downloads_dir() -> pathlib.Path:
    return home() / "downloads"


def known_names() -> list[str]:
    return sorted(MODEL_SHAPES)
