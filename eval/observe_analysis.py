"""The observations from collected importance scores (`observe_measure.Record`s): set measurements on index sets
(Jaccard, recall, chunk density) and the analyses behind items 1-5 of the report: head and layer similarity, the
probe-head choice, static pre-identification, chunk density, the ITF threshold sweep and accuracy per selection.

Every selection comes from `observe_measure` (H2O's top-k and ITF's decision, both `specjax.kernels.itf`); the
helpers here only measure the sets they return.
"""

from __future__ import annotations

import math

import numpy as np

from specjax.eval.observe_measure import (
    MeasureSettings,
    Record,
    identify_layers,
    itf_selection,
    keep_count,
    keys_fraction,
    kv_heads_of,
    kv_itf_selection,
    partner_of,
    probe_choices,
    shared_sets,
    top_k,
)
from specjax.kernels import itf

# ---------------------------------------------------------------- set measurements


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


def recall(found, wanted) -> float:
    """Fraction of `wanted` that is in `found` (1.0 when nothing is wanted)."""
    wanted = set(np.asarray(wanted).tolist())
    return len(wanted & set(np.asarray(found).tolist())) / len(wanted) if wanted else 1.0


def coverage(chosen, needed) -> float:
    """Fraction of `needed` already in `chosen` (ContiguousKV's coverage ratio)."""
    return recall(chosen, needed)


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


def random_jaccard(k: int, n: int) -> float:
    """Expected Jaccard of two random k-subsets of n (SPEC's j)."""
    return float(itf.itf_threshold(k, n, 1.0))


def _mean(values) -> float:
    values = [v for v in values if not (isinstance(v, float) and math.isnan(v))]
    return float(np.mean(values)) if values else float("nan")


# ---------------------------------------------------------------- analyses


