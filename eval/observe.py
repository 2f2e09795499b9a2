"""`python -m specjax.eval.observe`: the SPEC / ContiguousKV motivating measurements on a real model.

    python -m specjax.eval.observe --model smollm2-135m --task piqa --data_dir ../shared/data --limit 30
    python -m specjax.eval.observe --model smollm2-135m --task needle --limit 30

For every request the prefix KV is computed once (plain prefill) and the query is run on top of it
with all query heads as probes: H2O importance of every prefix token for every head and layer
(`specjax.kernels.probe_scores`, rows = query tokens only, as when the prefix KV is reused). From
those scores: head and layer similarity, period coverage, static pre-identification, chunk
density and an ITF threshold sweep. Accuracy under a selection is the lm-eval loglikelihood
accuracy when query and continuation attend only to the selected prefix tokens (masked reference
attention, per query head). Writes OUTPUT_DIR/observations.md, observations.json and PNG figures.
"""

from __future__ import annotations

import dataclasses
import functools
import json
import math
import pathlib
import shlex
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np
from absl import flags

from specjax.kernels import itf_threshold, probe_scores
from specjax.models import transformer as T
from specjax.models.attention import NEG_INF
from specjax.models.inference import bucket

FLAGS = flags.FLAGS


def define_flags() -> None:
    """Flags of this command; defined only when it runs, so importing the module defines none."""
    flags.DEFINE_string("model", "smollm2-135m", "Registered model name or converted model directory.")
    flags.DEFINE_enum("init", "pretrained", ["pretrained", "random"], "Weights (random: for tests only).")
    flags.DEFINE_string("task", "needle", "Task name (see python -m specjax.eval --help).")
    flags.DEFINE_string("data_dir", None, "Folder laid out like ../shared/data.")
    flags.DEFINE_integer("limit", 30, "Number of requests.")
    flags.DEFINE_string("num_fewshot", "2-10", "Few-shot examples per prefix: N or A-B.")
    flags.DEFINE_integer("prefix_tokens", 800, "Extend every prefix to at least this many tokens (0: do not).")
    flags.DEFINE_float("reuse_mean", 8.0, "Mean number of queries per prefix.")
    flags.DEFINE_integer("seed", 0, "Workload seed.")
    flags.DEFINE_string("retentions", "0.1,0.25,0.4", "Retention ratios for the similarity measurements.")
    flags.DEFINE_float("main_retention", 0.25, "Retention for single-retention measurements (layers, ITF).")
    flags.DEFINE_float("density_retention", 0.5, "Extra retention for chunk density (SPEC Fig. 5a uses 50%).")
    flags.DEFINE_integer("chunk_tokens", 64, "Tokens per stored chunk (SPEC: 64).")
    flags.DEFINE_integer("period_chunk_tokens", 16, "ContiguousChunk size for period coverage (ContiguousKV: 16).")
    flags.DEFINE_integer("period_layers", 8, "Layers per period (ContiguousKV: 8).")
    flags.DEFINE_string("alphas", "0,0.3,0.6,1,2", "ITF threshold exponents to sweep.")
    flags.DEFINE_bool("accuracy", True, "Also measure loglikelihood accuracy under the selections (slower).")
    flags.DEFINE_bool("engine", True, "Also run the engine (items 5-6: alpha sweep, reordering, cache policy).")
    flags.DEFINE_integer("reorder_every", 0, "Engine: also run SPEC's reordering pass after every N measured "
                         "requests (0: only once, between the two warm-up passes, as specjax.eval does; each "
                         "repack frees the old chunks, so the caches restart cold after it).")
    flags.DEFINE_float("gpu_cache", 0.15, "Engine: device cache as a fraction of the stored prefix KV (SPEC: 10 of ~60 GB).")
    flags.DEFINE_float("cpu_cache", 0.5, "Engine: host cache as a fraction of the stored prefix KV.")
    flags.DEFINE_string("output_dir", None, "Where to write; default results/observe-<model>-<task>.")

PAPER = {  # the papers' numbers, only ever shown in their own column
    "head_jaccard": "> 0.95 (OPT-6.7B middle layer, SPEC Fig. 7b)",
    "head_jaccard_10": "0.48 (OPT-30B, all layers, SPEC Fig. 8)",
    "head_jaccard_40": "0.68 (OPT-30B, all layers, SPEC Fig. 8)",
    "adjacent": "\"highly similar\" (SPEC Obs. III, no number)",
    "period": "52-64% (Qwen2.5-7B, ContiguousKV Fig. 7b)",
    "spi": "recall drops and accuracy falls below ORI (SPEC Fig. 4)",
    "density": "46% important per loaded chunk -> 2.2x (OPT-6.7B, RTE, 50% kept, SPEC Fig. 5a)",
    "ckv_amp": "~12x for most requests at 25% (IMPRESS, Qwen2.5-7B, RTE, with caching, ContiguousKV Fig. 4)",
    "fallback": "< 20% of layers fall back (SPEC VI-C)",
    "reorder": "~1.2x fewer chunks read with reordering (SPEC Fig. 20)",
    "hit": "device-cache hit ratio 68% (LFU) -> 80% (score policy) (SPEC Fig. 21)",
}


# ---------------------------------------------------------------- set measurements (pure numpy)


def jaccard(a, b) -> float:
    """|A & B| / |A | B|; two empty sets give 1.0."""
    a, b = set(np.asarray(a).tolist()), set(np.asarray(b).tolist())
    union = len(a | b)
    return len(a & b) / union if union else 1.0


def jaccard_matrix(sets) -> np.ndarray:
    """Pairwise Jaccard of a list of index sets (rows of a [P, k] array or ragged lists)."""
    n = len(sets)
    out = np.ones((n, n))
    for i in range(n):
        for j in range(i + 1, n):
            out[i, j] = out[j, i] = jaccard(sets[i], sets[j])
    return out


def group_pair_means(matrix: np.ndarray, group_of: np.ndarray) -> tuple[float, float]:
    """Mean off-diagonal entry over pairs in the same group and over pairs in different groups
    (NaN where there are no such pairs)."""
    n = matrix.shape[0]
    i, j = np.triu_indices(n, 1)
    same = group_of[i] == group_of[j]
    within = float(matrix[i[same], j[same]].mean()) if same.any() else float("nan")
    across = float(matrix[i[~same], j[~same]].mean()) if (~same).any() else float("nan")
    return within, across


def top_k(scores: np.ndarray, k: int) -> np.ndarray:
    """Per row, the k highest-scoring columns, sorted by position ([P, k]; ties: lower index)."""
    order = np.argsort(-scores, axis=-1, kind="stable")[..., :k]
    return np.sort(order, axis=-1)


def shared_scores(scores: np.ndarray) -> np.ndarray:
    """Each head's scores divided by their sum, summed over heads (as `kernels.shared_topk`)."""
    total = scores.sum(axis=-1, keepdims=True)
    return (scores / np.maximum(total, np.finfo(np.float32).tiny)).sum(axis=-2)


def recall(found, wanted) -> float:
    """Fraction of `wanted` that is in `found` (1.0 when nothing is wanted)."""
    wanted = set(np.asarray(wanted).tolist())
    return len(wanted & set(np.asarray(found).tolist())) / len(wanted) if wanted else 1.0


