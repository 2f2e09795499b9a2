"""Prefill throughput with no prefix reuse: tokens/s to first-token logits, of the plain model forward or (with
--engine) of the engine's `recompute` system (Engine.run, the compute-only baseline of the eval). With
--against transformers, also of Hugging Face transformers' PyTorch model built from the same params (checked to
give the same first-token logits first), side by side.

    python -m specjax.bench --model smollm2-135m --tokens 2048
    python -m specjax.bench --model smollm2-135m --against transformers --tokens 256,1024,4096 --threads 2 --output_dir benchmarks/results/cpu
    python -m specjax.bench --model smollm2-135m --tokens 1024 --engine
    python -m specjax.bench --model opt-1.3b --init random --tokens 2048 --output_dir benchmarks/results
"""

from __future__ import annotations

import dataclasses
import json
import multiprocessing
import os
import pathlib
import platform
import shlex
import statistics
import sys
import time

import jax
import numpy as np
from absl import flags

from specjax import torch_ref
from specjax.api import load_model
from specjax.cli import run
from specjax.errors import SpecjaxError
from specjax.models import inference
from specjax.models import transformer as T

FLAGS = flags.FLAGS
CHECK_TOKENS = 16  # the prompt on which specjax and transformers must give the same first-token logits


def define_flags() -> None:
    """Flags of this command; defined only when it runs, so importing the module defines none."""
    flags.DEFINE_string("model", "smollm2-135m", "Registered model name or converted model directory.")
    flags.DEFINE_enum("init", "pretrained", ["pretrained", "random"], "Weights: converted checkpoint, or random of the model's shape.")
    flags.DEFINE_string("dtype", None, "Compute dtype (float32, bfloat16); default: stored dtype (random: float32 on CPU).")
    flags.DEFINE_list("tokens", ["2048"], "Prompt length(s) in tokens, comma-separated (e.g. 256,1024,4096).")
    flags.DEFINE_integer("repeats", 3, "Timed repetitions after one warm-up (compile) run; the median is reported.")
    flags.DEFINE_enum("against", None, ["transformers"], "Also time Hugging Face transformers' PyTorch forward "
                      "(sdpa attention, same dtype) of the same weights, after checking it gives specjax's logits.")
    flags.DEFINE_integer("threads", os.cpu_count(), "With --against: torch.set_num_threads (JAX keeps its own pool).")
    flags.DEFINE_bool("engine", False, "Time the engine's recompute system (Engine.run of one request: the "
                      "tokens as prefix, no query) instead of the plain model forward.")
    flags.DEFINE_integer("prefill_chunk_tokens", None, "With --engine: EngineConfig.prefill_chunk_tokens (0: one "
                         "block); default: the engine's default.")
    flags.DEFINE_string("output_dir", None, "If set, append the results as JSON lines to OUTPUT_DIR/prefill_<device>.jsonl "
                        "(--against: prefill_vs_transformers_<device>.jsonl, and the table as .md).")


def device_name() -> str:
    dev = jax.devices()[0]
    if dev.platform == "cpu":
        return f"cpu ({platform.processor() or platform.machine()}, {jax.local_device_count()} device)"
    return dev.device_kind


def prompt_ids(vocab_size: int, n_tokens: int) -> np.ndarray:
    """The timed prompt: n_tokens random ids (seed 0), the same for every system timed."""
    return np.random.default_rng(0).integers(0, vocab_size, n_tokens)


def prefill_logits(cfg, params, ids) -> jax.Array:
    """specjax's prefill (the timed function): plain forward, then first-token logits [1, vocab] of the last row."""
    h, n = inference.forward_hidden(cfg, params, ids)
    return T.head_step(cfg, params, h[n - 1 : n])


def torch_prefill_logits(hf_model, ids):
    """transformers' prefill (the timed function): forward without a KV cache, first-token logits [1, vocab]."""
    import torch

    with torch.inference_mode():
        return hf_model(torch.as_tensor(ids)[None], use_cache=False, logits_to_keep=1).logits[0]


