"""The folders an evaluation is given: `--store` (checked before any work) and `--output_dir` (claimed for this
process, so that no run's results are written over another's)."""

from __future__ import annotations

import contextlib
import fcntl
import os
import pathlib
import re
import sys
import tempfile

from specjax.eval.errors import EvalError
from specjax.eval.partial import DIRNAME as PARTIAL  # an interrupted evaluation's finished runs
from specjax.eval.report import RESULT_FILES  # what an evaluation writes into its output folder
CLAIM = ".specjax-eval.lock"  # held by the evaluation writing into the folder, removed when it ends
_URL = re.compile(r"^[A-Za-z][A-Za-z0-9+.-]*://")


def check_folder(flag: str, path: pathlib.Path) -> None:
    """A folder flag must name a folder or nothing yet (it is created): never a file, nor a path through one."""
    for part in [path, *path.parents]:
        if part.exists() and not part.is_dir():
            raise EvalError(f"{flag} {path}: {part} is a file, not a folder; give a folder (created if missing)")


def store_folder(value: str) -> pathlib.Path:
    """--store's folder: a path, or a `file://` URL of one. Other kvstore URLs (memory://, gs://, an OCDBT
    `...|ocdbt` path) are refused: the evaluation gives each run a hard-linked copy of a base store and locks it
    with lock files, which only a local folder has (the Python API, `specjax.stores.KVStore`, opens any kvstore).
    The folder (created later if missing) must take files, so that a read-only one fails before any work."""
    text = value
    if text.startswith("file://") and "|" not in text:
        text = text[len("file://"):]
    elif _URL.match(text) or "|" in text:
        raise EvalError(f"--store {value}: the evaluation keeps its stores in a local folder (each run works on a "
                        "hard-linked copy of a base store); give a folder path (or file:///path), not a kvstore URL")
    _check_utf8("--store", text)
    path = pathlib.Path(text).expanduser()
    check_folder("--store", path)
    check_writable("--store", path)
    return path


def _check_utf8(flag: str, text: str) -> None:
    """TensorStore takes paths as UTF-8 text: a path with bytes that are not is refused in one line."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as e:
        byte = os.fsencode(text[e.start:e.end])[:1]
        raise EvalError(f"{flag} {text.encode('utf-8', 'backslashreplace').decode()}: the path is not UTF-8 text "
                        f"(byte {byte[0]:#04x}); give a folder whose path is UTF-8") from None


def check_writable(flag: str, path: pathlib.Path) -> None:
    """`path` (a folder, or where one will be made) can take files: a read-only or foreign folder fails in one line
    before any work. Makes nothing: a file is made and removed at once in the nearest folder that exists."""
    existing = path
    while not existing.exists() and existing != existing.parent:
        existing = existing.parent
    try:
        with tempfile.TemporaryFile(dir=existing):
            pass
    except OSError as e:
        raise _cannot_write(flag, path, e) from None


def _cannot_write(flag: str, path: pathlib.Path, error: OSError) -> EvalError:
    return EvalError(f"{flag} {path}: cannot write there ({error.strerror or error}); give a folder you can write "
                     "to, on a disk with free space")


class OutputFolder:
    """The folder an evaluation writes its results into, held for this process (`CLAIM`, a lock file) while it runs.

    A folder that holds another evaluation's results (`RESULT_FILES`) or that another live evaluation holds is never
    written into: the results go to the first free `<folder>-2`, `<folder>-3`, ..., said on stderr (`moved_from`).
    With `resume` the folder itself is used (its `.partial` runs are the ones resumed); a folder another evaluation
    holds, or whose evaluation finished (results and nothing partial), is refused."""

    def __init__(self, requested: pathlib.Path, *, resume: bool = False, results: tuple[str, ...] = RESULT_FILES):
        self.requested = pathlib.Path(requested)
        self.resume = resume
        self.results = results  # the files whose presence says the folder holds a finished evaluation's results
        self.path: pathlib.Path | None = None
        self.moved_from: pathlib.Path | None = None
        self._lock = None

    def claim(self) -> pathlib.Path:
        """The folder this process writes into, held until `release`."""
        if self._lock is None:
            self._claim_for_resume() if self.resume else self._claim_free()
        return self.path

    def release(self) -> None:
        if self._lock is not None:
            with contextlib.suppress(OSError):
                (self.path / CLAIM).unlink()  # while held: no one sees it free and stale
            self._lock.close()
            self._lock = None

    def __enter__(self) -> OutputFolder:
        self.claim()
        return self

    def __exit__(self, *exc) -> None:
        self.release()

    def _claim_for_resume(self) -> None:
        path = self.requested
        check_folder("--output_dir", path)
        if not self._try_claim(path):
            raise EvalError(f"--output_dir {path}: another evaluation is writing into it now; wait for it to end, "
                            "or resume into another --output_dir")
        if self._holds_results(path) and not (path / PARTIAL).is_dir():
            self.release()
            raise EvalError(f"--output_dir {path} holds the results of an evaluation that finished (nothing to "
                            "resume); run without --resume to write a new folder beside it")

    def _claim_free(self) -> None:
        base = self.requested
        for n in range(1, 10_000):
            path = base if n == 1 else base.with_name(f"{base.name}-{n}")
            check_folder("--output_dir", path)
            if self._holds_results(path) or not self._try_claim(path):  # passed over untouched (it may be read-only)
                continue
            if self._holds_results(path):  # written between the look and the claim
                self.release()
                continue
            if path != base:
                self.moved_from = base
                print(f"note: {base} holds another evaluation's results; writing into {path}", file=sys.stderr)
            return
        raise EvalError(f"--output_dir {base}: it and {base.name}-2 ... -9999 all hold results; give another folder")

    def _holds_results(self, path: pathlib.Path) -> bool:
        return any((path / name).exists() for name in self.results)

    def _try_claim(self, path: pathlib.Path) -> bool:
        """Hold `path` for this process; False if another evaluation holds it. Fails in one line if it cannot be
        written (read-only, not ours, full), before any work."""
        try:
            path.mkdir(parents=True, exist_ok=True)
            lock = open(path / CLAIM, "a")
        except OSError as e:
            raise _cannot_write("--output_dir", path, e) from None
        try:
            fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            lock.close()
            return False
        self.path, self._lock = path, lock
        return True


__all__ = ["CLAIM", "OutputFolder", "PARTIAL", "RESULT_FILES", "check_folder", "check_writable", "store_folder"]
