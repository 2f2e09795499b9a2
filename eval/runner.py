"""Runs several systems on one request sequence, each from the same store contents.

The base store is written once (by the first system that needs a store) from every unique
prefix of the workload; systems that lay out their store differently (another chunk size, independently
cached text chunks, other weights) name it with a `store_key` attribute and get a base store of their own. A base
store outlives the run: a later evaluation on the same --store folder reuses the prefixes stored (results say how
many were reused and written), and several processes may populate one at once (a lock file per base store). Each
(system, retention) run then gets its own fresh copy of that directory (hard links to its files: the store replaces
files, never changes them), in a folder private to this process (`StoreFolder`), so write-behind, reordering or
checksum repairs of one run cannot leak into another, nor one process's runs into another's. Caches start empty
and are warmed with the same warm-up passes (each unique prefix once, in order of first arrival), then requests of
shapes not seen yet run once untimed, so no timed request should include JIT compilation; the compiles that still
happen in a timed request are counted in its `compilations` counter. Compiled programs are dropped after each
system, so every system compiles its own in those untimed passes and a long run's programs never pile up past the
process's limit on memory mappings.
"""

from __future__ import annotations

import contextlib
import dataclasses
import fcntl
import os
import pathlib
import re
import secrets
import shutil
import time

import jax

from specjax import distributed
from specjax.engine import shape_key
from specjax.eval import registry, systems as systems_lib
from specjax.compiles import CompileCounter
from specjax.eval.errors import EvalError
from specjax.eval.partial import PartialRuns
from specjax.eval.progress import Progress
from specjax.eval.workload import Workload
from specjax.stores.errors import free_bytes_without_inodes, is_disk_full, unopenable
from specjax.stores.manifest import LOCK_KEY as MANIFEST_LOCK


@dataclasses.dataclass
class Run:
    system: str
    retention: float | None  # None: the system does not depend on retention
    outcomes: list[systems_lib.Outcome]
    warm_s: float
    run_s: float
    sweep: bool = False  # several retentions in this run: keys carry the retention
    # the base store it copied: {"base", "prefixes_written", "prefixes_reused", "prefixes_repaired"}, and what
    # damaged stored KV cost the run ({"damaged_chunks", "repair_disk_bytes", "repair_disk_bytes_written"})
    store: dict | None = None
    # what the system measured beyond its requests (the planner's cost model: rates, compute per plan, crossover)
    model: dict | None = None
    # the bits a loaded prefix token's K and V have: {"selected_bits", "rest_bits"} (rest None: not loaded), and
    # "rest_key_bits" where the rest's keys have others
    precision: dict | None = None

    @property
    def key(self) -> str:
        if self.retention is None or not self.sweep:
            return self.system
        return f"{self.system}@r={self.retention:g}"


def plan(names: list[str], retentions: list[float]) -> list[tuple[str, float | None]]:
    """(system, retention) pairs; retention-free systems run once."""
    out = []
    for name in names:
        if registry.uses_retention(name):
            out += [(name, r) for r in retentions]
        else:
            out.append((name, None))
    return out


def warmup_requests(workload: Workload) -> list:
    """One request per distinct prefix (by tokens), in order of first arrival."""
    seen, first = set(), []
    for r in workload.requests:
        if r.prefix_ids not in seen:
            seen.add(r.prefix_ids)
            first.append(r)
    return first


def compile_requests(workload: Workload) -> list:
    """Requests with shapes the warm-up requests lack: one per (prefix, query-length bucket, longest-choice bucket)
    beyond them. They run untimed after the warm-up, so that no timed request pays for JIT compilation
    (otherwise the first system of a run would pay for shapes the later ones reuse)."""
    def shape(r):
        return shape_key(r.prefix_ids, r.query_ids, r.choice_ids)

    seen = {shape(r) for r in warmup_requests(workload)}
    extra = []
    for r in workload.requests:
        if shape(r) not in seen:
            seen.add(shape(r))
            extra.append(r)
    return extra


def stored_sequences(system, warm: list) -> list:
    """What a base store is written from: each unique prefix, unless the system says otherwise (text chunks)."""
    if hasattr(system, "stored_sequences"):
        return system.stored_sequences(warm)
    return [r.prefix_ids for r in warm]


def run_all(model, workload: Workload, runs: list[tuple[str, float | None]], settings: systems_lib.SystemSettings,
            store_dir: pathlib.Path, progress: Progress | None = None, partial: PartialRuns | None = None, *,
            interleave: bool = False) -> list[Run]:
    """Every (system, retention) run, one after another, or with `interleave` request by request in turns; with
    `partial`, each finished run is saved as it ends and runs saved by an interrupted evaluation are loaded instead
    of run again."""
    with StoreFolder(store_dir) as folder:
        return _run_all(model, workload, runs, settings, folder, progress, partial, interleave)