def _seconds(run) -> float:
    start = time.perf_counter()
    run()
    return time.perf_counter() - start


def time_prefill(model, n_tokens: int, repeats: int) -> list[float]:
    """Seconds per prefill of n_tokens random ids, through first-token logits ready on the device (after one
    warm-up run that compiles)."""
    ids = prompt_ids(model.config.vocab_size, n_tokens)
    forward = lambda: prefill_logits(model.config, model.params, ids).block_until_ready()  # noqa: E731
    forward()
    return [_seconds(forward) for _ in range(repeats)]


def time_engine_prefill(model, n_tokens: int, repeats: int, chunk_tokens: int | None = None
                        ) -> tuple[list[float], list[float]]:
    """Seconds per Engine.run of the recompute system over n_tokens random ids (its TTFT: first-token logits
    ready on the device), and of the plain forward of the same ids, taken in turn in the same process."""
    from specjax.engine import Engine, EngineConfig, Request, make_system

    ids = prompt_ids(model.config.vocab_size, n_tokens)
    config = EngineConfig() if chunk_tokens is None else EngineConfig(prefill_chunk_tokens=chunk_tokens)
    engine = Engine(model, make_system("recompute"), None, config)
    request = Request(ids[:-1].tolist(), ids[-1:].tolist())
    forward = lambda: prefill_logits(model.config, model.params, ids).block_until_ready()  # noqa: E731
    engine.run(request)  # compile
    forward()
    engine_s, forward_s = [], []
    for _ in range(repeats):
        engine_s.append(engine.run(request).ttft_ms / 1e3)
        forward_s.append(_seconds(forward))
    return engine_s, forward_s


def _check_logits(model, n_tokens: int = CHECK_TOKENS) -> np.ndarray:
    params32 = jax.tree.map(lambda x: x.astype(np.float32), model.params)
    with jax.default_matmul_precision("highest"):  # full fp32 on accelerators too: the check is of the weights
        return np.asarray(prefill_logits(model.config, params32, prompt_ids(model.config.vocab_size, n_tokens)),
                          np.float32)


def _agreement(ours, theirs, tol: float, name: str, arch: str) -> float:
    diff = float(np.abs(np.asarray(ours) - np.asarray(theirs)).max())
    if not diff <= tol:
        raise SpecjaxError(f"the transformers model built from {name}'s params disagrees with specjax: max "
                           f"|first-token logit difference| {diff:.3g} > {tol:g} (float32, {CHECK_TOKENS} tokens); "
                           f"the config or weight mapping in specjax/torch_ref.py is wrong for {arch}")
    return diff


@dataclasses.dataclass(frozen=True)
class ModelSpec:
    """What `load_model` needs to build the same model in another process."""

    name: str
    init: str = "pretrained"
    dtype: str | None = None
    seed: int = 0

    def load(self):
        return load_model(self.name, dtype=self.dtype, init=self.init, seed=self.seed)


_SIDE: dict = {}  # in a worker process: its framework's model, prefill function and ids


def side_setup(side: str, spec: ModelSpec, threads: int | None) -> dict:
    """Load one framework's model in this (worker) process; its versions and its float32 first-token logits of the
    check prompt."""
    model = spec.load()
    _SIDE.update(model=model, ids={})
    if side == "specjax":
        _SIDE["prefill"] = lambda ids: prefill_logits(model.config, model.params, ids).block_until_ready()
        return {"check": _check_logits(model), "model": model.name, "weights": model.weights,
                "arch": model.config.arch, "dtype": np.dtype(model.dtype).name, "jax": jax.__version__,
                "device": device_name()}
    torch, transformers = torch_ref.require_torch()
    if threads:
        torch.set_num_threads(threads)
    hf_model = torch_ref.transformers_model(model.config, model.params)
    check = torch_prefill_logits(hf_model, prompt_ids(model.config.vocab_size, CHECK_TOKENS)).float().numpy()
    hf_model.to(getattr(torch, np.dtype(model.dtype).name))
    _SIDE["prefill"] = lambda ids: torch_prefill_logits(hf_model, ids)
    return {"check": check, "threads": torch.get_num_threads(), "torch": torch.__version__,
            "transformers": transformers.__version__, "attn_implementation": hf_model.config._attn_implementation}


