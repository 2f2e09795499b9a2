"""`python -m specjax.eval`: accuracy, TTFT and I/O of several systems on one shared-prefix workload.

    python -m specjax.eval                                    # smollm2-135m on needle, runs anywhere
    python -m specjax.eval --model smollm2-135m --task piqa --data_dir ../shared/data
    python -m specjax.eval --preset spec_fig16 --model opt-6.7b --init random

Writes OUTPUT_DIR/results.json (design.md section 7), results.md and PNG plots.
"""

from __future__ import annotations

import dataclasses
import os
import pathlib
import shlex
import sys
import tempfile
import time

import numpy as np
from absl import flags

from specjax import sharding
from specjax.engine.systems import SystemOptions
from specjax.engine.types import EngineConfig
from specjax.errors import SpecjaxError
from specjax.eval import presets as presets_lib
from specjax.eval import report, runner, tasks as tasks_lib, tradeoff, workload as workload_lib
from specjax.eval import systems as systems_lib
from specjax.eval.errors import EvalError
from specjax.eval.fallback_tokenizer import tokenizer_for
from specjax.eval.partial import PartialRuns, code_version, requests_digest
from specjax.eval.progress import Progress
from specjax.eval.units import parse_bandwidth, parse_bytes, parse_fewshot, parse_retentions, parse_size
from specjax.stores import Layout

FLAGS = flags.FLAGS


def define_option_flags(options=SystemOptions) -> tuple[str, ...]:
    """One flag per field of `options`: its name, default and help, typed by the field's type (an enum where it
    lists choices), checked by building the options from it (their own message on a bad value). Returns the
    flags' names."""
    for field in dataclasses.fields(options):
        help_text, choices = field.metadata["help"], field.metadata["choices"]
        if choices is not None:
            flags.DEFINE_enum(field.name, field.default, choices, help_text)
        else:
            define = {"bool": flags.DEFINE_bool, "int": flags.DEFINE_integer, "float": flags.DEFINE_float,
                      "str": flags.DEFINE_string}[field.type.split(" | ")[0]]
            define(field.name, field.default, help_text)
        flags.register_validator(field.name, lambda v, name=field.name: _parses(lambda x: options(**{name: x}), v),
                                 f"is not a value of {options.__name__}.{field.name}")
    return tuple(field.name for field in dataclasses.fields(options))


# model
flags.DEFINE_string("model", "smollm2-135m", "Model: a registered name (smollm2-135m, opt-6.7b, tiny-llama, ...), "
                    "a Hugging Face hub id ORG/NAME, a Hugging Face checkpoint folder, or a directory written by "
                    "`python -m specjax.convert`. Hub checkpoints and folders are converted once into "
                    "$SPECJAX_HOME/models.")
flags.DEFINE_string("revision", None, "Branch, tag or commit of a Hugging Face hub --model (default: main).")
flags.DEFINE_enum("init", "pretrained", ["pretrained", "random"],
                  "Weights: `pretrained` (converted checkpoint) or `random` (real shapes, for timing only: "
                  "accuracy is then meaningless and results say so).")
flags.DEFINE_string("dtype", None, "Model dtype (float32, bfloat16, float16); default: the model's own.")
flags.DEFINE_integer("tensor_parallel", 1, "Devices to split the model over by attention head and MLP unit "
                     "(jax.sharding mesh over the first N; specjax.sharding); each device holds, loads and attends "
                     "over its own KV heads. 1: one device, no mesh. On CPU, "
                     "XLA_FLAGS=--xla_force_host_platform_device_count=N gives N devices.")
# task and workload
flags.DEFINE_string("task", "needle",
                    "Task: " + "; ".join(f"{k} ({v.description})" for k, v in tasks_lib.TASKS.items()) + ".")
flags.DEFINE_string("data_dir", None, "Folder with task files laid out like ../shared/data (see its README.md). "
                    "Searched first, then $SPECJAX_DATA, then the Hugging Face hub (needs `datasets`).")