def chunk_density(idx, prefix_len: int, chunk_tokens: int) -> tuple[np.ndarray, float]:
    """For the important token positions `idx` of a prefix stored in chunks of `chunk_tokens`:
    the fraction of important tokens in each chunk touched, and the read amplification
    (tokens in touched chunks / important tokens; the last chunk counts only its real tokens)."""
    idx = np.unique(np.asarray(idx, np.int64))
    if idx.size == 0:
        return np.zeros(0), 1.0
    chunks, counts = np.unique(idx // chunk_tokens, return_counts=True)
    sizes = np.minimum(chunk_tokens, prefix_len - chunks * chunk_tokens)
    return counts / sizes, float(sizes.sum() / idx.size)


def chunk_scores(token_scores: np.ndarray, chunk_tokens: int) -> np.ndarray:
    """Sum of token scores per chunk (ContiguousKV's chunk score); last chunk may be partial."""
    m = token_scores.shape[-1]
    pad = -m % chunk_tokens
    padded = np.pad(token_scores, [(0, 0)] * (token_scores.ndim - 1) + [(0, pad)])
    return padded.reshape(*token_scores.shape[:-1], -1, chunk_tokens).sum(-1)


def coverage(chosen, needed) -> float:
    """Fraction of `needed` already in `chosen` (ContiguousKV's coverage ratio)."""
    return recall(chosen, needed)


def random_jaccard(k: int, n: int) -> float:
    """Expected Jaccard of two random k-subsets of n (SPEC's j)."""
    return float(itf_threshold(k, n, 1.0))


def keys_fraction(probe_kv_heads: int, kv_heads: int, m: int, k: int, fallback: bool) -> float:
    """Prefix key vectors one layer reads under ITF, as a fraction of all of them: the probe KV
    heads' keys, then either the k selected keys of the other KV heads or (fallback) all keys."""
    if fallback:
        return 1.0
    return (probe_kv_heads * m + (kv_heads - probe_kv_heads) * k) / (kv_heads * m)


def keep_count(retention: float, m: int) -> int:
    return max(1, min(m, math.ceil(retention * m)))


# ---------------------------------------------------------------- model passes


@functools.partial(jax.jit, static_argnums=(0, 1))
def _layer(cfg, kv_head_of_head, lp, h, positions, prefix_k, prefix_v, visible, prefix_len, own_len):
    """One layer for the computed tokens over the reused prefix KV.

    visible: bool [H, Mp], which prefix tokens each query head may see. Returns next hidden and,
    when kv_head_of_head is given, every head's H2O importance of each prefix token f32 [H, Mp]
    (computed over all valid prefix tokens, whatever `visible` says).
    """
    q, k, v = T.project(cfg, lp, h, positions)
    H, n, d = q.shape
    group = H // k.shape[0]
    keys = jnp.concatenate([prefix_k, k.astype(prefix_k.dtype)], axis=1)
    values = jnp.concatenate([prefix_v, v.astype(prefix_v.dtype)], axis=1)
    kq = jnp.repeat(keys, group, axis=0)
    vq = jnp.repeat(values, group, axis=0)
    logits = jnp.einsum("hqd,hkd->hqk", q, kq, preferred_element_type=jnp.float32) * d**-0.5
    rows, cols = jnp.arange(n), jnp.arange(n)
    own = (cols[None, :] <= rows[:, None]) & (cols[None, :] < own_len)
    mask = jnp.concatenate([jnp.broadcast_to(visible[:, None, :], (H, n, visible.shape[1])),
                            jnp.broadcast_to(own[None], (H, n, n))], axis=2)
    probs = jax.nn.softmax(jnp.where(mask, logits, NEG_INF), axis=-1)
    attn = jnp.einsum("hqk,hkd->hqd", probs.astype(vq.dtype), vq, preferred_element_type=jnp.float32)
    h_next = T.output_and_mlp(cfg, lp, h, attn.astype(q.dtype))
    if kv_head_of_head is None:
        return h_next, None
    scores = probe_scores(q, prefix_k, k.astype(prefix_k.dtype), kv_head_of_probe=kv_head_of_head,
                          prefix_len=prefix_len, q_len=own_len)
    return h_next, scores


@dataclasses.dataclass
class PrefixKV:
    k: list  # per layer [H_kv, Mp, d]
    v: list
    length: int


def prefix_kv(model, prefix_ids) -> PrefixKV:
    """Plain prefill of the prefix; the KV every query of this prefix reuses."""
    cfg, params = model.config, model.params
    m = len(prefix_ids)
    padded = np.zeros(bucket(m), np.int32)
    padded[:m] = prefix_ids
    positions = jnp.arange(len(padded), dtype=jnp.int32)
    valid = positions < m
    h = T.embed_step(cfg, params, jnp.asarray(padded), positions)
    ks, vs = [], []
    for lp in params["layers"]:
        h, k, v = T.self_attention_layer(cfg, lp, h, positions, valid)
        ks.append(k)
        vs.append(v)
    return PrefixKV(ks, vs, m)


def _run_tokens(model, kv: PrefixKV, ids, visible, with_scores: bool):
    """Run `ids` after the prefix. visible: None (all) or bool [L, H, m]. Returns (h, scores)."""
    cfg, params = model.config, model.params
    m, n = kv.length, len(ids)
    mp = kv.k[0].shape[1]
    padded = np.zeros(bucket(n, minimum=8), np.int32)
    padded[:n] = ids
    positions = jnp.arange(m, m + len(padded), dtype=jnp.int32)
    group = cfg.num_heads // cfg.num_kv_heads
    heads = tuple(h // group for h in range(cfg.num_heads)) if with_scores else None
    all_visible = np.zeros((cfg.num_heads, mp), bool)
    all_visible[:, :m] = True
    h = T.embed_step(cfg, params, jnp.asarray(padded), positions)
    scores = []
    for layer, lp in enumerate(params["layers"]):
        vis = all_visible
        if visible is not None:
            vis = np.zeros_like(all_visible)
            vis[:, :m] = visible[layer]
        h, s = _layer(cfg, heads, lp, h, positions, kv.k[layer], kv.v[layer], jnp.asarray(vis),
                      jnp.int32(m), jnp.int32(n))
        if with_scores:
            scores.append(np.asarray(s)[:, :m])
    return h, (np.stack(scores) if with_scores else None)


def query_importance(model, kv: PrefixKV, query_ids) -> np.ndarray:
    """H2O importance f32 [L, H, m] of each prefix token for every query head and layer."""
    return _run_tokens(model, kv, query_ids, None, with_scores=True)[1]


def choice_logprobs(model, kv: PrefixKV, query_ids, choice_ids, visible=None) -> list[float]:
    """Sum log p(choice | prefix + query) per choice, attending only to `visible` prefix tokens."""
    out = []
    for cont in choice_ids:
        ids = list(query_ids) + list(cont)
        h, _ = _run_tokens(model, kv, ids, visible, with_scores=False)
        rows = np.arange(len(query_ids) - 1, len(ids) - 1)
        logits = np.asarray(T.head_step(model.config, model.params, h))[rows]
        logp = logits - np.logaddexp.reduce(logits, axis=-1, keepdims=True)
        out.append(float(logp[np.arange(len(cont)), list(cont)].sum()))
    return out


def mask_from_sets(sets_per_layer, num_heads: int, m: int) -> np.ndarray:
    """bool [L, H, m] from per-layer index sets: an array [H, k] (per head) or [k] (shared)."""
    out = np.zeros((len(sets_per_layer), num_heads, m), bool)
    for layer, idx in enumerate(sets_per_layer):
        idx = np.asarray(idx)
        if idx.ndim == 1:
            out[layer, :, idx] = True
        else:
            for head in range(num_heads):
                out[layer, head, idx[head]] = True
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


def spread_probe_heads(cfg, count: int = 3) -> tuple[int, ...]:
    """Probe heads spanning as many KV heads as possible (one per KV head first)."""
    group = cfg.num_heads // cfg.num_kv_heads
    order = [kv * group + j for j in range(group) for kv in range(cfg.num_kv_heads)]
    return tuple(order[: min(count, cfg.num_heads)])


def same_group_probe_heads(cfg, count: int = 3) -> tuple[int, ...]:
    """The first `count` query heads (SPEC's choice; on GQA they share KV heads)."""
    return tuple(range(min(count, cfg.num_heads)))


def itf_sets(scores: np.ndarray, k: int, probes, alpha: float) -> tuple[list, np.ndarray, np.ndarray]:
    """Per layer: the ITF selection ([k] shared when the probes agree, else [H, k] per head), the
    probes' mean Jaccard and whether the layer fell back."""
    m = scores.shape[-1]
    threshold = float(itf_threshold(k, m, alpha))
    sets, jac, fell = [], [], []
    for layer_scores in scores:
        probe_sets = top_k(layer_scores[list(probes)], k)
        j = float(np.mean(jaccard_matrix(probe_sets)[np.triu_indices(len(probes), 1)])) if len(probes) > 1 else 1.0
        jac.append(j)
        fallback = j < threshold
        fell.append(fallback)
        if fallback:
            sets.append(top_k(layer_scores, k))
        else:
            sets.append(top_k(shared_scores(layer_scores[list(probes)])[None], k)[0])
    return sets, np.array(jac), np.array(fell)


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


def collect(model, requests, settings: dict, progress=print) -> list[Record]:
    """Importance for every request, then choice scores under every selection asked for."""
    cfg = model.config
    records: list[Record] = []
    kv_cache: dict[int, PrefixKV] = {}
    by_id = {}
    started = time.time()
    for r in requests:
        if r.prefix_id not in kv_cache:
            kv_cache = {r.prefix_id: prefix_kv(model, r.prefix_ids)}  # requests grouped by prefix
        kv = kv_cache[r.prefix_id]
        records.append(Record(r.request_id, r.prefix_id, r.gold, query_importance(model, kv, r.query_ids)))
        by_id[r.request_id] = r
    progress(f"importance of {len(records)} requests: {time.time() - started:.1f} s")
    if not settings["accuracy"]:
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
        H = cfg.num_heads
        modes = {"full": None}
        for ret in settings["retentions"]:
            k = keep_count(ret, m)
            modes[f"own@{ret}"] = mask_from_sets([top_k(s, k) for s in rec.scores], H, m)
            if i in partners:
                other = records[partners[i]].scores
                modes[f"spi@{ret}"] = mask_from_sets([top_k(s, k) for s in other], H, m)
        k = keep_count(settings["main_retention"], m)
        for alpha in settings["alphas"]:
            sets, _, _ = itf_sets(rec.scores, k, probes, alpha)
            modes[f"itf@{alpha}"] = mask_from_sets(sets, H, m)
        seen: dict[bytes, list[float]] = {}
        for name, mask in modes.items():
            key = b"full" if mask is None else np.packbits(mask).tobytes()
            if key not in seen:
                seen[key] = choice_logprobs(model, kv, r.query_ids, r.choice_ids, mask)
            rec.logprobs[name] = seen[key]
        if (i + 1) % 10 == 0:
            progress(f"accuracy passes: {i + 1}/{len(records)} requests, {time.time() - started:.1f} s")
    return records


def ordered_by_prefix(requests):
    """Requests grouped by prefix (each prefix's KV is computed once), arrival order inside."""
    return sorted(requests, key=lambda r: (r.prefix_id, r.request_id))


# ---------------------------------------------------------------- analysis


def _mean(values) -> float:
    values = [v for v in values if not (isinstance(v, float) and math.isnan(v))]
    return float(np.mean(values)) if values else float("nan")


def head_similarity(records: list[Record], cfg, retentions) -> dict:
    """Obs. I/II: per layer, the mean head x head Jaccard matrix and its within-/across-KV-group means."""
    group = cfg.num_heads // cfg.num_kv_heads
    group_of = np.arange(cfg.num_heads) // group
    out = {}
    for ret in retentions:
        mats, within, across, rand = [], [], [], []
        for rec in records:
            m = rec.scores.shape[-1]
            k = keep_count(ret, m)
            per_layer = [jaccard_matrix(top_k(s, k)) for s in rec.scores]
            mats.append(per_layer)
            pairs = [group_pair_means(mat, group_of) for mat in per_layer]
            within.append([p[0] for p in pairs])
            across.append([p[1] for p in pairs])
            rand.append(random_jaccard(k, m))
        mats = np.mean(np.array(mats), axis=0)  # [L, H, H]
        iu = np.triu_indices(cfg.num_heads, 1)
        all_pairs = mats[:, iu[0], iu[1]].mean(axis=1)
        out[ret] = {
            "matrix": mats, "per_layer": all_pairs,
            "within_per_layer": np.nanmean(np.array(within), axis=0) if group > 1 else None,
            "across_per_layer": np.nanmean(np.array(across), axis=0) if cfg.num_kv_heads > 1 else None,
            "random": float(np.mean(rand)),
        }
    return out


def probe_choice(records: list[Record], cfg, retention: float, alpha: float = 0.6) -> dict:
    """How well a probe-head choice stands in for all heads: the probes' Jaccard, the ITF pass
    rate, how much of every head's own set the shared set recovers, and the keys it must load."""
    choices = {"spread (one per KV head)": spread_probe_heads(cfg),
               "same KV group (first 3 heads)": same_group_probe_heads(cfg),
               "all heads": tuple(range(cfg.num_heads))}
    group = cfg.num_heads // cfg.num_kv_heads
    out = {}
    for name, probes in choices.items():
        jac, passed, rec_all, keys = [], [], [], []
        for rec in records:
            m = rec.scores.shape[-1]
            k = keep_count(retention, m)
            threshold = float(itf_threshold(k, m, alpha))
            for s in rec.scores:
                probe_sets = top_k(s[list(probes)], k)
                j = float(np.mean(jaccard_matrix(probe_sets)[np.triu_indices(len(probes), 1)]))
                shared = top_k(shared_scores(s[list(probes)])[None], k)[0]
                own = top_k(s, k)
                jac.append(j)
                passed.append(j >= threshold)
                rec_all.append(np.mean([recall(shared, own[h]) for h in range(cfg.num_heads)]))
                probe_kv = len({p // group for p in probes})
                keys.append(keys_fraction(probe_kv, cfg.num_kv_heads, m, k, j < threshold))
        out[name] = {"probes": list(probes), "probe_kv_heads": len({p // group for p in probes}),
                     "probe_jaccard": _mean(jac), "itf_pass": float(np.mean(passed)),
                     "shared_recall": _mean(rec_all), "keys_loaded": _mean(keys)}
    return out


def layer_similarity(records: list[Record], cfg, retention: float, chunk: int, period: int) -> dict:
    """Obs. III and ContiguousKV Fig. 7: layer x layer Jaccard of the shared sets, adjacent layers
    (shared set and per head), and chunk-set coverage inside and between periods of layers."""
    L = cfg.num_layers
    mats, adj_shared, adj_head, within, between, rand = [], [], [], [], [], []
    for rec in records:
        m = rec.scores.shape[-1]
        k = keep_count(retention, m)
        shared = [top_k(shared_scores(s)[None], k)[0] for s in rec.scores]
        mats.append(jaccard_matrix(shared))
        adj_shared.append([jaccard(shared[l], shared[l + 1]) for l in range(L - 1)])
        heads = [top_k(s, k) for s in rec.scores]
        adj_head.append([np.mean([jaccard(heads[l][h], heads[l + 1][h]) for h in range(cfg.num_heads)])
                         for l in range(L - 1)])
        cs = chunk_scores(np.stack([shared_scores(s) for s in rec.scores]), chunk)  # [L, chunks]
        kc = keep_count(retention, cs.shape[1])
        csets = [top_k(c[None], kc)[0] for c in cs]
        starts = list(range(0, L, period))
        for s in starts:
            for l in range(s + 1, min(s + period, L)):
                within.append(coverage(csets[s], csets[l]))
        for a, b in zip(starts, starts[1:]):
            between.append(coverage(csets[a], csets[b]))
        rand.append((random_jaccard(k, m), kc / cs.shape[1]))
    return {"matrix": np.mean(mats, axis=0), "adjacent_shared": np.mean(adj_shared, axis=0),
            "adjacent_per_head": np.mean(adj_head, axis=0), "period_within": _mean(within),
            "period_between": _mean(between), "random_jaccard": float(np.mean([r[0] for r in rand])),
            "random_coverage": float(np.mean([r[1] for r in rand])), "retention": retention,
            "chunk_tokens": chunk, "period_layers": period}


def static_preidentification(records: list[Record], cfg, retentions) -> dict:
    """SPEC Fig. 4: recall of a request's own per-head important sets by another request's sets
    on the same prefix, and the accuracy of each selection."""
    partners = partner_of(records)
    out = {}
    for ret in retentions:
        recalls = []
        for i, j in partners.items():
            a, b = records[j].scores, records[i].scores
            m = b.shape[-1]
            k = keep_count(ret, m)
            recalls.append(np.mean([recall(top_k(a[l], k)[h], top_k(b[l], k)[h])
                                    for l in range(len(b)) for h in range(cfg.num_heads)]))
        out[ret] = {"recall": _mean(recalls), "pairs": len(partners)}
    return out


def density(records: list[Record], cfg, retentions, chunk: int) -> dict:
    """SPEC Fig. 5a: important fraction per touched chunk and read amplification, for the shared
    set (what ITF loads for all heads) and per KV head (union of its query heads' sets)."""
    group = cfg.num_heads // cfg.num_kv_heads
    out = {}
    for ret in retentions:
        res = {"shared": ([], []), "per_kv_head": ([], [])}
        per_request_amp = []
        for rec in records:
            m = rec.scores.shape[-1]
            k = keep_count(ret, m)
            amps = []
            for s in rec.scores:
                frac, amp = chunk_density(top_k(shared_scores(s)[None], k)[0], m, chunk)
                res["shared"][0].extend(frac)
                res["shared"][1].append(amp)
                amps.append(amp)
                own = top_k(s, k)
                for g in range(cfg.num_kv_heads):
                    frac, amp = chunk_density(own[g * group:(g + 1) * group].ravel(), m, chunk)
                    res["per_kv_head"][0].extend(frac)
                    res["per_kv_head"][1].append(amp)
            per_request_amp.append(float(np.mean(amps)))
        out[ret] = {name: {"fractions": np.array(f), "mean_fraction": float(np.mean(f)),
                           "read_amplification": float(np.mean(a))} for name, (f, a) in res.items()}
        out[ret]["per_request_amp"] = per_request_amp
    return out


def itf_sweep(records: list[Record], cfg, retention: float, alphas) -> dict:
    """SPEC Fig. 11/19/22 on the reference path: per alpha, keys read, tokens kept and the
    fallback rate per layer (engine probe heads; same-KV-group probes for comparison)."""
    out = {}
    group = cfg.num_heads // cfg.num_kv_heads
    for probes_name, probes in (("spread", spread_probe_heads(cfg)), ("same_group", same_group_probe_heads(cfg))):
        probe_kv = len({p // group for p in probes})
        for alpha in alphas:
            fell_layers, keys, kept = [], [], []
            for rec in records:
                m = rec.scores.shape[-1]
                k = keep_count(retention, m)
                sets, _, fell = itf_sets(rec.scores, k, probes, alpha)
                fell_layers.append(fell)
                keys.append(np.mean([keys_fraction(probe_kv, cfg.num_kv_heads, m, k, f) for f in fell]))
                kept.append([len(np.unique(s)) / m for s in sets])
            out[(probes_name, alpha)] = {
                "fallback_per_layer": np.mean(fell_layers, axis=0), "fallback": float(np.mean(fell_layers)),
                "keys_loaded": float(np.mean(keys)), "kept_per_layer": np.mean(kept, axis=0),
                "probes": list(probes)}
    return out


def accuracy(records: list[Record]) -> dict:
    """acc (argmax of summed log-likelihood, as lm-eval) and its stderr per selection mode."""
    modes = sorted({k for r in records for k in r.logprobs})
    out = {}
    for mode in modes:
        hits = [float(np.argmax(r.logprobs[mode]) == r.gold) for r in records if mode in r.logprobs]
        n = len(hits)
        acc = float(np.mean(hits)) if n else float("nan")
        out[mode] = {"acc": acc, "stderr": float(np.sqrt(acc * (1 - acc) / max(n - 1, 1))), "n": n}
    return out


# ---------------------------------------------------------------- engine measurements (items 5-6)


def engine_measurements(model, requests, settings: dict, progress=print) -> dict:
    """SPEC Fig. 11/19/22 (alpha sweep) and Fig. 20/21 (reordering, score cache vs LFU) with the
    engine's own counters. Requests run in arrival order over an in-memory store (counts, not
    timings). Returns {"runs": {label: summary}} or {"error": why} when the engine cannot run."""
    try:
        import tensorstore as ts

        from specjax.engine import Engine, EngineConfig, Request as EngineRequest, fingerprint, make_system
        from specjax.eval.engine_systems import warm_up
        from specjax.stores import KVStore
    except Exception as e:  # the engine is optional for items 1-4
        return {"error": f"engine not importable: {type(e).__name__}: {e}"}
    cfg = model.config
    requests = sorted(requests, key=lambda r: r.request_id)
    unique = {r.prefix_id: len(r.prefix_ids) for r in requests}
    kv_bytes = sum(unique.values()) * cfg.num_layers * 2 * cfg.num_kv_heads * cfg.head_dim * \
        jnp.dtype(model.dtype).itemsize
    gpu, cpu = int(settings["gpu_cache"] * kv_bytes), int(settings["cpu_cache"] * kv_bytes)
    ret = settings["main_retention"]
    runs = [(f"spec alpha={a}", make_system("spec", alpha=a), True) for a in settings["alphas"]]
    runs += [("spec no reorder", make_system("spec", no_reorder=True), False),
             ("spec LFU cache", make_system("spec", no_score_cache=True), True)]
    group = cfg.num_heads // cfg.num_kv_heads

    def _engine_request(r):
        return EngineRequest(list(r.prefix_ids), list(r.query_ids), [list(c) for c in r.choice_ids])

    out = {}
    for label, system, reorder in runs:
        started = time.time()
        try:
            store = KVStore.open({"driver": "memory", "path": f"observe{time.time_ns()}/"},
                                 fingerprint(model, settings["chunk_tokens"]), context=ts.Context())
            engine = Engine(model, system, store, EngineConfig(
                retention=ret, gpu_cache_bytes=gpu, cpu_cache_bytes=cpu,
                reorder_every=settings["reorder_every"] if reorder else 0))
            # specjax.eval's warm-up for every run: each prefix stored once, then two passes over its first request
            first: dict = {}
            for r in requests:
                first.setdefault(r.prefix_id, r)
            for r in first.values():
                engine.warm(list(r.prefix_ids))
            warm_up(engine, [_engine_request(r) for r in first.values()])
            store.metrics.reset()
            totals: dict[str, float] = {}
            fallback, retained, keys, hits = [], [], [], []
            for r in requests:
                res = engine.run(_engine_request(r))
                for key, v in res.io.items():
                    totals[key] = totals.get(key, 0) + v
                fb = np.asarray(res.layers["fallback"], float)
                fallback.append(fb)
                retained.append(np.asarray(res.layers["retained"], float))
                m = res.reused_tokens
                k = keep_count(ret, m) if m else 0
                probe_kv = len({h // group for h in engine.probe_q})
                keys.append(np.mean([keys_fraction(probe_kv, cfg.num_kv_heads, m, k, bool(f)) for f in fb]) if m else 1.0)
                hits.append(float(np.argmax([c for c, _ in res.continuation_logprobs]) == r.gold))
        except Exception as e:  # an engine in progress: report it, keep items 1-4
            return {"error": f"engine run '{label}' failed: {type(e).__name__}: {str(e)[:300]}", "runs": out}
        lookups = totals.get("device_hits", 0) + totals.get("host_hits", 0) + totals.get("misses", 0)
        n = len(hits)
        acc = float(np.mean(hits))
        out[label] = {
            "accuracy": acc, "stderr": float(np.sqrt(acc * (1 - acc) / max(n - 1, 1))), "n": n,
            "fallback": float(np.mean(fallback)), "fallback_per_layer": np.mean(fallback, axis=0),
            "retained_per_layer": np.mean(retained, axis=0), "keys_loaded": float(np.mean(keys)),
            "chunks_read_per_request": totals.get("chunks_read", 0) / n,
            "disk_bytes_per_request": totals.get("disk_bytes", 0) / n,
            "device_hit_ratio": totals.get("device_hits", 0) / lookups if lookups else float("nan"),
            "host_hit_ratio": totals.get("host_hits", 0) / lookups if lookups else float("nan"),
            "wall_s": time.time() - started, "probe_heads": [int(h) for h in engine.probe_q],
        }
        progress(f"engine {label}: {time.time() - started:.1f} s")
    return {"runs": out, "gpu_cache_bytes": gpu, "cpu_cache_bytes": cpu, "store_bytes": int(kv_bytes),
            "reorder_every": settings["reorder_every"]}


# ---------------------------------------------------------------- figures


def _plt():
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def _reorder_note(eng: dict) -> str:
    every = eng.get("reorder_every", 0)
    return f", and again after every {every} measured requests" if every else "; no repack while measuring"


def write_figures(results: dict, out: pathlib.Path, label: str) -> list[pathlib.Path]:
    plt = _plt()
    written = []

    def save(fig, name):
        fig.suptitle(label, fontsize=8, y=0.995)
        fig.tight_layout()
        path = out / name
        fig.savefig(path, dpi=110)
        plt.close(fig)
        written.append(path)

    heads, rets = results["heads"], results["retentions"]
    mid = results["middle_layer"]
    fig, axes = plt.subplots(1, len(rets), figsize=(4 * len(rets), 3.6))
    for ax, ret in zip(np.atleast_1d(axes), rets):
        im = ax.imshow(heads[ret]["matrix"][mid], vmin=0, vmax=1, cmap="viridis")
        ax.set_title(f"layer {mid}, retention {ret:.0%}", fontsize=9)
        ax.set_xlabel("query head")
        ax.set_ylabel("query head")
        fig.colorbar(im, ax=ax, fraction=0.046)
    save(fig, "fig7b_head_jaccard_heatmap.png")

    fig, ax = plt.subplots(figsize=(7, 4))
    for i, ret in enumerate(rets):
        color = f"C{i}"
        h = heads[ret]
        ax.plot(h["per_layer"], color=color, label=f"{ret:.0%} all pairs")
        if h["within_per_layer"] is not None:
            ax.plot(h["within_per_layer"], color=color, ls="--", label=f"{ret:.0%} same KV head")
        if h["across_per_layer"] is not None:
            ax.plot(h["across_per_layer"], color=color, ls=":", label=f"{ret:.0%} different KV heads")
        ax.axhline(h["random"], color=color, lw=0.6, alpha=0.6)
    ax.set_xlabel("layer")
    ax.set_ylabel("mean Jaccard between heads")
    ax.set_ylim(0, 1)
    ax.legend(fontsize=6, ncol=3)
    ax.set_title("head similarity per layer (thin lines: random expectation)", fontsize=9)
    save(fig, "fig8_head_jaccard_per_layer.png")

    lay = results["layers"]
    fig, axes = plt.subplots(1, 2, figsize=(10, 4))
    im = axes[0].imshow(lay["matrix"], vmin=0, vmax=1, cmap="viridis")
    axes[0].set_title(f"layer x layer Jaccard of the shared set ({lay['retention']:.0%})", fontsize=9)
    axes[0].set_xlabel("layer")
    axes[0].set_ylabel("layer")
    fig.colorbar(im, ax=axes[0], fraction=0.046)
    axes[1].plot(np.arange(1, len(lay["adjacent_shared"]) + 1), lay["adjacent_shared"], label="shared set")
    axes[1].plot(np.arange(1, len(lay["adjacent_per_head"]) + 1), lay["adjacent_per_head"], label="same head")
    axes[1].axhline(lay["random_jaccard"], color="gray", lw=0.8, label="random")
    axes[1].set_xlabel("layer l (vs l-1)")
    axes[1].set_ylabel("Jaccard")
    axes[1].set_ylim(0, 1)
    axes[1].legend(fontsize=7)
    axes[1].set_title("adjacent layers (SPEC Obs. III)", fontsize=9)
    save(fig, "obs3_layer_similarity.png")

    spi, acc = results["spi"], results["accuracy"]
    fig, axes = plt.subplots(1, 2, figsize=(10, 3.8))
    axes[0].bar([f"{r:.0%}" for r in rets], [spi[r]["recall"] for r in rets])
    axes[0].set_ylim(0, 1)
    axes[0].set_ylabel("recall of own important set")
    axes[0].set_xlabel("retention")
    axes[0].set_title("static pre-identification (another query's sets)", fontsize=9)
    if acc:
        x = np.arange(len(rets))
        own = [acc.get(f"own@{r}", {}).get("acc", np.nan) for r in rets]
        stat = [acc.get(f"spi@{r}", {}).get("acc", np.nan) for r in rets]
        axes[1].bar(x - 0.2, own, 0.4, label="own sets (ORI)")
        axes[1].bar(x + 0.2, stat, 0.4, label="other query's sets (SPI)")
        axes[1].axhline(acc["full"]["acc"], color="k", lw=0.8, label="full prefix")
        axes[1].set_xticks(x, [f"{r:.0%}" for r in rets])
        axes[1].set_ylim(0, 1)
        axes[1].set_ylabel("accuracy")
        axes[1].legend(fontsize=7)
    axes[1].set_title("accuracy cost (SPEC Fig. 4)", fontsize=9)
    save(fig, "fig4_static_preidentification.png")

    den = results["density"]
    fig, axes = plt.subplots(1, 2, figsize=(10, 3.8))
    for ret in den:
        axes[0].hist(den[ret]["shared"]["fractions"], bins=np.linspace(0, 1, 21), histtype="step",
                     density=True, label=f"{ret:.0%} kept")
    axes[0].set_xlabel(f"important fraction of a touched {results['chunk_tokens']}-token chunk (shared set)")
    axes[0].set_ylabel("density")
    axes[0].legend(fontsize=7)
    axes[0].set_title("chunk density (SPEC Fig. 5a)", fontsize=9)
    xs = sorted(den)
    axes[1].plot([f"{r:.0%}" for r in xs], [den[r]["shared"]["read_amplification"] for r in xs], "o-",
                 label="shared set")
    axes[1].plot([f"{r:.0%}" for r in xs], [den[r]["per_kv_head"]["read_amplification"] for r in xs], "s-",
                 label="per KV head")
    axes[1].set_xlabel("retention")
    axes[1].set_ylabel("read amplification")
    axes[1].legend(fontsize=7)
    axes[1].set_title("read amplification (ContiguousKV Fig. 4)", fontsize=9)
    save(fig, "fig5a_chunk_density.png")

    sweep, alphas = results["itf"], results["alphas"]
    fig, axes = plt.subplots(1, 3, figsize=(14, 3.8))
    for probes_name, marker in (("spread", "o"), ("same_group", "s")):
        axes[0].plot(alphas, [sweep[(probes_name, a)]["keys_loaded"] for a in alphas], marker + "-",
                     label=f"{probes_name} probes")
    axes[0].set_xlabel("alpha")
    axes[0].set_ylabel("prefix keys read / all keys")
    axes[0].legend(fontsize=7)
    axes[0].set_title("keys loaded vs alpha (SPEC Fig. 11)", fontsize=9)
    if acc:
        axes[1].plot(alphas, [acc.get(f"itf@{a}", {}).get("acc", np.nan) for a in alphas], "o-", label="ITF")
        axes[1].axhline(acc["full"]["acc"], color="k", lw=0.8, label="full prefix")
        axes[1].set_ylim(0, 1)
        axes[1].legend(fontsize=7)
    axes[1].set_xlabel("alpha")
    axes[1].set_ylabel("accuracy (spread probes)")
    axes[1].set_title("accuracy vs alpha (SPEC Fig. 22)", fontsize=9)
    for a in alphas:
        axes[2].plot(sweep[("spread", a)]["fallback_per_layer"], label=f"alpha {a}")
    axes[2].set_xlabel("layer")
    axes[2].set_ylabel("fallback rate")
    axes[2].set_ylim(-0.02, 1.02)
    axes[2].legend(fontsize=6)
    axes[2].set_title("per-layer ITF fallback, spread probes (SPEC Fig. 19)", fontsize=9)
    eng_runs = (results.get("engine") or {}).get("runs") or {}
    eng_alphas = [a for a in alphas if f"spec alpha={a}" in eng_runs]
    if eng_alphas:
        axes[0].plot(eng_alphas, [eng_runs[f"spec alpha={a}"]["keys_loaded"] for a in eng_alphas], "^--",
                     label="engine (spec)")
        axes[0].legend(fontsize=7)
        axes[1].plot(eng_alphas, [eng_runs[f"spec alpha={a}"]["accuracy"] for a in eng_alphas], "^--",
                     label="engine (spec)")
        axes[1].legend(fontsize=7)
    save(fig, "fig11_19_22_itf_threshold.png")
    base, noro, lfu = (eng_runs.get(k) for k in ("spec alpha=0.6", "spec no reorder", "spec LFU cache"))
    if base and noro and lfu:
        fig, axes = plt.subplots(1, 2, figsize=(9, 3.6))
        axes[0].bar(["no reorder", "reorder"], [noro["chunks_read_per_request"], base["chunks_read_per_request"]])
        axes[0].set_ylabel("chunks read per request")
        axes[0].set_title("reordering (SPEC Fig. 20), engine", fontsize=9)
        axes[1].bar(["LFU", "score"], [lfu["device_hit_ratio"], base["device_hit_ratio"]])
        axes[1].set_ylim(0, 1)
        axes[1].set_ylabel("device-cache hit ratio")
        axes[1].set_title("cache policy (SPEC Fig. 21), engine", fontsize=9)
        save(fig, "fig20_21_engine.png")
    return written


# ---------------------------------------------------------------- report


def analyse(records: list[Record], cfg, settings: dict) -> dict:
    rets, main = settings["retentions"], settings["main_retention"]
    density_rets = sorted(set(rets) | {settings["density_retention"]})
    return {
        "retentions": rets, "main_retention": main, "alphas": settings["alphas"],
        "middle_layer": cfg.num_layers // 2, "chunk_tokens": settings["chunk_tokens"],
        "heads": head_similarity(records, cfg, rets),
        "probes": probe_choice(records, cfg, main),
        "layers": layer_similarity(records, cfg, main, settings["period_chunk_tokens"], settings["period_layers"]),
        "spi": static_preidentification(records, cfg, rets),
        "density": density(records, cfg, density_rets, settings["chunk_tokens"]),
        "itf": itf_sweep(records, cfg, main, settings["alphas"]),
        "accuracy": accuracy(records) if settings["accuracy"] else {},
    }


def _f(x, pct=False) -> str:
    if x is None or (isinstance(x, float) and math.isnan(x)):
        return "n/a"
    return f"{100 * x:.1f}%" if pct else f"{x:.3f}"


def _acc(acc: dict, mode: str) -> str:
    a = acc.get(mode)
    return f"{100 * a['acc']:.1f}% ± {100 * a['stderr']:.1f} (n={a['n']})" if a else "n/a"


def verdicts(res: dict, cfg) -> list[tuple[str, str, str]]:
    """(observation, holds / partly / does not hold, the measured reason); rules are stated inline."""
    out = []
    main, mid = res["main_retention"], res["middle_layer"]
    h = res["heads"][main]
    mid_j = float(h["per_layer"][mid])
    mean_j = float(np.mean(h["per_layer"]))
    rule = "holds if >= 0.9 (paper > 0.95); partly if > 2x random; else does not hold"
    state = "holds" if mid_j >= 0.9 else "partly" if mid_j > 2 * h["random"] else "does not hold"
    out.append(("I: heads of a layer pick similar tokens", state,
                f"middle layer {_f(mid_j)}, all layers {_f(mean_j)}, random {_f(h['random'])} at {main:.0%} ({rule})"))
    rets = res["retentions"]
    means = [float(np.mean(res["heads"][r]["per_layer"])) for r in rets]
    rising = all(b >= a for a, b in zip(means, means[1:]))
    above = all(m > 2 * res["heads"][r]["random"] for m, r in zip(means, rets))
    out.append(("II: similarity rises with retention, above random", "holds" if rising and above else
                "partly" if rising or above else "does not hold",
                ", ".join(f"{r:.0%}: {_f(m)} (random {_f(res['heads'][r]['random'])})" for r, m in zip(rets, means))))
    lay = res["layers"]
    adj = float(np.mean(lay["adjacent_shared"]))
    out.append(("III: adjacent layers pick similar tokens", "holds" if adj >= 0.5 else
                "partly" if adj > 2 * lay["random_jaccard"] else "does not hold",
                f"shared-set Jaccard l vs l+1 {_f(adj)} (random {_f(lay['random_jaccard'])}; holds if >= 0.5)"))
    between = lay["period_between"]
    out.append(("ContiguousKV: periods of layers share chunks", "n/a (one period)" if math.isnan(between) else
                "holds" if between >= 0.52 else
                "partly" if between > 1.5 * lay["random_coverage"] else "does not hold",
                f"adjacent-period coverage {_f(between, True)} (paper 52-64%; random {_f(lay['random_coverage'], True)})"))
    spi_r = res["spi"][main]["recall"]
    acc = res["accuracy"]
    cost = ""
    if acc and f"spi@{main}" in acc:
        cost = f"; accuracy own {_acc(acc, f'own@{main}')} vs static {_acc(acc, f'spi@{main}')}"
    out.append(("SPI: important tokens depend on the query", "holds" if spi_r < 0.8 else "partly" if spi_r < 0.95
                else "does not hold", f"recall of own sets by another query's sets {_f(spi_r, True)} at {main:.0%}{cost}"))
    paper_ret = max(res["density"])
    d = res["density"][paper_ret]["shared"]
    out.append(("Important tokens are spread thinly over chunks", "holds" if d["read_amplification"] >= 1.5 else
                "partly" if d["read_amplification"] >= 1.2 else "does not hold",
                f"{_f(d['mean_fraction'], True)} important per touched {res['chunk_tokens']}-token chunk -> "
                f"{d['read_amplification']:.2f}x at {paper_ret:.0%} kept (paper 46% -> 2.2x)"))
    return out


def gqa_notes(res: dict, cfg) -> str:
    """What the measured head similarity means for choosing probe heads on this model."""
    main = res["main_retention"]
    group = cfg.num_heads // cfg.num_kv_heads
    if group == 1:
        return ("**Probe heads:** every query head has its own KV head here, so probe keys cost the same whichever "
                "heads are chosen.\n")
    h = res["heads"][main]
    within = float(np.nanmean(h["within_per_layer"]))
    across = float(np.nanmean(h["across_per_layer"])) if h["across_per_layer"] is not None else float("nan")
    spread = res["probes"]["spread (one per KV head)"]
    same = res["probes"]["same KV group (first 3 heads)"]
    every = res["probes"]["all heads"]
    lines = [f"**Probe heads on a grouped-query model** ({cfg.num_heads} query heads sharing {cfg.num_kv_heads} KV heads, "
             f"retention {main:.0%}, alpha 0.6):\n",
             f"- Query heads that share a KV head agree more than heads on different KV heads: Jaccard {_f(within)} vs "
             f"{_f(across)} (random {_f(h['random'])}).",
             f"- Probes spread over KV heads {spread['probes']} read the keys of {spread['probe_kv_heads']} of "
             f"{cfg.num_kv_heads} KV heads, i.e. {_f(spread['keys_loaded'], True)} of all prefix keys: "
             + ("no key I/O is saved over loading all keys (H2O), " if spread['keys_loaded'] >= 0.999 else "")
             + f"and they pass the ITF test in {_f(spread['itf_pass'], True)} of layers.",
             f"- Probes in one KV group {same['probes']} read {_f(same['keys_loaded'], True)} of the keys; their "
             f"agreement is {_f(same['probe_jaccard'])} vs {_f(spread['probe_jaccard'])} for spread probes"
             + (" (inflated by the shared keys)" if same['probe_jaccard'] > spread['probe_jaccard'] else "")
             + f": they pass in "
             f"{_f(same['itf_pass'], True)} of layers while the shared set they choose recovers "
             f"{_f(same['shared_recall'], True)} of every head's own set (spread probes: {_f(spread['shared_recall'], True)}; "
             f"all {cfg.num_heads} heads: {_f(every['shared_recall'], True)}).",
             "- Reading: the probe test trades I/O against trust: spread probes make the threshold meaningful "
             "but save no key reads when the probes cover every KV head; same-group probes save key reads but pass "
             "the threshold on similarity that does not carry to the other KV heads. A threshold calibrated on "
             "cross-KV-head similarity, or fewer probe KV heads than KV heads, is needed for ITF to pay off.\n"]
    return "\n".join(lines) + "\n"


def write_markdown(res: dict, meta: dict, out: pathlib.Path, figures) -> pathlib.Path:
    cfg = meta["cfg"]
    rets, main, mid = res["retentions"], res["main_retention"], res["middle_layer"]
    acc = res["accuracy"]
    L = []
    w = L.append
    w(f"# Observations: {meta['model']} on {meta['task']}\n")
    w(f"Measured by `{meta['command']}` in {meta['wall_s']:.0f} s on {meta['device']}.\n")
    w(f"- model: {meta['model']} ({meta['weights']} weights), {cfg.num_layers} layers, {cfg.num_heads} query heads, "
      f"{cfg.num_kv_heads} KV heads (groups of {cfg.num_heads // cfg.num_kv_heads}), head_dim {cfg.head_dim}")
    w(f"- task: {meta['task']}, {meta['n_requests']} requests on {meta['n_prefixes']} shared prefixes, prefix "
      f"{meta['prefix_mean']:.0f} tokens on average (max {meta['prefix_max']}), query {meta['query_mean']:.1f} tokens")
    w("- importance: H2O column sums of every query head's softmax over the prefix + causal query keys, rows = "
      "query tokens only (the prefix KV is reused; `specjax.kernels.probe_scores`); important set = top "
      "ceil(r * prefix) tokens per head. Shared set = top-k of the per-head-normalised scores summed over heads "
      "(what ITF loads for all heads).")
    w("- accuracy: lm-eval loglikelihood accuracy (argmax of summed log p(choice)); under a selection, the query "
      "and continuation tokens attend only to the selected prefix tokens (per query head) in every layer, "
      "masked reference attention. Selections come from an unpruned pass over the query (oracle scores), so "
      "they are what an exact identification would pick, not what a pruned pass would.")
    w("- paper numbers are quoted from the papers for other models; they are never measured here.\n")

    w("## Summary\n")
    w("| observation | on this model | measured |")
    w("|---|---|---|")
    for name, state, why in verdicts(res, cfg):
        w(f"| {name} | **{state}** | {why} |")
    w("")

    w(gqa_notes(res, cfg))
    w("## 1. Head similarity (SPEC Obs. I/II, Fig. 7b, 8)\n")
    w("| retention | middle layer (all pairs) | all layers (all pairs) | same KV head | different KV heads | random | paper |")
    w("|---|---|---|---|---|---|---|")
    for r in rets:
        h = res["heads"][r]
        paper = {0.1: PAPER["head_jaccard_10"], 0.4: PAPER["head_jaccard_40"]}.get(r, "")
        if r == main:
            paper = (paper + "; " if paper else "") + PAPER["head_jaccard"]
        w(f"| {r:.0%} | {_f(float(h['per_layer'][mid]))} | {_f(float(np.mean(h['per_layer'])))} | "
          f"{_f(float(np.nanmean(h['within_per_layer'])) if h['within_per_layer'] is not None else None)} | "
          f"{_f(float(np.nanmean(h['across_per_layer'])) if h['across_per_layer'] is not None else None)} | "
          f"{_f(h['random'])} | {paper} |")
    w(f"\nPer-layer means: `fig8_head_jaccard_per_layer.png`; layer {mid} heatmaps: `fig7b_head_jaccard_heatmap.png`.\n")
    w(f"### Probe-head choice on this model (retention {main:.0%}, alpha 0.6)\n")
    w("| probes | query heads | KV heads read | probes' mean Jaccard | ITF passes | shared set's recall of every head's own set | prefix keys read |")
    w("|---|---|---|---|---|---|---|")
    for name, p in res["probes"].items():
        w(f"| {name} | {p['probes']} | {p['probe_kv_heads']} of {cfg.num_kv_heads} | {_f(p['probe_jaccard'])} | "
          f"{_f(p['itf_pass'], True)} of layers | {_f(p['shared_recall'], True)} | {_f(p['keys_loaded'], True)} |")
    w("")

    lay = res["layers"]
    w(f"## 2. Layer similarity (SPEC Obs. III; ContiguousKV Fig. 7), retention {main:.0%}\n")
    w("| measurement | measured | random | paper |")
    w("|---|---|---|---|")
    w(f"| Jaccard of shared sets, layer l vs l+1 (mean over layers) | {_f(float(np.mean(lay['adjacent_shared'])))} | "
      f"{_f(lay['random_jaccard'])} | {PAPER['adjacent']} |")
    w(f"| Jaccard of the same head, layer l vs l+1 | {_f(float(np.mean(lay['adjacent_per_head'])))} | "
      f"{_f(lay['random_jaccard'])} | |")
    w(f"| coverage between adjacent periods of {lay['period_layers']} layers ({lay['chunk_tokens']}-token chunks) | "
      f"{_f(lay['period_between'], True)} | {_f(lay['random_coverage'], True)} | {PAPER['period']} |")
    w(f"| coverage of a layer's chunk set by its period's first-layer set | {_f(lay['period_within'], True)} | "
      f"{_f(lay['random_coverage'], True)} | |")
    w("\nFigure: `obs3_layer_similarity.png` (layer x layer matrix and adjacent-layer curve).\n")

    w("## 3. Static pre-identification (SPEC Fig. 4)\n")
    w("Each request reuses the per-head important sets of the first other request on its prefix.\n")
    w("| retention | recall of own sets | accuracy, own sets (ORI) | accuracy, other query's sets (SPI) | paper |")
    w("|---|---|---|---|---|")
    for r in rets:
        w(f"| {r:.0%} | {_f(res['spi'][r]['recall'], True)} | {_acc(acc, f'own@{r}')} | {_acc(acc, f'spi@{r}')} | "
          f"{PAPER['spi'] if r == main else ''} |")
    if acc:
        w(f"\nFull prefix (no selection): {_acc(acc, 'full')}. Figure: `fig4_static_preidentification.png`.\n")
    else:
        w("\nAccuracy not measured (--noaccuracy).\n")

    w(f"## 4. Chunk density and read amplification ({res['chunk_tokens']}-token chunks; SPEC Fig. 5a, ContiguousKV Fig. 4)\n")
    w("| retention | important per touched chunk (shared set) | read amplification (shared) | important per touched chunk (per KV head) | read amplification (per KV head) | request p50 / p90 amplification (shared) | paper |")
    w("|---|---|---|---|---|---|---|")
    for r, d in sorted(res["density"].items()):
        amps = d["per_request_amp"]
        paper = PAPER["density"] if r == 0.5 else PAPER["ckv_amp"] if r == 0.25 else ""
        w(f"| {r:.0%} | {_f(d['shared']['mean_fraction'], True)} | {d['shared']['read_amplification']:.2f}x | "
          f"{_f(d['per_kv_head']['mean_fraction'], True)} | {d['per_kv_head']['read_amplification']:.2f}x | "
          f"{np.percentile(amps, 50):.2f}x / {np.percentile(amps, 90):.2f}x | {paper} |")
    w("\nNo caching here: every touched chunk is counted as read. Figure: `fig5a_chunk_density.png`.\n")

    w(f"## 5. ITF threshold sweep (SPEC Fig. 11, 19, 22), retention {main:.0%}, reference path\n")
    w("Measured from the importance scores above and the masked reference attention, not by the engine: "
      "per layer the probes' mean Jaccard J is compared with t = j^alpha; J >= t keeps the probes' shared "
      "set for all heads, otherwise every head keeps its own top-k (fallback, all keys read).\n")
    w("| alpha | probes | fallback (layers) | prefix keys read | tokens kept (union over heads) | accuracy | paper |")
    w("|---|---|---|---|---|---|---|")
    for a in res["alphas"]:
        for probes_name in ("spread", "same_group"):
            s = res["itf"][(probes_name, a)]
            accs = _acc(acc, f"itf@{a}") if probes_name == "spread" else "not measured"
            paper = PAPER["fallback"] if (a == 0.6 and probes_name == "spread") else ""
            w(f"| {a} | {probes_name} {s['probes']} | {_f(s['fallback'], True)} | {_f(s['keys_loaded'], True)} | "
              f"{_f(float(np.mean(s['kept_per_layer'])), True)} | {accs} | {paper} |")
    w("\nFigure: `fig11_19_22_itf_threshold.png` (keys read and accuracy vs alpha; fallback per layer).\n")
    w(meta.get("engine_note", "## 5b/6. Engine measurements\n\npending: the engine was not run."))
    w("")
    w("## Figures\n")
    for f in figures:
        w(f"- `{f.name}`")
    path = out / "observations.md"
    path.write_text("\n".join(L) + "\n")
    return path


def engine_section(res: dict) -> str:
    """Markdown for items 5 (engine alpha sweep) and 6 (reordering, cache policy)."""
    eng = res.get("engine") or {}
    L = ["## 5b. ITF threshold sweep with the engine (SPEC Fig. 11, 19, 22)\n"]
    runs = eng.get("runs") or {}
    if "error" in eng:
        L.append(f"**pending / partial**: {eng['error']}\n")
    alphas = [a for a in res["alphas"] if f"spec alpha={a}" in runs]
    if alphas:
        probes = runs[f"spec alpha={alphas[0]}"].get("probe_heads")
        L.append(f"`spec` system (speculative prefetch, score cache, reordering; the engine's probe heads {probes}) "
                 f"at retention {res['main_retention']:.0%}; "
                 "accuracy from the engine's continuation log-likelihoods; fallback and retention from its per-layer "
                 "record; prefix keys read derived from that record (probe KV heads' keys, then selected or all keys).\n")
        L.append("| alpha | accuracy | fallback (layers) | prefix keys read | chunks read / request | paper |")
        L.append("|---|---|---|---|---|---|")
        for a in alphas:
            r = runs[f"spec alpha={a}"]
            L.append(f"| {a} | {100 * r['accuracy']:.1f}% ± {100 * r['stderr']:.1f} (n={r['n']}) | {_f(r['fallback'], True)} | "
                     f"{_f(r['keys_loaded'], True)} | {r['chunks_read_per_request']:.0f} | "
                     f"{PAPER['fallback'] if a == 0.6 else ''} |")
        L.append("")
    L.append("## 6. Reordering and cache policy with the engine (SPEC Fig. 20, 21)\n")
    base, noro, lfu = runs.get("spec alpha=0.6"), runs.get("spec no reorder"), runs.get("spec LFU cache")
    if base and noro and lfu:
        L.append(f"In-memory store (counts, not timings); device cache {eng['gpu_cache_bytes'] / 2**20:.1f} MiB and host "
                 f"cache {eng['cpu_cache_bytes'] / 2**20:.1f} MiB of {eng['store_bytes'] / 2**20:.1f} MiB stored prefix KV; "
                 "each prefix stored once, then its first request run twice as warm-up (reordering systems repack "
                 f"between the two passes{_reorder_note(eng)}), then every request in arrival order.\n")
        L.append("| measurement | measured | paper |")
        L.append("|---|---|---|")
        ratio = noro["chunks_read_per_request"] / base["chunks_read_per_request"] if base["chunks_read_per_request"] else float("nan")
        L.append(f"| chunks read per request, without / with reordering | {noro['chunks_read_per_request']:.0f} / "
                 f"{base['chunks_read_per_request']:.0f} ({ratio:.2f}x fewer) | {PAPER['reorder']} |")
        L.append(f"| device-cache hit ratio, LFU / score policy | {_f(lfu['device_hit_ratio'], True)} / "
                 f"{_f(base['device_hit_ratio'], True)} | {PAPER['hit']} |")
        L.append(f"| host-cache hit ratio, LFU / score policy | {_f(lfu['host_hit_ratio'], True)} / "
                 f"{_f(base['host_hit_ratio'], True)} | |")
        L.append(f"| accuracy, no reorder / LFU / spec | {100 * noro['accuracy']:.1f}% / {100 * lfu['accuracy']:.1f}% / "
                 f"{100 * base['accuracy']:.1f}% | |")
        L.append("\nFigure: `fig20_21_engine.png`.")
    else:
        L.append("**pending**: the engine runs needed for this item did not complete (see above).")
    return "\n".join(L) + "\n"


def _jsonable(x):
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


def _floats(text: str, name: str) -> list[float]:
    try:
        values = [float(v) for v in text.split(",") if v.strip()]
    except ValueError:
        values = []
    if not values:
        from specjax.eval.errors import EvalError

        raise EvalError(f"--{name} {text!r}: want comma-separated numbers, e.g. 0.1,0.25,0.4")
    return values


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


def run(values: dict, progress=print) -> dict:
    """The whole command; `values` has the flag names as keys. Returns the results dict."""
    from specjax.eval import tasks as tasks_lib, workload as workload_lib
    from specjax.eval.errors import EvalError
    from specjax.eval.fallback_tokenizer import tokenizer_for
    from specjax.eval.units import parse_fewshot

    started = time.time()
    retentions = _floats(values["retentions"], "retentions")
    alphas = _floats(values["alphas"], "alphas")
    if any(not 0 < r <= 1 for r in retentions + [values["main_retention"], values["density_retention"]]):
        raise EvalError("retentions must be fractions in (0, 1]")
    if values["main_retention"] not in retentions:
        retentions = sorted(set(retentions) | {values["main_retention"]})
    settings = {"retentions": retentions, "main_retention": values["main_retention"], "alphas": alphas,
                "density_retention": values["density_retention"], "chunk_tokens": values["chunk_tokens"],
                "period_chunk_tokens": values["period_chunk_tokens"], "period_layers": values["period_layers"],
                "accuracy": values["accuracy"], "reorder_every": values.get("reorder_every", 0),
                "gpu_cache": values.get("gpu_cache", 0.15), "cpu_cache": values.get("cpu_cache", 0.5)}
    model = _load_model(values["model"], values["init"], values["seed"])
    cfg = model.config
    task = tasks_lib.load_task(values["task"], values["data_dir"])
    tokenizer, _ = tokenizer_for(model)
    spec = workload_lib.WorkloadSpec(fewshot=parse_fewshot(values["num_fewshot"]), reuse_mean=values["reuse_mean"],
                                     prefix_tokens=values["prefix_tokens"] or None, limit=values["limit"],
                                     seed=values["seed"])
    wl = workload_lib.build_workload(task, tokenizer, spec)
    requests = ordered_by_prefix(wl.requests)
    longest = max(len(r.context_ids) + max(len(c) for c in r.choice_ids) for r in requests)
    if longest > cfg.max_positions:
        raise EvalError(f"the longest request has {longest} tokens, more than {cfg.max_positions}; lower --prefix_tokens")
    out = pathlib.Path(values["output_dir"] or f"results/observe-{pathlib.Path(values['model']).name}-{values['task']}")
    out.mkdir(parents=True, exist_ok=True)
    progress(f"{len(requests)} requests, {len({r.prefix_id for r in requests})} prefixes, "
             f"prefix {np.mean([len(r.prefix_ids) for r in requests]):.0f} tokens on average")
    records = collect(model, requests, settings, progress)
    res = analyse(records, cfg, settings)
    res["engine"] = (engine_measurements(model, wl.requests, settings, progress) if values.get("engine")
                     else {"error": "not run (--noengine)"})
    label = (f"{model.name} ({model.weights}), {values['task']}, n={len(records)} requests, "
             f"main retention {settings['main_retention']:.0%}")
    figures = write_figures(res, out, label)
    meta = {"cfg": cfg, "model": model.name, "weights": model.weights, "task": values["task"],
            "command": values.get("command") or "python -m specjax.eval.observe", "device": _device(),
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
    names = ("model", "init", "task", "data_dir", "limit", "num_fewshot", "prefix_tokens", "reuse_mean", "seed",
             "retentions", "main_retention", "density_retention", "chunk_tokens", "period_chunk_tokens",
             "period_layers", "alphas", "accuracy", "engine", "reorder_every", "gpu_cache", "cpu_cache",
             "output_dir")
    values = {n: FLAGS[n].value for n in names}
    values["command"] = shlex.join(["python", "-m", "specjax.eval.observe", *sys.argv[1:]])
    run(values)


if __name__ == "__main__":
    from specjax.cli import run as run_cli

    define_flags()
    run_cli(main)
