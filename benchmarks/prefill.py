"""Prefill throughput with no prefix reuse: tokens/s to first-token logits, of the plain model forward or (with
--engine) of the engine's `recompute` system (Engine.run, the compute-only baseline of the eval). With
--against transformers, also of Hugging Face transformers' PyTorch model built from the same params (checked to
give the same first-token logits first), side by side.

    python benchmarks/prefill.py --model smollm2-135m --tokens 2048
    python benchmarks/prefill.py --model smollm2-135m --against transformers --tokens 256,1024,4096 --threads 2 --output_dir benchmarks/results/cpu
    python benchmarks/prefill.py --model smollm2-135m --tokens 1024 --engine
    python benchmarks/prefill.py --model opt-1.3b --init random --tokens 2048 --output_dir benchmarks/results
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import math
import multiprocessing
import os
import pathlib
import re
import shlex
import statistics
import sys

import jax
import numpy as np
from absl import flags

# benchmarks/ on sys.path: for _common, and for the spawned workers of --against, which import this script by name
sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent))

from _common import device_name, matmul_tflops, wall_seconds  # noqa: E402
from specjax import host_memory, torch_ref  # noqa: E402
from specjax.api import load_model  # noqa: E402
from specjax.cli import run  # noqa: E402
from specjax.errors import SpecjaxError  # noqa: E402
from specjax.models import inference  # noqa: E402
from specjax.models.params import param_specs  # noqa: E402
from specjax.models import transformer as T  # noqa: E402

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
    flags.DEFINE_enum("torch_device", "cpu", ["cpu", "cuda"], "With --against: where transformers runs (its float32 "
                      "logit check always runs on the CPU).")
    flags.DEFINE_float("check_tol", 1e-3, "With --against: largest max |first-token logit difference| (float32, "
                       f"{CHECK_TOKENS} tokens) accepted between the two frameworks.")
    flags.DEFINE_float("peak_tflops", None, "With --against: the device's datasheet dense TFLOP/s for the dtype; if set, "
                       "model FLOP utilisation (MFU) is reported against it.")
    flags.DEFINE_bool("engine", False, "Time the engine's recompute system (Engine.run of one request: the "
                      "tokens as prefix, no query) instead of the plain model forward.")
    flags.DEFINE_integer("prefill_chunk_tokens", None, "With --engine: EngineConfig.prefill_chunk_tokens (0: one "
                         "block); default: the engine's default.")
    flags.DEFINE_string("output_dir", None, "If set, append the results as JSON lines to OUTPUT_DIR/prefill_<device>.jsonl "
                        "(--against: prefill_vs_transformers_<device>.jsonl, and the table as .md).")


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


def time_prefill(model, n_tokens: int, repeats: int) -> list[float]:
    """Seconds per prefill of n_tokens random ids, through first-token logits ready on the device (after one
    warm-up run that compiles)."""
    ids = prompt_ids(model.config.vocab_size, n_tokens)
    forward = lambda: prefill_logits(model.config, model.params, ids).block_until_ready()  # noqa: E731
    forward()
    return [wall_seconds(forward) for _ in range(repeats)]


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
        forward_s.append(wall_seconds(forward))
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
    lengths: tuple[int, ...] = ()  # the prompt lengths to be timed (for their FLOP counts)

    def load(self):
        return load_model(self.name, dtype=self.dtype, init=self.init, seed=self.seed)


_SIDE: dict = {}  # in a worker process: its framework's prefill function, vocabulary size and ids


def prefill_flops(cfg, n_tokens: int) -> float:
    """Model FLOPs of one prefill to first-token logits: 2 per weight per token in every layer's matrices, the LM
    head for the last token only, and attention's two products over the causally visible query-key pairs."""
    matrices = sum(math.prod(spec.shape) for spec in param_specs(cfg)["layers"][0].values()
                   if len(spec.axes) > 1 and "embed" in spec.axes)  # not the (heads, head_dim) biases
    visible_pairs = n_tokens * (n_tokens + 1) / 2
    attention = 2 * 2 * cfg.num_heads * cfg.head_dim * visible_pairs
    return cfg.num_layers * (2 * n_tokens * matrices + attention) + 2 * cfg.embed_dim * cfg.vocab_size