flags.DEFINE_string("data_path", None, "JSONL file for --task mc_jsonl: one {\"query\",\"choices\",\"gold\"} per line.")
flags.DEFINE_integer("limit", None, "Number of requests (the first N task items, as lm-eval's --limit). "
                     "Default: all items; for needle 16, to keep the default run (8 runs: 5 systems, the 3 that "
                     "prune at 2 retentions) short on a 2-core CPU; README.md gives its measured time.")
flags.DEFINE_string("num_fewshot", "2-10", "Few-shot examples per shared prefix: N, or A-B for a uniform draw per "
                    "prefix (the papers' 2-10). 0 gives lm-eval's zero-shot prompts.")
flags.DEFINE_integer("prefix_tokens", None, "Extend every prefix with more examples (needle: more facts) to at "
                     "least this many tokens (SPEC: 4.8k-5.7k average, up to 10k).")
flags.DEFINE_float("reuse_mean", 8.0, "Mean number of queries sharing one prefix (normal distribution).")
flags.DEFINE_float("reuse_std", 3.0, "Standard deviation of the number of queries sharing one prefix.")
flags.DEFINE_integer("needle_facts", tasks_lib.NeedleSpec.num_facts,
                     "needle: key-value facts per prefix (ignored when --prefix_tokens is set).")
flags.DEFINE_bool("add_bos", False, "Start every prefix with the tokenizer's BOS token (lm-eval adds none).")
flags.DEFINE_integer("seed", 0, "Seed for the workload (items, few-shot draws, reuse counts, needle facts) and "
                     "random weights.")
# systems
flags.DEFINE_string("systems", "default", "Comma-separated systems: " + ", ".join(systems_lib.KNOWN_SYSTEMS) +
                    ". `default` = the SPEC paper's line-up (recompute, as_full, as_h2o_lru, as_h2o_lfu, spec) "
                    "restricted to those built; `all` = every built system.")
flags.DEFINE_string("retention", "0.25,0.75", "Fraction of prefix tokens kept, or a comma-separated list to sweep "
                    "(e.g. 0.05,0.1,0.25,0.5); each system that prunes runs once per value, the others (recompute, "
                    "as_full, cake, ...) once in all. results.md opens with the accuracy-TTFT trade-off over them.")
flags.DEFINE_integer("chunk_tokens", Layout.chunk_tokens,
                     "Tokens per stored KV chunk (SPEC: 64; contiguous_kv uses its own 16).")
flags.DEFINE_string("gpu_cache", "15%", "GPU prefix-KV cache budget: bytes (10GB, 512MiB) or a percentage of "
                    "the workload's stored prefix KV (SPEC: 10GB of ~60GB).")
flags.DEFINE_string("cpu_cache", "50%", "CPU prefix-KV cache budget: bytes or a percentage of the stored prefix "
                    "KV (SPEC: 32GB of ~60GB). Keep GPU+CPU under 100% so part of the KV lives only on disk.")
flags.DEFINE_string("disk_bandwidth", None, "Emulated disk read bandwidth (e.g. 5GB/s); unset = the real disk.")
flags.DEFINE_string("pcie_bandwidth", None, "Emulated CPU->GPU bandwidth (e.g. 25GB/s); unset = the real link.")
flags.DEFINE_bool("direct_io", False, "Read the store with O_DIRECT so the page cache does not hide the disk.")
flags.DEFINE_string("inflight_bytes", None, "Most bytes of KV reads the disk's read scheduler keeps in flight (e.g. "
                    "4MiB); unset: 4MiB on a real disk, one read at a time on an emulated one. Reads beyond it wait "
                    "in its queue, demand before speculative, where a superseded speculative read is dropped unread.")
# what a user may change about a system: one flag per SystemOptions field (specjax.engine.systems)
OPTION_FLAGS = define_option_flags()
flags.DEFINE_integer("cake_chunk_tokens", EngineConfig.cake_chunk_tokens, "cake: tokens per chunk computed from "
                     "the front or loaded from the back (Cake: 512); a multiple of --chunk_tokens.")
