"""`python -m specjax.eval.observe`: the SPEC / ContiguousKV motivating measurements on a real model.

    python -m specjax.eval.observe --model smollm2-135m --task piqa --data_dir DATA --limit 30
    python -m specjax.eval.observe --model smollm2-135m --task needle --limit 30

For every request the prefix KV is computed once (the model's plain prefill) and the query is run on top of it
with the engine's layer steps and all query heads as probes: H2O importance of every prefix token for every head
and layer (`specjax.kernels.probe_scores`, rows = query tokens only, as when the prefix KV is reused). From those
scores: head and layer similarity, the probe-head choice (the engine's probe heads vs spread probes), period
coverage, static pre-identification, chunk density and an ITF threshold sweep (ITF's decision by
`specjax.kernels.itf.identify`, as in the engine). Accuracy under a selection is the lm-eval loglikelihood
accuracy when query and continuation attend only to the selected prefix tokens (the engine's gathered attention,
per query head). The engine itself then runs the workload for the alpha sweep, reordering and cache policy.
Writes OUTPUT_DIR/observations.md, observations.json and PNG figures.

This module is the command; the work is in `observe_measure` (model passes, selections, engine runs),
`observe_analysis` (the measurements from the collected scores), `observe_figures` and `observe_report`.
"""

from __future__ import annotations

import dataclasses
import json
import pathlib
import shlex
import sys
import time
from typing import Mapping

import jax
import numpy as np
from absl import flags

from specjax.eval import settings as settings_lib
from specjax.eval.observe_analysis import analyse
from specjax.eval.observe_figures import write_figures
from specjax.eval.observe_measure import (
    MeasureSettings,
    collect,
    engine_measurements,
    ordered_by_prefix,
    stored_kv_bytes,
)
from specjax.eval.observe_report import engine_section, verdicts, write_markdown
from specjax.eval.settings import setting
from specjax.eval.units import cache_bytes

FLAGS = flags.FLAGS


def _floats(text: str, name: str) -> list[float]:
    try:
        values = [float(v) for v in text.split(",") if v.strip()]
    except ValueError:
        values = []
    if not values:
        from specjax.eval.errors import EvalError

        raise EvalError(f"--{name} {text!r}: want comma-separated numbers, e.g. 0.1,0.25,0.4")
    return values


def _fraction(value: float) -> None:
    if not 0 < value <= 1:
        raise ValueError("must be a fraction in (0, 1]")


def _fractions(text: str) -> None:
    for value in _floats(text, "retentions"):
        _fraction(value)


@dataclasses.dataclass(frozen=True)
class ObserveSettings:
    """This command's own settings; the model's, the workload's and the store's are the evaluation's
    (`specjax.eval.settings`), with defaults of its own (`SHARED`)."""

    retentions: str = setting("0.1,0.25,0.4", "Retention ratios for the similarity measurements.",
                              check=_fractions)
    main_retention: float = setting(0.25, "Retention for single-retention measurements (layers, ITF).",
                                    check=_fraction)
    density_retention: float = setting(0.5, "Extra retention for chunk density (SPEC Fig. 5a uses 50%).",
                                       check=_fraction)
    period_chunk_tokens: int = setting(16, "ContiguousChunk size for period coverage (ContiguousKV: 16).")
    period_layers: int = setting(8, "Layers per period (ContiguousKV: 8).")
    alphas: str = setting("0,0.3,0.6,1,2", "ITF threshold exponents to sweep.", check=lambda v: _floats(v, "alphas"))
    accuracy: bool = setting(True, "Also measure loglikelihood accuracy under the selections (slower).")
    engine: bool = setting(True, "Also run the engine (items 5-6: alpha sweep, reordering, cache policy).")
    reorder_every: int = setting(0, "Engine: also run SPEC's reordering pass after every N measured requests (0: only "
                                 "once, between the two warm-up passes, as specjax.eval does; each repack frees the "
                                 "old chunks, so the caches restart cold after it).")
    output_dir: str | None = setting(None, "Where to write; default results/observe-<model>-<task>.")

    __post_init__ = settings_lib.check_fields


# the evaluation's settings this command shares, and its defaults for them
SHARED = {settings_lib.ModelSettings: (("model", "init"), {}),
          settings_lib.WorkloadSettings: (("task", "data_dir", "limit", "num_fewshot", "prefix_tokens", "reuse_mean",
                                           "seed"), {"limit": 30, "prefix_tokens": 800}),
          settings_lib.StoreSettings: (("chunk_tokens", "gpu_cache", "cpu_cache"), {"chunk_tokens": 64})}