def side_setup(side: str, spec: ModelSpec, threads: int | None, torch_device: str = "cpu") -> dict:
    """Load one framework's model in this (worker) process; its versions and its float32 first-token logits of the
    check prompt."""
    model = spec.load()
    _SIDE.update(vocab_size=model.config.vocab_size, ids={})
    if side == "specjax":
        config, params = model.config, model.params
        _SIDE["prefill"] = lambda ids: prefill_logits(config, params, ids).block_until_ready()
        on_gpu = jax.default_backend() == "gpu"
        return {"check": _check_logits(model), "model": model.name, "weights": model.weights,
                "arch": model.config.arch, "dtype": np.dtype(model.dtype).name, "jax": jax.__version__,
                "device": device_name(), "host_malloc": _host_malloc(),
                "flops": {n: prefill_flops(model.config, n) for n in spec.lengths},
                "matmul_tflops": matmul_tflops() if on_gpu else None}
    torch, transformers = torch_ref.require_torch()
    if threads:
        torch.set_num_threads(threads)
    hf_model = torch_ref.transformers_model(model.config, model.params)
    dtype = np.dtype(model.dtype).name
    del model  # its arrays may sit on the GPU transformers is about to use
    check = torch_prefill_logits(hf_model, prompt_ids(_SIDE["vocab_size"], CHECK_TOKENS)).float().numpy()
    hf_model.to(device=torch_device, dtype=getattr(torch, dtype))
    sync = torch.cuda.synchronize if torch_device == "cuda" else (lambda: None)

    def prefill(ids):
        logits = torch_prefill_logits(hf_model, ids)
        sync()
        return logits

    _SIDE["prefill"] = prefill
    device = torch.cuda.get_device_name() if torch_device == "cuda" else "cpu"
    return {"check": check, "threads": torch.get_num_threads(), "torch": torch.__version__,
            "host_malloc": _host_malloc(),
            "transformers": transformers.__version__, "attn_implementation": hf_model.config._attn_implementation,
            "torch_device": device}


def _host_malloc() -> str:
    """This process's malloc settings: specjax's "reuse" (specjax.host_memory) or the "system"'s defaults."""
    return "reuse" if host_memory.reuse_freed_blocks() else "system"


def side_seconds(n_tokens: int) -> float:
    """Seconds of one prefill of the n-token prompt in this worker (its first call per length warms up first)."""
    ids = _SIDE["ids"].get(n_tokens)
    if ids is None:
        ids = _SIDE["ids"][n_tokens] = prompt_ids(_SIDE["vocab_size"], n_tokens)
        _SIDE["prefill"](ids)
    return wall_seconds(lambda: _SIDE["prefill"](ids))


SPECJAX_GPU_MEMORY_FRACTION = 0.6  # of the GPU, for the specjax worker: bf16 + fp32 (check) params of a 7B model


def worker_environment(side: str, torch_device: str) -> dict[str, str]:
    """Environment of each framework's worker. The transformers worker's JAX only builds the weights, on the host,
    so it never takes GPU memory, and specjax's malloc settings are not imposed on it. With torch on the GPU, the
    specjax worker's JAX takes GPU memory as it needs it, up to a fraction that leaves transformers room (by
    default JAX takes 75% of the GPU at start)."""
    if side == "transformers":  # and glibc's malloc as PyTorch users have it (see specjax.host_memory)
        return {"JAX_PLATFORMS": "cpu", host_memory.ENV_VAR: "system"}
    if torch_device == "cuda":
        return {"XLA_PYTHON_CLIENT_PREALLOCATE": "false",
                "XLA_PYTHON_CLIENT_MEM_FRACTION": str(SPECJAX_GPU_MEMORY_FRACTION)}
    return {}


