"""Diagnostic: is CacheBlend's token *selection* what limits its accuracy, or the number of tokens recomputed?

Runs `cacheblend` on the `rag` workload twice per ratio, once as built and once with an oracle selection: every
layer ranks its candidate tokens by their true KV deviation, the squared distance between the reused (re-rotated)
keys and values and the keys and values a full prefill of the whole request computes on that layer. The oracle
keeps CacheBlend's structure (full check layers, gradual filtering or a fixed set, the same counts) and changes
only the ranking, so if it does not beat the built selection, a better deviation estimate cannot close the gap.

    python benchmarks/cacheblend_oracle.py --ratios 0.15,0.3 --limit 80

The oracle answers the engine's `blend_layer` event (`specjax.engine.events`) with the deviation to rank by; it is
a measurement aid, not a system. It needs the model's full-prefill KV per request (one extra forward pass each,
untimed). Prints one JSON line per (ratio, selection) with accuracy and the requests answered wrongly.
"""

from __future__ import annotations

import json
import tempfile

import jax.numpy as jnp
import numpy as np
from absl import app, flags

import specjax
from specjax.engine import events
from specjax.engine.systems import BLEND_FILTERS, SystemOptions
from specjax.engine.types import EngineConfig
from specjax.eval import registry, runner, systems as systems_lib, tasks as tasks_lib, workload as workload_lib
from specjax.eval.fallback_tokenizer import tokenizer_for
from specjax.models import transformer as T
from specjax.models.inference import bucket

flags.DEFINE_string("model", "smollm2-135m", "A RoPE model name or directory.")
flags.DEFINE_string("ratios", "0.15,0.3", "Comma-separated cacheblend recompute ratios.")
flags.DEFINE_integer("limit", 80, "rag requests (seed 0, as `python -m specjax.eval --task rag`).")
flags.DEFINE_enum("blend_filter", "gradual", BLEND_FILTERS, "cacheblend's filtering, as in specjax.eval.")
FLAGS = flags.FLAGS


class _Oracle:
    """Holds the current request's full-prefill KV per layer and ranks rows by their true deviation."""

    def __init__(self):
        self.kv, self.m = None, 0

    def prepare(self, model, request) -> None:
        cfg, params = model.config, model.params
        tokens = list(request.prefix_ids) + list(request.query_ids)
        ids = np.zeros(bucket(len(tokens)), np.int32)
        ids[: len(tokens)] = tokens
        positions = jnp.arange(len(ids), dtype=jnp.int32)
        h = T.embed_step(cfg, params, jnp.asarray(ids), positions)
        rotary = T.rotary_step(cfg, positions)
        self.kv = []
        for lp in params["layers"]:
            h, k, v = T.self_attention_layer(cfg, lp, h, positions, positions < len(tokens), rotary)
            self.kv.append((k, v))
        self.m = len(request.prefix_ids)

    def deviation(self, layer, reused_k, reused_v, rotation, rows, deviation):
        """The `blend_layer` event: each recomputed row's true deviation instead of the built estimate."""
        del deviation
        full_k, full_v = self.kv[layer]
        keys = T.rotate(reused_k, *rotation)
        size = keys.shape[1]
        true = (jnp.square(full_k[:, :size].astype(jnp.float32) - keys.astype(jnp.float32)).sum((0, 2))
                + jnp.square(full_v[:, :size].astype(jnp.float32) - reused_v.astype(jnp.float32)).sum((0, 2)))
        true = jnp.where(jnp.arange(size) < self.m, true, 0.0)
        return jnp.take(true, rows, mode="fill", fill_value=0.0)


def _accuracy(model, workload, ratio, oracle: _Oracle | None) -> dict:
    settings = systems_lib.SystemSettings(
        EngineConfig(retention=1.0), disk_bandwidth=None, direct_io=False, seed=0,
        options=SystemOptions(blend_ratio=ratio, blend_filter=FLAGS.blend_filter))
    system = registry.make_system("cacheblend", model, settings)
    wrong = []
    with tempfile.TemporaryDirectory(prefix="specjax-oracle-") as tmp:
        system.populate(tmp, runner.stored_sequences(system, runner.warmup_requests(workload)))
        system.open(tmp)
        try:
            for i, request in enumerate(workload.requests):
                if oracle is not None:
                    oracle.prepare(model, request)
                outcome = system.run(request)
                if int(np.argmax(outcome.choice_logprobs)) != request.gold:
                    wrong.append(i)
        finally:
            system.close()
    n = len(workload.requests)
    return {"ratio": ratio, "selection": "oracle" if oracle else "built", "filter": FLAGS.blend_filter,
            "acc": 100.0 * (n - len(wrong)) / n, "n": n, "wrong": wrong}


def main(argv):
    del argv
    model = specjax.load_model(FLAGS.model)
    tokenizer, _ = tokenizer_for(model)
    workload = workload_lib.build_workload(tasks_lib.load_task("rag", None, None), tokenizer,
                                           workload_lib.WorkloadSpec(limit=FLAGS.limit, seed=0))
    for ratio in (float(r) for r in FLAGS.ratios.split(",")):
        print(json.dumps(_accuracy(model, workload, ratio, None)), flush=True)
        oracle = _Oracle()
        with events.subscribed("blend_layer", oracle.deviation):
            print(json.dumps(_accuracy(model, workload, ratio, oracle)), flush=True)


if __name__ == "__main__":
    app.run(main)
