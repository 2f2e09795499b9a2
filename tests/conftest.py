"""Shared pytest fixtures: data location, GPU marker handling, CPU-only determinism."""

import os
import pathlib

import jax
import pytest

REPO = pathlib.Path(__file__).resolve().parents[1]
SHARED_DATA = REPO.parent / "shared" / "data"

# Tests compare against fp32 references: make CPU matmuls full precision.
jax.config.update("jax_default_matmul_precision", "highest")


def _has_gpu() -> bool:
    try:
        return any(d.platform == "gpu" for d in jax.devices())
    except RuntimeError:
        return False


def pytest_collection_modifyitems(config, items):
    if _has_gpu():
        return
    skip_gpu = pytest.mark.skip(reason="needs a GPU")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip_gpu)


@pytest.fixture(scope="session")
def shared_data_dir() -> pathlib.Path:
    """The evaluation data beside the checkout (../shared/data), or SPECJAX_DATA."""
    path = pathlib.Path(os.environ.get("SPECJAX_DATA", SHARED_DATA))
    if not path.is_dir():
        pytest.skip(f"evaluation data not found at {path} (set SPECJAX_DATA)")
    return path
