"""results.json (design.md section 7, plus extras) and its validator; `write_all` writes it with results.md
(`report_markdown`) and the PNG plots (`report_figures`)."""

from __future__ import annotations

import collections
import json
import math
import pathlib
from collections.abc import Sequence

import numpy as np

from specjax.engine.planner import prediction_errors
from specjax.eval import metrics, tasks as tasks_lib, tradeoff
from specjax.eval.report_figures import (LAYERS_PNG, RETENTION_PNG, TRADEOFF_PNG, TTFT_PNG, figures,
                                         plot_accuracy_vs_retention, plot_layers, plot_ttft)
from specjax.eval.report_markdown import fmt_bytes, markdown
from specjax.eval.systems import BREAKDOWN_KEYS, check_counters, device_bytes

# ---------------------------------------------------------------- schema (design.md section 7)

NUMBER = "number"
INT = "int"
STR = "str"
BOOL = "bool"
NUMBER_OR_NULL = "number|null"

SYSTEM_SCHEMA = {
    "accuracy": {"acc": NUMBER, "acc_norm": NUMBER, "stderr": NUMBER, "n": INT},
    "ttft_ms": {"mean": NUMBER, "p50": NUMBER, "p95": NUMBER, "p99": NUMBER},
    "breakdown_ms": {k: NUMBER for k in BREAKDOWN_KEYS},
    "io": {"disk_bytes": INT, "host_to_device_bytes": INT, "chunks_read": INT, "read_amplification": NUMBER,
           "read_requests_per_request": NUMBER, "bytes_per_read": NUMBER_OR_NULL,
           "host_to_device_transfers_per_request": NUMBER},
    "cache": {"device_hit_ratio": NUMBER, "host_hit_ratio": NUMBER},
    "itf": ("nullable", {"fallback_ratio": NUMBER, "mean_jaccard": NUMBER}),
    "prefetch": ("nullable", {"precision": NUMBER, "recall": NUMBER}),
    "compilations_timed": INT,  # XLA compiles inside the timed requests (each request's in its counters)
}

RESULTS_SCHEMA = {
    "model": STR,
    "task": STR,
    "weights": ("enum", ("pretrained", "random")),
    "device": STR,
    "emulation": {"disk_bandwidth": NUMBER_OR_NULL, "pcie_bandwidth": NUMBER_OR_NULL, "direct_io": BOOL},
    "config": dict,
    "systems": ("map", SYSTEM_SCHEMA),
}


def _is_number(v) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v)


def _check(value, schema, path: str, errors: list[str]) -> None:
    if isinstance(schema, dict):
        if not isinstance(value, dict):
            errors.append(f"{path}: expected an object, got {type(value).__name__}")
            return
        for key, sub in schema.items():
            if key not in value:
                errors.append(f"{path}.{key}: missing")
            else:
                _check(value[key], sub, f"{path}.{key}", errors)
    elif schema is dict:
        if not isinstance(value, dict):
            errors.append(f"{path}: expected an object")
    elif isinstance(schema, tuple) and schema[0] == "nullable":
        if value is not None:
            _check(value, schema[1], path, errors)
    elif isinstance(schema, tuple) and schema[0] == "enum":
        if value not in schema[1]:
            errors.append(f"{path}: {value!r} not one of {schema[1]}")
    elif isinstance(schema, tuple) and schema[0] == "map":
        if not isinstance(value, dict) or not value:
            errors.append(f"{path}: expected a non-empty object")
            return
        for key, sub in value.items():
            _check(sub, schema[1], f"{path}.{key}", errors)
    elif schema == NUMBER:
        if not _is_number(value):
            errors.append(f"{path}: expected a finite number, got {value!r}")
    elif schema == NUMBER_OR_NULL:
        if value is not None and not _is_number(value):
            errors.append(f"{path}: expected a number or null, got {value!r}")
    elif schema == INT:
        if not isinstance(value, int) or isinstance(value, bool):
            errors.append(f"{path}: expected an integer, got {value!r}")
    elif schema == STR:
        if not isinstance(value, str):
            errors.append(f"{path}: expected a string, got {value!r}")
    elif schema == BOOL:
        if not isinstance(value, bool):
            errors.append(f"{path}: expected true/false, got {value!r}")
    else:
        raise AssertionError(schema)


def validate_results(results: dict) -> None:
    """Raise ValueError listing every way `results` departs from design.md section 7."""
    errors: list[str] = []
    _check(results, RESULTS_SCHEMA, "results", errors)
    if errors:
        raise ValueError("results.json does not match the schema:\n  " + "\n  ".join(errors))


# ---------------------------------------------------------------- building results


def _ratio(num: float, den: float) -> float:
    return float(num / den) if den else 0.0


