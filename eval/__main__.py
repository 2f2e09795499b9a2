"""`python -m specjax.eval`: accuracy, TTFT and I/O of several systems on one shared-prefix workload.

    python -m specjax.eval                               # smollm2-135m on needle, runs anywhere
    python -m specjax.eval --task piqa --data_dir DATA   # DATA laid out as docs/data.md describes
    python -m specjax.eval --preset spec_fig16 --model opt-6.7b --init random

Writes OUTPUT_DIR/results.json (docs/results.md), results.md and PNG plots.
"""

from __future__ import annotations

import dataclasses
import os
import pathlib
import shlex
import shutil
import sys
import tempfile
import time
from typing import Mapping

import numpy as np
from absl import flags

from specjax import sharding
from specjax.engine.types import EngineConfig
from specjax.kernels import resolve_impl as resolve_kernels
from specjax.models import attention as attention_lib
from specjax.eval import folders, presets as presets_lib
from specjax.eval import report, runner, tasks as tasks_lib, tradeoff, workload as workload_lib
from specjax.eval import settings as settings_lib
from specjax.eval import registry, synthetic, systems as systems_lib
from specjax.eval.errors import EvalError
from specjax.eval.fallback_tokenizer import tokenizer_for
from specjax.eval.partial import PartialRuns, code_version, requests_digest
from specjax.eval.progress import Progress
from specjax.eval.units import cache_bytes, parse_bandwidth, parse_bytes, parse_fewshot, parse_retentions

FLAGS = flags.FLAGS


# Every setting of an evaluation is a field of one of `settings.EVAL_GROUPS` (the model, the workload, the store, the
# engine, the run, the systems' options): its flag, type, default, help and check come from the field, and the
# values are results.json's `config`.
OUR_FLAGS = tuple(name for group in settings_lib.EVAL_GROUPS for name in settings_lib.define_flags(group))
# how this command runs, not what it measures: neither recorded nor part of a resumed evaluation's identity
flags.DEFINE_bool("progress", True, "Show a progress bar with ETA on stderr.")
flags.DEFINE_bool("resume", False, "Reuse the runs an interrupted evaluation finished (kept in <output_dir>/.partial "
                  "until its results are written) and run only the rest; the flags, code and machine must match.")

flags.DEFINE_integer("num_processes", 1, "Processes that run this evaluation together, one model over all their "
                     "devices (each started with the same flags and its own --process_id; docs/scaling.md).")
flags.DEFINE_integer("process_id", 0, "This process's number, 0..num_processes-1; process 0 writes the results.")
flags.DEFINE_string("coordinator", "", "HOST:PORT where process 0 listens for the others (with --num_processes).")

NEEDLE_DEFAULT_LIMIT = settings_lib.NEEDLE_DEFAULT_LIMIT
COMMAND_FLAGS = ("progress", "resume", "num_processes", "process_id", "coordinator")
HELP_FLAGS = ("-h", "-?", "--help", "-help", "--helpshort", "-helpshort", "--help=true", "--helpshort=true")


def load_model(name: str, dtype: str | None, init: str, seed: int, revision: str | None = None,
               tensor_parallel: int = 1):
    import specjax

    try:
        return specjax.load_model(name, dtype=dtype, init=init, seed=seed, revision=revision,
                                  tensor_parallel=tensor_parallel)
    except (ValueError, KeyError, FileNotFoundError, NotImplementedError) as e:
        raise EvalError(f"cannot load model '{name}': {e}") from None


def implementations(kernel_impl: str) -> dict:
    """What the kernels (probe scoring, gathered attention) and the model's own attention ran as on this machine:
    the flag, $SPECJAX_KERNEL_IMPL / $SPECJAX_ATTENTION_IMPL and the platform resolved, so a figure names the code it
    timed."""
    kernels = resolve_kernels(kernel_impl)
    return {"kernels": ("pallas, " + ("interpreted" if kernels.interpret else "compiled")) if kernels.use_pallas
            else "reference (jnp)",
            "attention": attention_lib.resolve_impl()}