def _run_all(model, workload, runs, settings, folder: "StoreFolder", progress, partial, interleave) -> list[Run]:
    warm, compile_only = warmup_requests(workload), compile_requests(workload)
    sweep = len({r for _, r in runs if r is not None}) > 1
    results: dict = {}
    todo = []
    for name, retention in runs:
        label = name if retention is None else f"{name} r={retention:g}"
        saved = partial.load(label) if partial else None
        if saved is not None:
            results[label] = Run(**{**saved, "sweep": sweep})
            if progress:
                progress.skip(_steps(workload), warmup=_warmup_steps(workload))
        else:
            todo.append((name, retention, label))
    for group in ([todo] if interleave else [[run] for run in todo]):
        opened, failed = [], True
        try:
            for name, retention, label in group:
                opened.append(_Opened.prepare(model, warm, compile_only, name, retention, label, settings, folder,
                                              progress))
            _time(workload, opened, progress)
            failed = False
        finally:
            for run in opened:
                run.close(folder, together=not failed)
            # Each compiled program holds memory mappings and a process may have only vm.max_map_count of them;
            # dropping the programs of the runs done keeps a long evaluation of many runs within that. The next
            # runs compile what they need in their own untimed warm-up and compile passes.
            jax.clear_caches()
        for run in opened:
            results[run.label] = run.result(folder, sweep)
            if partial:
                partial.save(run.label, results[run.label])
    return [results[name if retention is None else f"{name} r={retention:g}"] for name, retention in runs]


def _steps(workload) -> int:
    """Progress steps of one run: its warm-up, compile and timed requests."""
    return _warmup_steps(workload) + len(workload.requests)


def _warmup_steps(workload) -> int:
    """Progress steps of one run before its timed requests: warm-up and compile requests (untimed, compiling)."""
    return len(warmup_requests(workload)) + len(compile_requests(workload))


def _time(workload, opened: list["_Opened"], progress) -> None:
    """The timed requests of the opened runs: each request by every run in turn, the first run of the turn rotating
    with the request (with one run: its requests in order)."""
    with CompileCounter() as compiles:
        for i, request in enumerate(workload.requests):
            for j in range(len(opened)):
                run = opened[(i + j) % len(opened)]
                if progress:
                    progress.set_label(run.label)
                before, start = compiles.count, time.perf_counter()
                outcome = systems_lib.as_outcome(run.system.run(request))
                run.run_s += time.perf_counter() - start
                outcome.counters["compilations"] = compiles.count - before
                run.outcomes.append(outcome)
                if progress:
                    progress.update()


@dataclasses.dataclass
class _Opened:
    """One run's system, open on its private store copy, warmed and compiled; its timed outcomes so far."""
    label: str
    retention: float | None
    system: object
    base: pathlib.Path | None
    private: pathlib.Path | None
    warm_s: float
    outcomes: list = dataclasses.field(default_factory=list)
    run_s: float = 0.0

    @classmethod
    def prepare(cls, model, warm, compile_only, name, retention, label, settings, folder, progress) -> "_Opened":
        """The run's system made, opened on a private copy of its base store, warmed on `warm` and run on
        `compile_only` (untimed)."""
        run_settings = settings if retention is None else settings.at_retention(retention)
        system = registry.make_system(name, model, run_settings)
        if progress:
            progress.set_label(label + " (warm)", warmup=True)
        t0 = time.perf_counter()
        private = base = None
        if system.needs_store:
            base = folder.base(system, warm)
            private = folder.private_copy(base, label.replace(" ", "_").replace("=", ""))
            system.open(str(private))
        opened = cls(label, retention, system, base, private, 0.0)
        try:
            system.warm(warm)
            if progress:
                progress.update(len(warm))
            for request in compile_only:
                system.run(request)
                if progress:
                    progress.update()
        except BaseException:
            opened.close(folder, together=False)
            raise
        opened.warm_s = time.perf_counter() - t0
        return opened

    def close(self, folder: "StoreFolder", together: bool = True) -> None:
        """`together`: every process closes the run (it did not fail in this one; `StoreFolder.remove_copy`)."""
        self.system.close()
        if self.private is not None:
            folder.remove_copy(self.private, together)

    def result(self, folder, sweep: bool) -> Run:
        repaired = list(getattr(self.system, "repaired", ()))
        if repaired:
            folder.repair(self.base, self.system, repaired)
        summary = self.system.summary() if hasattr(self.system, "summary") else None
        # named as built: a system with options of its own carries them in its name ("spec-no_prefetch",
        # "spec_gqa-candidates2"), so a result never passes for the system's default form
        return Run(self.system.name, self.retention, self.outcomes, self.warm_s, self.run_s, sweep,
                   _with_repair_io(folder.record(self.base, len(repaired)), self.system), summary,
                   getattr(self.system, "precision", None))