@contextlib.contextmanager
def _environment(variables: dict[str, str]):
    saved = {k: os.environ.get(k) for k in variables}
    os.environ.update(variables)
    try:
        yield
    finally:
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k)
            else:
                os.environ[k] = v


def compare_prefill(spec: ModelSpec, lengths: list[int], repeats: int, threads: int | None = None,
                    tol: float = 1e-3, torch_device: str = "cpu", peak_tflops: float | None = None) -> list[dict]:
    """One record per prompt length: specjax and transformers prefill seconds (same weights, same ids, same
    repeats, one warm-up each).

    Each framework runs in a process of its own (in one process, torch's presence left specjax 10-20% slower on
    2 cores), and their timed runs alternate, one at a time, so a machine whose speed drifts (a shared VM) drifts
    for both alike. Their first-token logits of a check prompt must agree in float32 first (see
    `worker_environment` for how both fit on one GPU)."""
    torch_ref.require_torch()
    spec = dataclasses.replace(spec, lengths=tuple(lengths))
    context = multiprocessing.get_context("spawn")
    pools = {}
    for side in ("specjax", "transformers"):
        with _environment(worker_environment(side, torch_device)):  # a spawned worker starts with these
            pools[side] = context.Pool(1)
    try:
        setups = {side: pool.apply_async(side_setup, (side, spec, threads, torch_device))  # both build at once
                  for side, pool in pools.items()}
        info = {side: setup.get() for side, setup in setups.items()}
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
    base = {k: ours[k] for k in ("model", "weights", "dtype", "device", "jax", "matmul_tflops")}
    base |= {"specjax_host_malloc": ours["host_malloc"], "transformers_host_malloc": theirs["host_malloc"]}
    base |= {k: theirs[k] for k in ("threads", "torch", "transformers", "attn_implementation", "torch_device")}
    base |= {"max_abs_logit_diff_fp32": diff, "repeats": repeats, "peak_tflops": peak_tflops,
             "processes": "one per framework; timed runs alternate"}
    records = []
    for n in lengths:
        mine, other = seconds["specjax"][n], seconds["transformers"][n]
        flops = ours["flops"][n]
        record = base | {
            "tokens": n, "specjax_seconds": mine, "transformers_seconds": other,
            "specjax_tokens_per_s": n / statistics.median(mine), "specjax_best_tokens_per_s": n / min(mine),
            "transformers_tokens_per_s": n / statistics.median(other), "transformers_best_tokens_per_s": n / min(other),
            "time_ratio": statistics.median(mine) / statistics.median(other), "model_tflop": flops / 1e12,
            "specjax_tflops_per_s": flops / statistics.median(mine) / 1e12,
            "transformers_tflops_per_s": flops / statistics.median(other) / 1e12,
        }
        if peak_tflops:
            record |= {"specjax_mfu": record["specjax_tflops_per_s"] / peak_tflops,
                       "transformers_mfu": record["transformers_tflops_per_s"] / peak_tflops}
        records.append(record)
    return records