flags.DEFINE_integer("prefill_chunk_tokens", EngineConfig.prefill_chunk_tokens, "Chunked prefill when nothing is "
                     "reused (recompute, a cold request): more new tokens than this are computed in chunks of this "
                     "many, each attending to the earlier chunks' KV (exact); 0: one block, as the plain forward.")
flags.DEFINE_string("record_selections", None, "Folder to record, for each system that identifies, the attention "
                    "scores its identification decided from (one file per system and retention), to replay in a "
                    "timing run of another shape (--replay_selections; specjax.engine.replay).")
flags.DEFINE_string("replay_selections", None, "Folder of selection traces (--record_selections): each system that "
                    "identifies decides from the recorded scores of its own system and retention instead of its own, "
                    "mapped by request, relative layer depth and relative prefix offset. Same task only; onto random "
                    "weights or the recording model. Accuracy of a replayed run is meaningless; its TTFT, bytes, "
                    "reads and hits are what it is for.")
# where things go
flags.DEFINE_string("store", None, "Directory (or TensorStore kvstore path) for the prefix-KV store; default: a "
                    "temporary directory removed at the end.")
flags.DEFINE_string("output_dir", None, "Where results.json, results.md and plots go; default results/<model>-<task>.")
flags.DEFINE_string("preset", None, "Experiment preset from specjax.configs.presets (" +
                    ", ".join(presets_lib.names()) + "); flags given on the command line override it.")
flags.DEFINE_bool("progress", True, "Show a progress bar with ETA on stderr.")
flags.DEFINE_bool("resume", False, "Reuse the runs an interrupted evaluation finished (kept in <output_dir>/.partial "
                  "until its results are written) and run only the rest; the flags, code and machine must match.")

flags.register_validator("retention", lambda v: _ok(parse_retentions, v), "must be fractions in (0, 1], "
                         "comma-separated, e.g. 0.25 or 0.05,0.1,0.25,0.5")
flags.register_validator("num_fewshot", lambda v: _ok(parse_fewshot, v), "must be N or A-B with 0 <= A <= B")
flags.register_validator("gpu_cache", lambda v: _parses(parse_size, v), "must be a size like 10GB, 512MiB or 15%")
flags.register_validator("cpu_cache", lambda v: _parses(parse_size, v), "must be a size like 32GB, 2GiB or 50%")
flags.register_validator("disk_bandwidth", lambda v: v is None or _parses(parse_bandwidth, v),
                         "must be a rate like 5GB/s or 800MB/s")
flags.register_validator("inflight_bytes", lambda v: v is None or _ok(parse_bytes, v),
                         "must be a size like 4MiB or 512KB")
flags.register_validator("pcie_bandwidth", lambda v: v is None or _parses(parse_bandwidth, v),
                         "must be a rate like 25GB/s")
flags.register_validator("limit", lambda v: v is None or v > 0, "must be a positive number of requests")
flags.register_validator("tensor_parallel", lambda v: v >= 1, "must be at least 1 (1: one device)")
flags.register_validator("prefix_tokens", lambda v: v is None or v > 0, "must be a positive token count")
flags.register_validator("chunk_tokens", lambda v: v > 0, "must be positive")
flags.register_validator("cake_chunk_tokens", lambda v: v > 0, "must be positive")
flags.register_validator("prefill_chunk_tokens", lambda v: v >= 0, "must be >= 0 (0: one block)")
flags.register_validator("needle_facts", lambda v: v >= 4, "must be at least 4")
flags.register_validator("reuse_mean", lambda v: v >= 1, "must be at least 1")
flags.register_validator("reuse_std", lambda v: v >= 0, "must be non-negative")

NEEDLE_DEFAULT_LIMIT = 16
# flags that are SystemSettings fields of the same name
SYSTEM_FLAGS = ("cake_chunk_tokens", "prefill_chunk_tokens")
OUR_FLAGS = ("model", "init", "dtype", "task", "data_dir", "data_path", "limit", "num_fewshot", "prefix_tokens",
             "reuse_mean", "reuse_std", "needle_facts", "add_bos", "seed", "systems", "retention", "chunk_tokens",
             "gpu_cache", "cpu_cache", "disk_bandwidth", "pcie_bandwidth", "direct_io", "inflight_bytes", "store",
             "output_dir", "preset", "revision", "tensor_parallel", "record_selections",
             "replay_selections") + SYSTEM_FLAGS + OPTION_FLAGS