def side_seconds(n_tokens: int) -> float:
    """Seconds of one prefill of the n-token prompt in this worker (its first call per length warms up first)."""
    ids = _SIDE["ids"].get(n_tokens)
    if ids is None:
        ids = _SIDE["ids"][n_tokens] = prompt_ids(_SIDE["model"].config.vocab_size, n_tokens)
        _SIDE["prefill"](ids)
    return _seconds(lambda: _SIDE["prefill"](ids))


def compare_prefill(spec: ModelSpec, lengths: list[int], repeats: int, threads: int | None = None,
                    tol: float = 1e-3) -> list[dict]:
    """One record per prompt length: specjax and transformers prefill seconds (same weights, same ids, same
    repeats, one warm-up each).

    Each framework runs in a process of its own (in one process, torch's presence left specjax 10-20% slower on
    2 cores), and their timed runs alternate, one at a time, so a machine whose speed drifts (a shared VM) drifts
    for both alike. Their first-token logits of a check prompt must agree in float32 first."""
    torch_ref.require_torch()
    context = multiprocessing.get_context("spawn")
    pools = {side: context.Pool(1) for side in ("specjax", "transformers")}
    try:
        info = {side: pool.apply(side_setup, (side, spec, threads)) for side, pool in pools.items()}
        seconds = {side: {n: [] for n in lengths} for side in pools}
        for n in lengths:
            for r in range(repeats):
                for side in (("specjax", "transformers") if r % 2 == 0 else ("transformers", "specjax")):
                    seconds[side][n].append(pools[side].apply(side_seconds, (n,)))
    finally:
        for pool in pools.values():
            pool.terminate()
    ours, theirs = info["specjax"], info["transformers"]
    diff = _agreement(ours["check"], theirs["check"], tol, ours["model"], ours["arch"])
    base = {k: ours[k] for k in ("model", "weights", "dtype", "device", "jax")}
    base |= {k: theirs[k] for k in ("threads", "torch", "transformers", "attn_implementation")}
    base |= {"torch_device": "cpu", "max_abs_logit_diff_fp32": diff, "repeats": repeats,
             "processes": "one per framework; timed runs alternate"}
    records = []
    for n in lengths:
        mine, other = seconds["specjax"][n], seconds["transformers"][n]
        records.append(base | {
            "tokens": n, "specjax_seconds": mine, "transformers_seconds": other,
            "specjax_tokens_per_s": n / statistics.median(mine), "specjax_best_tokens_per_s": n / min(mine),
            "transformers_tokens_per_s": n / statistics.median(other), "transformers_best_tokens_per_s": n / min(other),
            "time_ratio": statistics.median(mine) / statistics.median(other),
        })
    return records


def markdown_table(records: list[dict]) -> str:
    r = records[0]
    lines = [
        f"# Prefill to first-token logits: specjax vs transformers, {r['model']}", "",
        f"{r['weights']} weights, {r['dtype']}, {r['device']}, {r['threads']} torch threads; jax {r['jax']}, "
        f"torch {r['torch']}, transformers {r['transformers']} ({r['attn_implementation']} attention). Median (best) of "
        f"{r['repeats']} after one warm-up each, each framework in a process of its own, timed runs alternating. Same weights: max |first-token logit difference| "
        f"{r['max_abs_logit_diff_fp32']:.1e} in float32.", "",
    ]
    if r.get("command"):
        lines += [f"`{r['command']}`", ""]
    lines += ["| tokens | specjax tok/s | transformers tok/s | specjax time / transformers time |", "|---:|---:|---:|---:|"]
    lines += [f"| {r['tokens']} | {r['specjax_tokens_per_s']:.0f} ({r['specjax_best_tokens_per_s']:.0f}) | "
              f"{r['transformers_tokens_per_s']:.0f} ({r['transformers_best_tokens_per_s']:.0f}) | {r['time_ratio']:.2f} |"
              for r in records]
    return "\n".join(lines) + "\n"


