"""Accuracy paired per item against one reference system, per task and pooled over tasks, with disk bytes.

    python -m specjax.eval --preset gqa_identification --data_dir DATA --output_dir DIR
    python benchmarks/pooled_accuracy.py DIR --reference as_h2o_lfu

Reads DIR/<task>/requests.jsonl (one per task of a preset run; every system ran the same requests) and prints, per
task and pooled: each run's accuracy (lm-eval acc), its paired difference from the reference at the same retention
(mean and standard error over items, `specjax.eval.metrics.paired_difference`), its disk bytes over the reference's,
and the share of ITF layers that fell back; then, per layer, each ITF run's pass rate (the share of requests whose
probes passed the similarity test there) and mean probe Jaccard, from DIR/<task>/results.json, pooled over tasks with
each task weighted by its requests. `--json FILE` writes the same numbers.
"""

from __future__ import annotations

import argparse
import json
import pathlib

import numpy as np

from specjax.eval import metrics


def load(directory: pathlib.Path) -> dict[str, dict[str, dict[int, dict]]]:
    """task -> system -> request id -> the request's row."""
    files = sorted(directory.glob("*/requests.jsonl")) or sorted(directory.glob("requests.jsonl"))
    if not files:
        raise SystemExit(f"no requests.jsonl under {directory}")
    out: dict = {}
    for path in files:
        task = path.parent.name
        for line in path.read_text().splitlines():
            row = json.loads(line)
            out.setdefault(task, {}).setdefault(row["system"], {})[row["request_id"]] = row
    return out


def correct(row: dict) -> float:
    return float(int(np.argmax(row["choice_logprobs"])) == row["gold"])


def retention_of(system: str) -> str:
    """A run's retention suffix ("r=0.25" of "spec@r=0.25"; "" when the run had one retention)."""
    return system.partition("@")[2]


def summary(rows: dict[str, dict[int, dict]], reference: str) -> dict:
    """Per system, over the requests every system ran; each paired with the reference at its own retention."""
    ids = sorted(set.intersection(*(set(r) for r in rows.values())))
    out = {}
    for system, by_id in rows.items():
        ref = f"{reference}@{retention_of(system)}" if retention_of(system) else reference
        if ref not in rows:  # a run without retention (recompute, as_full) beside runs with several
            continue
        ref_correct = [correct(rows[ref][i]) for i in ids]
        ref_bytes = sum(rows[ref][i]["counters"]["disk_bytes"] for i in ids)
        c = [correct(by_id[i]) for i in ids]
        counters = [by_id[i]["counters"] for i in ids]
        layers = sum(x["itf_layers"] for x in counters)
        out[system] = {"n": len(ids), "acc": float(np.mean(c)),
                       "paired": metrics.paired_difference(c, ref_correct),
                       "disk_bytes": int(sum(x["disk_bytes"] for x in counters)),
                       "disk_bytes_vs_reference": sum(x["disk_bytes"] for x in counters) / max(ref_bytes, 1),
                       "itf_fallback": sum(x["itf_fallbacks"] for x in counters) / layers if layers else None}
    return out


def layer_rates(directory: pathlib.Path) -> dict[str, dict[str, list[float]]]:
    """Run -> {"pass": per-layer share of requests whose ITF test passed, "jaccard": per-layer mean probe Jaccard,
    and where every task has it "head_share": spec_gqa's guard, the per-layer mean of the shared set's least share of
    a head's own top-k attention}, pooled over DIR/<task>/results.json with each task weighted by its requests; runs
    without ITF are left out."""
    sums: dict = {}
    for path in sorted(directory.glob("*/results.json")) or sorted(directory.glob("results.json")):
        for key, entry in json.loads(path.read_text())["systems"].items():
            layers = entry.get("layers") or {}
            if "jaccard" not in layers:  # no ITF test (as_h2o_lfu reports fallback 0 on every layer)
                continue
            n = entry["accuracy"]["n"]
            acc = sums.setdefault(key, {"n": 0, "fallback": 0.0, "jaccard": 0.0, "head_share": 0.0})
            if acc["n"] and len(acc["fallback"]) != len(layers["fallback"]):
                raise SystemExit(f"{path}: {key} has {len(layers['fallback'])} layers, other tasks "
                                 f"{len(acc['fallback'])}")
            acc["n"] += n
            acc["fallback"] = acc["fallback"] + n * np.asarray(layers["fallback"], dtype=np.float64)
            acc["jaccard"] = acc["jaccard"] + n * np.asarray(layers["jaccard"], dtype=np.float64)
            acc["head_share"] = acc["head_share"] + n * np.asarray(layers.get("head_share", np.nan), dtype=np.float64)
    out = {}
    for key, a in sums.items():
        out[key] = {"pass": (1.0 - a["fallback"] / a["n"]).tolist(), "jaccard": (a["jaccard"] / a["n"]).tolist()}
        if not np.isnan(a["head_share"]).any():
            out[key]["head_share"] = (a["head_share"] / a["n"]).tolist()
    return out


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("directory", type=pathlib.Path)
    ap.add_argument("--reference", default="as_h2o_lfu")
    ap.add_argument("--json", type=pathlib.Path)
    args = ap.parse_args(argv)
    data = load(args.directory)
    pooled: dict = {}
    results = {}
    for task, rows in data.items():
        results[task] = summary(rows, args.reference)
        for system, by_id in rows.items():
            pooled.setdefault(system, {}).update({(task, i): row for i, row in by_id.items()})
    results["pooled"] = summary(pooled, args.reference)
    print(f"{'task':<12}{'system':<22}{'n':>5}{'acc':>8}{'vs ' + args.reference:>22}{'disk bytes':>12}"
          f"{'ITF fallback':>14}")
    for task, systems in results.items():
        for system, s in systems.items():
            p = s["paired"]
            fallback = "-" if s["itf_fallback"] is None else f"{s['itf_fallback']:.2f}"
            print(f"{task:<12}{system:<22}{s['n']:>5}{100 * s['acc']:>7.1f}%"
                  f"{100 * p['acc_diff']:>+12.1f} ± {100 * p['stderr']:.1f} pp{s['disk_bytes_vs_reference']:>11.3f}x"
                  f"{fallback:>14}")
    layers = layer_rates(args.directory)
    if layers:
        runs = sorted(layers)
        print("\nITF pass rate (mean probe Jaccard) [mean head share, spec_gqa's guard] per layer, pooled over tasks")
        print(f"{'layer':<7}" + "".join(f"{run:>31}" for run in runs))
        for i in range(len(layers[runs[0]]["pass"])):
            print(f"{i:<7}" + "".join(f"{layers[run]['pass'][i]:>17.2f} ({layers[run]['jaccard'][i]:.2f})" +
                                      (f" [{layers[run]['head_share'][i]:.2f}]" if "head_share" in layers[run]
                                       else " " * 7) for run in runs))
    if args.json:
        args.json.write_text(json.dumps({**results, "layers": layers}, indent=1))


if __name__ == "__main__":
    main()