def _stderr(x: float) -> float:
    return 0.0 if not math.isfinite(x) else x  # n < 2: no spread to estimate


def system_entry(run, requests: Sequence, reference_correct: np.ndarray | None, metric=metrics.accuracy) -> dict:
    """One `systems.<key>` object from a runner.Run and the requests it answered, scored by the task's `metric`."""
    outs = run.outcomes
    scored = [(o.choice_logprobs, r.choices, r.gold) for o, r in zip(outs, requests)]
    acc = metric(scored)
    totals = {}
    for o in outs:
        check_counters(o.counters)  # also what was added after the system answered (the runner's compiles)
        for k, v in o.counters.items():
            totals[k] = totals.get(k, 0.0) + v
    get = lambda k: totals.get(k, 0.0)  # noqa: E731
    breakdown = {k: float(np.mean([o.breakdown_ms.get(k, 0.0) for o in outs])) for k in BREAKDOWN_KEYS}
    entry = {
        "accuracy": {"acc": acc["acc"], "acc_norm": acc["acc_norm"], "stderr": _stderr(acc["stderr"]),
                     "n": acc["n"], "acc_norm_stderr": _stderr(acc["acc_norm_stderr"])},
        "ttft_ms": metrics.latency_summary([o.ttft_ms for o in outs]),
        "breakdown_ms": breakdown,
        "io": _io(get, len(outs)),
        "cache": {"device_hit_ratio": _ratio(get("device_hits"), get("cache_lookups")),
                  "host_hit_ratio": _ratio(get("host_hits"), get("cache_lookups"))},
        "itf": None,
        "prefetch": None,
        "compilations_timed": int(get("compilations")),
        "requests_recomputed_bad_chunks": sum(1 for o in outs if o.counters.get("bad_chunks")),
        "repair": _repair(run),
        # extras beyond the contract
        # mean per request: host time no disk read or device wait overlapped (None where not measured)
        "host_exposed_ms": _ratio(get("host_exposed_ms"), len(outs)) if "host_exposed_ms" in totals else None,
        # mean per request: the process's CPU time (every thread) to the first token (None where not measured)
        "cpu_ms": _ratio(get("cpu_ms"), len(outs)) if "cpu_ms" in totals else None,
        "system": run.system,
        "retention": run.retention,
        "precision": run.precision,
        "counters": {k: float(v) for k, v in sorted(totals.items())},
        "warm_s": run.warm_s,
        "run_s": run.run_s,
    }
    _add_optional_parts(entry, run, outs, totals, get)
    if reference_correct is not None:
        paired = metrics.paired_difference(metrics.per_request_correct(scored), reference_correct)
        paired["stderr"] = _stderr(paired["stderr"])
        entry["paired_vs_recompute"] = paired
    return entry


def _io(get, n: int) -> dict:
    """`systems.<key>.io` from the run's summed counters (`get`) over its `n` requests."""
    return {"disk_bytes": int(get("disk_bytes")), "host_to_device_bytes": int(get("host_to_device_bytes")),
            "chunks_read": int(get("chunks_read")),
            "read_amplification": _ratio(get("disk_bytes"), get("used_token_bytes")),
            "read_requests_per_request": _ratio(get("read_requests"), n),
            "bytes_per_read": get("disk_bytes") / get("read_requests") if get("read_requests") else None,
            "host_to_device_transfers_per_request": _ratio(get("host_to_device_transfers"), n),
            # beyond the contract: the bytes of the vectors the layers took (the probe keys or keys they score
            # with, and the rows they attend to), host->device bytes per such byte, and of those bytes the whole
            # chunks written into the device tier's pages (after each first token)
            "used_token_bytes": int(get("used_token_bytes")),
            "host_to_device_per_used": _ratio(get("host_to_device_bytes"), get("used_token_bytes")),
            "device_page_bytes_per_request": _ratio(get("device_page_bytes"), n),
            # of the used bytes, the rows a device step chose that the device took from the caches' pages itself
            "chosen_on_device_share": _ratio(get("chosen_on_device_bytes"), get("used_token_bytes")),
            # beyond the contract: what damaged stored KV made the timed requests read and write, not in disk_bytes
            "repair_disk_bytes": int(get("repair_disk_bytes")),
            "repair_disk_bytes_written": int(get("repair_disk_bytes_written"))}