def _lengths(values) -> list[int]:
    try:
        lengths = [int(v) for v in values]
    except ValueError:
        raise SpecjaxError(f"--tokens must be positive integers separated by commas, got {','.join(values)!r}") from None
    if not lengths or min(lengths) < 1:
        raise SpecjaxError("--tokens must be positive")
    return lengths


def _output(name: str) -> pathlib.Path:
    out = pathlib.Path(FLAGS.output_dir)
    out.mkdir(parents=True, exist_ok=True)
    return out / name.format(device=device_name().split(" ")[0].replace("/", "_"))


def main(argv):
    del argv
    lengths = _lengths(FLAGS.tokens)
    if FLAGS.repeats < 1:
        raise SpecjaxError("--repeats must be positive")
    if FLAGS.against:
        if FLAGS.engine:
            raise SpecjaxError("--against transformers compares the plain model forward; drop --engine")
        spec = ModelSpec(FLAGS.model, FLAGS.init, FLAGS.dtype, seed=0)
        records = compare_prefill(spec, lengths, FLAGS.repeats, FLAGS.threads)
        command = shlex.join(["python", "-m", "specjax.bench", *sys.argv[1:]])
        records = [r | {"command": command} for r in records]
        table = markdown_table(records)
        print(table, end="")
        if FLAGS.output_dir:
            with open(_output("prefill_vs_transformers_{device}.jsonl"), "a") as f:
                f.writelines(json.dumps(r) + "\n" for r in records)
            _output("prefill_vs_transformers_{device}.md").write_text(table)
        return
    model = load_model(FLAGS.model, dtype=FLAGS.dtype, init=FLAGS.init)
    label = " (random weights)" if model.weights == "random" else ""
    for n_tokens in lengths:
        forward = None
        if FLAGS.engine:
            seconds, forward = time_engine_prefill(model, n_tokens, FLAGS.repeats, FLAGS.prefill_chunk_tokens)
        else:
            seconds = time_prefill(model, n_tokens, FLAGS.repeats)
        median = statistics.median(seconds)
        result = {
            "model": model.name, "weights": model.weights, "dtype": str(model.dtype), "device": device_name(),
            "tokens": n_tokens, "path": "engine recompute" if FLAGS.engine else "forward",
            "prefill_chunk_tokens": FLAGS.prefill_chunk_tokens if FLAGS.engine else None, "seconds": seconds,
            "tokens_per_s": n_tokens / median,
        }
        chunks = "" if FLAGS.prefill_chunk_tokens is None else f" (prefill_chunk_tokens={FLAGS.prefill_chunk_tokens})"
        line = (f"{model.name}{label} {result['dtype']} on {result['device']}, {result['path']}{chunks}: prefill "
                f"{n_tokens} tokens in {median * 1e3:.0f} ms (median of {FLAGS.repeats}) = "
                f"{result['tokens_per_s']:.0f} tokens/s")
        if forward is not None:  # the plain forward of the same tokens, timed in turn with it
            result |= {"forward_seconds": forward, "engine_over_forward": median / statistics.median(forward)}
            line += (f"; plain forward {statistics.median(forward) * 1e3:.0f} ms, engine / forward "
                     f"{result['engine_over_forward']:.2f}")
        print(line)
        if FLAGS.output_dir:
            with open(_output("prefill_{device}.jsonl"), "a") as f:
                f.write(json.dumps(result) + "\n")


if __name__ == "__main__":
    define_flags()
    run(main)
