"""What `python -m specjax.eval.observe` measures on the model, with the engine's own pieces.

- Probe heads: the engine's (`specjax.engine.policy_steps.probe_query_heads`, the first 3 query heads; looked up there
  on every call, so observe follows the engine's choice) and, for comparison, spread probes (one query head per
  KV group).
- Selections: H2O's per-head top-k and ITF's decision, both from `specjax.kernels.itf` (the engine's ITF).
- Model passes: the prefix KV from the model's plain prefill (`specjax.models.inference.extend`); the query (and
  continuation) tokens over it with the engine's layer steps (`specjax.engine.steps`: projection, H2O scores from
  `specjax.kernels.probe_scores`, gathered attention over the selected prefix tokens).
- Collection: every request's importance scores and its choices' log-likelihoods under each selection.
- The engine itself on the workload (items 5b-6): its counters for the alpha sweep, reordering and cache policy.

What these read of the command's settings is one `MeasureSettings`, which `specjax.eval.observe` builds.
"""

from __future__ import annotations

import dataclasses
import functools
import math
import time

import jax
import jax.numpy as jnp
import numpy as np
import tensorstore as ts

from specjax import sharding
from specjax.engine import EngineConfig, fingerprint, make_engine, make_system, steps
from specjax.engine import policy_steps
from specjax.engine import state as st
from specjax.eval.engine_systems import warm_up
from specjax.kernels import PerHeadIndices, itf
from specjax.models import inference
from specjax.models import transformer as T
from specjax.models.inference import bucket
from specjax.stores import KVStore

KERNEL_IMPL = "auto"  # as EngineConfig.kernel_impl: Pallas on GPU, reference elsewhere


@dataclasses.dataclass(frozen=True)
class MeasureSettings:
    """What the measurements read (`collect`, `engine_measurements`, `observe_analysis.analyse`), one field per
    quantity, values already parsed; `specjax.eval.observe` builds it once from its settings."""

    retentions: tuple[float, ...]  # retentions of the similarity measurements, `main_retention` among them
    main_retention: float  # single-retention measurements (layers, ITF) and the engine runs' EngineConfig.retention
    alphas: tuple[float, ...]  # ITF threshold exponents to sweep
    density_retention: float  # chunk density's extra retention
    chunk_tokens: int  # the store's chunk size: chunk density and the engine runs' store
    period_chunk_tokens: int  # ContiguousChunk size for period coverage
    period_layers: int  # layers per period
    accuracy: bool  # whether `collect` also scores the choices under every selection
    reorder_every: int  # the engine runs' EngineConfig.reorder_every (the runs that reorder)
    gpu_cache_bytes: int  # the engine runs' cache budgets in bytes (EngineConfig's), parsed against the stored KV
    cpu_cache_bytes: int


def stored_kv_bytes(model, requests) -> int:
    """Bytes of prefix KV the workload stores (every distinct prefix once, all layers, K and V): what percentage
    cache budgets are shares of."""
    unique = {r.prefix_id: len(r.prefix_ids) for r in requests}
    return sum(unique.values()) * model.config.kv_bytes_per_token(jnp.dtype(model.dtype).itemsize)


# ---------------------------------------------------------------- probe heads


def spread_probe_heads(cfg, count: int = 3) -> tuple[int, ...]:
    """Spread probes, for comparison with the engine's: one query head per KV group first, so they span as many
    KV heads as possible."""
    group = cfg.q_per_kv
    order = [kv * group + j for j in range(group) for kv in range(cfg.num_kv_heads)]
    return tuple(order[: min(count, cfg.num_heads)])


PROBE_LABELS = {"engine": "engine's probes (first 3 query heads)",
                "spread": "spread probes (one query head per KV group)", "all": "all heads"}


def probe_choices(cfg) -> dict[str, tuple[int, ...]]:
    """The probe sets the observations compare, by key: the engine's (its ITF's probe heads), spread ones and
    all heads."""
    return {"engine": policy_steps.probe_query_heads(cfg), "spread": spread_probe_heads(cfg),
            "all": tuple(range(cfg.num_heads))}


