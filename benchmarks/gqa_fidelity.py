"""Diagnostic: how much of exact per-head H2O each identification keeps on a grouped-query model, from exact scores.

For every request of the eval's workload (the eval's default few-shot prefixes) the prefix KV comes from the model's
plain prefill; the query then runs layer by layer over the whole prefix (`specjax.engine.steps`), and each layer's
exact H2O scores of every query head (`steps.scores`, all keys) stand in for what the engine would score. On them:

- **kept**: for a selection (one shared set, or each head's own), each query head's scores summed over what it is
  given, over the same sum for its own top-k of the whole prefix (exact per-head H2O keeps 1.0), averaged over heads,
  layers and requests; with the share of layers that pass the test. Identifications:
  `spec` (SPEC's test on its probe query heads), `kv_jaccard` (spec_gqa's KV-head probes, ITF's test alone, as
  before its guard), `kv_guard` (with spec_gqa's guard at `--min_head_share`, by default the System's), and both
  with the candidate stage of `--candidates` (`*_candidates`: test and fallback over the candidates only).
- **candidate recall**: of each head's own top-k, the share of positions and of attention the candidate chunks
  hold, for the engine's rule (`kernels.quest.chunk_mass` summed over heads), the best chunks by exact scores (what
  any chunk rule can reach at the budget) and random chunks.

Chunks are `--chunk_tokens` positions from the prefix's start, as a stored segment's. Accuracy is not measured:
this says what a rule keeps of the baseline it must not lose against, before any accuracy run.

    python benchmarks/gqa_fidelity.py --task rte --limit 40 --data_dir DATA

Prints the tables and writes `--json` when given.
"""

from __future__ import annotations

import json
import math
import time

import jax.numpy as jnp
import numpy as np
from absl import app, flags

import specjax
from specjax.engine import make_system, steps
from specjax.eval import tasks as tasks_lib, workload as workload_lib
from specjax.eval.fallback_tokenizer import tokenizer_for
from specjax.engine.identify import covering, ranked_chunks
from specjax.engine.policy_steps import probe_query_heads
from specjax.eval.observe_measure import (itf_selection, keep_count, kv_itf_selection, ordered_by_prefix, prefix_kv,
                                         top_k)
from specjax.kernels import PerHeadIndices, quest
from specjax.models import transformer as T
from specjax.models.inference import bucket
from specjax.stores.summaries import summarise

flags.DEFINE_string("model", "smollm2-135m", "Model (a grouped-query one).")
flags.DEFINE_string("task", "rte", "Task.")
flags.DEFINE_string("data_dir", None, "Task data folder (docs/data.md); default $SPECJAX_DATA.")
flags.DEFINE_integer("limit", 40, "Requests (the task's first items, as the eval).")
flags.DEFINE_float("retention", 0.25, "Kept share of the prefix.")
flags.DEFINE_float("candidates", 2.0, "Candidate budget, x the kept tokens, for the *_candidates rows.")
flags.DEFINE_integer("chunk_tokens", 16, "Chunk of the candidate stage (spec_gqa's store chunk).")
flags.DEFINE_float("min_head_share", None, "The guard's threshold for the kv_guard rows (default: spec_gqa's).")
flags.DEFINE_string("json", None, "Write the results here.")
FLAGS = flags.FLAGS


def _kept(scores: np.ndarray, own: np.ndarray, sets: np.ndarray) -> float:
    """Mean over heads of what `sets` (positions [k] for every head, or [H, k] each head's) keeps of the head's own
    top-k `own` [H, k], by each head's scores [H, m]."""
    sets = np.broadcast_to(sets, own.shape)
    return float(np.mean(np.take_along_axis(scores, sets, 1).sum(1) / np.take_along_axis(scores, own, 1).sum(1)))