def device_description() -> str:
    import jax

    devices = jax.devices()
    d = devices[0]
    kind = getattr(d, "device_kind", d.platform)
    text = f"{len(devices)}x {d.platform} ({kind})"
    if d.platform == "cpu":
        text += f", {os.cpu_count()} host cores"
    return text


def _values() -> dict:
    """The settings' flag values, flat (setting name -> value): what a preset applies to."""
    return {name: FLAGS[name].value for name in OUR_FLAGS}


def flag_settings() -> settings_lib.EvalSettings:
    """The settings tree of the flags' values (no preset applied)."""
    return settings_lib.EvalSettings.from_values(_values())


# Flags that choose which runs to make or where files go; a resumed evaluation may change them.
NOT_FINGERPRINTED = ("systems", "retention", "store", "output_dir", "preset")


def run_task(model, settings: settings_lib.EvalSettings | Mapping, output_dir: pathlib.Path, *,
             resume: bool = False) -> dict:
    """One task end to end; returns the results dict it wrote. `settings`: the tree, or flat values (setting name
    -> value) built into it here. `resume`: reuse the runs an interrupted evaluation into the same `output_dir`
    finished (see specjax.eval.partial). The results go into `output_dir`, or beside it when it holds another
    evaluation's (`folders.OutputFolder`)."""
    settings = settings_lib.as_settings(settings)  # a caller's flat values pass the flags' checks too
    out = folders.OutputFolder(output_dir, resume=resume)
    try:
        return _run_task(model, settings, out, resume)
    except KeyboardInterrupt:
        kept = (out.path or output_dir) / folders.PARTIAL
        raise Interrupted(f"interrupted: the runs that finished are kept in {kept}; run the same command with "
                          "--resume to run only the rest") from None
    finally:
        out.release()


class Interrupted(EvalError):
    """Ctrl-C during an evaluation: one line saying how to go on, exit status 130."""

    exit_code = 130


def _run_task(model, settings: settings_lib.EvalSettings, out: folders.OutputFolder, resume: bool) -> dict:
    started = time.time()
    values = settings.values()  # recorded as `config`, and what identifies a resumed evaluation
    registry.load_plugins(settings.run.plugins)  # once per process: by `main` already, or by a caller of run_task
    names = registry.resolve(settings.run.systems)  # unknown systems fail before any work
    retentions = parse_retentions(settings.run.retention)
    task, limit, workload, tokenizer_source = _workload(model, settings.workload)
    summary = workload.summary()
    # the model's own dtype: cache budgets given as a share of the store must match the bytes it holds
    kv_per_token = model.config.kv_bytes_per_token(np.dtype(model.dtype).itemsize)
    store_bytes = summary["unique_prefix_tokens"] * kv_per_token
    resolved = _system_settings(settings, retentions[0], store_bytes)
    registry.check_distinct(names, resolved.options)

    code = code_version()
    output_dir = out.claim()  # once the request is known to be sound, before any run
    partial = PartialRuns(output_dir, {
        **{k: v for k, v in values.items() if k not in NOT_FINGERPRINTED}, "limit": limit,
        "model_name": model.name, "weights": model.weights, "model_dtype": np.dtype(model.dtype).name,
        "requests": requests_digest(workload.requests), "source": code["source_sha256"],
        "device": device_description()},
        resume=resume)
    runs = runner.plan(names, retentions)
    traces = _replayed(model, runs, resolved)  # a trace that cannot be replayed fails before any work
    progress = Progress(runner.total_steps(workload, runs), enabled=FLAGS.progress,
                        warmup_total=runner.warmup_steps(workload, runs))
    with tempfile.TemporaryDirectory(prefix="specjax-store-") as tmp:
        store_dir = folders.store_folder(settings.store.store) if settings.store.store else pathlib.Path(tmp)
        done = runner.run_all(model, workload, runs, resolved, store_dir, progress, partial,
                              interleave=settings.run.interleave)
    progress.close()
    per_process = _per_process_io(done)

    notes = _notes(model, settings.run, resolved, done, traces, len(runs), tokenizer_source, partial.loaded,
                   out.moved_from, output_dir)
    config = {
        **values, "limit": limit,
        "resolved": {"systems": names, "retentions": retentions, **dataclasses.asdict(resolved)},
        "implementations": implementations(resolved.engine.kernel_impl),
        "store_bytes": store_bytes, "kv_bytes_per_token": kv_per_token,
        "tokenizer": tokenizer_source, "prompt_format": task.prompt_format, "data_source": task.source,
        "model_config": dataclasses.asdict(model.config) if dataclasses.is_dataclass(model.config) else None,
        "sharding": sharding.describe(model.config, getattr(model, "mesh", None)),
        "same_store_contents": "base store written once from every unique prefix (prefixes a --store kept from "
                               "an earlier run are reused: see `stores`); each run opens its own copy; caches "
                               "warmed with each unique prefix once, in first-arrival order, then one untimed "
                               "request per unseen shape (compiles left in timed requests: compilations_timed)",
        "ttft": "request arrival to first-token logits ready on the device; requests run one at a time, no queueing",
    }
    results = report.build_results(
        model=model.name, task=settings.workload.task, weights=model.weights, device=device_description(),
        emulation={"disk_bandwidth": resolved.disk_bandwidth, "pcie_bandwidth": resolved.engine.pcie_bandwidth,
                   "direct_io": resolved.direct_io},
        config=config, runs=done, requests=workload.requests,
        extras={"workload": summary, "notes": notes, "stores": report.store_summary(done),
                "command": shlex.join(sys.argv), "code": code, "resumed": partial.loaded,
                "wall_s": time.time() - started,
                "selections": _selections_record(settings.run, traces), **per_process,
                "timestamp": time.strftime("%Y-%m-%dT%H:%M:%S%z", time.localtime(started))})
    _write_results(results, done, workload, output_dir, partial)
    return results