def define_flags() -> None:
    """Flags of this command; defined only when it runs, so importing the module defines none."""
    for group, (only, defaults) in SHARED.items():
        settings_lib.define_flags(group, only, defaults)
    settings_lib.define_flags(ObserveSettings)


def flag_names() -> tuple[str, ...]:
    return sum((only for only, _ in SHARED.values()), ()) + settings_lib.names([ObserveSettings])


COMMAND = "python -m specjax.eval.observe"


@dataclasses.dataclass(frozen=True)
class ObserveRun:
    """This command's settings as one tree: the evaluation's groups it shares (of which only the `SHARED` fields are
    its flags, with its defaults), its own, and its command line; built once from the flags' values (`from_values`),
    then read by attribute."""

    model: settings_lib.ModelSettings
    workload: settings_lib.WorkloadSettings
    store: settings_lib.StoreSettings
    observe: ObserveSettings
    command: str = COMMAND

    @classmethod
    def from_values(cls, values: Mapping) -> ObserveRun:
        """The tree from flat values (flag name -> value, and the `command`); a flag left out keeps its default."""
        settings_lib.refuse_unknown(values, flag_names() + ("command",), "specjax.eval.observe")
        shared = {group: settings_lib.group_from(group, {name: values[name] for name in only if name in values},
                                                 defaults)
                  for group, (only, defaults) in SHARED.items()}
        return cls(model=shared[settings_lib.ModelSettings], workload=shared[settings_lib.WorkloadSettings],
                   store=shared[settings_lib.StoreSettings], observe=settings_lib.group_from(ObserveSettings, values),
                   command=values.get("command") or COMMAND)


def _jsonable(x):
    """Results as JSON: tuple keys joined with "/", arrays as lists (larger than 2-D: left out)."""
    if isinstance(x, dict):
        return {(k if isinstance(k, str) else "/".join(map(str, k)) if isinstance(k, tuple) else str(k)): _jsonable(v)
                for k, v in x.items()}
    if isinstance(x, (list, tuple)):
        return [_jsonable(v) for v in x]
    if isinstance(x, np.ndarray):
        return x.tolist() if x.ndim <= 2 else None  # full matrices are in the figures
    if isinstance(x, (np.floating, np.integer, np.bool_)):
        return x.item()
    return x


# ---------------------------------------------------------------- command


def _load_model(name: str, init: str, seed: int):
    import specjax
    from specjax.eval.errors import EvalError

    try:
        return specjax.load_model(name, init=init, seed=seed)
    except (ValueError, KeyError, FileNotFoundError, NotImplementedError) as e:
        raise EvalError(f"cannot load model '{name}': {e}") from None


def _device() -> str:
    d = jax.devices()[0]
    return f"{len(jax.devices())}x {d.platform} ({getattr(d, 'device_kind', d.platform)})"


def measure_settings(settings: ObserveRun, store_bytes: int) -> MeasureSettings:
    """What the measurements read (`observe_measure`, `observe_analysis`), parsed from the tree: the retentions as
    the flag lists them, or sorted with the main one added where they lack it, the alphas, the chunk sizes, and the
    cache budgets in bytes (a percentage taken of the `store_bytes` of stored prefix KV, as specjax.eval does)."""
    own, store = settings.observe, settings.store
    retentions = _floats(own.retentions, "retentions")
    if own.main_retention not in retentions:
        retentions = sorted(set(retentions) | {own.main_retention})
    return MeasureSettings(
        retentions=tuple(retentions), main_retention=own.main_retention, alphas=tuple(_floats(own.alphas, "alphas")),
        density_retention=own.density_retention, chunk_tokens=store.chunk_tokens,
        period_chunk_tokens=own.period_chunk_tokens, period_layers=own.period_layers, accuracy=own.accuracy,
        reorder_every=own.reorder_every, gpu_cache_bytes=cache_bytes(store.gpu_cache, store_bytes),
        cpu_cache_bytes=cache_bytes(store.cpu_cache, store_bytes))