def measure(model, requests, progress=print) -> dict:
    cfg, params = model.config, model.params
    H, G, group, ct = cfg.num_heads, cfg.num_kv_heads, cfg.q_per_kv, FLAGS.chunk_tokens
    kv_of_head = tuple(h // group for h in range(H))
    gqa = make_system("spec_gqa")
    min_share = gqa.min_head_share if FLAGS.min_head_share is None else FLAGS.min_head_share
    spec_probes = list(probe_query_heads(cfg))
    kept: dict[str, list] = {}
    recall: dict[str, list] = {}
    started, kv, pid = time.time(), None, None
    for i, r in enumerate(requests):
        if r.prefix_id != pid:
            kv, pid = prefix_kv(model, r.prefix_ids), r.prefix_id
        m, n = kv.length, len(r.query_ids)
        k = keep_count(FLAGS.retention, m)
        need = math.ceil(FLAGS.candidates * k)
        chunk_of = np.arange(m) // ct
        sizes = np.bincount(chunk_of)
        C = len(sizes)
        ids = np.zeros(bucket(n, minimum=8), np.int32)
        ids[:n] = r.query_ids
        positions = jnp.arange(m, m + len(ids), dtype=jnp.int32)
        h = T.embed_step(cfg, params, jnp.asarray(ids), positions)
        whole = PerHeadIndices(jnp.asarray(np.broadcast_to(np.arange(kv.capacity, dtype=np.int32),
                                                           (H, kv.capacity))), m)
        rng = np.random.default_rng(i)
        for layer, lp in enumerate(params["layers"]):
            q, own_k, own_v = steps.project(cfg, lp, h, positions)
            S = np.asarray(steps.scores(q, kv.k[layer], own_k, m, n, kv_head_of_probe=kv_of_head,
                                        impl="auto"))[:, :m]
            keys = np.asarray(kv.k[layer], np.float32)[:, :m]
            summaries = np.zeros((bucket(C, minimum=4), G, 2, cfg.head_dim), np.float32)
            summaries[:C] = [summarise(keys[:, c * ct:(c + 1) * ct]) for c in range(C)]
            mass = np.asarray(quest.chunk_mass(q, jnp.asarray(summaries), n, C, kv_of_head=kv_of_head))[:, :C]
            share = S / S.sum(1, keepdims=True)
            exact = np.stack([np.bincount(chunk_of, weights=row, minlength=C) for row in share])
            rules = {"quest (the engine's)": covering(ranked_chunks(mass), sizes, need),
                     "best chunks by exact scores": covering(ranked_chunks(exact), sizes, need),
                     "random chunks": covering(rng.permutation(C), sizes, need)}
            own = top_k(S, k)
            for name, chunks in rules.items():
                inside = np.isin(chunk_of, chunks)
                recall.setdefault(name, []).append(
                    (layer, np.mean([inside[o].mean() for o in own]),
                     np.mean([share[hh, o[inside[o]]].sum() / share[hh, o].sum() for hh, o in enumerate(own)]),
                     inside.mean()))
            everything = np.arange(m)
            cand = np.flatnonzero(np.isin(chunk_of, rules["quest (the engine's)"]))
            for name, pool, guard in (("spec", everything, None), ("kv_jaccard", everything, 0.0),
                                      ("kv_guard", everything, min_share), ("kv_jaccard_candidates", cand, 0.0),
                                      ("kv_guard_candidates", cand, min_share)):
                x = S[None, :, pool]  # the engine's decision on the pool's scores (observe's, exactly)
                sets, _, fell = (itf_selection(x, k, spec_probes, gqa.alpha) if guard is None else
                                 kv_itf_selection(x, cfg, k, gqa.alpha, min_share=guard))
                kept.setdefault(name, []).append((layer, _kept(S, own, pool[sets[0]]), float(not fell[0])))
            h = steps.finish(cfg, lp, h, q, own_k, own_v, kv.k[layer], kv.v[layer], whole, n, impl="auto")
        if (i + 1) % 10 == 0:
            progress(f"{i + 1}/{len(requests)} requests, {time.time() - started:.0f} s")
    per_layer = lambda a, col: [float(a[a[:, 0] == l][:, col].mean()) for l in range(cfg.num_layers)]  # noqa: E731
    out = {"kept": {}, "candidate_recall": {}}
    for name, rows in kept.items():
        a = np.array(rows)
        out["kept"][name] = {"kept": float(a[:, 1].mean()), "pass": float(a[:, 2].mean()),
                             "kept_per_layer": per_layer(a, 1), "pass_per_layer": per_layer(a, 2)}
    for name, rows in recall.items():
        a = np.array(rows)
        out["candidate_recall"][name] = {"positions": float(a[:, 1].mean()), "attention": float(a[:, 2].mean()),
                                         "share_of_prefix": float(a[:, 3].mean()),
                                         "positions_per_layer": per_layer(a, 1)}
    return out


def report(out: dict, label: str) -> str:
    L = [label, "", "| identification | kept of exact per-head H2O | test passes | worst layers (kept) |",
         "|---|---|---|---|"]
    for name, r in out["kept"].items():
        worst = np.argsort(r["kept_per_layer"])[:4]
        L.append(f"| {name} | {r['kept']:.3f} | {r['pass']:.1%} | "
                 + ", ".join(f"{w}: {r['kept_per_layer'][w]:.2f}" for w in worst) + " |")
    L += ["", "| candidate chunks | top-k positions held | top-k attention held | share of prefix |",
          "|---|---|---|---|"]
    for name, r in out["candidate_recall"].items():
        L.append(f"| {name} | {r['positions']:.3f} | {r['attention']:.3f} | {r['share_of_prefix']:.3f} |")
    return "\n".join(L)


def main(argv):
    del argv
    model = specjax.load_model(FLAGS.model)
    if model.config.q_per_kv < 2:
        raise SystemExit(f"{FLAGS.model} has one query head per KV head; this diagnostic is for grouped-query models")
    tokenizer, _ = tokenizer_for(model)
    task = tasks_lib.load_task(FLAGS.task, FLAGS.data_dir)
    wl = workload_lib.build_workload(task, tokenizer, workload_lib.WorkloadSpec(limit=FLAGS.limit))
    requests = ordered_by_prefix(wl.requests)
    out = measure(model, requests)
    label = (f"{FLAGS.model}, {FLAGS.task}, {len(requests)} requests, retention {FLAGS.retention}, candidates "
             f"{FLAGS.candidates:g} x k in {FLAGS.chunk_tokens}-token chunks, the guard's min_head_share "
             f"{make_system('spec_gqa').min_head_share if FLAGS.min_head_share is None else FLAGS.min_head_share}")
    print(report(out, label))
    if FLAGS.json:
        with open(FLAGS.json, "w") as f:
            json.dump({"label": label, **out}, f, indent=1)


if __name__ == "__main__":
    app.run(main)
