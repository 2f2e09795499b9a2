"""Shared pytest fixtures: data location, GPU marker handling, CPU-only determinism, one compilation cache."""

import atexit
import os
import pathlib
import shutil
import tempfile

import jax
import pytest

REPO = pathlib.Path(__file__).resolve().parents[1]
SHARED_DATA = REPO.parent / "shared" / "data"

# Tests compare against fp32 references: make CPU matmuls full precision.
jax.config.update("jax_default_matmul_precision", "highest")

# Evaluations drop their compiled programs between systems, and many tests compile the same ones: with JAX's
# persistent cache a recompile is a read (a record-then-replay evaluation test: 34 s, then 20 s). `specjax.compiles`
# still counts a program read from it as a compile. The session's cache starts empty and is removed at the end; the
# processes that tests start inherit it through the environment.
if "JAX_COMPILATION_CACHE_DIR" not in os.environ:
    _cache = tempfile.mkdtemp(prefix="specjax-tests-jax-cache-")
    atexit.register(shutil.rmtree, _cache, ignore_errors=True)
    os.environ.update(JAX_COMPILATION_CACHE_DIR=_cache, JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS="0")
    jax.config.update("jax_compilation_cache_dir", _cache)
    jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.0)


def _has_gpu() -> bool:
    try:
        return any(d.platform == "gpu" for d in jax.devices())
    except RuntimeError:
        return False


def pytest_collection_modifyitems(config, items):
    # the slow tests first: run over several workers (`pytest -n 2`, pytest-xdist), the longest start first instead of
    # holding the suite's last minutes on one worker
    items.sort(key=lambda item: "slow" not in item.keywords)
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


@pytest.fixture
def specjax_home(tmp_path, monkeypatch) -> pathlib.Path:
    """SPECJAX_HOME (converted models, fetched files) in the test's own folder."""
    monkeypatch.setenv("SPECJAX_HOME", str(tmp_path / "sj"))
    return tmp_path / "sj"


@pytest.fixture
def conversions(monkeypatch) -> list:
    """The Hugging Face folders converted during a test (the real converter still runs)."""
    from specjax import convert

    calls = []
    real = convert.convert_hf_dir

    def counting(hf_dir, out, dtype=None):
        calls.append(pathlib.Path(hf_dir))
        return real(hf_dir, out, dtype)

    monkeypatch.setattr(convert, "convert_hf_dir", counting)
    return calls


@pytest.fixture
def held_behind(monkeypatch) -> list:
    """The layers found still holding certain reads (`Prefetcher.request(held=True)`) when a later layer's take
    begins: a request's held reads are let go layer by layer, not at its end."""
    from specjax.stores import prefetch

    take, behind = prefetch.Prefetcher.take, []

    def taking(self, match, layer, *args, **kwargs):
        with self._lock:
            behind.extend(of for (of, _), tickets in self._tickets.items()
                          if of < layer and any(t.held for t in tickets))
        return take(self, match, layer, *args, **kwargs)

    monkeypatch.setattr(prefetch.Prefetcher, "take", taking)
    return behind