def kv_heads_of(cfg, heads) -> tuple[int, ...]:
    """The KV heads that query heads `heads` read."""
    return tuple(sorted({h // cfg.q_per_kv for h in heads}))


# ---------------------------------------------------------------- selections (specjax.kernels.itf)


def keep_count(retention: float, m: int) -> int:
    """Tokens kept of an m-token prefix at `retention` (as the engine: ceil(r * m), at least 1)."""
    return max(1, min(m, math.ceil(retention * m)))


def top_k(scores: np.ndarray, k: int) -> np.ndarray:
    """H2O's set: each row's k highest-scoring columns, best first (`kernels.itf.top_k`; ties: lower index)."""
    return np.asarray(itf.top_k(jnp.asarray(scores), k))


@functools.partial(jax.jit, static_argnames="k_cap")
def _identify_layers(scores, k, prefix_len, alpha, *, k_cap: int) -> itf.Identification:
    """`itf.identify` over the leading (layer) axis of scores [L, P, m_pad], in one dispatch."""
    return jax.vmap(lambda s: itf.identify(s, k, prefix_len, alpha, k_cap=k_cap))(scores)


def identify_layers(scores: np.ndarray, k: int, alpha: float) -> itf.Identification:
    """`kernels.itf.identify` (ITF's decision, as the engine makes it) for every layer of probe scores f32 [L, P, m]:
    numpy fields with a leading layer axis, the shared sets cut to their k valid entries (best first), each probe's
    set a mask over the m positions.

    Scores are padded to the engine's bucket of the prefix and k to its bucket, so requests share compilations.
    """
    m = scores.shape[-1]
    padded = np.zeros(scores.shape[:-1] + (bucket(m),), np.float32)
    padded[..., :m] = scores
    found = _identify_layers(jnp.asarray(padded), k, m, alpha, k_cap=bucket(k))
    found = jax.tree.map(np.asarray, found)
    return found._replace(shared=found.shared[..., :k], probe_sets=found.probe_sets[..., :m])


def shared_sets(scores: np.ndarray, k: int) -> np.ndarray:
    """Per layer, the set ITF shares among heads when scores [L, P, m] are its probes' ([L, k], best first),
    whether or not it would share it (the decision, hence alpha, does not matter here)."""
    return identify_layers(scores, k, alpha=0.0).shared


def itf_selection(scores: np.ndarray, k: int, probes, alpha: float) -> tuple[list, np.ndarray, np.ndarray]:
    """The engine's ITF on every layer of scores [L, H, m] with probe heads `probes`: the selection (the shared
    set [k] when the probes agree, else every head's own top-k [H, k], the engine's fallback), the probes' mean
    Jaccard and whether the layer fell back."""
    return _decided(identify_layers(scores[:, list(probes)], k, alpha), scores, k)


def _decided(decision: itf.Identification, scores: np.ndarray, k: int) -> tuple[list, np.ndarray, np.ndarray]:
    """Per layer the shared set where the decision shares, else every head's own top-k of scores [L, H, m]."""
    own = top_k(scores, k)
    sets = [shared if use else heads for shared, use, heads in zip(decision.shared, decision.use_shared, own)]
    return sets, decision.jaccard, ~decision.use_shared


def kv_probe_heads(cfg) -> tuple[int, ...]:
    """spec_gqa's probes (`specjax.engine.identify.GroupedITF`): the first `num_probe_heads` KV heads."""
    return tuple(range(min(make_system("spec_gqa").num_probe_heads, cfg.num_kv_heads)))


def kv_itf_selection(scores: np.ndarray, cfg, k: int, alpha: float,
                     min_share: float | None = None) -> tuple[list, np.ndarray, np.ndarray]:
    """spec_gqa's test on every layer of scores [L, H, m], every position a candidate (spec_gqa's default; observe
    has the whole prefix's scores): each probe KV head's query heads' scores normalised and summed
    (`specjax.engine.state.kv_head_scores`), ITF's decision over those probes and, with several query heads per KV
    head, its guard (the shared set keeps `min_share`, by default spec_gqa's `min_head_share`, of every head's own
    top-k attention, `kernels.itf.head_share`; 0 turns it off); both holding, the top-k of their summed scores for
    every head, else every head's own top-k. Returns (sets, probes' Jaccard, fell back)."""
    group, probes = cfg.q_per_kv, kv_probe_heads(cfg)
    rows = [h for g in probes for h in range(g * group, (g + 1) * group)]
    m = scores.shape[-1]
    per_kv = np.stack([np.asarray(st.kv_head_scores(jnp.asarray(layer[rows]), m, groups=len(probes)))
                       for layer in scores])
    decision = identify_layers(per_kv, k, alpha)
    min_share = make_system("spec_gqa").min_head_share if min_share is None else min_share
    if group > 1 and min_share:
        padded = np.zeros(scores.shape[:-1] + (bucket(m),), np.float32)  # as identify_layers: shared compilations
        padded[..., :m] = scores
        shared = np.zeros((len(scores), bucket(k)), np.int32)
        shared[:, :k] = decision.shared
        shares = np.asarray(jax.vmap(lambda layer, sh: itf.head_share(layer, sh, k, m, k_cap=bucket(k)))(
            jnp.asarray(padded), jnp.asarray(shared)))
        decision = decision._replace(use_shared=decision.use_shared & (shares >= min_share))
    return _decided(decision, scores, k)


# ---------------------------------------------------------------- model passes (the engine's steps)


def prefix_kv(model, prefix_ids) -> inference.KVCache:
    """The KV every query of this prefix reuses, from the model's plain prefill."""
    cfg, params = model.config, model.params
    cache = inference.empty_cache(cfg, bucket(len(prefix_ids)), params["embed"].dtype)
    inference.extend(cfg, params, cache, prefix_ids)
    return cache


def _gathered(selections, num_layers: int, num_heads: int, kv: inference.KVCache) -> list[PerHeadIndices]:
    """Per layer, the prefix tokens each query head attends to, as gathered attention's selection:
    selections[layer] is [k] (every head) or [H, k] (per head); None: the whole prefix. A shared set becomes the
    same row for every head, and every row is padded to the prefix's capacity, so all selections on a prefix
    share one compilation."""
    if selections is None:
        rows = np.broadcast_to(np.arange(kv.capacity, dtype=np.int32), (num_heads, kv.capacity))
        return [PerHeadIndices(jnp.asarray(rows), kv.length)] * num_layers
    out = []
    for idx in selections:
        count = np.shape(idx)[-1]
        rows = np.zeros((num_heads, kv.capacity), np.int32)
        rows[:, :count] = idx
        out.append(PerHeadIndices(jnp.asarray(rows), count))
    return out


def _layers(model, kv: inference.KVCache, ids, selections, *, with_scores: bool = False):
    """Run `ids` after the prefix, layer by layer with the engine's steps over a reused prefix: project; with
    `with_scores`, every query head's H2O importance of every prefix token (all of them, as the engine's H2O
    scores); then gathered attention over the layer's selection (`_gathered`) and the causal computed tokens.
    Returns (hidden [n_pad, D], scores f32 [L, H, m] or None)."""
    cfg, params = model.config, model.params
    m, n = kv.length, len(ids)
    kv_of_head = tuple(h // cfg.q_per_kv for h in range(cfg.num_heads))
    h, positions, rotary = T.tokens_at(cfg, params, ids, m, bucket(n, minimum=8))  # as the engine's continuations
    scores = []
    pace = sharding.Pace(h)  # on a CPU mesh, at most a layer ahead of the devices (sharding.Pace)
    for layer, lp in enumerate(params["layers"]):
        q, own_k, own_v = steps.project(cfg, lp, h, positions, rotary)
        if with_scores:
            s = steps.scores(q, kv.k[layer], own_k, m, n, kv_head_of_probe=kv_of_head, impl=KERNEL_IMPL)
            scores.append(np.asarray(s)[:, :m])
        h = steps.finish(cfg, lp, h, q, own_k, own_v, kv.k[layer], kv.v[layer], selections[layer], n,
                         impl=KERNEL_IMPL)
        pace.step(h)
    return h, (np.stack(scores) if with_scores else None)


def query_importance(model, kv: inference.KVCache, query_ids) -> np.ndarray:
    """H2O importance f32 [L, H, m] of each prefix token for every query head and layer."""
    cfg = model.config
    everything = _gathered(None, cfg.num_layers, cfg.num_heads, kv)
    return _layers(model, kv, query_ids, everything, with_scores=True)[1]


def choice_logprobs(model, kv: inference.KVCache, query_ids, choice_ids, selections=None) -> list[float]:
    """Sum log p(choice | prefix + query) per choice when query and choice attend, in every layer, only to the
    selected prefix tokens: selections[layer] is [k] (every head) or [H, k] (per head); None: all of them."""
    cfg, params = model.config, model.params
    gathered = _gathered(selections, cfg.num_layers, cfg.num_heads, kv)
    out = []
    for cont in choice_ids:
        ids = list(query_ids) + list(cont)
        h, _ = _layers(model, kv, ids, gathered)
        rows = np.zeros(bucket(len(cont), minimum=4), np.int32)
        rows[: len(cont)] = np.arange(len(query_ids) - 1, len(ids) - 1)
        logits = np.asarray(T.head_rows(cfg, params, h, jnp.asarray(rows)))[: len(cont)]
        out.append(float(inference.log_softmax(logits)[np.arange(len(cont)), list(cont)].sum()))
    return out


# ---------------------------------------------------------------- collection


@dataclasses.dataclass
class Record:
    """What one request contributes: its prefix group, importance and (optionally) choice scores."""

    request_id: int
    prefix_id: int
    gold: int
    scores: np.ndarray  # [L, H, m]
    logprobs: dict = dataclasses.field(default_factory=dict)  # mode -> [choices]


def partner_of(records: list[Record]) -> dict[int, int]:
    """For static pre-identification: each request reuses the set of the first other request on
    its prefix (in arrival order). Requests alone on their prefix get none."""
    by_prefix: dict[int, list[int]] = {}
    for i, r in enumerate(records):
        by_prefix.setdefault(r.prefix_id, []).append(i)
    out = {}
    for members in by_prefix.values():
        for i in members:
            others = [j for j in members if j != i]
            if others:
                out[i] = others[0]
    return out


def ordered_by_prefix(requests):
    """Requests grouped by prefix (each prefix's KV is computed once), arrival order inside."""
    return sorted(requests, key=lambda r: (r.prefix_id, r.request_id))


def _same_tokens_key(selections, num_heads: int) -> tuple:
    """Equal for two per-layer selections exactly when every head sees the same prefix tokens in every layer."""
    return tuple(np.sort(np.broadcast_to(s, (num_heads, np.shape(s)[-1])), axis=-1).tobytes() for s in selections)


def collect(model, requests, settings: MeasureSettings, progress=print) -> list[Record]:
    """Importance for every request, then choice scores under every selection asked for: "full", per-head H2O
    sets of the request itself ("own@r") and of another request on its prefix ("spi@r"), ITF with spread
    probes ("itf-spread@alpha") and, on a grouped-query model, spec_gqa's test ("itf-kvheads@alpha")."""
    cfg = model.config
    records: list[Record] = []
    kv_cache: dict[int, inference.KVCache] = {}
    by_id = {}
    started = time.time()
    for r in requests:
        if r.prefix_id not in kv_cache:
            kv_cache = {r.prefix_id: prefix_kv(model, r.prefix_ids)}  # requests grouped by prefix
        kv = kv_cache[r.prefix_id]
        records.append(Record(r.request_id, r.prefix_id, r.gold, query_importance(model, kv, r.query_ids)))
        by_id[r.request_id] = r
    progress(f"importance of {len(records)} requests: {time.time() - started:.1f} s")
    if not settings.accuracy:
        return records
    partners = partner_of(records)
    probes = spread_probe_heads(cfg)
    started = time.time()
    for i, rec in enumerate(records):
        r = by_id[rec.request_id]
        if r.prefix_id not in kv_cache:
            kv_cache = {r.prefix_id: prefix_kv(model, r.prefix_ids)}
        kv = kv_cache[r.prefix_id]
        m = kv.length
        modes = {"full": None}
        for ret in settings.retentions:
            k = keep_count(ret, m)
            modes[f"own@{ret}"] = list(top_k(rec.scores, k))
            if i in partners:
                modes[f"spi@{ret}"] = list(top_k(records[partners[i]].scores, k))
        k = keep_count(settings.main_retention, m)
        for alpha in settings.alphas:
            modes[f"itf-spread@{alpha}"] = itf_selection(rec.scores, k, probes, alpha)[0]
            if cfg.q_per_kv > 1:
                modes[f"itf-kvheads@{alpha}"] = kv_itf_selection(rec.scores, cfg, k, alpha)[0]
        seen: dict[object, list[float]] = {}
        for name, selections in modes.items():
            key = "full" if selections is None else _same_tokens_key(selections, cfg.num_heads)
            if key not in seen:
                seen[key] = choice_logprobs(model, kv, r.query_ids, r.choice_ids, selections)
            rec.logprobs[name] = seen[key]
        if (i + 1) % 10 == 0:
            progress(f"accuracy passes: {i + 1}/{len(records)} requests, {time.time() - started:.1f} s")
    return records


# ---------------------------------------------------------------- the engine itself (items 5b-6)


def keys_fraction(probe_kv_heads: int, kv_heads: int, m: int, k: int, fallback: bool) -> float:
    """Prefix key vectors one layer reads under ITF, as a fraction of all of them: the probe KV
    heads' keys, then either the k selected keys of the other KV heads or (fallback) all keys."""
    if fallback:
        return 1.0
    return (probe_kv_heads * m + (kv_heads - probe_kv_heads) * k) / (kv_heads * m)


def engine_measurements(model, requests, settings: MeasureSettings, progress=print) -> dict:
    """SPEC Fig. 11/19/22 (alpha sweep) and Fig. 20/21 (reordering, score cache vs LFU) with the
    engine's own counters. Requests run in arrival order over an in-memory store (counts, not
    timings). Returns {"runs": {label: summary}} with the budgets and the stored KV's bytes, and "error" when a
    run failed."""
    cfg = model.config
    requests = sorted(requests, key=lambda r: r.request_id)
    gpu, cpu = settings.gpu_cache_bytes, settings.cpu_cache_bytes
    out = {}
    for label, system, reorder in _engine_runs(settings):
        started = time.time()
        probe_q = policy_steps.probe_query_heads(cfg, system.num_probe_heads)
        try:
            engine = _warmed_engine(model, requests, settings, system, EngineConfig(
                retention=settings.main_retention, gpu_cache_bytes=gpu, cpu_cache_bytes=cpu,
                reorder_every=settings.reorder_every if reorder else 0))
            counts = _engine_counts(engine, requests, settings.main_retention)
        except Exception as e:  # an engine in progress: report it, keep items 1-5
            return {"error": f"engine run '{label}' failed: {type(e).__name__}: {str(e)[:300]}", "runs": out}
        out[label] = {**_run_summary(counts), "wall_s": time.time() - started, "probe_heads": list(probe_q)}
        progress(f"engine {label}: {time.time() - started:.1f} s")
    return {"runs": out, "gpu_cache_bytes": gpu, "cpu_cache_bytes": cpu,
            "store_bytes": stored_kv_bytes(model, requests), "reorder_every": settings.reorder_every}


def _engine_runs(settings: MeasureSettings) -> list[tuple[str, object, bool]]:
    """(label, system, whether it reorders) of every engine run: spec at each alpha, then spec without reordering
    and spec with an LFU cache in place of the score cache."""
    runs = [(f"spec alpha={a}", make_system("spec", alpha=a), True) for a in settings.alphas]
    return runs + [("spec no reorder", make_system("spec", no_reorder=True), False),
                   ("spec LFU cache", make_system("spec", no_score_cache=True), True)]


def _warmed_engine(model, requests, settings: MeasureSettings, system, config: EngineConfig):
    """An engine for `system` over a new in-memory store, warmed as specjax.eval warms every run: each prefix
    stored once, then two passes over its first request; the store's counters then start from zero."""
    store = KVStore.open({"driver": "memory", "path": f"observe{time.time_ns()}/"},
                         fingerprint(model, settings.chunk_tokens), context=ts.Context())
    engine = make_engine(model, system, store, config)
    first: dict = {}
    for r in requests:
        first.setdefault(r.prefix_id, r)
    for r in first.values():
        engine.warm(list(r.prefix_ids))
    warm_up(engine, [r.engine_request() for r in first.values()])
    store.metrics.reset()
    return engine


def _engine_counts(engine, requests, retention: float) -> dict:
    """Run `requests` in order: the store's I/O counters summed over them ("totals") and, per request, the layers'
    fallbacks and retained shares, the share of prefix keys read ("keys": `keys_fraction`, 1 without a reused
    prefix) and whether the best-scoring choice was the gold one ("hits")."""
    cfg = engine.cfg
    probe_kv = len(policy_steps.probe_kv_heads(cfg, engine.system.num_probe_heads))
    counts: dict = {"totals": {}, "fallback": [], "retained": [], "keys": [], "hits": []}
    for r in requests:
        res = engine.run(r.engine_request())
        for key, v in res.io.items():
            counts["totals"][key] = counts["totals"].get(key, 0) + v
        fb = np.asarray(res.layers["fallback"], float)
        counts["fallback"].append(fb)
        counts["retained"].append(np.asarray(res.layers["retained"], float))
        m = res.reused_tokens
        k = keep_count(retention, m) if m else 0
        counts["keys"].append(
            np.mean([keys_fraction(probe_kv, cfg.num_kv_heads, m, k, bool(f)) for f in fb]) if m else 1.0)
        counts["hits"].append(float(np.argmax([c for c, _ in res.continuation_logprobs]) == r.gold))
    return counts


def _run_summary(counts: dict) -> dict:
    """One engine run's summary from `_engine_counts`: accuracy (with its standard error), fallbacks, retained
    shares and keys read, and per request the chunks and bytes read and the cache tiers' hit ratios."""
    totals, n = counts["totals"], len(counts["hits"])
    lookups = totals.get("device_hits", 0) + totals.get("host_hits", 0) + totals.get("misses", 0)
    acc = float(np.mean(counts["hits"]))
    return {
        "accuracy": acc, "stderr": float(np.sqrt(acc * (1 - acc) / max(n - 1, 1))), "n": n,
        "fallback": float(np.mean(counts["fallback"])), "fallback_per_layer": np.mean(counts["fallback"], axis=0),
        "retained_per_layer": np.mean(counts["retained"], axis=0), "keys_loaded": float(np.mean(counts["keys"])),
        "chunks_read_per_request": totals.get("chunks_read", 0) / n,
        "disk_bytes_per_request": totals.get("disk_bytes", 0) / n,
        "device_hit_ratio": totals.get("device_hits", 0) / lookups if lookups else float("nan"),
        "host_hit_ratio": totals.get("host_hits", 0) / lookups if lookups else float("nan"),
    }
