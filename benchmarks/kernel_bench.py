"""Kernel benchmark: probe scoring and gathered attention, Pallas vs the jnp/XLA reference vs
dense `jax.nn.dot_product_attention` over the full prefix, timed side by side in one run.

    python benchmarks/kernel_bench.py                         # OPT-6.7B heads, full grid (GPU)
    python benchmarks/kernel_bench.py --quick                 # small shapes, CPU smoke run
    python benchmarks/kernel_bench.py --output_dir benchmarks/results
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import json
import math
import pathlib
import re
import statistics
import time

import jax
import jax.numpy as jnp
import numpy as np

from specjax.kernels import (
    BlockTable,
    PerHeadIndices,
    SharedIndices,
    gathered_attention,
    probe_scores,
    quant,
)
from specjax.kernels.low_bit_attention import low_bit_attention


@dataclasses.dataclass(frozen=True)
class BenchConfig:
    heads: int = 32  # OPT-6.7B: 32 heads, no grouped-query sharing, head_dim 128
    kv_heads: int = 32
    head_dim: int = 128
    probe_heads: int = 3
    prefix_tokens: tuple[int, ...] = (2048, 8192, 32768)
    query_tokens: tuple[int, ...] = (16, 128, 512)
    retention: tuple[float, ...] = (0.05, 0.25, 0.5, 1.0)
    selections: tuple[str, ...] = ("shared",)
    chunk_tokens: int = 64
    dtype: str = "bfloat16"
    bits: tuple[int, ...] = (8, 4, 2)  # low-bit prefix rows (low_bit_attention), beside the full-precision kernel
    warmup: int = 3
    reps: int = 20


QUICK = BenchConfig(heads=4, kv_heads=2, head_dim=32, probe_heads=2, prefix_tokens=(256,),
                    query_tokens=(16,), retention=(0.25, 1.0), chunk_tokens=16, dtype="float32", bits=(4,),
                    warmup=1, reps=2)


def time_ms(fn, *, warmup: int, reps: int) -> float:
    """Median wall time of fn() in ms; every call waits for the device to finish."""
    for _ in range(warmup):
        jax.block_until_ready(fn())
    samples = []
    for _ in range(reps):
        start = time.perf_counter()
        jax.block_until_ready(fn())
        samples.append((time.perf_counter() - start) * 1e3)
    return statistics.median(samples)


def make_inputs(config: BenchConfig, m: int, n_q: int, seed: int = 0):
    keys = jax.random.split(jax.random.PRNGKey(seed), 5)
    dtype = jnp.dtype(config.dtype)

    def normal(key, shape):
        return jax.random.normal(key, shape, jnp.float32).astype(dtype)

    q = normal(keys[0], (config.heads, n_q, config.head_dim))
    prefix_k, prefix_v = (normal(k, (config.kv_heads, m, config.head_dim)) for k in keys[1:3])
    own_k, own_v = (normal(k, (config.kv_heads, n_q, config.head_dim)) for k in keys[3:5])
    return q, prefix_k, prefix_v, own_k, own_v


def make_selection(kind: str, config: BenchConfig, m: int, retention: float, rng):
    keep = max(1, math.ceil(retention * m))
    if kind == "shared":
        return SharedIndices(jnp.asarray(np.sort(rng.permutation(m)[:keep]), jnp.int32))
    if kind == "per_head":
        rows = [np.sort(rng.permutation(m)[:keep]) for _ in range(config.heads)]
        return PerHeadIndices(jnp.asarray(np.stack(rows), jnp.int32))
    if kind == "block_table":
        chunks = m // config.chunk_tokens
        blocks = np.sort(rng.permutation(chunks)[:max(1, math.ceil(retention * chunks))])
        return BlockTable(jnp.asarray(blocks, jnp.int32), chunk_tokens=config.chunk_tokens)
    raise ValueError(f"unknown selection {kind!r}; pick shared, per_head or block_table.")


def dense_attention_fn(q, prefix_k, prefix_v, own_k, own_v):
    """Full-prefix baseline: every head attends to all m prefix + causal computed tokens."""
    n_q, m = q.shape[1], prefix_k.shape[1]
    layout = jax.jit(lambda x: x.transpose(1, 0, 2)[None])  # [heads, T, d] -> [1, T, heads, d]
    keys = layout(jnp.concatenate([prefix_k, own_k], axis=1))
    values = layout(jnp.concatenate([prefix_v, own_v], axis=1))
    mask = (jnp.arange(m + n_q)[None, :] <= jnp.arange(n_q)[:, None] + m)[None, None]
    attend = jax.jit(jax.nn.dot_product_attention)
    query = layout(q)
    return lambda: attend(query, keys, values, mask=mask)


def bench_shape(config: BenchConfig, m: int, n_q: int, rng) -> list[dict]:
    q, prefix_k, prefix_v, own_k, own_v = make_inputs(config, m, n_q)
    timing = dict(warmup=config.warmup, reps=config.reps)
    dense_ms = time_ms(dense_attention_fn(q, prefix_k, prefix_v, own_k, own_v), **timing)
    rows = []

    probe_q = q[:config.probe_heads]
    group = config.heads // config.kv_heads
    kv_map = tuple(h // group for h in range(config.probe_heads))
    probe = {impl: time_ms(lambda impl=impl: probe_scores(
        probe_q, prefix_k, own_k, kv_head_of_probe=kv_map, impl=impl), **timing)
        for impl in ("pallas", "reference")}
    rows.append(dict(kernel="probe_scores", selection="-", m=m, n_q=n_q, retention=1.0,
                     pallas_ms=probe["pallas"], reference_ms=probe["reference"],
                     dense_full_ms=dense_ms))

    for kind in config.selections:
        for retention in config.retention:
            selection = make_selection(kind, config, m, retention, rng)
            variants = {"pallas": dict(impl="pallas"), "reference": dict(impl="reference")}
            if group > 1 and kind != "per_head":  # the same kernel with a tile per query head, side by side
                variants["pallas_per_head_tiles"] = dict(impl="pallas", pack_heads=False)
            times = {name: time_ms(lambda args=args: gathered_attention(
                q, prefix_k, prefix_v, own_k, own_v, selection, check_indices=False, **args), **timing)
                for name, args in variants.items()}
            rows.append(dict(kernel="gathered_attention", selection=kind, m=m, n_q=n_q,
                             retention=retention, pallas_ms=times["pallas"],
                             pallas_per_head_tiles_ms=times.get("pallas_per_head_tiles"),
                             reference_ms=times["reference"], dense_full_ms=dense_ms))
            for bits in config.bits:
                rows.append(_low_bit_row(config, bits, kind, m, n_q, retention, selection, dense_ms,
                                         (q, prefix_k, prefix_v, own_k, own_v)))
    return rows


def _low_bit_row(config: BenchConfig, bits: int, kind: str, m: int, n_q: int, retention: float, selection,
                 dense_ms: float, inputs) -> dict:
    """The gathered attention over the prefix stored at `bits` as a store holds it (keys per chunk and channel, value
    rows), decoded inside the kernel."""
    q, prefix_k, prefix_v, own_k, own_v = inputs
    group = min(32, config.head_dim)
    stored = [jnp.asarray(x) for x in quant.encode_key_chunks(np.asarray(prefix_k, np.float32), bits=bits,
                                                                chunk_tokens=config.chunk_tokens)]
    stored.append(jnp.asarray(quant.encode_rows(np.asarray(prefix_v, np.float32), bits=bits, group=group)))
    times = {impl: time_ms(lambda impl=impl: low_bit_attention(
        q, *stored, own_k, own_v, selection, bits=bits, group=group, chunk_tokens=config.chunk_tokens, impl=impl),
        warmup=config.warmup, reps=config.reps) for impl in ("pallas", "reference")}
    return dict(kernel=f"low_bit_attention {bits}-bit", selection=kind, m=m, n_q=n_q, retention=retention,
                pallas_ms=times["pallas"], reference_ms=times["reference"], dense_full_ms=dense_ms)


def run(config: BenchConfig) -> list[dict]:
    rng = np.random.default_rng(0)
    rows = []
    for m in config.prefix_tokens:
        for n_q in config.query_tokens:
            rows += bench_shape(config, m, n_q, rng)
            print(f"  done m={m} n_q={n_q}", flush=True)
    for row in rows:
        row["speedup_vs_reference"] = row["reference_ms"] / row["pallas_ms"]
        row["speedup_vs_dense_full"] = row["dense_full_ms"] / row["pallas_ms"]
    return rows


def device_description() -> dict:
    device = jax.devices()[0]
    on_gpu = device.platform == "gpu"
    return {
        "device": device.device_kind,
        "platform": device.platform,
        "jax_version": jax.__version__,
        "pallas_mode": "compiled (Triton)" if on_gpu else "interpreted",
        "note": None if on_gpu else (
            "CPU smoke run: Pallas runs in interpret mode; these timings say nothing about "
            "GPU performance."),
    }


def markdown_table(rows: list[dict], device: dict, config: BenchConfig) -> str:
    lines = [f"# Kernel benchmark on {device['device']} ({device['platform']})", ""]
    if device["note"]:
        lines += [f"**{device['note']}**", ""]
    lines += [
        f"jax {device['jax_version']}, Pallas {device['pallas_mode']}; heads={config.heads}, "
        f"kv_heads={config.kv_heads}, head_dim={config.head_dim}, "
        f"probe_heads={config.probe_heads}, dtype={config.dtype}; median of {config.reps} "
        "runs. Ratios compare implementations timed side by side in this run. "
        "dense_full = jax.nn.dot_product_attention of all heads over the whole prefix. "
        "per-head tiles = the same Pallas kernel with a tile per query head instead of a group's heads packed in one "
        "(shared selections on grouped-query heads only).",
        "",
        "| kernel | selection | m | n_q | retention | pallas ms | per-head tiles ms | reference ms | "
        "dense_full ms | vs reference | vs dense_full |",
        "|---|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for r in rows:
        per_head = r.get("pallas_per_head_tiles_ms")
        lines.append(
            f"| {r['kernel']} | {r['selection']} | {r['m']} | {r['n_q']} | "
            f"{r['retention']:.0%} | {r['pallas_ms']:.3f} | {'-' if per_head is None else f'{per_head:.3f}'} | "
            f"{r['reference_ms']:.3f} | {r['dense_full_ms']:.3f} | {r['speedup_vs_reference']:.2f}x | "
            f"{r['speedup_vs_dense_full']:.2f}x |")
    return "\n".join(lines) + "\n"


def write_results(output_dir: pathlib.Path, rows, device, config) -> list[pathlib.Path]:
    output_dir.mkdir(parents=True, exist_ok=True)
    slug = re.sub(r"[^a-z0-9]+", "_", device["device"].lower()).strip("_") or "unknown"
    stem = output_dir / f"kernels_{slug}"
    payload = {"device": device, "config": dataclasses.asdict(config), "rows": rows,
               "written": datetime.datetime.now(datetime.timezone.utc).isoformat()}
    json_path, md_path = stem.with_suffix(".json"), stem.with_suffix(".md")
    json_path.write_text(json.dumps(payload, indent=2) + "\n")
    md_path.write_text(markdown_table(rows, device, config))
    return [json_path, md_path]


def parse_args(argv=None) -> tuple[BenchConfig, pathlib.Path | None]:
    parser = argparse.ArgumentParser(prog="python benchmarks/kernel_bench.py", description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true",
                        help="small shapes that run on CPU in seconds (a smoke run)")
    defaults = BenchConfig()
    for field in ("heads", "kv_heads", "head_dim", "probe_heads", "chunk_tokens", "warmup",
                  "reps"):
        parser.add_argument(f"--{field}", type=int, help=f"default {getattr(defaults, field)}")
    parser.add_argument("--dtype", choices=["bfloat16", "float32"])
    parser.add_argument("--prefix_tokens", help="comma list of m, default 2048,8192,32768")
    parser.add_argument("--query_tokens", help="comma list of n_q, default 16,128,512")
    parser.add_argument("--retention", help="comma list, default 0.05,0.25,0.5,1.0")
    parser.add_argument("--selections", help="comma list of shared,per_head,block_table")
    parser.add_argument("--bits", help="comma list of low-bit prefixes also timed (8,4,2; default all); 0: none")
    parser.add_argument("--output_dir", type=pathlib.Path,
                        help="write kernels_<device>.json and .md here")
    args = parser.parse_args(argv)
    config = QUICK if args.quick else defaults
    changes = {name: getattr(args, name) for name in (
        "heads", "kv_heads", "head_dim", "probe_heads", "chunk_tokens", "warmup", "reps",
        "dtype") if getattr(args, name) is not None}
    lists = {"prefix_tokens": int, "query_tokens": int, "retention": float, "selections": str, "bits": int}
    for name, kind in lists.items():
        if getattr(args, name):
            changes[name] = tuple(kind(item) for item in getattr(args, name).split(","))
    changes["bits"] = tuple(b for b in changes.get("bits", config.bits) if b)
    config = dataclasses.replace(config, **changes)
    if config.heads % config.kv_heads or config.probe_heads > config.heads:
        parser.error("--heads must be a multiple of --kv_heads and >= --probe_heads")
    return config, args.output_dir


def main(argv=None) -> list[dict]:
    config, output_dir = parse_args(argv)
    device = device_description()
    print(f"benchmarking on {device['device']} ({device['pallas_mode']} Pallas)", flush=True)
    rows = run(config)
    table = markdown_table(rows, device, config)
    print(table)
    if output_dir is not None:
        for path in write_results(output_dir, rows, device, config):
            print(f"wrote {path}")
    return rows


if __name__ == "__main__":
    main()