def _per_process_io(done) -> dict:
    """With several processes: `processes`, what each read for each run (its own heads' share), gathered from all
    of them; nothing with one process."""
    import jax

    if jax.process_count() == 1:
        return {}
    from specjax import distributed

    keys = ("disk_bytes", "probe_disk_bytes", "chunks_read", "read_requests", "host_to_device_bytes")
    mine = {run.key: {k: float(sum(o.counters.get(k, 0.0) for o in run.outcomes)) for k in keys} for run in done}
    return {"processes": [{"process": i, "io": io} for i, io in enumerate(distributed.gather_json(mine))]}


def _workload(model, settings: settings_lib.WorkloadSettings):
    """(the task, the request limit, its workload, where the tokenizer came from), the longest request checked
    against the model's positions."""
    task = tasks_lib.load_task(settings.task, settings.data_dir, settings.data_path)
    limit = settings.limit
    if limit is None and task.synthetic:
        limit = NEEDLE_DEFAULT_LIMIT
    spec = workload_lib.WorkloadSpec(
        fewshot=parse_fewshot(settings.num_fewshot), reuse_mean=settings.reuse_mean,
        reuse_std=settings.reuse_std, prefix_tokens=settings.prefix_tokens, limit=limit,
        add_bos=settings.add_bos, seed=settings.seed,
        needle=dataclasses.replace(synthetic.NeedleSpec(), num_facts=settings.needle_facts))
    tokenizer, tokenizer_source = tokenizer_for(model)
    workload = workload_lib.build_workload(task, tokenizer, spec)
    max_len = max(len(r.context_ids) + max(len(c) for c in r.choice_ids) for r in workload.requests)
    if max_len > model.config.max_positions:
        raise EvalError(f"the longest request has {max_len} tokens but {model.name} takes at most "
                        f"{model.config.max_positions}; lower --prefix_tokens or --num_fewshot")
    return task, limit, workload, tokenizer_source


