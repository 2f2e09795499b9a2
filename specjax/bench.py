"""Prefill throughput with no prefix reuse: tokens/s to first-token logits, of the plain model forward or (with
--engine) of the engine's `recompute` system (Engine.run, the compute-only baseline of the eval).

    python -m specjax.bench --model smollm2-135m --tokens 2048
    python -m specjax.bench --model smollm2-135m --tokens 1024 --engine
    python -m specjax.bench --model opt-1.3b --init random --tokens 2048 --output_dir benchmarks/results
"""

from __future__ import annotations

import json
import pathlib
import platform
import statistics
import time

import jax
import numpy as np
from absl import flags

from specjax.api import load_model
from specjax.cli import run
from specjax.errors import SpecjaxError
from specjax.models import inference
from specjax.models import transformer as T

FLAGS = flags.FLAGS


def define_flags() -> None:
    """Flags of this command; defined only when it runs, so importing the module defines none."""
    flags.DEFINE_string("model", "smollm2-135m", "Registered model name or converted model directory.")
    flags.DEFINE_enum("init", "pretrained", ["pretrained", "random"], "Weights: converted checkpoint, or random of the model's shape.")
    flags.DEFINE_string("dtype", None, "Compute dtype (float32, bfloat16); default: stored dtype (random: float32 on CPU).")
    flags.DEFINE_integer("tokens", 2048, "Prompt length in tokens.")
    flags.DEFINE_integer("repeats", 3, "Timed repetitions after one warm-up (compile) run; the median is reported.")
    flags.DEFINE_bool("engine", False, "Time the engine's recompute system (Engine.run of one request: the "
                      "tokens as prefix, no query) instead of the plain model forward.")
    flags.DEFINE_integer("prefill_chunk_tokens", None, "With --engine: EngineConfig.prefill_chunk_tokens (0: one "
                         "block); default: the engine's default.")
    flags.DEFINE_string("output_dir", None, "If set, append the result as JSON lines to OUTPUT_DIR/prefill_<device>.jsonl.")


def device_name() -> str:
    dev = jax.devices()[0]
    if dev.platform == "cpu":
        return f"cpu ({platform.processor() or platform.machine()}, {jax.local_device_count()} device)"
    return dev.device_kind


def time_prefill(model, n_tokens: int, repeats: int) -> list[float]:
    """Seconds per prefill of n_tokens random ids, through first-token logits ready on the device."""
    rng = np.random.default_rng(0)
    ids = rng.integers(0, model.config.vocab_size, n_tokens)

    def once() -> float:
        start = time.perf_counter()
        h, n = inference.forward_hidden(model.config, model.params, ids)
        T.head_step(model.config, model.params, h[n - 1 : n]).block_until_ready()
        return time.perf_counter() - start

    once()  # compile
    return [once() for _ in range(repeats)]


def time_engine_prefill(model, n_tokens: int, repeats: int, chunk_tokens: int | None = None) -> list[float]:
    """Seconds per Engine.run of the recompute system over n_tokens random ids (its TTFT: first-token logits
    ready on the device)."""
    from specjax.engine import Engine, EngineConfig, Request, make_system

    rng = np.random.default_rng(0)
    ids = rng.integers(0, model.config.vocab_size, n_tokens).tolist()
    config = EngineConfig() if chunk_tokens is None else EngineConfig(prefill_chunk_tokens=chunk_tokens)
    engine = Engine(model, make_system("recompute"), None, config)
    request = Request(ids[:-1], ids[-1:])
    engine.run(request)  # compile
    return [engine.run(request).ttft_ms / 1e3 for _ in range(repeats)]


def main(argv):
    del argv
    if FLAGS.tokens < 1 or FLAGS.repeats < 1:
        raise SpecjaxError("--tokens and --repeats must be positive")
    model = load_model(FLAGS.model, dtype=FLAGS.dtype, init=FLAGS.init)
    if FLAGS.engine:
        seconds = time_engine_prefill(model, FLAGS.tokens, FLAGS.repeats, FLAGS.prefill_chunk_tokens)
    else:
        seconds = time_prefill(model, FLAGS.tokens, FLAGS.repeats)
    median = statistics.median(seconds)
    result = {
        "model": model.name, "weights": model.weights, "dtype": str(model.dtype), "device": device_name(),
        "tokens": FLAGS.tokens, "path": "engine recompute" if FLAGS.engine else "forward",
        "prefill_chunk_tokens": FLAGS.prefill_chunk_tokens if FLAGS.engine else None, "seconds": seconds, "tokens_per_s": FLAGS.tokens / median,
    }
    chunks = "" if FLAGS.prefill_chunk_tokens is None else f" (prefill_chunk_tokens={FLAGS.prefill_chunk_tokens})"
    label = " (random weights)" if model.weights == "random" else ""
    print(f"{model.name}{label} {result['dtype']} on {result['device']}, {result['path']}{chunks}: prefill {FLAGS.tokens} tokens in "
          f"{median * 1e3:.0f} ms (median of {FLAGS.repeats}) = {result['tokens_per_s']:.0f} tokens/s")
    if FLAGS.output_dir:
        out = pathlib.Path(FLAGS.output_dir)
        out.mkdir(parents=True, exist_ok=True)
        dev = result["device"].split(" ")[0].replace("/", "_")
        with open(out / f"prefill_{dev}.jsonl", "a") as f:
            f.write(json.dumps(result) + "\n")


if __name__ == "__main__":
    define_flags()
    run(main)
