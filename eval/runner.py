"""Runs several systems on one request sequence, each from the same store contents.

The base store is written once (by the first system that needs a store) from every unique
prefix of the workload; systems that lay out their store differently (another chunk size, independently
cached text chunks) name it with a `store_key` attribute and get a base store of their own. Each (system, retention) run then gets its own fresh copy of that
directory, so write-behind, reordering or checksum repairs of one run cannot leak into
another. Caches start empty and are warmed with the same warm-up passes (each unique prefix
once, in order of first arrival), then requests of shapes not seen yet run once untimed, so no
timed request should include JIT compilation; the compiles that still happen in a timed request are counted in its
`compilations` counter. Compiled programs are dropped after each system, so every system
compiles its own in those untimed passes and a long run's programs never pile up past the process's limit on
memory mappings.
"""

from __future__ import annotations

import dataclasses
import pathlib
import shutil
import time

import jax

from specjax.engine import shape_key
from specjax.eval import systems as systems_lib
from specjax.eval.compiles import CompileCounter
from specjax.eval.partial import PartialRuns
from specjax.eval.progress import Progress
from specjax.eval.workload import Workload


@dataclasses.dataclass
class Run:
    system: str
    retention: float | None  # None: the system does not depend on retention
    outcomes: list[systems_lib.Outcome]
    warm_s: float
    run_s: float
    sweep: bool = False  # several retentions in this run: keys carry the retention

    @property
    def key(self) -> str:
        if self.retention is None or not self.sweep:
            return self.system
        return f"{self.system}@r={self.retention:g}"


def plan(names: list[str], retentions: list[float]) -> list[tuple[str, float | None]]:
    """(system, retention) pairs; retention-free systems run once."""
    out = []
    for name in names:
        if systems_lib.uses_retention(name):
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


def _stored_sequences(system, warm: list) -> list:
    """What a base store is written from: each unique prefix, unless the system says otherwise (text chunks)."""
    if hasattr(system, "stored_sequences"):
        return system.stored_sequences(warm)
    return [r.prefix_ids for r in warm]


def run_all(model, workload: Workload, runs: list[tuple[str, float | None]], settings: systems_lib.SystemSettings,
            store_dir: pathlib.Path, progress: Progress | None = None, partial: PartialRuns | None = None) -> list[Run]:
    """Every (system, retention) run in order; with `partial`, each finished run is saved as it ends and runs
    saved by an interrupted evaluation are loaded instead of run again."""
    warm, compile_only = warmup_requests(workload), compile_requests(workload)
    sweep = len({r for _, r in runs if r is not None}) > 1
    bases_ready: set[str] = set()
    results = []
    for name, retention in runs:
        label = name if retention is None else f"{name} r={retention:g}"
        saved = partial.load(label) if partial else None
        if saved is not None:
            results.append(Run(**{**saved, "sweep": sweep}))
            if progress:
                progress.skip(len(warm) + len(compile_only) + len(workload.requests))
            continue
        run_settings = dataclasses.replace(settings, retention=retention if retention is not None else settings.retention)
        system = systems_lib.make_system(name, model, run_settings)
        if progress:
            progress.set_label(label + " (warm)")
        t0 = time.perf_counter()
        if system.needs_store:
            key = getattr(system, "store_key", "default")
            base = store_dir / f"base-{key}"
            if key not in bases_ready:
                base.mkdir(parents=True, exist_ok=True)
                system.populate(str(base), _stored_sequences(system, warm))
                bases_ready.add(key)
            private = store_dir / label.replace(" ", "_").replace("=", "")
            if private.exists():
                shutil.rmtree(private)
            shutil.copytree(base, private)
            system.open(str(private))
        else:
            private = None
        system.warm(warm)
        if progress:
            progress.update(len(warm))
        for request in compile_only:
            system.run(request)
            if progress:
                progress.update()
        if progress:
            progress.set_label(label)
        t1 = time.perf_counter()
        outcomes = []
        try:
            with CompileCounter() as compiles:
                for request in workload.requests:
                    before = compiles.count
                    outcomes.append(systems_lib.as_outcome(system.run(request)))
                    outcomes[-1].counters["compilations"] = compiles.count - before
                    if progress:
                        progress.update()
        finally:
            system.close()
            if private is not None:
                shutil.rmtree(private, ignore_errors=True)
            # Each compiled program holds memory mappings and a process may have only vm.max_map_count of
            # them; dropping one system's programs keeps a long run of several systems within that. The
            # next system compiles what it needs in its own untimed warm-up and compile passes.
            jax.clear_caches()
        results.append(Run(name, retention, outcomes, t1 - t0, time.perf_counter() - t1, sweep))
        if partial:
            partial.save(label, results[-1])
    return results


def total_steps(workload: Workload, runs) -> int:
    return len(runs) * (len(workload.requests) + len(warmup_requests(workload)) + len(compile_requests(workload)))
