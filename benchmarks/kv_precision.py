"""What loading a stored prefix's KV at fewer bits costs in accuracy (issue 70), before any store holds low-bit KV.

For each request of the eval's workload (its few-shot prefixes, lengthened to `--prefix_tokens`), the prefix's KV
comes from the model's own prefill. It is then quantised (`specjax.kernels.quant`: keys per channel over
`--key_group` tokens, values per token over `--value_group` channels, as KIVI groups them) and dequantised, and the
query and each choice run over it as they would over a loaded prefix; the query and choices themselves stay at the
model's precision. At `full` the prefix KV is used as computed: as_full's answers. Reported per task and pooled over
tasks: accuracy (acc, as lm-eval), the paired difference from `full` on the same requests with its stderr, the mean
|change| of the choices' log-probabilities, and the bytes a stored token would take (codes plus a bf16 scale and
zero point per group) against the model's KV dtype.

    python benchmarks/kv_precision.py --tasks piqa,rte --limit 150 --prefix_tokens 1024 --data_dir DATA --out DIR

Writes DIR/kv_precision.json and DIR/kv_precision.md. Nothing here is timed: the bytes are what the store would
read, the accuracy is what the model answers over KV of that precision.
"""

from __future__ import annotations

import json
import pathlib
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np
from absl import app, flags

import specjax
from specjax.eval import metrics, tasks as tasks_lib, workload as workload_lib
from specjax.eval.fallback_tokenizer import tokenizer_for
from specjax.eval.observe_measure import ordered_by_prefix
from specjax.kernels import quant
from specjax.models import inference
from specjax.shapes import bucket

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent))
from _common import stored_keys, write_report  # noqa: E402  (benchmarks/_common.py)

flags.DEFINE_string("model", "smollm2-135m", "Model.")
flags.DEFINE_list("tasks", ["piqa"], "Tasks (docs/data.md).")
flags.DEFINE_string("data_dir", None, "Task data folder (docs/data.md); default $SPECJAX_DATA.")
flags.DEFINE_integer("limit", 150, "Requests per task (the task's first items, as the eval).")
flags.DEFINE_integer("prefix_tokens", 1024, "Lengthen every few-shot prefix to at least this many tokens.")
flags.DEFINE_list("bits", ["8", "4", "2"], "Precisions to load the prefix KV at, besides full.")
flags.DEFINE_enum("grouping", "kivi", ["kivi", "rows", "store"], "kivi: keys per channel over --key_group tokens, "
                  "values per token (KIVI's); rows: keys and values per token over --value_group channels with "
                  "float16 scales (`kernels.quant.encode_rows`), as a store held them before its format 3; store: as "
                  "a store holds them, keys per channel over each --key_group-token chunk against its float16 range "
                  "(`encode_key_chunks`), values as rows.")
flags.DEFINE_bool("rotate", False, "With --grouping rows: rotate each row by the head dim's Hadamard matrix "
                  "before encoding it (and back after decoding).")
flags.DEFINE_bool("sort_keys", False, "With --grouping rows: order each layer's key channels, per head, by their RMS "
                  "over the run's first prefix (kept for every later request) before grouping them, so that a "
                  "group's channels are alike in size.")
flags.DEFINE_enum("center_keys", "none", ["none", "model", "chunk"], "With --grouping rows: subtract a float16 "
                  "mean from each key channel before encoding the rows (and add it back after decoding): model, "
                  "per layer and head over the run's first prefix (kept for every later request, as a store could "
                  "keep one per model); chunk, per --key_group tokens (data a store would keep per chunk).")
flags.DEFINE_integer("key_group", 64, "Tokens a key scale covers (per channel); the store's chunk is 64.")
flags.DEFINE_integer("value_group", 64, "Channels a value scale covers (per token); a multiple of the head dim's "
                     "divisors.")
flags.DEFINE_string("out", None, "Folder for kv_precision.json and kv_precision.md (printed either way).")
flags.DEFINE_list("pool", None, "Instead of measuring: the folders of earlier runs (same model, groups and bits, other "
                  "tasks), their tasks pooled into --out.")
FLAGS = flags.FLAGS