def _system_settings(settings: settings_lib.EvalSettings, retention: float,
                     store_bytes: int) -> systems_lib.SystemSettings:
    """What every run of the evaluation shares, resolved from `settings`: the engine's config (cache budgets in
    bytes of a store of `store_bytes`; `EngineSettings`' fields as they are), the store's chunk and disk, the
    systems' options and the selection trace."""
    store = settings.store
    engine = EngineConfig(
        retention=retention, gpu_cache_bytes=cache_bytes(store.gpu_cache, store_bytes),
        cpu_cache_bytes=cache_bytes(store.cpu_cache, store_bytes),
        pcie_bandwidth=parse_bandwidth(store.pcie_bandwidth) if store.pcie_bandwidth else None,
        **dataclasses.asdict(settings.engine))
    return systems_lib.SystemSettings(
        engine=engine, chunk_tokens=store.chunk_tokens,
        disk_bandwidth=parse_bandwidth(store.disk_bandwidth) if store.disk_bandwidth else None,
        direct_io=store.direct_io, seed=settings.workload.seed,
        inflight_bytes=parse_bytes(store.inflight_bytes) if store.inflight_bytes else None,
        options=settings.options, selections=_selection_setting(settings))


def _notes(model, run_settings: settings_lib.RunSettings, settings: systems_lib.SystemSettings, done, traces,
           n_runs: int, tokenizer_source: str, resumed, moved_from, output_dir) -> list[str]:
    """The results' caveats, first in results.md: random weights, emulation, stores, replayed or recorded
    selections, interleaving, where the results went, what was resumed."""
    notes = []
    if model.weights == "random":
        notes.append("weights are random: accuracy is meaningless; TTFT and I/O are valid for these shapes")
    if tokenizer_source != "model":
        notes.append(f"tokenizer: {tokenizer_source}")
    if settings.disk_bandwidth or settings.engine.pcie_bandwidth:
        notes.append("bandwidths are emulated (a throttled link; the disk serves demand reads before speculative "
                     "ones), see `emulation`")
    notes += report.store_notes(done)
    if traces:
        recorded = sorted({f"{t['recorded_by']} ({t['weights']} weights) on {t['task']}" for t in traces.values()})
        notes.append(f"selections replayed from {run_settings.replay_selections}, recorded by {', '.join(recorded)}: "
                     "accuracy is meaningless (the recorded model's choices, this model's logits); TTFT, bytes, "
                     "reads, hits and plans are what this run measures (see `selections`)")
    elif run_settings.record_selections:
        notes.append(f"selections recorded into {run_settings.record_selections}: each layer's scores were copied to "
                     "the host as it identified, and that is in these TTFTs")
    if run_settings.interleave and n_runs > 1:
        notes.append("runs timed in turns (--interleave): each request by every run before the next request, the "
                     "first run of a turn rotating; all runs were warmed and compiled first and stayed open")
    if moved_from is not None:
        notes.append(f"written into {output_dir}: {moved_from} holds another evaluation's results")
    if resumed:
        notes.append(f"resumed: {', '.join(resumed)} were run by an earlier process of this evaluation (same "
                     "flags, code and machine; see `resumed`); their TTFTs were not timed side by side with the rest")
    return notes


def _write_results(results: dict, done, workload, output_dir: pathlib.Path, partial) -> None:
    """results.json, results.md, the plots and requests.jsonl into `output_dir`; the finished runs kept until
    then are dropped once they are written."""
    try:
        written = report.write_all(results, output_dir)
        report.write_requests(done, workload.requests, output_dir / "requests.jsonl")
    except OSError as e:
        raise EvalError(f"could not write the results into {output_dir} ({e.strerror or e}); the finished runs are "
                        f"kept in {partial.dir}: free space and run the same command with --resume") from None
    written.append(output_dir / "requests.jsonl")
    partial.discard()
    if not FLAGS.process_id:  # the others' results are process 0's, which it writes
        _print_summary(results, written)


