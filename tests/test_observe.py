"""The observation measurements on hand-built index sets, and the command on a tiny random model."""

import dataclasses

import jax.numpy as jnp
import numpy as np
import pytest

from specjax.config import from_hf_config
from specjax.configs.models import MODEL_SHAPES
from specjax.engine.policy_steps import probe_kv_heads, probe_query_heads
from specjax.eval import observe, observe_analysis as A, observe_measure as M, observe_report as R
from specjax.kernels import itf


def test_jaccard_spec_example():
    # SPEC section III: h0 = {0, 2}, h1 = {0, 1} -> 1/3
    assert A.jaccard([0, 2], [0, 1]) == pytest.approx(1 / 3)
    assert A.jaccard([], []) == 1.0
    assert A.jaccard([1, 2, 3], [4, 5]) == 0.0


def test_jaccard_matrix_and_group_means():
    sets = [[0, 1], [0, 1], [0, 2], [3, 4]]
    mat = A.jaccard_matrix(sets)
    assert np.allclose(np.diag(mat), 1.0)
    assert mat[0, 1] == 1.0 and mat[0, 2] == pytest.approx(1 / 3) and mat[0, 3] == 0.0
    assert np.allclose(mat, mat.T)
    # groups {0,1}, {2,3}: within = mean(1, 0), across = mean(1/3, 0, 1/3, 0)
    within, across = A.group_pair_means(mat, np.array([0, 0, 1, 1]))
    assert within == pytest.approx(0.5)
    assert across == pytest.approx(1 / 6)


def test_top_k_and_shared_sets():
    scores = np.array([[0.1, 0.9, 0.5, 0.0], [0.8, 0.1, 0.7, 0.2]], np.float32)
    assert M.top_k(scores, 2).tolist() == [[1, 2], [0, 2]]  # best first
    # head 1 has 9x the total mass of head 0, but after normalising each head votes equally
    skewed = np.array([[[1.0, 0.0, 0.2], [0.0, 9.0, 0.0]]], np.float32)
    assert sorted(M.shared_sets(skewed, 2)[0].tolist()) == [0, 1]


def test_recall_and_coverage():
    assert A.recall(found=[0, 1, 2], wanted=[1, 2, 3, 4]) == 0.5
    assert A.recall(found=[5], wanted=[]) == 1.0
    assert A.coverage([0, 1], [1]) == 1.0


def test_chunk_density_spec_style():
    # 8 important tokens of a 256-token prefix in 64-token chunks: 4 in chunk 0, 4 in chunk 2
    idx = [0, 1, 2, 3, 130, 131, 132, 133]
    fractions, amp = A.chunk_density(idx, 256, 64)
    assert fractions.tolist() == [4 / 64, 4 / 64]
    assert amp == pytest.approx(128 / 8)
    # half the tokens, packed into whole chunks: no amplification
    fractions, amp = A.chunk_density(list(range(128)), 256, 64)
    assert fractions.tolist() == [1.0, 1.0] and amp == 1.0
    # a partial last chunk counts only its real tokens (prefix of 70 tokens: chunk 1 has 6)
    fractions, amp = A.chunk_density([64, 65, 66], 70, 64)
    assert fractions.tolist() == [0.5] and amp == pytest.approx(2.0)


def test_chunk_scores():
    assert A.chunk_scores(np.arange(5.0), 2).tolist() == [1.0, 5.0, 4.0]


def test_random_jaccard_matches_formula():
    k, n = 25, 100
    overlap = k * k / n
    assert A.random_jaccard(k, n) == pytest.approx(overlap / (2 * k - overlap), rel=1e-5)


def test_keys_fraction():
    # 3 KV heads, probes on 1 of them, 25 of 100 tokens selected: 100 + 2 * 25 of 300 keys
    assert M.keys_fraction(1, 3, 100, 25, fallback=False) == pytest.approx(150 / 300)
    assert M.keys_fraction(3, 3, 100, 25, fallback=False) == 1.0
    assert M.keys_fraction(1, 3, 100, 25, fallback=True) == 1.0


# smollm2-135m's heads (9 query heads on 3 KV heads), 3 of its layers
GqaCfg = dataclasses.replace(from_hf_config(MODEL_SHAPES["smollm2-135m"]), num_layers=3)


def test_probe_choices_on_gqa():
    assert M.spread_probe_heads(GqaCfg) == (0, 3, 6)
    choices = M.probe_choices(GqaCfg)
    assert choices["engine"] == probe_query_heads(GqaCfg) == (0, 1, 2)
    assert M.kv_heads_of(GqaCfg, choices["engine"]) == probe_kv_heads(GqaCfg) == (0,)
    assert M.kv_heads_of(GqaCfg, choices["spread"]) == (0, 1, 2)


