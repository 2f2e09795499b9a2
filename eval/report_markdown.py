"""results.md: a run's results.json as sentences and tables, its figures linked (`report_figures`)."""

from __future__ import annotations

import json

from specjax.eval import tradeoff
from specjax.eval.report_figures import LAYERS_PNG, RETENTION_PNG, TRADEOFF_PNG, TTFT_PNG, figure_lines, figures
from specjax.eval.systems import BREAKDOWN_KEYS

# README.md's definition, word for word (tests/test_eval_report_figures.py holds the two together)
TTFT_DEFINITION = "TTFT runs from a request's arrival to its first-token logits ready on the device."


def _per_taken(io: dict) -> str:
    ratio = io.get("host_to_device_per_used")
    return f"{ratio:.2f}" if ratio else "-"


def fmt_bytes(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(n) < 1024 or unit == "TiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.2f} {unit}"
        n /= 1024
    return str(n)


def _disk_read_cell(io: dict) -> str:
    """The system's own disk reads, and beside them what damaged stored KV made its timed requests read, if any
    (results written before that was counted have none)."""
    repair = io.get("repair_disk_bytes")
    own = fmt_bytes(io["disk_bytes"])
    return f"{own} (+ {fmt_bytes(repair)} repair)" if repair else own


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
    out += figure_lines(results, TRADEOFF_PNG)
    out += [tradeoff.table(results), "",
            "`frontier`: no other run is both at least as fast and at least as accurate. Δacc is paired: the "
            "same requests answered by both.", ""]
    return out


def markdown(results: dict) -> str:
    """results.md: caveats first, then the trade-off, the run, accuracy and TTFT, the breakdown, I/O, reads, Cake's
    split, per-layer figures and the settings."""
    out = [f"# {results['model']} on {results['task']}", ""]
    for note in results.get("notes", []):  # caveats (random weights, emulation) come before any claim
        out.append(f"- **note**: {note}")
    if results.get("notes"):
        out.append("")
    out += tradeoff_section(results)
    out += run_section(results)
    out += accuracy_section(results)
    out += breakdown_section(results)
    out += io_section(results)
    out += reads_section(results)
    split = {k: s["split"] for k, s in results["systems"].items() if s.get("split")}
    if split:
        out += ["", "## Cake: stored prefix computed on the device vs loaded (mean per request)", ""]
        out.append(_table(["system", "computed fraction", "computed tokens", "loaded tokens"], [
            [k, f"{x['computed_fraction']:.2f}", f"{x['computed_prefix_tokens_mean']:.0f}",
             f"{x['loaded_prefix_tokens_mean']:.0f}"] for k, x in split.items()]))
    if LAYERS_PNG in figures(results):
        out += ["", "## Per layer", ""] + figure_lines(results, LAYERS_PNG)[:-1]
    out += ["", "## Settings", "", "```", json.dumps(results["config"], indent=2, sort_keys=True), "```", ""]
    return "\n".join(out)


def run_section(results: dict) -> list[str]:
    """Where and how the run ran: device, weights, kernels, emulation, selections, workload, code, eval time."""
    out = ["## Run", "", f"- device: {results['device']}", f"- weights: {results['weights']}"]
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
    return out


def accuracy_section(results: dict) -> list[str]:
    """Each run's accuracy, paired difference and TTFT percentiles against recompute's, and the retention figure."""
    systems = results["systems"]
    ref = systems.get("recompute")
    rows = []
    for key, s in systems.items():
        a, t = s["accuracy"], s["ttft_ms"]
        paired = s.get("paired_vs_recompute")
        diff = f"{100 * paired['acc_diff']:+.1f} ± {100 * paired['stderr']:.1f}" if paired else "-"
        speedup = f"{ref['ttft_ms']['mean'] / t['mean']:.2f}x" if ref and t["mean"] else "-"
        rows.append([key, f"{100 * a['acc']:.1f} ± {100 * a['stderr']:.1f}", f"{100 * a['acc_norm']:.1f}",
                     str(a["n"]), diff, f"{t['mean']:.1f}", f"{t['p50']:.1f}", f"{t['p95']:.1f}",
                     f"{t['p99']:.1f}", speedup])
    out = ["", "## Accuracy and TTFT", ""]
    out.append(_table(["system", "acc %", "acc_norm %", "n", "Δacc vs recompute (pp)", "TTFT mean ms",
                       "p50", "p95", "p99", "speedup vs recompute"], rows))
    return out + [""] + figure_lines(results, RETENTION_PNG)


def breakdown_section(results: dict) -> list[str]:
    """TTFT by phase and the process's CPU time per request, and the breakdown figure."""
    out = ["## TTFT breakdown (mean ms per request)", ""]
    out.append(_table(["system", *BREAKDOWN_KEYS, "process CPU"], [
        [k, *(f"{s['breakdown_ms'][b]:.1f}" for b in BREAKDOWN_KEYS), _ms(s.get("cpu_ms"))]
        for k, s in results["systems"].items()]))
    out += ["", "`process CPU`: the CPU time of every thread of the process from a request's start to its first token "
            "(the request's thread, the disk threads and, on a CPU device, XLA's compute): the request's work, above "
            "its TTFT where threads ran in parallel.",
            "", f"{TTFT_DEFINITION} Its phases: probe-key I/O (`probe_io`), identification (`identify`), KV I/O "
                f"stall (`kv_io_stall`) and compute (`compute`, the rest).", ""]
    return out + figure_lines(results, TTFT_PNG)[:-1]


def io_section(results: dict) -> list[str]:
    """Disk and host->device bytes, cache hits, ITF and prefetch figures over the run."""
    systems = results["systems"]
    out = ["", "## I/O and caches (totals over the run)", ""]
    rows = []
    for k, s in systems.items():
        io, c = s["io"], s["cache"]
        itf = s["itf"]
        pf = s["prefetch"]
        rows.append([k, _bits_cell(s.get("precision")), _disk_read_cell(io), fmt_bytes(io["host_to_device_bytes"]),
                     str(io["chunks_read"]),
                     f"{io['read_amplification']:.2f}", f"{c['device_hit_ratio']:.2f}", f"{c['host_hit_ratio']:.2f}",
                     f"{itf['fallback_ratio']:.2f} / {itf['mean_jaccard']:.2f}" if itf else "-",
                     _prefetch_cell(pf, s.get("speculation"))])
    out.append(_table(["system", "bits selected / rest", "disk read", "host->device", "chunks read", "read ampl.",
                       "device hit", "host hit", "ITF fallback / Jaccard", "prefetch precision / recall / guess recall"],
                      rows))
    if any(s["io"].get("repair_disk_bytes") for s in systems.values()):
        out += ["", "`repair`: what stored KV failing its checksum made the timed requests read beside the system's "
                    "own reads (`disk read`): the attempt given up at a bad chunk and the repair's checks of the "
                    "stored prefix (results.json `io.repair_disk_bytes`; `repair` there: the whole run's)."]
    if any((s.get("speculation") or {}).get("unpaid_layers") for s in systems.values()):
        out += ["", "`did not pay`: a layer guesses the next one's set only where those tokens' bytes take the disk, "
                    "at its measured rate, longer than a guess costs the host (measured too); the next layer then "
                    "reads its set on demand (`Speculator.pays`)."]
    return out


def _bits_cell(precision: dict | None) -> str:
    """A loaded token's bits per K/V element, the selected tokens' / the rest's ("-": the rest is not loaded; its keys'
    where they differ)."""
    if not precision:
        return "-"
    rest, plans = precision.get("rest_bits"), precision.get("plan_bits")
    also = f" (or {', '.join(map(str, plans))} as planned)" if plans else ""
    if precision.get("rest_key_bits", rest) != rest:
        also += f" (its keys {precision['rest_key_bits']})"
    return f"{precision['selected_bits']} / {rest if rest is not None else '-'}{also}"


def reads_section(results: dict) -> list[str]:
    """Reads, transfers and compiles per timed request."""
    out = ["", "## Reads, transfers and compiles (means per timed request; compiles: total)", ""]
    out.append(_table(["system", "read requests", "bytes per read", "host->device transfers",
                       "host->device / taken", "of which device pages", "compiles timed"], [
        [k, f"{s['io']['read_requests_per_request']:.1f}",
         fmt_bytes(s["io"]["bytes_per_read"]) if s["io"]["bytes_per_read"] is not None else "-",
         f"{s['io']['host_to_device_transfers_per_request']:.1f}", _per_taken(s["io"]),
         fmt_bytes(s["io"]["device_page_bytes_per_request"]) if "device_page_bytes_per_request" in s["io"] else "-",
         str(s["compilations_timed"])]
        for k, s in results["systems"].items()]))
    out += ["", "`host->device / taken`: the bytes that crossed to the device per byte of the vectors the layers took "
                "(their probe keys, or the keys they score with, and the rows they attend to; results.json "
                "`io.used_token_bytes`); above 1: whole chunks, padding or the device tier's page writes crossed too. "
                "`of which device pages`: per request, the whole chunks written into the device tier after its first "
                "token."]
    return out