def _ok(parse, value) -> bool:
    try:
        parse(value)
        return True
    except (ValueError, TypeError):
        return False


def _parses(parse, value) -> bool:
    """As `_ok`, but a refusal carries the parser's own message (it says what to write instead)."""
    try:
        parse(value)
        return True
    except (ValueError, TypeError, SpecjaxError) as e:
        raise flags.ValidationError(f"{e}") from None


def load_model(name: str, dtype: str | None, init: str, seed: int, revision: str | None = None,
               tensor_parallel: int = 1):
    import specjax

    try:
        return specjax.load_model(name, dtype=dtype, init=init, seed=seed, revision=revision,
                                  tensor_parallel=tensor_parallel)
    except (ValueError, KeyError, FileNotFoundError, NotImplementedError) as e:
        raise EvalError(f"cannot load model '{name}': {e}") from None


def check_folder(flag: str, path: pathlib.Path) -> None:
    """A folder flag must name a folder or nothing yet (it is created): never a file, nor a path through one."""
    for part in [path, *path.parents]:
        if part.exists() and not part.is_dir():
            raise EvalError(f"{flag} {path}: {part} is a file, not a folder; give a folder (created if missing)")


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
    return {name: FLAGS[name].value for name in OUR_FLAGS}


def _cache_bytes(spec: str, store_bytes: int) -> int:
    value, is_fraction = parse_size(spec)
    return int(round(value * store_bytes)) if is_fraction else int(value)


# Flags that choose which runs to make or where files go; a resumed evaluation may change them.
NOT_FINGERPRINTED = ("systems", "retention", "store", "output_dir", "preset")