def markdown_table(records: list[dict]) -> str:
    r = records[0]
    where = r["device"] if r["torch_device"] == "cpu" else f"{r['device']} (torch on {r['torch_device']})"
    threads = f", {r['threads']} torch threads" if r["torch_device"] == "cpu" else ""
    lines = [
        f"# Prefill to first-token logits: specjax vs transformers, {r['model']}", "",
        f"{r['weights']} weights, {r['dtype']}, {where}{threads}; jax {r['jax']}, "
        f"torch {r['torch']}, transformers {r['transformers']} ({r['attn_implementation']} attention). Median (best) of "
        f"{r['repeats']} after one warm-up each, each framework in a process of its own, timed runs alternating. Same weights: max |first-token logit difference| "
        f"{r['max_abs_logit_diff_fp32']:.1e} in float32. Host malloc (specjax.host_memory): specjax "
        f"{r.get('specjax_host_malloc', 'system')}, transformers {r.get('transformers_host_malloc', 'system')}.", "",
    ]
    if r.get("matmul_tflops"):
        lines += [f"Model FLOPs count every layer matrix twice per token, attention's two products over the causally "
                  f"visible pairs and the LM head once. A dense bfloat16 8192^3 matrix product measured "
                  f"{r['matmul_tflops']:.0f} TFLOP/s through JAX in the same run"
                  + (f"; MFU is against {r['peak_tflops']:g} TFLOP/s (datasheet)." if r.get("peak_tflops") else "."), ""]
    if r.get("command"):
        lines += [f"`{r['command']}`", ""]
    header = "| tokens | specjax tok/s | transformers tok/s | specjax time / transformers time |"
    rule = "|---:|---:|---:|---:|"
    flops = bool(r.get("matmul_tflops"))
    if flops:
        header += " specjax TFLOP/s | transformers TFLOP/s |" + (" specjax MFU | transformers MFU |" if r.get("peak_tflops") else "")
        rule += "---:|---:|" + ("---:|---:|" if r.get("peak_tflops") else "")
    lines += [header, rule]
    for r in records:
        line = (f"| {r['tokens']} | {r['specjax_tokens_per_s']:.0f} ({r['specjax_best_tokens_per_s']:.0f}) | "
                f"{r['transformers_tokens_per_s']:.0f} ({r['transformers_best_tokens_per_s']:.0f}) | {r['time_ratio']:.2f} |")
        if flops:
            line += f" {r['specjax_tflops_per_s']:.0f} | {r['transformers_tflops_per_s']:.0f} |"
            if r.get("peak_tflops"):
                line += f" {r['specjax_mfu']:.1%} | {r['transformers_mfu']:.1%} |"
        lines.append(line)
    return "\n".join(lines) + "\n"


def _lengths(values) -> list[int]:
    try:
        lengths = [int(v) for v in values]
    except ValueError:
        raise SpecjaxError(f"--tokens must be positive integers separated by commas, got {','.join(values)!r}") from None
    if not lengths or min(lengths) < 1:
        raise SpecjaxError("--tokens must be positive")
    return lengths


def _output(name: str, device: str | None = None) -> pathlib.Path:
    out = pathlib.Path(FLAGS.output_dir)
    out.mkdir(parents=True, exist_ok=True)
    device = device or device_name()
    return out / name.format(device="cpu" if device.startswith("cpu") else re.sub(r"\W+", "_", device).lower())


def main(argv):
    del argv
    lengths = _lengths(FLAGS.tokens)
    if FLAGS.repeats < 1:
        raise SpecjaxError("--repeats must be positive")
    if FLAGS.against:
        if FLAGS.engine:
            raise SpecjaxError("--against transformers compares the plain model forward; drop --engine")
        spec = ModelSpec(FLAGS.model, FLAGS.init, FLAGS.dtype, seed=0)
        records = compare_prefill(spec, lengths, FLAGS.repeats, FLAGS.threads, FLAGS.check_tol, FLAGS.torch_device,
                                  FLAGS.peak_tflops)
        command = shlex.join(["python", "benchmarks/prefill.py", *sys.argv[1:]])
        records = [r | {"command": command} for r in records]
        table = markdown_table(records)
        print(table, end="")
        if FLAGS.output_dir:
            device = records[0]["device"]  # the parent process never starts JAX's GPU client
            with open(_output("prefill_vs_transformers_{device}.jsonl", device), "a") as f:
                f.writelines(json.dumps(r) + "\n" for r in records)
            _output("prefill_vs_transformers_{device}.md", device).write_text(table)
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