def test_itf_selection_shares_when_probes_agree_and_falls_back_otherwise():
    agree = np.tile(np.array([5.0, 4.0, 0.1, 0.2, 0.3, 0.0]), (4, 1))
    disagree = np.zeros((4, 6))
    for head in range(4):  # head h prefers tokens 2h, 2h+1 (mod 6): disjoint probe sets
        disagree[head, [2 * head % 6, (2 * head + 1) % 6]] = [2.0, 1.0]
    scores = np.stack([agree, disagree]).astype(np.float32)  # [L=2, H=4, m=6]
    sets, jac, fell = M.itf_selection(scores, 2, probes=(0, 1, 2), alpha=0.6)
    assert fell.tolist() == [False, True]
    assert sets[0].tolist() == [0, 1] and sets[1].shape == (4, 2)
    assert jac[0] == 1.0


def test_itf_selection_is_the_engines_identify():
    # observe's ITF decision must be kernels.itf.identify's (what the engine's state.itf_select calls), layer by layer
    rng = np.random.default_rng(0)
    scores = rng.gamma(0.3, size=(6, 9, 70)).astype(np.float32)  # [L, H, m]
    scores[:3, :3] += 3 * scores[:3, :1]  # the first three heads agree in the first three layers
    k, probes = 12, probe_query_heads(GqaCfg)
    decisions = set()
    for alpha in (0.0, 0.3, 0.6, 1.0, 2.0):
        sets, jac, fell = M.itf_selection(scores, k, probes, alpha)
        for layer in range(len(scores)):
            want = itf.identify(jnp.asarray(scores[layer, list(probes)]), k, 70, alpha, k_cap=k)
            decisions.add((alpha, bool(want.use_shared)))
            assert fell[layer] == (not bool(want.use_shared))
            assert jac[layer] == pytest.approx(float(want.jaccard), abs=1e-6)
            if want.use_shared:
                assert sets[layer].tolist() == np.asarray(want.shared)[:k].tolist()
            else:  # the engine's fallback: every head's own top-k (engine.state.per_head_select)
                assert sets[layer].tolist() == np.asarray(itf.top_k(jnp.asarray(scores[layer]), k)).tolist()
    assert {(0.6, True), (0.6, False)} <= decisions, "the case should cover both decisions"


