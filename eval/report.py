"""results.json (design.md section 7, plus extras), its validator, results.md and PNG plots."""

from __future__ import annotations

import json
import math
import pathlib
from collections.abc import Sequence

import numpy as np

from specjax.engine.planner import prediction_errors
from specjax.eval import metrics, tasks as tasks_lib, tradeoff
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
        "io": {"disk_bytes": int(get("disk_bytes")), "host_to_device_bytes": int(get("host_to_device_bytes")),
               "chunks_read": int(get("chunks_read")),
               "read_amplification": _ratio(get("disk_bytes"), get("used_token_bytes")),
               "read_requests_per_request": _ratio(get("read_requests"), len(outs)),
               "bytes_per_read": get("disk_bytes") / get("read_requests") if get("read_requests") else None,
               "host_to_device_transfers_per_request": _ratio(get("host_to_device_transfers"), len(outs)),
               # beyond the contract: the bytes of the vectors the layers took (the probe keys or keys they score
               # with, and the rows they attend to), host->device bytes per such byte, and of those bytes the whole
               # chunks written into the device tier's pages (after each first token)
               "used_token_bytes": int(get("used_token_bytes")),
               "host_to_device_per_used": _ratio(get("host_to_device_bytes"), get("used_token_bytes")),
               "device_page_bytes_per_request": _ratio(get("device_page_bytes"), len(outs)),
               # of the used bytes, the rows a device step chose that the device took from the caches' pages itself
               "chosen_on_device_share": _ratio(get("chosen_on_device_bytes"), get("used_token_bytes")),
               # beyond the contract: what damaged stored KV made the timed requests read and write, not in disk_bytes
               "repair_disk_bytes": int(get("repair_disk_bytes")),
               "repair_disk_bytes_written": int(get("repair_disk_bytes_written"))},
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
        "counters": {k: float(v) for k, v in sorted(totals.items())},
        "warm_s": run.warm_s,
        "run_s": run.run_s,
    }
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
    if reference_correct is not None:
        paired = metrics.paired_difference(metrics.per_request_correct(scored), reference_correct)
        paired["stderr"] = _stderr(paired["stderr"])
        entry["paired_vs_recompute"] = paired
    return entry


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
    """The planner's plans (computed share of the stored prefix per request, how many loaded it whole, the share of
    their loaded tokens the caches held), its prediction error per request
    (|predicted - measured| / measured) and its cost model at the run's end."""
    errors = prediction_errors([(o.counters.get("predicted_ttft_ms"), o.ttft_ms) for o in outs])
    shares = [round(o.counters.get("computed_prefix_tokens", 0) / o.counters["reused_tokens"], 2)
              for o in outs if o.counters.get("reused_tokens")]
    return {"prediction_error_median": float(np.median(errors)) if len(errors) else None,
            "prediction_error_p90": float(np.percentile(errors, 90)) if len(errors) else None,
            "predicted_requests": len(errors),
            "computed_share_counts": {str(s): shares.count(s) for s in sorted(set(shares))},
            "load_all_requests": int(sum(o.counters.get("planned_load_all", 0) for o in outs)),
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
    return (f"; disk: {_fmt_bytes(own)} a request its own, and repair of {repair['damaged_chunks']} damaged chunks "
            f"{_fmt_bytes(repair['disk_bytes'])} read, {_fmt_bytes(repair['disk_bytes_written'])} written over the "
            f"run ({_fmt_bytes(timed)} of those reads in the timed requests), none of it in its disk read")


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


# ---------------------------------------------------------------- results.md


def _per_taken(io: dict) -> str:
    ratio = io.get("host_to_device_per_used")
    return f"{ratio:.2f}" if ratio else "-"


def _fmt_bytes(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(n) < 1024 or unit == "TiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.2f} {unit}"
        n /= 1024
    return str(n)


def _disk_read_cell(io: dict) -> str:
    """The system's own disk reads, and beside them what damaged stored KV made its timed requests read, if any
    (results written before that was counted have none)."""
    repair = io.get("repair_disk_bytes")
    own = _fmt_bytes(io["disk_bytes"])
    return f"{own} (+ {_fmt_bytes(repair)} repair)" if repair else own


def _ms(value: float | None) -> str:
    return "-" if value is None else f"{value:.1f}"


def _prefetch_cell(pf: dict | None, speculation: dict | None = None) -> str:
    """precision / recall / guess recall (results written before guess_recall was counted have only the first two),
    and the layers left unguessed because a guess would not have paid, where there were any."""
    speculation = speculation or {}
    unpaid = speculation.get("unpaid_layers")
    if not unpaid:
        unguessed = ""
    elif not speculation.get("guessed_layers"):
        return f"no guess: did not pay ({unpaid:.1f} layers a request)"
    else:
        unguessed = f" ({unpaid:.1f} layers a request unguessed: did not pay)"
    if not pf:
        return "-" + unguessed
    return " / ".join(f"{pf[k]:.2f}" if pf.get(k) is not None else "-"
                      for k in ("precision", "recall", "guess_recall")) + unguessed


def _table(header: list[str], rows: list[list[str]]) -> str:
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    lines += ["| " + " | ".join(r) + " |" for r in rows]
    return "\n".join(lines)


TRADEOFF_PNG = "tradeoff.png"
TTFT_PNG = "ttft_breakdown.png"
RETENTION_PNG = "accuracy_vs_retention.png"
LAYERS_PNG = "layers.png"

# README.md's definition, word for word (tests/test_eval_report_figures.py holds the two together)
TTFT_DEFINITION = "TTFT runs from a request's arrival to its first-token logits ready on the device."

# each figure's alt text and the one-line caption results.md gives it
FIGURES = {
    TRADEOFF_PNG: ("accuracy vs mean TTFT", f"accuracy against mean TTFT, one point per run (labelled with its "
                                            f"retention where it prunes); the grey band: within {tradeoff.BAND_PP:g} "
                                            f"accuracy points of the reference."),
    TTFT_PNG: ("TTFT by phase", "each run's mean TTFT by phase: in ms on one scale with its p99 (left), and as "
                                "shares of the run's own mean, so every run's phases show (right)."),
    RETENTION_PNG: ("accuracy vs retention", "accuracy against retention, a line per pruning system (each its own "
                                             "marker and line style, set slightly apart so equal values stay "
                                             "visible); recompute dashed."),
    LAYERS_PNG: ("per-layer KV loaded and fallback rate", "per layer, the KV loaded (fraction of the prefix) and the "
                                                          "fallback rate (the layer loaded every key and used per-head "
                                                          "sets)."),
}
LAYERS_PER_HEAD = " `as_h2o_*` take per-head H2O sets on every layer, so their fallback rate is 1.0 by construction."


def figures(results: dict) -> list[str]:
    """The PNGs `write_all` writes for `results`, in the order results.md shows them."""
    out = []
    if tradeoff.worth_plotting(results):
        out.append(TRADEOFF_PNG)
    out.append(TTFT_PNG)
    if len({s.get("retention") for s in results["systems"].values()} - {None}) > 1:
        out.append(RETENTION_PNG)
    if _layer_panels(layer_series(results)):
        out.append(LAYERS_PNG)
    return out


def _figure_lines(results: dict, name: str) -> list[str]:
    """A figure's link and caption, where `write_all` writes it."""
    if name not in figures(results):
        return []
    alt, caption = FIGURES[name]
    if name == LAYERS_PNG and _has_per_head(results):
        caption += LAYERS_PER_HEAD
    return [f"![{alt}]({name})", "", f"*{name}: {caption}*", ""]


def _rate(value: float | None) -> str | None:
    """A rate in bytes per second, in the flags' decimal units (20 MB/s); None where there is none."""
    if value is None:
        return None
    for unit, scale in (("GB/s", 1e9), ("MB/s", 1e6), ("kB/s", 1e3)):
        if abs(value) >= scale:
            return f"{value / scale:.4g} {unit}"
    return f"{value:.4g} B/s"


def _emulation_line(emu: dict) -> str:
    """What was emulated: a rate only where one was set; the rest is the real link, said so (never "None B/s")."""
    parts = []
    for name, key, real in (("disk", "disk_bandwidth", "the real disk"), ("PCIe", "pcie_bandwidth", "the real link")):
        rate = _rate(emu.get(key))
        parts.append(f"{name} {rate} (emulated)" if rate else f"{name}: {real}, not emulated")
    emulated = any(emu.get(k) is not None for k in ("disk_bandwidth", "pcie_bandwidth"))
    return (f"- emulation: {'on' if emulated else 'off'} ({'; '.join(parts)}; direct I/O "
            f"{'on' if emu.get('direct_io') else 'off'})")


def tradeoff_section(results: dict) -> list[str]:
    """The accuracy-TTFT trade-off: sentences computed from the results, the plot, the table."""
    out = ["## Accuracy-TTFT trade-off", "", *(f"- {line}" for line in tradeoff.summary(results)), "",
           TTFT_DEFINITION, ""]
    out += _figure_lines(results, TRADEOFF_PNG)
    out += [tradeoff.table(results), "",
            "`frontier`: no other run is both at least as fast and at least as accurate. Δacc is paired: the "
            "same requests answered by both.", ""]
    return out


def markdown(results: dict) -> str:
    systems = results["systems"]
    ref = systems.get("recompute")
    out = [f"# {results['model']} on {results['task']}", ""]
    for note in results.get("notes", []):  # caveats (random weights, emulation) come before any claim
        out.append(f"- **note**: {note}")
    if results.get("notes"):
        out.append("")
    out += tradeoff_section(results)
    out += ["## Run", ""]
    out += [f"- device: {results['device']}",
            f"- weights: {results['weights']}"]
    impl = results.get("config", {}).get("implementations")
    if impl:
        out.append(f"- kernels: {impl['kernels']}; the model's attention: {impl['attention']}")
    out.append(_emulation_line(results["emulation"]))
    selections = results.get("selections")
    if selections and selections["mode"] == "replay":
        out.append(f"- selections: **replayed** from {selections['folder']} (" + "; ".join(
            f"{run}: {t['system']} of {t['recorded_by']} on {t['task']}, {t['requests']} requests"
            for run, t in selections["runs"].items()) + ")")
    elif selections:
        out.append(f"- selections: recorded into {selections['folder']}")
    if "workload" in results:
        w = results["workload"]
        out.append(f"- workload: {w['num_requests']} requests over {w['num_prefixes']} shared prefixes; "
                   f"prefix {w['prefix_tokens_mean']:.0f} tokens mean / {w['prefix_tokens_max']} max; "
                   f"reuse per prefix {w['reuse_per_prefix_mean']:.1f} mean")
    if "code" in results:
        c = results["code"]
        dirty = " with uncommitted changes" if c.get("uncommitted_changes") else ""
        where = f"commit {c['commit'][:10]}{dirty}" if "commit" in c else f"specjax {c['version']}"
        out.append(f"- code: {where}, source hash {c['source_sha256']}")
    if "wall_s" in results:
        out.append(f"- eval time: {results['wall_s']:.0f} s (workload, store, warm-up and timed requests of every "
                   f"run; model loading not included)")
    out += ["", "## Accuracy and TTFT", ""]
    rows = []
    for key, s in systems.items():
        a, t = s["accuracy"], s["ttft_ms"]
        paired = s.get("paired_vs_recompute")
        diff = f"{100 * paired['acc_diff']:+.1f} ± {100 * paired['stderr']:.1f}" if paired else "-"
        speedup = f"{ref['ttft_ms']['mean'] / t['mean']:.2f}x" if ref and t["mean"] else "-"
        rows.append([key, f"{100 * a['acc']:.1f} ± {100 * a['stderr']:.1f}", f"{100 * a['acc_norm']:.1f}",
                     str(a["n"]), diff, f"{t['mean']:.1f}", f"{t['p50']:.1f}", f"{t['p95']:.1f}",
                     f"{t['p99']:.1f}", speedup])
    out.append(_table(["system", "acc %", "acc_norm %", "n", "Δacc vs recompute (pp)", "TTFT mean ms",
                       "p50", "p95", "p99", "speedup vs recompute"], rows))
    out += [""] + _figure_lines(results, RETENTION_PNG)
    out += ["## TTFT breakdown (mean ms per request)", ""]
    out.append(_table(["system", *BREAKDOWN_KEYS, "process CPU"], [
        [k, *(f"{s['breakdown_ms'][b]:.1f}" for b in BREAKDOWN_KEYS), _ms(s.get("cpu_ms"))]
        for k, s in systems.items()]))
    out += ["", "`process CPU`: the CPU time of every thread of the process from a request's start to its first token "
            "(the request's thread, the disk threads and, on a CPU device, XLA's compute): the request's work, above "
            "its TTFT where threads ran in parallel.",
            "", f"{TTFT_DEFINITION} Its phases: probe-key I/O (`probe_io`), identification (`identify`), KV I/O "
                f"stall (`kv_io_stall`) and compute (`compute`, the rest).", ""]
    out += _figure_lines(results, TTFT_PNG)[:-1]
    out += ["", "## I/O and caches (totals over the run)", ""]
    rows = []
    for k, s in systems.items():
        io, c = s["io"], s["cache"]
        itf = s["itf"]
        pf = s["prefetch"]
        rows.append([k, _disk_read_cell(io), _fmt_bytes(io["host_to_device_bytes"]), str(io["chunks_read"]),
                     f"{io['read_amplification']:.2f}", f"{c['device_hit_ratio']:.2f}", f"{c['host_hit_ratio']:.2f}",
                     f"{itf['fallback_ratio']:.2f} / {itf['mean_jaccard']:.2f}" if itf else "-",
                     _prefetch_cell(pf, s.get("speculation"))])
    out.append(_table(["system", "disk read", "host->device", "chunks read", "read ampl.", "device hit", "host hit",
                       "ITF fallback / Jaccard", "prefetch precision / recall / guess recall"], rows))
    if any(s["io"].get("repair_disk_bytes") for s in systems.values()):
        out += ["", "`repair`: what stored KV failing its checksum made the timed requests read beside the system's "
                    "own reads (`disk read`): the attempt given up at a bad chunk and the repair's checks of the "
                    "stored prefix (results.json `io.repair_disk_bytes`; `repair` there: the whole run's)."]
    if any((s.get("speculation") or {}).get("unpaid_layers") for s in systems.values()):
        out += ["", "`did not pay`: a layer guesses the next one's set only where those tokens' bytes take the disk, "
                    "at its measured rate, longer than a guess costs the host (measured too); the next layer then "
                    "reads its set on demand (`Speculator.pays`)."]
    out += ["", "## Reads, transfers and compiles (means per timed request; compiles: total)", ""]
    out.append(_table(["system", "read requests", "bytes per read", "host->device transfers",
                       "host->device / taken", "of which device pages", "compiles timed"], [
        [k, f"{s['io']['read_requests_per_request']:.1f}",
         _fmt_bytes(s["io"]["bytes_per_read"]) if s["io"]["bytes_per_read"] is not None else "-",
         f"{s['io']['host_to_device_transfers_per_request']:.1f}", _per_taken(s["io"]),
         _fmt_bytes(s["io"]["device_page_bytes_per_request"]) if "device_page_bytes_per_request" in s["io"] else "-",
         str(s["compilations_timed"])]
        for k, s in systems.items()]))
    out += ["", "`host->device / taken`: the bytes that crossed to the device per byte of the vectors the layers took "
                "(their probe keys, or the keys they score with, and the rows they attend to; results.json "
                "`io.used_token_bytes`); above 1: whole chunks, padding or the device tier's page writes crossed too. "
                "`of which device pages`: per request, the whole chunks written into the device tier after its first "
                "token."]
    split = {k: s["split"] for k, s in systems.items() if s.get("split")}
    if split:
        out += ["", "## Cake: stored prefix computed on the device vs loaded (mean per request)", ""]
        out.append(_table(["system", "computed fraction", "computed tokens", "loaded tokens"], [
            [k, f"{x['computed_fraction']:.2f}", f"{x['computed_prefix_tokens_mean']:.0f}",
             f"{x['loaded_prefix_tokens_mean']:.0f}"] for k, x in split.items()]))
    if LAYERS_PNG in figures(results):
        out += ["", "## Per layer", ""] + _figure_lines(results, LAYERS_PNG)[:-1]
    out += ["", "## Settings", "", "```", json.dumps(results["config"], indent=2, sort_keys=True), "```", ""]
    return "\n".join(out)


# ---------------------------------------------------------------- plots


def pyplot():
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


PHASE_COLOURS = {"probe_io": "tab:blue", "identify": "tab:orange", "kv_io_stall": "tab:green", "compute": "tab:red"}


def ttft_shares(results: dict) -> dict[str, dict[str, float]]:
    """Per run, each TTFT phase's share of the run's own mean TTFT (the phases' sum; 0 where it has none)."""
    out = {}
    for key, s in results["systems"].items():
        total = sum(s["breakdown_ms"][p] for p in BREAKDOWN_KEYS)
        out[key] = {p: (s["breakdown_ms"][p] / total if total else 0.0) for p in BREAKDOWN_KEYS}
    return out


def ttft_figure(results: dict):
    """Two panels, one row per run: on the left the mean TTFT in ms stacked by phase (one scale for every run, with
    its p99), on the right each run's phases as shares of its own mean, so a run much faster than the slowest one
    (recompute) still shows every phase; each row there names its mean TTFT."""
    plt = pyplot()
    systems = results["systems"]
    keys = list(systems)
    shares = ttft_shares(results)
    y = np.arange(len(keys))[::-1]  # the first run on top
    fig, (ax_ms, ax_share) = plt.subplots(1, 2, figsize=(11, 1.4 + 0.38 * len(keys)), sharey=True,
                                          gridspec_kw={"width_ratios": [1, 1.3]})
    left_ms = np.zeros(len(keys))
    left_share = np.zeros(len(keys))
    for part in BREAKDOWN_KEYS:
        values = np.array([systems[k]["breakdown_ms"][part] for k in keys])
        share = np.array([shares[k][part] for k in keys])
        ax_ms.barh(y, values, left=left_ms, color=PHASE_COLOURS[part], label=part, height=0.7)
        bars = ax_share.barh(y, 100 * share, left=left_share, color=PHASE_COLOURS[part], height=0.7)
        for bar, f in zip(bars, share):
            if f >= 0.08:  # wide enough for its figure
                ax_share.text(bar.get_x() + bar.get_width() / 2, bar.get_y() + bar.get_height() / 2,
                              f"{100 * f:.0f}%", ha="center", va="center", fontsize=7, color="white")
        left_ms += values
        left_share += 100 * share
    p99 = [systems[k]["ttft_ms"]["p99"] for k in keys]
    ax_ms.scatter(p99, y, marker="|", s=160, color="black", label="p99", zorder=3)
    ax_ms.set_xlim(0, 1.05 * max([*p99, *left_ms, 1e-9]))
    ax_ms.set_yticks(y, keys)
    ax_ms.set_xlabel("TTFT (ms): mean, stacked by phase; | p99")
    ax_ms.grid(axis="x", alpha=0.3)
    ax_share.set_xlim(0, 100)
    ax_share.set_xlabel("share of the run's own mean TTFT (%)")
    ax_share.tick_params(axis="y", length=0)
    twin = ax_share.twinx()  # each row's mean TTFT, on the right
    twin.set_ylim(ax_share.get_ylim())
    twin.set_yticks(y, [f"{systems[k]['ttft_ms']['mean']:.1f} ms" for k in keys], fontsize=8)
    twin.tick_params(axis="y", length=0)
    twin.set_ylabel("mean TTFT", fontsize=8)
    handles, labels = ax_ms.get_legend_handles_labels()
    height = fig.get_figheight()
    fig.suptitle(f"{results['model']} / {results['task']} ({results['weights']} weights): TTFT by phase",
                 fontsize=10, y=1 - 0.06 / height, va="top")
    fig.legend(handles, labels, loc="upper center", ncol=len(labels), fontsize=8, frameon=False,
               bbox_to_anchor=(0.5, 1 - 0.26 / height))
    fig.tight_layout(rect=(0, 0, 1, 1 - 0.4 / height))
    return fig


def plot_ttft(results: dict, path: pathlib.Path) -> None:
    plt = pyplot()
    fig = ttft_figure(results)
    fig.savefig(path, dpi=120)
    plt.close(fig)


SERIES_MARKERS = "osD^vP*Xh<>"
SERIES_LINESTYLES = ("-", "--", "-.", ":")


def retention_series(results: dict) -> list[dict]:
    """accuracy_vs_retention.png's series, one per pruning system (sorted by name): its points (retention, acc,
    stderr), its marker, marker size, line style and x offset (a factor: series side by side, so equal values stay
    visible), and the earlier series whose every point it shares (`same_as`; None where it shares none)."""
    by_system: dict[str, list[tuple[float, float, float]]] = {}
    for s in results["systems"].values():
        if s.get("retention") is not None:
            a = s["accuracy"]
            by_system.setdefault(s["system"], []).append((s["retention"], a["acc"], a["stderr"]))
    names = sorted(by_system)
    out = []
    for i, name in enumerate(names):
        points = sorted(by_system[name])
        same = next((o["name"] for o in out if len(o["points"]) == len(points) and all(
            abs(p[0] - q[0]) < 1e-12 and abs(p[1] - q[1]) < 1e-12 for p, q in zip(points, o["points"]))), None)
        out.append({"name": name, "points": points, "marker": SERIES_MARKERS[i % len(SERIES_MARKERS)],
                    "markersize": max(4.0, 10.0 - 2.0 * i), "linestyle": SERIES_LINESTYLES[i % len(SERIES_LINESTYLES)],
                    "offset": 10 ** (0.012 * (i - (len(names) - 1) / 2)), "same_as": same})
    return out


def accuracy_figure(results: dict):
    """Accuracy against retention, a series per pruning system: each its own marker (shape and size, the first
    largest), line style and a slight sideways offset, so a series equal to another still shows; the legend, outside
    the axes, says which series coincide."""
    plt = pyplot()
    fig, ax = plt.subplots(figsize=(8, 4.2))
    series = retention_series(results)
    for i, sr in enumerate(series):
        x, y, e = zip(*sr["points"])
        label = sr["name"] + (f" (same values as {sr['same_as']})" if sr["same_as"] else "")
        ax.errorbar(np.array(x) * sr["offset"], np.array(y) * 100, yerr=np.array(e) * 100, marker=sr["marker"],
                    markersize=sr["markersize"], linestyle=sr["linestyle"], capsize=3, label=label,
                    markeredgecolor="white" if i else None, markeredgewidth=0.6, zorder=2 + i)
    ref = results["systems"].get("recompute")
    if ref:
        ax.axhline(100 * ref["accuracy"]["acc"], color="gray", linestyle="--", label="recompute", zorder=1)
    ax.set_xscale("log")
    ticks = sorted({p[0] for sr in series for p in sr["points"]})
    ax.set_xticks(ticks, [f"{t:g}" for t in ticks])
    ax.minorticks_off()
    if len(ticks) > 1:  # room for the offsets and the markers at both ends
        ax.set_xlim(ticks[0] / 1.15 ** (1 + 0.1 * len(series)), ticks[-1] * 1.15 ** (1 + 0.1 * len(series)))
    ax.set_xlabel("retention (fraction of prefix tokens kept; series set slightly apart)")
    ax.set_ylabel("accuracy (%), ± one standard error")
    ax.set_title(f"{results['model']} / {results['task']}")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8, loc="upper left", bbox_to_anchor=(1.01, 1.0), borderaxespad=0.0)
    fig.tight_layout()
    return fig


def plot_accuracy_vs_retention(results: dict, path: pathlib.Path) -> None:
    plt = pyplot()
    fig = accuracy_figure(results)
    fig.savefig(path, dpi=120)
    plt.close(fig)


def _always_per_head(system: str) -> bool:
    """Systems that take per-head H2O sets on every layer (AttentionStore + H2O): their `fallback` is 1.0 on every
    layer by construction, not a failed identification."""
    return system.startswith("as_h2o")


LAYERS_CAPTION = ("fallback rate: the share of requests in which the layer loaded every key and used per-head sets "
                  "instead of one shared set.")
PER_HEAD_CAPTION = "as_h2o_* take per-head H2O sets on every layer, so theirs is 1.0 on every layer by construction."


def _has_per_head(results: dict) -> bool:
    return any(_always_per_head(s.get("system", k)) for k, s in results["systems"].items() if s.get("layers"))


def layer_series(results: dict) -> list[dict]:
    """layers.png's series, one per run with per-layer records: its colour index (one per system), marker, marker
    size (the first of lines that may coincide largest) and line style (one per retention), and its legend label,
    which for an as_h2o_* run says why its fallback rate is 1.0."""
    entries = [(k, s) for k, s in results["systems"].items() if s.get("layers")]
    systems = list(dict.fromkeys(s.get("system", k) for k, s in entries))
    retentions = sorted({s.get("retention") for _, s in entries if s.get("retention") is not None})
    out = []
    for i, (key, s) in enumerate(entries):
        system = s.get("system", key)
        r = s.get("retention")
        style = 0 if r is None else 1 + retentions.index(r)
        label = key + (" (per-head H2O: fallback 1.0)" if _always_per_head(system) else "")
        out.append({"key": key, "layers": s["layers"], "label": label, "colour": systems.index(system),
                    "marker": SERIES_MARKERS[style % len(SERIES_MARKERS)],
                    "linestyle": SERIES_LINESTYLES[style % len(SERIES_LINESTYLES)],
                    "markersize": max(3.0, 9.0 - 6.0 * i / max(1, len(entries) - 1))})
    return out


def _layer_panels(series: list[dict]) -> list[str]:
    """The per-layer records layers.png plots (none: no layers.png)."""
    return [name for name in ("retained", "fallback") if any(name in sr["layers"] for sr in series)]


def layers_figure(results: dict):
    """Per layer, the KV loaded (kept fraction of the prefix) and the fallback rate, a line per run: colour per
    system, marker and line style per retention, marker sizes shrinking run by run so equal lines all show; the
    legend, outside the axes, and a caption under them say what fallback means and why as_h2o_*'s is 1.0. None
    where no run has per-layer records."""
    series = layer_series(results)
    panels = _layer_panels(series)
    if not panels:
        return None
    plt = pyplot()
    fig, axes = plt.subplots(len(panels), 1, figsize=(10, 1.6 + 2.4 * len(panels)), sharex=True, squeeze=False)
    axes = axes[:, 0]
    colours = plt.rcParams["axes.prop_cycle"].by_key()["color"]
    for ax, name in zip(axes, panels):
        for z, sr in enumerate(series):
            if name in sr["layers"]:
                ax.plot(sr["layers"][name], marker=sr["marker"], markersize=sr["markersize"],
                        linestyle=sr["linestyle"], color=colours[sr["colour"] % len(colours)], label=sr["label"],
                        markeredgecolor="white", markeredgewidth=0.4, zorder=2 + z)
        ax.set_ylabel({"retained": "KV loaded / prefix", "fallback": "fallback rate"}[name])
        ax.set_ylim(-0.05, 1.08)
        ax.grid(alpha=0.3)
    axes[-1].set_xlabel("layer")
    axes[0].set_title(f"{results['model']} / {results['task']}: per layer, mean over requests", fontsize=10)
    axes[0].legend(fontsize=7, loc="upper left", bbox_to_anchor=(1.01, 1.0), borderaxespad=0.0)
    caption = ""
    if "fallback" in panels:
        caption = LAYERS_CAPTION + (" " + PER_HEAD_CAPTION if _has_per_head(results) else "")
    if caption:
        fig.text(0.01, 0.01, caption, fontsize=7.5, ha="left", va="bottom", wrap=True)
    fig.tight_layout(rect=(0, 0.06 if caption else 0, 1, 1))
    return fig


def plot_layers(results: dict, path: pathlib.Path) -> bool:
    fig = layers_figure(results)
    if fig is None:
        return False
    plt = pyplot()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return True


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