def _selection_setting(settings: settings_lib.EvalSettings) -> systems_lib.SelectionTrace | None:
    run_settings = settings.run
    if run_settings.record_selections and run_settings.replay_selections:
        raise EvalError("--record_selections and --replay_selections exclude each other: record a trace in one run, "
                        "replay it in another")
    folder, mode = ((run_settings.record_selections, "record") if run_settings.record_selections else
                    (run_settings.replay_selections, "replay"))
    if folder is None:
        return None
    return systems_lib.SelectionTrace(mode, str(pathlib.Path(folder).expanduser()), settings.workload.task,
                                      settings.workload.prefix_tokens)


def _replayed(model, runs, settings: systems_lib.SystemSettings) -> dict:
    """Each run that replays a selection trace: what the trace says of its recording (loading it checks it)."""
    if settings.selections is None or settings.selections.mode != "replay":
        return {}
    found = {}
    for name, retention in runs:
        if retention is None:
            continue
        system = registry.make_system(name, model, settings.at_retention(retention))
        trace = getattr(system, "selections", None)
        if trace is not None:
            found[f"{name}@r={retention:g}"] = trace.describe()
    if not found:
        raise EvalError(f"--replay_selections {settings.selections.folder}: none of these systems identifies "
                        "(nothing to replay); replay into systems such as spec, spec_gqa or as_h2o_lfu")
    return found


def _selections_record(run_settings: settings_lib.RunSettings, traces: dict) -> dict | None:
    """results.json `selections`: recorded into a folder, or replayed (per run: from what)."""
    if run_settings.record_selections:
        return {"mode": "record", "folder": run_settings.record_selections}
    if run_settings.replay_selections:
        return {"mode": "replay", "folder": run_settings.replay_selections, "runs": traces}
    return None


def _print_summary(results: dict, written: list[pathlib.Path]) -> None:
    ref = results["systems"].get("recompute")
    for key, s in results["systems"].items():
        a, t = s["accuracy"], s["ttft_ms"]
        speed = f", {ref['ttft_ms']['mean'] / t['mean']:.2f}x vs recompute" if ref and key != "recompute" else ""
        print(f"{key:<22} acc {100 * a['acc']:5.1f}% ± {100 * a['stderr']:.1f} (n={a['n']})  "
              f"TTFT mean {t['mean']:.1f} ms p99 {t['p99']:.1f} ms{speed}")
    for note in results.get("notes", []):
        print(f"note: {note}")
    print("trade-off: " + " ".join(tradeoff.summary(results)))
    print(f"eval time {results['wall_s']:.0f} s (model loading not included)")
    print("wrote " + ", ".join(str(p) for p in written))


def main(argv):
    if len(argv) > 1:
        raise EvalError(f"unexpected arguments {argv[1:]}; flags look like --task piqa")
    _join_processes()  # before anything starts JAX
    present = {name for name in OUR_FLAGS if FLAGS[name].present}
    preset = presets_lib.load(FLAGS.preset) if FLAGS.preset else None
    values = presets_lib.apply(preset, _values(), present) if preset else _values()  # the command line's win
    task_list = _task_list(values["task"], preset, present)
    # fail on a bad setting (a preset's) or an unknown system before loading a model
    settings = settings_lib.EvalSettings.from_values(values)
    registry.load_plugins(settings.run.plugins)  # the systems they register are named like the engine's
    registry.resolve(settings.run.systems)
    base_dir = pathlib.Path(settings.run.output_dir or f"results/{pathlib.Path(settings.model.model).name}-"
                            f"{settings.run.preset or settings.workload.task}")
    folders.check_folder("--output_dir", base_dir)
    if settings.store.store:
        folders.store_folder(settings.store.store)
    folders.check_writable("--output_dir", base_dir)
    if FLAGS.num_processes > 1:
        _check_processes(settings)
        if FLAGS.process_id:  # process 0 writes the results; the others' go to a folder removed at the end
            base_dir = pathlib.Path(tempfile.mkdtemp(prefix=f"specjax-eval-process{FLAGS.process_id}-"))
            FLAGS.progress = False
    m = settings.model
    model = load_model(m.model, m.dtype, m.init, settings.workload.seed, m.revision, m.tensor_parallel)
    for name in task_list:
        task_settings = settings_lib.EvalSettings.from_values(presets_lib.for_task(preset, values, name, present))
        out = base_dir / name if len(task_list) > 1 else base_dir
        run_task(model, task_settings, out, resume=FLAGS.resume)
    if FLAGS.process_id:
        shutil.rmtree(base_dir, ignore_errors=True)


