"""Finished runs of an evaluation kept on disk, so an interrupted long run can resume where it stopped.

Each (system, retention) run is saved the moment it finishes, under `<output_dir>/.partial/`, with a fingerprint
of everything its figures depend on: the flags that shape the workload and the systems, the model, the request
sequence, the source code (a hash of its files) and the machine. `--resume` loads the saved runs whose
fingerprint matches and runs only the rest; a saved run made under any other fingerprint is refused with the
fields that differ, never mixed in. Every system starts from the same store contents and cold compiled programs
(see runner.py), so a loaded run's accuracy, bytes and hit ratios are what it would have measured in this
process. Its TTFTs were timed in another process: the report says which runs were loaded and when they finished.
"""

from __future__ import annotations

import dataclasses
import functools
import hashlib
import json
import pathlib
import subprocess
import time

import specjax
from specjax.eval import systems as systems_lib
from specjax.eval.errors import EvalError

DIRNAME = ".partial"


def code_version() -> dict:
    """The code a figure came from: a hash of specjax's source files (what a resumed run must share), and the git
    commit of the checkout when specjax runs from one (with a flag if the checkout has uncommitted changes).

    Taken once per process, at its first call: the code a process runs is what it imported, so a commit made while
    a long run (a preset's tasks) goes on must not relabel its later tasks."""
    return dict(_code_version_once())


@functools.cache
def _code_version_once() -> dict:
    version = {"version": _package_version(), "source_sha256": source_digest()}
    root = pathlib.Path(specjax.__file__).resolve().parent.parent
    try:
        git = ["git", "-C", str(root)]
        version["commit"] = subprocess.run(git + ["rev-parse", "HEAD"], capture_output=True, text=True, check=True,
                                           timeout=10).stdout.strip()
        status = subprocess.run(git + ["status", "--porcelain", "--untracked-files=no"], capture_output=True,
                                text=True, check=True, timeout=30).stdout
        version["uncommitted_changes"] = bool(status.strip())
    except (OSError, subprocess.SubprocessError):
        pass  # not a checkout: the version and the source hash say what ran
    return version


def source_digest() -> str:
    """A hash of every source file of the specjax packages (Python and presets), wherever they are installed."""
    import importlib

    h = hashlib.sha256()
    for name in ("specjax", "specjax.kernels", "specjax.stores", "specjax.eval", "specjax.configs"):
        for folder in importlib.import_module(name).__path__:
            folder = pathlib.Path(folder)
            for path in sorted(p for p in folder.rglob("*") if p.suffix in (".py", ".json", ".toml", ".yaml")):
                h.update(f"{name}/{path.relative_to(folder).as_posix()}\0".encode())
                h.update(path.read_bytes())
    return h.hexdigest()[:16]


def _package_version() -> str:
    from importlib import metadata

    try:
        return metadata.version("specjax")
    except metadata.PackageNotFoundError:
        return "unknown"


def requests_digest(requests) -> str:
    """A hash of the request sequence as the systems see it (token ids, choices, gold)."""
    h = hashlib.sha256()
    for r in requests:
        h.update(json.dumps([list(r.prefix_ids), list(r.query_ids), [list(c) for c in r.choice_ids], r.gold])
                 .encode())
    return h.hexdigest()[:16]


def _read(path: pathlib.Path) -> dict:
    """A saved run, or one line saying it is damaged (a save cut short by a full disk or a crash of the machine)."""
    try:
        saved = json.loads(path.read_text())
        if isinstance(saved, dict) and {"fingerprint", "finished", "run"} <= saved.keys():
            return saved
        why = "not a saved run"
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        why = "empty" if path.is_file() and path.stat().st_size == 0 else f"unreadable: {type(e).__name__}"
    raise EvalError(f"cannot resume: {path} is damaged ({why}); delete that file to run {path.stem} again (the "
                    "other saved runs are kept), then run the same command with --resume")


class PartialRuns:
    """The finished runs of one evaluation under `<output_dir>/.partial/`, keyed by run label."""

    def __init__(self, output_dir: pathlib.Path, fingerprint: dict, *, resume: bool):
        self.dir = pathlib.Path(output_dir) / DIRNAME
        self.fingerprint = json.loads(json.dumps(fingerprint))  # as it will read back from disk
        self.loaded: dict[str, str] = {}  # label -> when that run finished
        saved = sorted(self.dir.glob("*.json")) if self.dir.is_dir() else []
        if saved and not resume:
            raise EvalError(f"{self.dir} holds {len(saved)} finished run(s) of an interrupted evaluation "
                            f"({', '.join(p.stem for p in saved)}); pass --resume to keep them and run only the "
                            "rest, or delete that folder to start over")
        for path in saved:
            self._check(path, _read(path)["fingerprint"])

    def _check(self, path: pathlib.Path, fingerprint: dict) -> None:
        differ = sorted(k for k in fingerprint.keys() | self.fingerprint.keys()
                        if fingerprint.get(k) != self.fingerprint.get(k))
        if differ:
            detail = "; ".join(f"{k}: saved {fingerprint.get(k)!r}, now {self.fingerprint.get(k)!r}"
                               for k in differ[:4])
            raise EvalError(f"cannot resume from {path}: it was made under other settings ({detail}). Run with "
                            f"the same flags, code and machine, or delete {self.dir} to start over")

    def load(self, label: str) -> dict | None:
        """The saved fields of run `label` (runner.Run's), or None if it has not finished yet."""
        path = self._path(label)
        if not path.is_file():
            return None
        saved = _read(path)  # its fingerprint was checked when this evaluation started
        run = saved["run"]
        run["outcomes"] = [systems_lib.as_outcome(o) for o in run["outcomes"]]
        self.loaded[label] = saved["finished"]
        return run

    def save(self, label: str, run) -> None:
        """Keep a finished run; written to a temporary name first, so an interruption leaves no half file."""
        self.dir.mkdir(parents=True, exist_ok=True)
        path = self._path(label)
        tmp = path.with_suffix(".tmp")
        try:
            tmp.write_text(json.dumps({"fingerprint": self.fingerprint,
                                       "finished": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
                                       "run": dataclasses.asdict(run)}))
            tmp.replace(path)
        except OSError as e:
            tmp.unlink(missing_ok=True)
            raise EvalError(f"could not save the finished run {label} into {self.dir} ({e.strerror or e}); the runs "
                            "saved before it are kept: free space and run the same command with --resume") from None

    def discard(self) -> None:
        """The evaluation's results are written: its saved runs are in them."""
        for path in self.dir.glob("*.json"):
            path.unlink()
        if self.dir.is_dir() and not any(self.dir.iterdir()):
            self.dir.rmdir()

    def _path(self, label: str) -> pathlib.Path:
        return self.dir / (label.replace(" ", "_").replace("=", "") + ".json")