def hadamard(d: int) -> np.ndarray:
    """The orthonormal Walsh-Hadamard matrix (float32 [d, d], symmetric: its own inverse) of the largest power of
    two dividing `d`, repeated down the diagonal where `d` is not one."""
    block = d & -d
    h = np.ones((1, 1))
    while h.shape[0] < block:
        h = np.block([[h, h], [h, -h]])
    return np.kron(np.eye(d // block), h / np.sqrt(block)).astype(np.float32)


_ORDER = {}


def key_order(layer: int, x):
    """Layer `layer`'s key channel order, per head (int [H, d]): by RMS over the first prefix it is asked for."""
    if layer not in _ORDER:
        rms = np.sqrt(np.mean(np.square(np.asarray(x, np.float32)), axis=1))
        _ORDER[layer] = np.argsort(-rms, axis=-1, kind="stable")
    return _ORDER[layer]


_CENTER = {}


def key_center(layer: int, x, group: int):
    """float32 [H, m, d]: each key channel's float16 mean, over the run's first prefix (--center_keys model) or over
    each run of `group` tokens (chunk)."""
    x = np.asarray(x, np.float32)
    if FLAGS.center_keys == "model":
        if layer not in _CENTER:
            _CENTER[layer] = x.mean(axis=1, keepdims=True).astype(np.float16).astype(np.float32)
        return np.broadcast_to(_CENTER[layer], x.shape)
    starts = np.arange(0, x.shape[1], group)
    means = np.stack([x[:, lo:lo + group].mean(axis=1) for lo in starts], axis=1).astype(np.float16)
    return np.repeat(means.astype(np.float32), group, axis=1)[:, :x.shape[1]]


def round_trip(x, bits: int, per_channel: bool, group: int, order=None, center=None):
    """x [H, m, d] through `bits`-bit codes and back, in x's dtype, and the bytes those codes and their bf16 scales
    take. Keys' token groups run from the prefix's start (a stored chunk's); a last partial group is its own group.
    With --grouping rows, every row on its own (`per_channel` and `group` unused); with --grouping store, keys as a
    store encodes them (the prefix in chunks of `group` tokens from its start, the last one's padding left out of its
    range) and values as rows."""
    if FLAGS.grouping == "store" and per_channel:
        back, _, nbytes = stored_keys(x, bits, group)
        return jnp.asarray(back, x.dtype), nbytes
    if FLAGS.grouping in ("rows", "store"):
        h = hadamard(x.shape[-1]) if FLAGS.rotate else np.eye(x.shape[-1], dtype=np.float32)
        y = np.asarray(x, np.float32) @ h
        if center is not None:
            y = y - center
        if order is not None:
            y = np.take_along_axis(y, order[:, None, :], axis=-1)
        rows = quant.encode_rows(y, bits=bits, group=FLAGS.value_group)
        back = quant.decode_rows(jnp.asarray(rows), bits=bits, group=FLAGS.value_group, head_dim=x.shape[-1])
        if order is not None:
            back = jnp.take_along_axis(back, jnp.asarray(np.argsort(order, axis=-1))[:, None, :], axis=-1)
        if center is not None:
            back = back + center
        return (back @ h.T).astype(x.dtype), rows.size
    whole = x.shape[1] - x.shape[1] % group if per_channel else x.shape[1]
    parts, nbytes = [], 0
    for lo, hi in ((0, whole), (whole, x.shape[1])):
        if hi > lo:
            part = x[:, lo:hi]
            q = (quant.quantize_keys(part, bits=bits, group_tokens=min(group, hi - lo)) if per_channel else
                 quant.quantize_values(part, bits=bits, group_channels=group))
            parts.append(quant.dequantize(q).astype(x.dtype))
            nbytes += q.nbytes()
    return jnp.concatenate(parts, axis=1), nbytes


def choice_logprobs(cfg, params, cache, query, choices) -> list[float]:
    """Sum of log p(choice | prefix in `cache`, query) for each choice; `cache` itself is left as it is."""
    out = []
    for choice in choices:
        ids = list(query) + list(choice)[:-1]
        # the cached layers take their buffers over (donated): each choice extends copies
        mine = inference.KVCache([jnp.copy(x) for x in cache.k], [jnp.copy(x) for x in cache.v], cache.length)
        logits = inference.extend(cfg, params, mine, ids)
        rows = np.arange(len(query) - 1, len(ids))
        logp = np.asarray(inference.log_softmax(logits[rows]))
        out.append(float(logp[np.arange(len(choice)), np.asarray(choice)].sum()))
    return out


def run_task(model, name: str, precisions: list) -> dict:
    cfg, params = model.config, model.params
    tokenizer, _ = tokenizer_for(model)
    task = tasks_lib.load_task(name, FLAGS.data_dir)
    spec = workload_lib.WorkloadSpec(limit=FLAGS.limit, prefix_tokens=FLAGS.prefix_tokens)
    requests = ordered_by_prefix(workload_lib.build_workload(task, tokenizer, spec).requests)
    outcomes = {p: [] for p in precisions}
    logprobs = {p: [] for p in precisions}
    bytes_per_token = {}
    itemsize = np.dtype(model.dtype).itemsize
    started, prefix_id, caches = time.monotonic(), None, None
    for i, r in enumerate(requests):
        if r.prefix_id != prefix_id:  # the prefix's KV, then its round trips at each precision
            prefix_id, m = r.prefix_id, len(r.prefix_ids)
            jax.clear_caches()  # every prefix length compiles its own round trip: let the last one's go
            longest = max(len(q.query_ids) + max(len(c) for c in q.choice_ids) for q in requests
                          if q.prefix_id == prefix_id)
            full = inference.empty_cache(cfg, bucket(m + longest), model.dtype)
            inference.extend(cfg, params, full, list(r.prefix_ids))
            caches, layer_bytes = {"full": full}, {"full": 2 * cfg.num_kv_heads * m * cfg.head_dim * itemsize}
            for p in precisions[1:]:
                k = [round_trip(layer[:, :m], p, True, FLAGS.key_group,
                                key_order(i, layer[:, :m]) if FLAGS.sort_keys else None,
                                key_center(i, layer[:, :m], FLAGS.key_group) if FLAGS.center_keys != "none" else None)
                     for i, layer in enumerate(full.k)]
                v = [round_trip(layer[:, :m], p, False, FLAGS.value_group) for layer in full.v]
                caches[p] = inference.KVCache([layer.at[:, :m].set(x) for layer, (x, _) in zip(full.k, k)],
                                              [layer.at[:, :m].set(x) for layer, (x, _) in zip(full.v, v)], m)
                layer_bytes[p] = k[0][1] + v[0][1]  # every layer's are the same
        for p in precisions:
            lls = choice_logprobs(cfg, params, caches[p], r.query_ids, r.choice_ids)
            outcomes[p].append((lls, r.choices, r.gold))
            logprobs[p].append(lls)
            bytes_per_token.setdefault(p, []).append(layer_bytes[p] / m)
        if (i + 1) % 25 == 0 or i + 1 == len(requests):
            print(f"  {name}: {i + 1}/{len(requests)} requests, {time.monotonic() - started:.0f} s", flush=True)
    full_correct = metrics.per_request_correct(outcomes["full"])
    result = {"requests": len(requests), "precisions": {}}
    for p in precisions:
        correct = metrics.per_request_correct(outcomes[p])
        change = [abs(a - b) for x, y in zip(logprobs[p], logprobs["full"]) for a, b in zip(x, y)]
        result["precisions"][str(p)] = {
            **metrics.accuracy(outcomes[p]),
            "paired_vs_full": metrics.paired_difference(correct, full_correct),
            "mean_abs_logprob_change": float(np.mean(change)),
            "bytes_per_token_per_layer": float(np.mean(bytes_per_token[p])),
            "correct": correct.tolist(),
            "logprobs": logprobs[p],  # per request, per choice
        }
    return result


def pooled(results: dict, precisions: list) -> dict:
    out = {}
    full = np.concatenate([results[t]["precisions"]["full"]["correct"] for t in results])
    for p in precisions:
        correct = np.concatenate([results[t]["precisions"][str(p)]["correct"] for t in results])
        out[str(p)] = {"acc": float(correct.mean()), "paired_vs_full": metrics.paired_difference(correct, full),
                       "bytes_vs_full": float(np.mean([results[t]["precisions"][str(p)]["bytes_per_token_per_layer"] /
                                                        results[t]["precisions"]["full"]["bytes_per_token_per_layer"]
                                                        for t in results]))}
    return out


def markdown(out: dict) -> str:
    kind = out.get("grouping", "kivi")
    rotated = (", each row rotated by the head dim's Hadamard matrix first" if "+hadamard" in kind else "") + \
        (", key channels ordered by their RMS over the first prefix" if "+sorted" in kind else "") + \
        (f", each key channel's float16 mean ({kind.split('+centered-')[1]}) taken off first" if "+centered-" in kind
         else "")
    grouping = (f"Keys and values per token over {out['value_group']} channels, float16 scales and zero points "
                f"(rows{rotated})" if kind.startswith("rows") else
                f"Keys per channel over each {out['key_group']}-token chunk against its float16 range, values per "
                f"token over {out['value_group']} channels with float16 scales and zero points (a store's format 3)"
                if kind == "store" else
                f"Keys per channel over {out['key_group']} tokens, values per token over {out['value_group']} "
                "channels, bf16 scales and zero points")
    lines = [f"# {out['model']}: the prefix's KV loaded at fewer bits", "",
             f"{grouping}; {out['prefix_tokens']}-token prefixes; acc as lm-eval; the paired "
             "difference from full precision on the same requests (pp, +- stderr).", "",
             f"| task | precision | acc % | vs full (pp) | only this right / only full right | mean abs log-prob change "
             f"| bytes / {out['kv_dtype']}'s |", "|---|---|---|---|---|---|---|"]
    for task, r in out["tasks"].items():
        full_bytes = r["precisions"]["full"]["bytes_per_token_per_layer"]
        for p, s in r["precisions"].items():
            d = s["paired_vs_full"]
            lines.append(f"| {task} ({r['requests']}) | {p} | {s['acc'] * 100:.1f} | {d['acc_diff'] * 100:+.1f} +- "
                         f"{d['stderr'] * 100:.1f} | {d['only_system']} / {d['only_reference']} | "
                         f"{s['mean_abs_logprob_change']:.3f} | {s['bytes_per_token_per_layer'] / full_bytes:.3f} |")
    lines += ["", f"| pooled | acc % | vs full (pp) | bytes / {out['kv_dtype']}'s | bytes / bf16's |",
              "|---|---|---|---|---|"]
    for p, s in out["pooled"].items():
        d = s["paired_vs_full"]
        lines.append(f"| {p} | {s['acc'] * 100:.1f} | {d['acc_diff'] * 100:+.2f} +- {d['stderr'] * 100:.2f} (n "
                     f"{d['n']}) | {s['bytes_vs_full']:.3f} | {s['bytes_vs_full'] * out['kv_itemsize'] / 2:.3f} |")
    return "\n".join(lines) + "\n"


def pooled_runs(folders: list[str]) -> dict:
    """The runs in `folders` as one: their tasks side by side, pooled anew. Runs of another model, grouping or set of
    precisions are refused."""
    runs = [json.loads((pathlib.Path(f) / "kv_precision.json").read_text()) for f in folders]
    same = ("model", "prefix_tokens", "grouping", "key_group", "value_group", "kv_dtype")
    for run, folder in zip(runs[1:], folders[1:]):
        differs = [k for k in same if run.get(k, "kivi") != runs[0].get(k, "kivi")]  # before rows: kivi
        if differs or run["pooled"].keys() != runs[0]["pooled"].keys():
            raise SystemExit(f"{folder} was measured with other settings ({', '.join(differs) or 'precisions'}) than "
                             f"{folders[0]}")
    out = {k: v for k, v in runs[0].items() if k not in ("tasks", "pooled")}
    out["tasks"] = {task: r for run in runs for task, r in run["tasks"].items()}
    out["pooled"] = pooled(out["tasks"], list(runs[0]["pooled"]))
    return out


def write(out: dict) -> None:
    write_report(FLAGS.out, "kv_precision", out, markdown(out))


def main(argv):
    del argv
    if FLAGS.pool:
        return write(pooled_runs(FLAGS.pool))
    precisions = ["full"] + [int(b) for b in FLAGS.bits]
    model = specjax.load_model(FLAGS.model)
    if FLAGS.rotate and FLAGS.grouping != "rows":
        raise SystemExit("--rotate applies to --grouping rows")
    if FLAGS.center_keys != "none" and (FLAGS.grouping != "rows" or FLAGS.rotate or FLAGS.sort_keys):
        raise SystemExit("--center_keys applies to --grouping rows, unrotated and unsorted")
    if FLAGS.sort_keys and FLAGS.grouping != "rows":
        raise SystemExit("--sort_keys applies to --grouping rows")
    if model.config.head_dim % FLAGS.value_group:
        raise SystemExit(f"--value_group {FLAGS.value_group} does not divide the head dim {model.config.head_dim}")
    results = {}
    for name in FLAGS.tasks:
        print(f"{name}: precisions {precisions}", flush=True)
        results[name] = run_task(model, name, precisions)
    out = {"model": FLAGS.model, "prefix_tokens": FLAGS.prefix_tokens, "limit": FLAGS.limit,
           "grouping": FLAGS.grouping + ("+hadamard" if FLAGS.rotate else "") + ("+sorted" if FLAGS.sort_keys else "")
           + ("" if FLAGS.center_keys == "none" else f"+centered-{FLAGS.center_keys}"),
           "key_group": FLAGS.key_group,
           "value_group": FLAGS.value_group,
           "kv_dtype": str(np.dtype(model.dtype)),
           "kv_itemsize": np.dtype(model.dtype).itemsize,
           "tasks": results, "pooled": pooled(results, precisions)}
    write(out)


if __name__ == "__main__":
    app.run(main)