def _join_processes() -> None:
    """With --num_processes N: join this process to the others (`specjax.distributed.initialize`)."""
    if FLAGS.num_processes == 1:
        return
    if not FLAGS.coordinator:
        raise EvalError("--num_processes needs --coordinator HOST:PORT: where process 0 listens for the others")
    from specjax import distributed
    from specjax.errors import SpecjaxError

    try:
        distributed.initialize(FLAGS.coordinator, FLAGS.num_processes, FLAGS.process_id)
    except SpecjaxError as e:
        raise EvalError(str(e)) from None


def _check_processes(settings: settings_lib.EvalSettings) -> None:
    """What an evaluation over several processes needs: one store folder they all reach, and no resuming (each
    process would resume its own)."""
    if not settings.store.store:
        raise EvalError("--num_processes needs --store: a folder every process reaches (a shared file system), "
                        "where process 0 writes the stored prefixes the others read")
    if FLAGS.resume:
        raise EvalError("--resume does not run with --num_processes: run the evaluation again whole")


def _task_list(task: str, preset: dict | None, present: set[str]) -> list[str]:
    """The tasks to run, one after another: `task`, or a preset's tasks where --task is not given; each a known
    task, and no flag that sizes needle prefixes beside rag."""
    task_list = list(preset.get("tasks", [task])) if preset and "task" not in present else [task]
    for name in task_list:
        if name not in tasks_lib.TASKS:
            raise EvalError(f"unknown task '{name}'; known tasks: {', '.join(tasks_lib.TASKS)}")
    if "rag" in task_list:
        ignored = [f"--{name}" for name in ("prefix_tokens", "needle_facts") if FLAGS[name].present]
        if ignored:
            raise EvalError(f"{' and '.join(ignored)} size needle prefixes; rag contexts are 4-6 text chunks "
                            f"(~110 tokens each) drawn from a fixed pool (specjax.eval.synthetic.RagSpec)")
    return task_list


def _flag_entry(flag) -> str:
    kind = {"bool": "bool", "int": "int", "float": "float"}.get(flag.flag_type(), "str")
    return settings_lib.flag_help(flag.name, kind, flag.default, flag.help)


def help_text() -> str:
    """`--help`: every flag of this command with its default and help, grouped as the settings tree, then the
    command's own flags, then any other flag specjax defines; absl's and other libraries' are left to --helpfull."""
    shown = set(OUR_FLAGS) | set(COMMAND_FLAGS)
    others = sorted({flag.name: flag for module, defined in FLAGS.flags_by_module_dict().items()
                     if module.startswith("specjax") for flag in defined if flag.name not in shown}.items())
    return settings_lib.render_help(
        __doc__, settings_lib.EVAL_GROUPS,
        [("How this command runs (not recorded in results.json, not part of a resumed evaluation's identity).",
          [_flag_entry(FLAGS[name]) for name in COMMAND_FLAGS]),
         ("Other flags of specjax.", [_flag_entry(flag) for _, flag in others])],
        footer="Flags take --name=value or --name value, a bool flag --name or --noname; the settings' values "
               "are recorded in results.json's `config`. absl's own flags (-v/--verbosity, --flagfile, "
               "--logtostderr, ...) and those of the libraries specjax loads: --helpfull.")


def wants_help(argv: list[str]) -> bool:
    """Whether the command line asks for --help, -h or --helpshort (before a `--` ending the flags)."""
    args = argv[:argv.index("--")] if "--" in argv else argv
    return any(arg.lower() in HELP_FLAGS for arg in args)


def run():
    from specjax.cli import run as run_cli

    if wants_help(sys.argv[1:]):
        sys.stdout.write(help_text())
        sys.exit(0)
    run_cli(main)


if __name__ == "__main__":
    run()