def run_task(model, values: dict, output_dir: pathlib.Path, *, resume: bool = False) -> dict:
    """One task end to end; returns the results dict it wrote. `resume`: reuse the runs an interrupted
    evaluation into the same `output_dir` finished (see specjax.eval.partial)."""
    started = time.time()
    names = systems_lib.resolve(values["systems"])  # unknown systems fail before any work
    retentions = parse_retentions(values["retention"])
    task = tasks_lib.load_task(values["task"], values["data_dir"], values["data_path"])
    limit = values["limit"]
    if limit is None and task.synthetic:
        limit = NEEDLE_DEFAULT_LIMIT
    spec = workload_lib.WorkloadSpec(
        fewshot=parse_fewshot(values["num_fewshot"]), reuse_mean=values["reuse_mean"],
        reuse_std=values["reuse_std"], prefix_tokens=values["prefix_tokens"], limit=limit,
        add_bos=values["add_bos"], seed=values["seed"],
        needle=dataclasses.replace(tasks_lib.NeedleSpec(), num_facts=values["needle_facts"]))
    tokenizer, tokenizer_source = tokenizer_for(model)
    workload = workload_lib.build_workload(task, tokenizer, spec)
    summary = workload.summary()
    max_len = max(len(r.context_ids) + max(len(c) for c in r.choice_ids) for r in workload.requests)
    if max_len > model.config.max_positions:
        raise EvalError(f"the longest request has {max_len} tokens but {model.name} takes at most "
                        f"{model.config.max_positions}; lower --prefix_tokens or --num_fewshot")

    # the model's own dtype: cache budgets given as a share of the store must match the bytes it holds
    kv_per_token = model.config.kv_bytes_per_token(np.dtype(model.dtype).itemsize)
    store_bytes = summary["unique_prefix_tokens"] * kv_per_token
    settings = systems_lib.SystemSettings(
        retention=retentions[0], chunk_tokens=values["chunk_tokens"],
        gpu_cache_bytes=_cache_bytes(values["gpu_cache"], store_bytes),
        cpu_cache_bytes=_cache_bytes(values["cpu_cache"], store_bytes),
        disk_bandwidth=parse_bandwidth(values["disk_bandwidth"]) if values["disk_bandwidth"] else None,
        pcie_bandwidth=parse_bandwidth(values["pcie_bandwidth"]) if values["pcie_bandwidth"] else None,
        direct_io=values["direct_io"], seed=values["seed"],
        inflight_bytes=parse_bytes(values["inflight_bytes"]) if values["inflight_bytes"] else None,
        options=SystemOptions(**{k: values[k] for k in OPTION_FLAGS}), selections=_selection_setting(values),
        **{k: values[k] for k in SYSTEM_FLAGS})

    code = code_version()
    partial = PartialRuns(output_dir, {
        **{k: v for k, v in values.items() if k not in NOT_FINGERPRINTED}, "limit": limit,
        "model_name": model.name, "weights": model.weights, "model_dtype": np.dtype(model.dtype).name,
        "requests": requests_digest(workload.requests), "source": code["source_sha256"],
        "device": device_description()},
        resume=resume)
    runs = runner.plan(names, retentions)
    traces = _replayed(model, runs, settings)  # a trace that cannot be replayed fails before any work
    progress = Progress(runner.total_steps(workload, runs), enabled=FLAGS.progress)
    with tempfile.TemporaryDirectory(prefix="specjax-store-") as tmp:
        store_dir = pathlib.Path(values["store"]).expanduser() if values["store"] else pathlib.Path(tmp)
        done = runner.run_all(model, workload, runs, settings, store_dir, progress, partial)
    progress.close()

    notes = []
    if model.weights == "random":
        notes.append("weights are random: accuracy is meaningless; TTFT and I/O are valid for these shapes")
    if tokenizer_source != "model":
        notes.append(f"tokenizer: {tokenizer_source}")
    if settings.disk_bandwidth or settings.pcie_bandwidth:
        notes.append("bandwidths are emulated (a throttled link; the disk serves demand reads before speculative ones), see `emulation`")
    notes += report.store_notes(done)
    if traces:
        recorded = sorted({f"{t['recorded_by']} ({t['weights']} weights) on {t['task']}" for t in traces.values()})
        notes.append(f"selections replayed from {values['replay_selections']}, recorded by {', '.join(recorded)}: "
                     "accuracy is meaningless (the recorded model's choices, this model's logits); TTFT, bytes, "
                     "reads, hits and plans are what this run measures (see `selections`)")
    elif values["record_selections"]:
        notes.append(f"selections recorded into {values['record_selections']}: each layer's scores were copied to "
                     "the host as it identified, and that is in these TTFTs")
    if partial.loaded:
        notes.append(f"resumed: {', '.join(partial.loaded)} were run by an earlier process of this evaluation (same "
                     "flags, code and machine; see `resumed`); their TTFTs were not timed side by side with the rest")
    config = {
        **values, "limit": limit,
        "resolved": {"systems": names, "retentions": retentions, **dataclasses.asdict(settings)},
        "store_bytes": store_bytes, "kv_bytes_per_token": kv_per_token,
        "tokenizer": tokenizer_source, "prompt_format": task.prompt_format, "data_source": task.source,
        "model_config": dataclasses.asdict(model.config) if dataclasses.is_dataclass(model.config) else None,
        "sharding": sharding.describe(model.config, getattr(model, "mesh", None)),
        "same_store_contents": "base store written once from every unique prefix (prefixes a --store kept from "
                               "an earlier run are reused: see `stores`); each run opens its own copy; caches "
                               "warmed with each unique prefix once, in first-arrival order, then one untimed "
                               "request per unseen shape (compiles left in timed requests: compilations_timed)",
        "ttft": "request dispatch to first-token logits on host; requests run one at a time, no queueing",
    }
    results = report.build_results(
        model=model.name, task=values["task"], weights=model.weights, device=device_description(),
        emulation={"disk_bandwidth": settings.disk_bandwidth, "pcie_bandwidth": settings.pcie_bandwidth,
                   "direct_io": settings.direct_io},
        config=config, runs=done, requests=workload.requests,
        extras={"workload": summary, "notes": notes, "stores": report.store_summary(done),
                "command": shlex.join(sys.argv), "code": code, "resumed": partial.loaded,
                "wall_s": time.time() - started,
                "selections": _selections_record(values, traces),
                "timestamp": time.strftime("%Y-%m-%dT%H:%M:%S%z", time.localtime(started))})
    written = report.write_all(results, output_dir)
    report.write_requests(done, workload.requests, output_dir / "requests.jsonl")
    written.append(output_dir / "requests.jsonl")
    partial.discard()
    _print_summary(results, written)
    return results