def head_similarity(records: list[Record], cfg, retentions) -> dict:
    """Obs. I/II: per layer, the mean head x head Jaccard matrix and its within-/across-KV-group means."""
    group = cfg.q_per_kv
    group_of = np.arange(cfg.num_heads) // group
    out = {}
    for ret in retentions:
        mats, within, across, rand = [], [], [], []
        for rec in records:
            m = rec.scores.shape[-1]
            k = keep_count(ret, m)
            per_layer = [jaccard_matrix(sets) for sets in top_k(rec.scores, k)]
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
    """How well each probe-head choice (`observe_measure.probe_choices`: the engine's, spread, all heads) stands
    in for all heads under ITF: the probes' Jaccard, the ITF pass rate, how much of every head's own set the
    shared set recovers, and the keys it must load."""
    out = {}
    for name, probes in probe_choices(cfg).items():
        probe_kv = len(kv_heads_of(cfg, probes))
        jac, passed, rec_all, keys = [], [], [], []
        for rec in records:
            m = rec.scores.shape[-1]
            k = keep_count(retention, m)
            decision = identify_layers(rec.scores[:, list(probes)], k, alpha)
            own = top_k(rec.scores, k)
            for layer in range(len(rec.scores)):
                shared, use_shared = decision.shared[layer], bool(decision.use_shared[layer])
                jac.append(float(decision.jaccard[layer]))
                passed.append(use_shared)
                rec_all.append(np.mean([recall(shared, own[layer, h]) for h in range(cfg.num_heads)]))
                keys.append(keys_fraction(probe_kv, cfg.num_kv_heads, m, k, not use_shared))
        out[name] = {"probes": list(probes), "probe_kv_heads": probe_kv,
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
        shared = shared_sets(rec.scores, k)
        mats.append(jaccard_matrix(shared))
        adj_shared.append([jaccard(shared[l], shared[l + 1]) for l in range(L - 1)])
        heads = top_k(rec.scores, k)
        adj_head.append([np.mean([jaccard(heads[l][h], heads[l + 1][h]) for h in range(cfg.num_heads)])
                         for l in range(L - 1)])
        # a token's importance: its share of each head's attention, summed over heads (ITF's shared score)
        cs = chunk_scores(np.asarray(itf.normalised(rec.scores).sum(-2)), chunk)  # [L, chunks]
        kc = keep_count(retention, cs.shape[1])
        csets = top_k(cs, kc)
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
            k = keep_count(ret, b.shape[-1])
            theirs, own = top_k(a, k), top_k(b, k)
            recalls.append(np.mean([recall(theirs[l, h], own[l, h])
                                    for l in range(len(b)) for h in range(cfg.num_heads)]))
        out[ret] = {"recall": _mean(recalls), "pairs": len(partners)}
    return out


def density(records: list[Record], cfg, retentions, chunk: int) -> dict:
    """SPEC Fig. 5a: important fraction per touched chunk and read amplification, for the shared
    set (what ITF loads for all heads) and per KV head (union of its query heads' sets)."""
    group = cfg.q_per_kv
    out = {}
    for ret in retentions:
        res = {"shared": ([], []), "per_kv_head": ([], [])}
        per_request_amp = []
        for rec in records:
            m = rec.scores.shape[-1]
            k = keep_count(ret, m)
            amps = []
            for shared, own in zip(shared_sets(rec.scores, k), top_k(rec.scores, k)):
                frac, amp = chunk_density(shared, m, chunk)
                res["shared"][0].extend(frac)
                res["shared"][1].append(amp)
                amps.append(amp)
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
    """SPEC Fig. 11/19/22 from the collected scores: per alpha and probe set (the engine's probe heads and
    spread probes), keys read, tokens kept and the fallback rate per layer. Keys: (probes key, alpha)."""
    out = {}
    choices = probe_choices(cfg)
    for probes_name in ("spread", "engine"):
        probes = choices[probes_name]
        probe_kv = len(kv_heads_of(cfg, probes))
        for alpha in alphas:
            fell_layers, keys, kept = [], [], []
            for rec in records:
                m = rec.scores.shape[-1]
                k = keep_count(retention, m)
                sets, _, fell = itf_selection(rec.scores, k, probes, alpha)
                fell_layers.append(fell)
                keys.append(np.mean([keys_fraction(probe_kv, cfg.num_kv_heads, m, k, f) for f in fell]))
                kept.append([len(np.unique(s)) / m for s in sets])
            out[(probes_name, alpha)] = {
                "fallback_per_layer": np.mean(fell_layers, axis=0), "fallback": float(np.mean(fell_layers)),
                "keys_loaded": float(np.mean(keys)), "kept_per_layer": np.mean(kept, axis=0),
                "probes": list(probes)}
    return out


def kv_head_test(records: list[Record], cfg, retention: float, alphas) -> dict:
    """spec_gqa's test (KV-head probes, `observe_measure.kv_itf_selection`) per alpha: its pass rate per layer and,
    where it passes, how much of every query head's own top-k the shared set recovers (what sharing keeps); beside
    them the same for the engine's ITF (SPEC's query-head probes). Empty on a model with one query head per KV
    head, where the two tests are the same."""
    if cfg.q_per_kv == 1:
        return {}
    out = {}
    for alpha in alphas:
        passed = {"kvheads": [], "engine": []}
        kept = {"kvheads": [], "engine": []}
        for rec in records:
            m = rec.scores.shape[-1]
            k = keep_count(retention, m)
            own = top_k(rec.scores, k)
            chosen = {"kvheads": kv_itf_selection(rec.scores, cfg, k, alpha),
                      "engine": itf_selection(rec.scores, k, probe_choices(cfg)["engine"], alpha)}
            for name, (sets, _, fell) in chosen.items():
                passed[name].append(~fell)
                kept[name].append([np.mean([recall(s, own[layer, h]) for h in range(cfg.num_heads)])
                                   if not f else np.nan for layer, (s, f) in enumerate(zip(sets, fell))])
        out[alpha] = {name: {"pass_per_layer": np.mean(passed[name], axis=0), "pass": float(np.mean(passed[name])),
                             "recall_per_layer": _nanmean_rows(kept[name]),
                             "recall": float(np.nanmean(kept[name])) if np.any(~np.isnan(kept[name])) else float("nan")}
                      for name in passed}
    return out


def _nanmean_rows(rows) -> np.ndarray:
    """Column means of a [requests, layers] array ignoring NaN (a layer no request passed on: NaN)."""
    a = np.asarray(rows, dtype=np.float64)
    counts = (~np.isnan(a)).sum(0)
    return np.where(counts > 0, np.nansum(a, 0) / np.maximum(counts, 1), np.nan)


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


def analyse(records: list[Record], cfg, settings: MeasureSettings) -> dict:
    """Every analysis of the collected records, keyed as the report and figures read them (retentions and alphas
    as lists)."""
    rets, main, alphas = list(settings.retentions), settings.main_retention, list(settings.alphas)
    density_rets = sorted(set(rets) | {settings.density_retention})
    return {
        "retentions": rets, "main_retention": main, "alphas": alphas,
        "middle_layer": cfg.num_layers // 2, "chunk_tokens": settings.chunk_tokens,
        "heads": head_similarity(records, cfg, rets),
        "probes": probe_choice(records, cfg, main),
        "layers": layer_similarity(records, cfg, main, settings.period_chunk_tokens, settings.period_layers),
        "spi": static_preidentification(records, cfg, rets),
        "density": density(records, cfg, density_rets, settings.chunk_tokens),
        "itf": itf_sweep(records, cfg, main, alphas),
        "kv_heads": kv_head_test(records, cfg, main, alphas),
        "accuracy": accuracy(records) if settings.accuracy else {},
    }