def _with_repair_io(store: dict | None, system) -> dict | None:
    """A run's base store record, with what damaged stored KV cost the run beyond its own I/O (the system's
    `repair_io`: damaged chunks, repair_disk_bytes, repair_disk_bytes_written), where the system counts it."""
    return None if store is None else {**store, **getattr(system, "repair_io", {})}


class StoreFolder:
    """An evaluation's --store folder: base stores `base-<store key>`, shared by every run and every process that
    uses the folder, and this process's private copies under `runs/<id>/`, removed when it ends. A lock file per
    base store (`base-<key>.lock`) makes populating it exclusive and copying it shared, so a copy never catches a
    base store half written; `runs/<id>.lock` is held while the process lives, so a later process removes the
    private copies of one that was killed: only folders named as this class names them that hold its mark
    (`RUN_MARK`), never another folder of `runs/`.

    With several processes running one evaluation (`specjax.distributed`) the folder is one that every process
    reaches: process 0 takes the locks, populates (every process computes, process 0 writes), makes the private
    copies and removes them; the others use its copies."""

    def __init__(self, root: pathlib.Path):
        self.root = pathlib.Path(root)
        self.bases: dict[pathlib.Path, dict] = {}  # populated by this process: what populating wrote and reused
        self.private: pathlib.Path | None = None
        self._alive = None

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        if self.private is not None and _leads():
            shutil.rmtree(self.private, ignore_errors=True)
            pathlib.Path(self._alive.name).unlink(missing_ok=True)  # while held: no one sees it free and stale
            self._alive.close()

    def base(self, system, warm) -> pathlib.Path:
        """The system's base store, populated with every prefix not stored yet (once per process)."""
        base = self.root / f"base-{getattr(system, 'store_key', 'default')}"
        if base not in self.bases:
            base.mkdir(parents=True, exist_ok=True)
            with self._locked(base, fcntl.LOCK_EX) if _leads() else contextlib.nullcontext():
                counts = system.populate(str(base), stored_sequences(system, warm))
            self.bases[base] = {"base": base.name, **_populated(counts)}
        return base

    def record(self, base: pathlib.Path | None, repaired: int) -> dict | None:
        """What a run's results say of its base store; `repaired`: its stored prefixes the run found damaged."""
        return None if base is None else dict(self.bases[base], prefixes_repaired=repaired)

    def private_copy(self, base: pathlib.Path, label: str) -> pathlib.Path:
        """A fresh copy of `base` for one run, in this process's own folder: its files hard links to the base's where
        the filesystem allows (`_link_or_copy`), so a run's copy costs no bytes and no time however large the store."""
        if self.private is None:
            self._make_private()
        copy = self.private / label
        if _leads():
            shutil.rmtree(copy, ignore_errors=True)
            with self._locked(base, fcntl.LOCK_SH):
                try:
                    shutil.copytree(base, copy, copy_function=_link_or_copy)
                except (shutil.Error, OSError) as e:
                    shutil.rmtree(copy, ignore_errors=True)
                    raise EvalError(_copy_failed(base, copy, e)) from None
        if jax.process_count() > 1:
            distributed.barrier("specjax-eval-copy")
        return copy

    def remove_copy(self, copy: pathlib.Path, together: bool = True) -> None:
        """A run's copy, once its run is closed in every process (with `together`: a run that failed here is not
        waited for elsewhere, and the process it failed in stops)."""
        if jax.process_count() > 1 and together:
            distributed.barrier("specjax-eval-closed")
        if _leads():
            shutil.rmtree(copy, ignore_errors=True)

    def repair(self, base: pathlib.Path, system, sequences: list) -> None:
        """A run met chunks failing their checksum in its copy (and repaired them there as it went): repair those
        stored sequences in the base store too, so that later runs do not meet them again (every process; process 0
        holds the lock)."""
        with self._locked(base, fcntl.LOCK_EX) if _leads() else contextlib.nullcontext():
            system.repair(str(base), sequences)

    @contextlib.contextmanager
    def _locked(self, base: pathlib.Path, how: int):
        lock = base.with_name(base.name + ".lock")
        try:
            f = open(lock, "a")
        except OSError as e:
            raise EvalError(_lock_failed(lock, e)) from None
        with f:
            fcntl.flock(f, how)
            try:
                yield
            finally:
                fcntl.flock(f, fcntl.LOCK_UN)

    def _make_private(self) -> None:
        runs = self.root / "runs"
        name = f"{os.getpid()}-{secrets.token_hex(4)}"
        if jax.process_count() > 1:  # process 0's, for every process
            name = distributed.process_zeros_json(name)
            if not _leads():
                self.private = runs / name
                return
        runs.mkdir(parents=True, exist_ok=True)
        _remove_abandoned(runs)
        self._alive = open(runs / f"{name}.lock", "a")
        fcntl.flock(self._alive, fcntl.LOCK_EX)
        self.private = runs / name
        self.private.mkdir()
        (self.private / RUN_MARK).write_text(f"private run copies of process {os.getpid()}, removed when it ends\n")