def _requests(model, workload: settings_lib.WorkloadSettings):
    """The workload, and its requests ordered by prefix; the longest checked against the model's positions."""
    from specjax.eval import tasks as tasks_lib, workload as workload_lib
    from specjax.eval.errors import EvalError
    from specjax.eval.fallback_tokenizer import tokenizer_for
    from specjax.eval.units import parse_fewshot

    task = tasks_lib.load_task(workload.task, workload.data_dir)
    tokenizer, _ = tokenizer_for(model)
    spec = workload_lib.WorkloadSpec(fewshot=parse_fewshot(workload.num_fewshot), reuse_mean=workload.reuse_mean,
                                     prefix_tokens=workload.prefix_tokens or None, limit=workload.limit,
                                     seed=workload.seed)
    wl = workload_lib.build_workload(task, tokenizer, spec)
    requests = ordered_by_prefix(wl.requests)
    longest = max(len(r.context_ids) + max(len(c) for c in r.choice_ids) for r in requests)
    if longest > model.config.max_positions:
        raise EvalError(f"the longest request has {longest} tokens, more than {model.config.max_positions}; "
                        "lower --prefix_tokens")
    return wl, requests


def run(settings: ObserveRun | Mapping, progress=print) -> dict:
    """The whole command; `settings`: the tree, or flat values (flag name -> value) built into it here. Returns the
    results dict."""
    started = time.time()
    settings = settings if isinstance(settings, ObserveRun) else ObserveRun.from_values(settings)
    model = _load_model(settings.model.model, settings.model.init, settings.workload.seed)
    cfg, task_name = model.config, settings.workload.task
    wl, requests = _requests(model, settings.workload)
    measure = measure_settings(settings, stored_kv_bytes(model, wl.requests))
    out = pathlib.Path(settings.observe.output_dir
                       or f"results/observe-{pathlib.Path(settings.model.model).name}-{task_name}")
    out.mkdir(parents=True, exist_ok=True)
    progress(f"{len(requests)} requests, {len({r.prefix_id for r in requests})} prefixes, "
             f"prefix {np.mean([len(r.prefix_ids) for r in requests]):.0f} tokens on average")
    records = collect(model, requests, measure, progress)
    res = analyse(records, cfg, measure)
    res["engine"] = (engine_measurements(model, wl.requests, measure, progress) if settings.observe.engine
                     else {"error": "not run (--noengine)"})
    label = (f"{model.name} ({model.weights}), {task_name}, n={len(records)} requests, "
             f"main retention {measure.main_retention:.0%}")
    figures = write_figures(res, out, label)
    meta = {"cfg": cfg, "model": model.name, "weights": model.weights, "task": task_name,
            "command": settings.command, "device": _device(),
            "n_requests": len(records), "n_prefixes": len({r.prefix_id for r in records}),
            "prefix_mean": float(np.mean([len(r.prefix_ids) for r in requests])),
            "prefix_max": int(max(len(r.prefix_ids) for r in requests)),
            "query_mean": float(np.mean([len(r.query_ids) for r in requests])),
            "wall_s": time.time() - started, "engine_note": engine_section(res)}
    md = write_markdown(res, meta, out, figures)
    summary = {k: v for k, v in res.items() if k != "heads"}
    summary["heads"] = {r: {k: v for k, v in h.items() if k != "matrix"} for r, h in res["heads"].items()}
    summary["layers"] = {k: v for k, v in res["layers"].items()}
    summary["density"] = {r: {k: ({kk: vv for kk, vv in v.items() if kk != "fractions"} if isinstance(v, dict) else v)
                              for k, v in d.items()} for r, d in res["density"].items()}
    summary["meta"] = {k: v for k, v in meta.items() if k != "cfg"}
    summary["verdicts"] = verdicts(res, cfg)
    summary["engine"] = res["engine"]
    (out / "observations.json").write_text(json.dumps(_jsonable(summary), indent=1))
    progress(f"wrote {md} and {len(figures)} figures in {time.time() - started:.0f} s")
    return res


def main(argv):
    from specjax.eval.errors import EvalError

    if len(argv) > 1:
        raise EvalError(f"unexpected arguments {argv[1:]}; flags look like --task piqa")
    values = {n: FLAGS[n].value for n in flag_names()}
    run(ObserveRun.from_values({**values, "command": shlex.join([*COMMAND.split(), *sys.argv[1:]])}))


if __name__ == "__main__":
    from specjax.cli import run as run_cli

    define_flags()
    run_cli(main)
