"""Workloads (shared prefixes, reuse counts, extension) and metrics on hand-computed values."""

import math

import numpy as np
import pytest

from specjax.eval import metrics, tasks, workload

from eval_fakes import FakeModel


def _toy_task(n=60):
    docs = tuple(tasks.Example(f"Item {i} is", ("odd", "even"), i % 2, label=str(i % 2)) for i in range(n))
    return tasks.Task("toy", docs, docs, True, False, "toy", "memory")


def test_reuse_counts_sum_and_spread():
    rng = np.random.default_rng(0)
    counts = workload.reuse_counts(1000, 8.0, 3.0, rng)
    assert sum(counts) == 1000 and min(counts) >= 1
    assert 7.0 < np.mean(counts[:-1]) < 9.0 and 2.0 < np.std(counts[:-1]) < 4.0


def test_shared_prefixes_and_determinism():
    model = FakeModel()
    spec = workload.WorkloadSpec(limit=40, seed=5)
    wl = workload.build_workload(_toy_task(), model.tokenizer, spec)
    assert wl == workload.build_workload(_toy_task(), model.tokenizer, spec)
    assert sorted(r.doc_index for r in wl.requests) == list(range(40))
    by_prefix = {}
    for r in wl.requests:
        assert by_prefix.setdefault(r.prefix_id, r.prefix_ids) == r.prefix_ids
    assert all(2 <= s <= 10 for s in wl.prefix_shots)
    assert [r.request_id for r in wl.requests] == list(range(40))
    # interleaved arrivals: prefixes come back over time, not in one block each
    ids = [r.prefix_id for r in wl.requests]
    assert ids != sorted(ids)


def test_zero_shot_has_empty_prefix():
    wl = workload.build_workload(_toy_task(), FakeModel().tokenizer, workload.WorkloadSpec(fewshot=(0, 0), limit=5))
    assert all(r.prefix_ids == () for r in wl.requests)


def test_prefix_tokens_extends():
    wl = workload.build_workload(_toy_task(), FakeModel().tokenizer,
                                 workload.WorkloadSpec(limit=20, prefix_tokens=300))
    assert all(300 <= len(r.prefix_ids) < 320 for r in wl.requests)


def test_continuation_split_like_lm_eval():
    model = FakeModel()
    enc = workload._Encoder(model.tokenizer, add_bos=True)
    query, choices = enc.query("Answer:", [" yes", " no"])
    assert model.tokenizer.decode(query) == "Answer:"
    assert [model.tokenizer.decode(c) for c in choices] == [" yes", " no"]
    assert enc.prefix("") == (model.tokenizer.bos_id,)


def test_acc_and_acc_norm_hand_computed():
    # choice 0 is likelier in total, choice 1 per byte: -4/2 = -2 vs -6/6 = -1
    outcomes = [([-4.0, -6.0], ["ab", "abcdef"], 1), ([-1.0, -3.0], ["x", "y"], 0),
                ([-2.0, -1.0], ["é", "e"], 0)]  # "é" is 2 bytes: -1.0 vs -1.0 -> argmax picks 0
    acc = metrics.accuracy(outcomes)
    assert acc["acc"] == pytest.approx(1 / 3)
    assert acc["acc_norm"] == pytest.approx(1.0)
    # sample std of [0, 1, 0] is sqrt(1/3); / sqrt(3) = 1/3
    assert acc["stderr"] == pytest.approx(1 / 3)
    assert acc["n"] == 3


def test_latency_summary():
    s = metrics.latency_summary([10, 20, 30, 40, 50, 60, 70, 80, 90, 100])
    assert s["mean"] == 55 and s["p50"] == 55
    assert s["p95"] == pytest.approx(95.5) and s["p99"] == pytest.approx(99.1)


def test_paired_difference():
    d = metrics.paired_difference([1, 1, 0, 1], [1, 0, 1, 0])
    assert d["acc_diff"] == pytest.approx(0.25)
    assert d["only_system"] == 2 and d["only_reference"] == 1 and d["n"] == 4
    # differences [0, 1, -1, 1]: mean 0.25, sample var = (0.0625+0.5625+1.5625+0.5625)/3
    assert d["stderr"] == pytest.approx(math.sqrt(2.75 / 3) / 2)


def test_compile_requests_cover_every_unseen_shape_once():
    from specjax.eval import runner

    def req(rid, prefix, query_len, choice_len):
        return workload.Request(rid, prefix, rid, (prefix,) * 5, (1,) * query_len, ((2,) * choice_len,), ("a",), 0)

    # prefix 0: query buckets 16 (first), 16 again, 32 (new); prefix 1: only its warm-up shape;
    # a longer choice (bucket 16 instead of 8) is a new shape too
    reqs = (req(0, 0, 10, 1), req(1, 0, 12, 2), req(2, 1, 10, 1), req(3, 0, 20, 1), req(4, 0, 25, 1),
            req(5, 0, 10, 9))
    wl = workload.Workload(reqs, ("p0", "p1"), (1, 1))
    assert [r.request_id for r in runner.warmup_requests(wl)] == [0, 2]
    assert [r.request_id for r in runner.compile_requests(wl)] == [3, 5]