def _add_optional_parts(entry: dict, run, outs, totals: dict, get) -> None:
    """The parts only some runs have: ITF's decisions, prefetching and speculation, per-device bytes, Cake's split,
    the planner's choices, per-layer means."""
    if get("itf_layers"):
        entry["itf"] = {"fallback_ratio": _ratio(get("itf_fallbacks"), get("itf_layers")),
                        "mean_jaccard": _ratio(get("jaccard_sum"), get("itf_layers"))}
    if get("prefetch_issued") or get("prefetch_needed"):
        entry["prefetch"] = {"precision": _ratio(get("prefetch_used"), get("prefetch_ahead")),
                             "recall": _ratio(get("prefetch_used"), get("prefetch_needed")),
                             # beyond the contract: how much of the sets the guess named, read ahead or not
                             "guess_recall": _ratio(get("prefetch_guess_hits"), get("prefetch_needed"))}
    if get("prefetch_guessed_layers") or get("prefetch_unpaid_layers"):
        # beyond the contract: per request, the layers whose next layer was guessed, and those whose guess was not
        # made because it would not have paid for its host time (their next layer read its set on demand)
        entry["speculation"] = {"guessed_layers": _ratio(get("prefetch_guessed_layers"), len(outs)),
                                "unpaid_layers": _ratio(get("prefetch_unpaid_layers"), len(outs))}
    devices = device_bytes(totals)
    if devices:  # beyond the contract: tensor parallel, each device's own heads' bytes (replicated heads: once)
        entry["io"]["disk_bytes_by_device"] = [int(v) for v in devices]
    if "computed_prefix_tokens" in totals:  # cake: where computing from the front met loading from the back
        entry["split"] = _split(outs, get)
    if "predicted_ttft_ms" in totals or run.model is not None:  # the planner
        entry["planner"] = _planner(outs, run.model)
    layers = _mean_layers(outs)
    if layers:
        entry["layers"] = layers


def _repair(run) -> dict | None:
    """What damaged stored KV cost the whole run (warm-up, timed requests, the base store's repair after it) beyond
    its own I/O; None where it met no damage."""
    store = getattr(run, "store", None) or {}
    if not (store.get("prefixes_repaired") or store.get("repair_disk_bytes")):
        return None
    return {"prefixes": store.get("prefixes_repaired", 0), "damaged_chunks": store.get("damaged_chunks", 0),
            "disk_bytes": store.get("repair_disk_bytes", 0),
            "disk_bytes_written": store.get("repair_disk_bytes_written", 0)}


def _split(outs, get) -> dict:
    """Cake's split of the stored prefix: the fraction computed on the device (the rest was loaded)."""
    per_request = [o.counters["computed_prefix_tokens"] / o.counters["reused_tokens"]
                   for o in outs if o.counters.get("reused_tokens")]
    return {"computed_fraction": _ratio(get("computed_prefix_tokens"), get("reused_tokens")),
            "computed_fraction_per_request_mean": float(np.mean(per_request)) if per_request else 0.0,
            "computed_prefix_tokens_mean": _ratio(get("computed_prefix_tokens"), len(outs)),
            "loaded_prefix_tokens_mean": _ratio(get("reused_tokens") - get("computed_prefix_tokens"), len(outs))}


def _planner(outs, model: dict | None) -> dict:
    """The planner's plans (computed share of the stored prefix per request, how many loaded it whole and at which
    bits, the share of their loaded tokens the caches held), its prediction error per request
    (|predicted - measured| / measured) and its cost model at the run's end."""
    errors = prediction_errors([(o.counters.get("predicted_ttft_ms"), o.ttft_ms) for o in outs])
    shares = [round(o.counters.get("computed_prefix_tokens", 0) / o.counters["reused_tokens"], 2)
              for o in outs if o.counters.get("reused_tokens")]
    return {"prediction_error_median": float(np.median(errors)) if len(errors) else None,
            "prediction_error_p90": float(np.percentile(errors, 90)) if len(errors) else None,
            "predicted_requests": len(errors),
            "computed_share_counts": {str(s): shares.count(s) for s in sorted(set(shares))},
            "load_all_requests": int(sum(o.counters.get("planned_load_all", 0) for o in outs)),
            # requests per precision its plans loaded K and V at (0: the system's)
            "bits_counts": {str(b): n for b, n in sorted(collections.Counter(
                int(o.counters.get("planned_bits", 0)) for o in outs).items())},
            "held_share_mean": float(np.mean([o.counters.get("planned_held_share", 0.0) for o in outs])),
            "model": model}


def _mean_layers(outs) -> dict[str, list[float]]:
    names = sorted({k for o in outs for k in o.layers})
    out = {}
    for name in names:
        rows = [o.layers[name] for o in outs if name in o.layers]
        width = min(len(r) for r in rows)
        out[name] = [float(v) for v in np.mean([r[:width] for r in rows], axis=0)]
    return out