def test_kv_head_test_is_not_passed_by_heads_sharing_keys():
    # smollm2's shape: 9 query heads on 3 KV heads. Layer 0: the heads of KV head 0 agree with each other (SPEC's
    # probes, query heads 0-2, pass) but the KV heads want disjoint tokens; layer 1: every head agrees.
    m, k = 30, 4
    scores = np.full((2, 9, m), 0.01, np.float32)
    for head in range(9):
        scores[0, head, 4 * (head // 3): 4 * (head // 3) + 4] = [4.0, 3.0, 2.0, 1.0]
        scores[1, head, 20:24] = [4.0, 3.0, 2.0, 1.0]
    assert M.kv_probe_heads(GqaCfg) == (0, 1, 2)
    sets, jac, fell = M.kv_itf_selection(scores, GqaCfg, k, alpha=0.6)
    assert fell.tolist() == [True, False] and jac[1] == 1.0
    assert sets[0].shape == (9, k) and sets[1].tolist() == [20, 21, 22, 23]
    assert M.itf_selection(scores, k, probe_query_heads(GqaCfg), alpha=0.6)[2].tolist() == [False, False]
    test = A.kv_head_test([M.Record(0, 0, 0, scores)], GqaCfg, retention=0.13, alphas=[0.6])[0.6]
    assert test["kvheads"]["pass_per_layer"].tolist() == [0.0, 1.0]
    assert test["engine"]["pass_per_layer"].tolist() == [1.0, 1.0]
    # the engine's layer-0 shared set is KV group 0's tokens: it keeps 1/3 of the nine heads' own sets
    assert test["engine"]["recall_per_layer"][0] == pytest.approx(1 / 3)
    assert np.isnan(test["kvheads"]["recall_per_layer"][0]) and test["kvheads"]["recall_per_layer"][1] == 1.0
    assert A.kv_head_test([], dataclasses.replace(GqaCfg, num_kv_heads=9), 0.25, [0.6]) == {}


def test_kv_head_test_is_not_passed_by_kv_heads_agreeing_while_their_query_heads_do_not():
    # every KV head's first query head wants tokens 0-3, its other two tokens 10-13: the KV heads agree (Jaccard 1),
    # the shared set is 10-13, and each first query head keeps almost none of its own attention: the guard fails
    m, k = 30, 4
    scores = np.full((1, 9, m), 0.01, np.float32)
    for head in range(9):
        scores[0, head, (0 if head % 3 == 0 else 10) + np.arange(4)] = [4.0, 3.0, 2.0, 1.0]
    sets, jac, fell = M.kv_itf_selection(scores, GqaCfg, k, alpha=0.6)
    assert jac[0] == 1.0 and fell.tolist() == [True] and sets[0].shape == (9, k)
    scores[0, ::3] = scores[0, 1]  # now every query head agrees: shared
    sets, jac, fell = M.kv_itf_selection(scores, GqaCfg, k, alpha=0.6)
    assert fell.tolist() == [False] and sorted(sets[0].tolist()) == [10, 11, 12, 13]


def test_reported_engine_probes_are_the_engines(tmp_path):
    rng = np.random.default_rng(0)
    records = [M.Record(i, i % 2, 0, rng.gamma(0.3, size=(3, 9, 64)).astype(np.float32)) for i in range(4)]
    settings = M.MeasureSettings(retentions=(0.25,), main_retention=0.25, alphas=(0.6,), density_retention=0.5,
                                 chunk_tokens=16, period_chunk_tokens=8, period_layers=1, accuracy=False,
                                 reorder_every=0, gpu_cache_bytes=0, cpu_cache_bytes=0)
    res = A.analyse(records, GqaCfg, settings)
    engine = list(probe_query_heads(GqaCfg))
    assert res["probes"]["engine"]["probes"] == engine
    assert res["probes"]["engine"]["probe_kv_heads"] == len(probe_kv_heads(GqaCfg))
    assert res["itf"][("engine", 0.6)]["probes"] == engine
    assert res["probes"]["spread"]["probes"] != engine
    res["engine"] = {"error": "not run"}
    meta = {"cfg": GqaCfg, "model": "m", "weights": "random", "task": "t", "command": "c", "wall_s": 0.0,
            "device": "cpu", "n_requests": 4, "n_prefixes": 2, "prefix_mean": 64.0, "prefix_max": 64,
            "query_mean": 5.0}
    md = R.write_markdown(res, meta, tmp_path, []).read_text()
    assert f"the engine's ITF probes with the first 3 query heads {engine}" in md
    assert f"The engine's probes {engine}" in md and "Spread probes [0, 3, 6] (one query head per KV group)" in md
    assert "same KV group" not in md and "same_group" not in md


def test_engine_probes_follow_the_engines_choice(monkeypatch):
    from specjax.engine import policy_steps

    monkeypatch.setattr(policy_steps, "probe_query_heads", lambda cfg, count=3: (2, 5, 8))
    assert M.probe_choices(GqaCfg)["engine"] == (2, 5, 8)


def test_partner_of_pairs_requests_on_the_same_prefix():
    recs = [M.Record(i, p, 0, np.zeros((1, 1, 4))) for i, p in enumerate([0, 0, 1, 0])]
    assert M.partner_of(recs) == {0: 1, 1: 0, 3: 0}


def test_selected_pass_matches_plain_forward_and_selection_changes_it():
    import specjax
    from specjax.models import inference

    model = specjax.load_model("tiny-llama", init="random")
    rng = np.random.default_rng(0)
    prefix, query, cont = (rng.integers(0, 500, n).tolist() for n in (40, 6, 3))
    kv = M.prefix_kv(model, prefix)
    ours = M.choice_logprobs(model, kv, query, [cont])[0]
    ids = prefix + query + cont
    logits = inference.forward_logits(model.config, model.params, ids)
    logp = logits - np.logaddexp.reduce(logits, axis=-1, keepdims=True)
    n = len(prefix) + len(query)
    assert ours == pytest.approx(float(logp[np.arange(n - 1, len(ids) - 1), cont].sum()), abs=1e-3)
    cfg = model.config
    every_head = [np.tile(np.arange(len(prefix)), (cfg.num_heads, 1))] * cfg.num_layers
    assert M.choice_logprobs(model, kv, query, [cont], every_head)[0] == pytest.approx(ours, abs=1e-4)
    few = [np.arange(4)] * cfg.num_layers
    assert M.choice_logprobs(model, kv, query, [cont], few)[0] != pytest.approx(ours, abs=1e-4)
    scores = M.query_importance(model, kv, query)
    assert scores.shape == (cfg.num_layers, cfg.num_heads, len(prefix))
    # each query row's softmax mass over the prefix is at most 1
    assert np.all(scores.sum(-1) <= len(query) + 1e-4)


def test_command_on_tiny_random_model(tmp_path):
    values = {"model": "tiny-llama", "init": "random", "task": "needle", "data_dir": None, "limit": 4,
              "num_fewshot": "2-10", "prefix_tokens": 100, "reuse_mean": 4.0, "seed": 0,
              "retentions": "0.1,0.25", "main_retention": 0.25, "density_retention": 0.5, "chunk_tokens": 16,
              "period_chunk_tokens": 8, "period_layers": 1, "alphas": "0,0.6,2", "accuracy": True,
              "engine": False, "output_dir": str(tmp_path), "command": "test"}
    res = observe.run(values, progress=lambda *_: None)
    md = (tmp_path / "observations.md").read_text()
    for name in ("fig7b_head_jaccard_heatmap.png", "fig8_head_jaccard_per_layer.png", "obs3_layer_similarity.png",
                 "fig4_static_preidentification.png", "fig5a_chunk_density.png", "fig11_19_22_itf_threshold.png",
                 "observations.json"):
        assert (tmp_path / name).stat().st_size > 0, name
        if name.endswith(".png"):
            assert f"`{name}`" in md
    assert "| paper |" in md and "tiny-llama" in md
    assert set(res["accuracy"]) >= {"full", "own@0.25", "itf-spread@0.6", "itf-kvheads@0.6"}  # tiny-llama: GQA
    assert "### spec_gqa's test" in md and set(res["kv_heads"]) == {0.0, 0.6, 2.0}
    assert 0.0 <= res["heads"][0.25]["per_layer"].min() <= 1.0


def test_observe_shares_the_evaluations_settings():
    """observe's model, workload and store flags are the eval's settings (their help and checks), with its own defaults;
    its own settings are checked as the eval's are."""
    from specjax.errors import SpecjaxError

    for group, (only, defaults) in observe.SHARED.items():
        assert set(only) <= {f.name for f in dataclasses.fields(group)} and set(defaults) <= set(only)
        group(**defaults)  # observe's defaults pass the shared checks
    assert {"gpu_cache", "prefix_tokens", "alphas", "output_dir"} <= set(observe.flag_names())
    with pytest.raises(SpecjaxError, match="main_retention 2.0: must be a fraction"):
        observe.ObserveSettings(main_retention=2.0)
    with pytest.raises(SpecjaxError, match="want comma-separated numbers"):
        observe.ObserveSettings(alphas="x")


def test_engine_section_marks_missing_engine_results_pending():
    res = {"alphas": [0.6], "main_retention": 0.25, "engine": {"error": "engine not importable: boom"}}
    text = R.engine_section(res)
    assert "pending" in text and "boom" in text


def test_engine_measurements_run_every_system_after_the_eval_warm_up():
    import specjax
    from specjax.eval.workload import Request

    model = specjax.load_model("tiny-llama", init="random")
    rng = np.random.default_rng(1)
    prefixes = [tuple(rng.integers(0, 500, n).tolist()) for n in (70, 90)]
    requests = [Request(request_id=i, prefix_id=i % 2, doc_index=i, prefix_ids=prefixes[i % 2],
                        query_ids=tuple(rng.integers(0, 500, 5).tolist()),
                        choice_ids=(tuple(rng.integers(0, 500, 2).tolist()), (7, 8)), choices=("a", "b"), gold=0)
                for i in range(5)]
    tree = observe.ObserveRun.from_values({"gpu_cache": "10%", "cpu_cache": "30%", "main_retention": 0.25,
                                           "alphas": "0.6", "chunk_tokens": 16, "reorder_every": 0})
    settings = observe.measure_settings(tree, M.stored_kv_bytes(model, requests))
    res = M.engine_measurements(model, requests, settings, progress=lambda *_: None)
    assert "error" not in res, res.get("error")
    # budgets as the eval's --gpu_cache / --cpu_cache take them: shares of the stored prefix KV
    assert res["gpu_cache_bytes"] == round(0.1 * res["store_bytes"]) > 0
    assert res["cpu_cache_bytes"] == round(0.3 * res["store_bytes"])
    assert set(res["runs"]) == {"spec alpha=0.6", "spec no reorder", "spec LFU cache"}
    for run in res["runs"].values():
        assert run["n"] == len(requests) and 0.0 <= run["accuracy"] <= 1.0
        assert run["chunks_read_per_request"] >= 0 and run["keys_loaded"] <= 1.0
    assert "no repack while measuring" in R._reorder_note(res)