def _leads() -> bool:
    """Whether this process takes the folder's locks and makes its copies (process 0; one process: itself)."""
    return jax.process_index() == 0


def _link_or_copy(source: str, target: str) -> None:
    """A store's file into a run's copy: a hard link, since the store never changes a file it wrote (chunk extents
    and the manifest are replaced whole: TensorStore's file kvstore and `ManifestIO` write a new file and rename it
    over the old, and a run's reordering and repairs write new extents and unlink old ones, in its own folder); a
    real copy for the manifest's lock file (a lock is the inode's: a shared one would lock the base with the copy)
    and where links cannot be made (another filesystem)."""
    if os.path.basename(source) != MANIFEST_LOCK:
        with contextlib.suppress(OSError):
            os.link(source, target)
            return
    shutil.copy2(source, target)


RUN_MARK = ".specjax-run-copies"  # in each folder of private copies StoreFolder makes
_RUN_NAME = re.compile(r"^[0-9]+-[0-9a-f]{8}$")  # `_make_private`'s names: <pid>-<8 hex digits>


def _remove_abandoned(runs: pathlib.Path) -> None:
    """Private copies of processes that died without removing them: folders this class made (its name pattern and
    mark) whose lock file is no longer held. Anything else in `runs/` is left as it is."""
    for lock in runs.glob("*.lock"):
        folder = lock.with_suffix("")
        if not (_RUN_NAME.match(folder.name) and lock.is_file() and (folder / RUN_MARK).is_file()):
            continue
        with open(lock, "a") as f:
            try:
                fcntl.flock(f, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                continue  # its process is alive
            shutil.rmtree(lock.with_suffix(""), ignore_errors=True)
            lock.unlink(missing_ok=True)


def _lock_failed(lock: pathlib.Path, error: OSError) -> str:
    return (f"the store's lock file {unopenable(lock, error)}: the evaluation locks its base store there; move "
            f"{'that folder' if isinstance(error, IsADirectoryError) else 'it'} away or give --store another folder")


def _populated(counts) -> dict:
    """What a system's populate reported ({"written": n, "reused": n}); unknown for systems that report nothing."""
    counts = counts if isinstance(counts, dict) else {}
    return {"prefixes_written": counts.get("written"), "prefixes_reused": counts.get("reused")}


def _tree_bytes(path: pathlib.Path) -> int:
    return sum(p.stat().st_size for p in path.rglob("*") if p.is_file())


def _copy_failed(base: pathlib.Path, copy: pathlib.Path, error: BaseException) -> str:
    if is_disk_full(error) and free_bytes_without_inodes(copy.parent) is not None:
        return (f"could not copy the base store {base} for a run (no free inodes at {copy.parent}: too many files, "
                "not too many bytes; the partial copy was removed): remove files you no longer need from that file "
                "system or give --store a folder on another")
    need, free = _tree_bytes(base), shutil.disk_usage(copy.parent).free
    why = "the disk is full" if is_disk_full(error) else f"{type(error).__name__}: {str(error)[:200]}"
    return (f"could not copy the base store {base} for a run ({why}; the partial copy was removed): a run needs "
            f"{need / 1e6:.1f} MB free at {copy.parent}, {free / 1e6:.1f} MB are; free space or give --store "
            f"a folder on a larger disk")


def total_steps(workload: Workload, runs) -> int:
    return len(runs) * _steps(workload)


def warmup_steps(workload: Workload, runs) -> int:
    """How many of `total_steps` are warm-up and compile steps: each takes far longer than a timed request, so the
    progress bar's ETA rates the two kinds apart."""
    return len(runs) * _warmup_steps(workload)