def _selection_setting(values: dict) -> systems_lib.SelectionTrace | None:
    if values["record_selections"] and values["replay_selections"]:
        raise EvalError("--record_selections and --replay_selections exclude each other: record a trace in one run, "
                        "replay it in another")
    folder, mode = ((values["record_selections"], "record") if values["record_selections"] else
                    (values["replay_selections"], "replay"))
    if folder is None:
        return None
    return systems_lib.SelectionTrace(mode, str(pathlib.Path(folder).expanduser()), values["task"],
                                      values["prefix_tokens"])


def _replayed(model, runs, settings: systems_lib.SystemSettings) -> dict:
    """Each run that replays a selection trace: what the trace says of its recording (loading it checks it)."""
    if settings.selections is None or settings.selections.mode != "replay":
        return {}
    found = {}
    for name, retention in runs:
        if retention is None:
            continue
        system = systems_lib.make_system(name, model, dataclasses.replace(settings, retention=retention))
        trace = getattr(system, "selections", None)
        if trace is not None:
            found[f"{name}@r={retention:g}"] = trace.describe()
    if not found:
        raise EvalError(f"--replay_selections {settings.selections.folder}: none of these systems identifies "
                        "(nothing to replay); replay into systems such as spec, spec_gqa or as_h2o_lfu")
    return found


def _selections_record(values: dict, traces: dict) -> dict | None:
    """results.json `selections`: recorded into a folder, or replayed (per run: from what)."""
    if values["record_selections"]:
        return {"mode": "record", "folder": values["record_selections"]}
    if values["replay_selections"]:
        return {"mode": "replay", "folder": values["replay_selections"], "runs": traces}
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
    values = _values()
    task_list = [values["task"]]
    preset = None
    if values["preset"]:
        preset = presets_lib.load(values["preset"])
        present = {name for name in OUR_FLAGS if FLAGS[name].present}
        values = presets_lib.apply(preset, values, present)
        task_list = [values["task"]] if "task" in present else list(preset.get("tasks", [values["task"]]))
    for name in task_list:
        if name not in tasks_lib.TASKS:
            raise EvalError(f"unknown task '{name}'; known tasks: {', '.join(tasks_lib.TASKS)}")
    if "rag" in task_list:
        ignored = [f"--{name}" for name in ("prefix_tokens", "needle_facts") if FLAGS[name].present]
        if ignored:
            raise EvalError(f"{' and '.join(ignored)} size needle prefixes; rag contexts are 4-6 text chunks "
                            f"(~110 tokens each) drawn from a fixed pool (specjax.eval.tasks.RagSpec)")
    systems_lib.resolve(values["systems"])  # fail on unknown systems before loading a model
    base_dir = pathlib.Path(values["output_dir"] or f"results/{pathlib.Path(values['model']).name}-"
                            f"{values['preset'] or values['task']}")
    check_folder("--output_dir", base_dir)
    if values["store"]:
        check_folder("--store", pathlib.Path(values["store"]).expanduser())
    model = load_model(values["model"], values["dtype"], values["init"], values["seed"], values["revision"],
                       values["tensor_parallel"])
    for name in task_list:
        task_values = presets_lib.for_task(preset, values, name, present if preset else set())
        out = base_dir / name if len(task_list) > 1 else base_dir
        run_task(model, task_values, out, resume=FLAGS.resume)


def run():
    from specjax.cli import run as run_cli

    run_cli(main)


if __name__ == "__main__":
    run()