def build_results(*, model: str, task: str, weights: str, device: str, emulation: dict, config: dict,
                  runs: Sequence, requests: Sequence, extras: dict | None = None) -> dict:
    reference = next((r for r in runs if r.system == "recompute"), None)
    ref_correct = None
    if reference is not None:
        ref_correct = metrics.per_request_correct(
            [(o.choice_logprobs, q.choices, q.gold) for o, q in zip(reference.outcomes, requests)])
    metric = tasks_lib.TASKS[task].metric if task in tasks_lib.TASKS else metrics.accuracy
    systems = {}
    for run in runs:
        systems[run.key] = system_entry(run, requests, ref_correct if run.system != "recompute" else None, metric)
    results = {"model": model, "task": task, "weights": weights, "device": device, "emulation": emulation,
               "config": config, "systems": systems}
    results.update(extras or {})
    return results


def store_summary(runs: Sequence) -> dict:
    """results.json `stores`: per base store, the prefixes populating it wrote and found stored already (a --store
    kept from an earlier run), the ones runs found damaged and stored anew, and the runs that copied it."""
    stores: dict[str, dict] = {}
    for run in runs:
        if not getattr(run, "store", None):
            continue
        entry = stores.setdefault(run.store["base"], {"prefixes_written": run.store["prefixes_written"],
                                                      "prefixes_reused": run.store["prefixes_reused"],
                                                      "prefixes_repaired": 0, "runs": []})
        entry["prefixes_repaired"] += run.store.get("prefixes_repaired", 0)
        entry["runs"].append(run.key)
    return stores


def store_notes(runs: Sequence) -> list[str]:
    """What results.md and the printed summary must say about the store: reuse across runs and damage met."""
    notes = []
    for base, s in store_summary(runs).items():
        if s["prefixes_reused"]:
            notes.append(f"store {base}: {s['prefixes_reused']} prefixes reused from an earlier run on this --store, "
                         f"{s['prefixes_written']} written")
    for run in runs:
        recomputed = sum(1 for o in run.outcomes if o.counters.get("bad_chunks"))
        repaired = (getattr(run, "store", None) or {}).get("prefixes_repaired", 0)
        if recomputed or repaired:
            notes.append(f"{run.key}: {recomputed} of {len(run.outcomes)} requests recomputed because of bad chunks "
                         f"(stored KV failing its checksum is never served); {repaired} damaged stored prefixes "
                         f"(met in the warm-up or these requests) were stored anew{_repair_bytes(run)}")
    return notes


def _repair_bytes(run) -> str:
    """The disk bytes a run read as its own beside those its damaged stored KV cost it (`_repair`)."""
    repair = _repair(run)
    if repair is None:
        return ""
    outs = run.outcomes
    own = _ratio(sum(o.counters.get("disk_bytes", 0) for o in outs), len(outs))
    timed = sum(o.counters.get("repair_disk_bytes", 0) for o in outs)
    return (f"; disk: {fmt_bytes(own)} a request its own, and repair of {repair['damaged_chunks']} damaged chunks "
            f"{fmt_bytes(repair['disk_bytes'])} read, {fmt_bytes(repair['disk_bytes_written'])} written over the "
            f"run ({fmt_bytes(timed)} of those reads in the timed requests), none of it in its disk read")


def write_requests(runs: Sequence, requests: Sequence, path: pathlib.Path) -> None:
    """requests.jsonl: one line per (run, request) with the raw outcome, for re-analysis."""
    with open(path, "w") as f:
        for run in runs:
            for o, r in zip(run.outcomes, requests):
                f.write(json.dumps({"system": run.key, "request_id": r.request_id, "prefix_id": r.prefix_id,
                                    "doc_index": r.doc_index, "gold": r.gold, "choice_logprobs": o.choice_logprobs,
                                    "choice_greedy": o.choice_greedy, "ttft_ms": o.ttft_ms,
                                    "breakdown_ms": o.breakdown_ms, "counters": o.counters}) + "\n")


def write_json(results: dict, path: pathlib.Path) -> None:
    validate_results(results)
    path.write_text(json.dumps(results, indent=2, allow_nan=False) + "\n")



# every file `write_all` and `write_requests` may write into an output folder
RESULT_FILES = ("results.json", "results.md", "requests.jsonl", TTFT_PNG, TRADEOFF_PNG, RETENTION_PNG, LAYERS_PNG)


def write_all(results: dict, output_dir: pathlib.Path) -> list[pathlib.Path]:
    """results.json, results.md and the plots that apply (`figures`, each linked from results.md); returns the paths
    written."""
    output_dir.mkdir(parents=True, exist_ok=True)
    written = [output_dir / "results.json", output_dir / "results.md"]
    write_json(results, written[0])
    written[1].write_text(markdown(results))
    plots = {TRADEOFF_PNG: tradeoff.plot, TTFT_PNG: plot_ttft, RETENTION_PNG: plot_accuracy_vs_retention,
             LAYERS_PNG: plot_layers}
    for name in figures(results):
        plots[name](results, output_dir / name)
        written.append(output_dir / name)
    return written
