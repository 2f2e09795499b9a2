"""Shared-prefix request sequences, as in the papers' evaluations.

Each system prompt (prefix) holds 2-10 few-shot examples and is shared by several queries;
how many queries reuse a prefix is drawn from a normal distribution; `prefix_tokens`
extends prefixes with more examples to a target length. Everything is seeded, so every
system sees the same requests in the same order.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Sequence

import numpy as np

from specjax.engine.types import Request as EngineRequest
from specjax.eval import synthetic, tasks as tasks_lib
from specjax.eval.errors import EvalError


@dataclasses.dataclass(frozen=True)
class Request:
    """One evaluation request: shared prefix tokens + its own query tokens, the choices to score, and what the
    evaluation knows of it (arrival, item, gold). The engine runs `engine_request()`."""

    request_id: int  # arrival order
    prefix_id: int  # requests with the same prefix_id share prefix_ids exactly
    doc_index: int  # which task item is asked (for needle: the fact index in its document)
    prefix_ids: tuple[int, ...]
    query_ids: tuple[int, ...]
    choice_ids: tuple[tuple[int, ...], ...]  # continuation tokens of each choice
    choices: tuple[str, ...]  # choice strings without the delimiter (acc_norm lengths)
    gold: int
    # rag: the prefix as independently cached text chunks (prefix_ids is their concatenation); () otherwise
    chunk_ids: tuple[tuple[int, ...], ...] = ()

    @property
    def context_ids(self) -> tuple[int, ...]:
        return self.prefix_ids + self.query_ids

    def engine_request(self) -> EngineRequest:
        """The tokens the engine runs: prefix, query, the choices as continuations, and the prefix's text chunks."""
        return EngineRequest(list(self.prefix_ids), list(self.query_ids), [list(c) for c in self.choice_ids],
                             [list(c) for c in self.chunk_ids], index=self.request_id)


@dataclasses.dataclass(frozen=True)
class WorkloadSpec:
    fewshot: tuple[int, int] = (2, 10)  # inclusive range of few-shot examples per prefix
    reuse_mean: float = 8.0  # queries per prefix ~ Normal(reuse_mean, reuse_std), at least 1
    reuse_std: float = 3.0
    prefix_tokens: int | None = None  # extend every prefix to at least this many tokens
    limit: int | None = None  # number of requests (the first `limit` task items, as lm-eval)
    interleave: bool = True  # shuffle arrival order so prefixes are reused over time
    add_bos: bool = False  # lm-eval adds no BOS token by default
    seed: int = 0
    needle: synthetic.NeedleSpec = synthetic.NeedleSpec()
    rag: synthetic.RagSpec = synthetic.RagSpec()


@dataclasses.dataclass(frozen=True)
class Workload:
    requests: tuple[Request, ...]
    prefix_texts: tuple[str, ...]  # by prefix_id
    prefix_shots: tuple[int, ...]  # few-shot examples (or needle facts) per prefix

    def summary(self) -> dict:
        lengths = [len(r.prefix_ids) for r in self.requests]
        unique = {r.prefix_id: len(r.prefix_ids) for r in self.requests}
        reuse = np.bincount([r.prefix_id for r in self.requests], minlength=len(self.prefix_texts))
        return {
            "num_requests": len(self.requests),
            "num_prefixes": len(unique),
            "prefix_tokens_mean": float(np.mean(lengths)) if lengths else 0.0,
            "prefix_tokens_max": int(max(lengths, default=0)),
            "query_tokens_mean": float(np.mean([len(r.query_ids) for r in self.requests])) if lengths else 0.0,
            "unique_prefix_tokens": int(sum(unique.values())),
            "reuse_per_prefix_mean": float(reuse[reuse > 0].mean()) if reuse.any() else 0.0,
            "reuse_per_prefix_min": int(reuse[reuse > 0].min()) if reuse.any() else 0,
            "reuse_per_prefix_max": int(reuse.max()) if reuse.any() else 0,
            "shots_per_prefix_mean": float(np.mean(self.prefix_shots)) if self.prefix_shots else 0.0,
        }


def reuse_counts(total: int, mean: float, std: float, rng: np.random.Generator) -> list[int]:
    """Queries per prefix, each ~ round(Normal(mean, std)) >= 1, summing to `total`."""
    counts: list[int] = []
    while sum(counts) < total:
        counts.append(max(1, int(round(rng.normal(mean, std)))))
    counts[-1] -= sum(counts) - total
    return counts


class _Encoder:
    """Tokenizes queries and continuations the way lm-eval splits context / continuation."""

    def __init__(self, tokenizer, add_bos: bool):
        self.tokenizer = tokenizer
        self.bos = [tokenizer.bos_id] if add_bos and tokenizer.bos_id is not None else []

    def prefix(self, text: str) -> tuple[int, ...]:
        return tuple(self.bos + (self.tokenizer.encode(text) if text else []))

    def query(self, text: str, continuations: Sequence[str]) -> tuple[tuple[int, ...], tuple[tuple[int, ...], ...]]:
        query_ids = self.tokenizer.encode(text)
        choice_ids = []
        for cont in continuations:
            # lm-eval: encode(context + continuation) and cut at len(encode(context)), so a
            # token that merges across the boundary is not split differently from the real text
            whole = self.tokenizer.encode(text + cont)
            if whole[: len(query_ids)] == query_ids and len(whole) > len(query_ids):
                choice_ids.append(tuple(whole[len(query_ids):]))
            else:
                choice_ids.append(tuple(self.tokenizer.encode(cont)))
        return tuple(query_ids), tuple(choice_ids)


def build_workload(task: tasks_lib.Task, tokenizer, spec: WorkloadSpec) -> Workload:
    if task.name == "rag":
        return _build_rag(tokenizer, spec)
    if task.synthetic:
        return _build_needle(tokenizer, spec)
    return _build_fewshot(task, tokenizer, spec)


def _arrival_order(groups: list[list[int]], rng: np.random.Generator, interleave: bool) -> list[tuple[int, int]]:
    """(prefix_id, position in group) in arrival order."""
    order = [(p, j) for p, g in enumerate(groups) for j in range(len(g))]
    if interleave:
        order = [order[i] for i in rng.permutation(len(order))]
    return order


def _build_fewshot(task: tasks_lib.Task, tokenizer, spec: WorkloadSpec) -> Workload:
    rng = np.random.default_rng(spec.seed)
    n = len(task.docs) if spec.limit is None else min(spec.limit, len(task.docs))
    if n == 0:
        raise EvalError(f"task {task.name}: no items to evaluate")
    asked = [int(i) for i in rng.permutation(n)]  # the first n items, in a seeded order
    groups: list[list[int]] = []
    for count in reuse_counts(n, spec.reuse_mean, spec.reuse_std, rng):
        start = sum(len(g) for g in groups)
        groups.append(asked[start:start + count])

    enc = _Encoder(tokenizer, spec.add_bos)
    lo, hi = spec.fewshot
    prefix_texts, prefix_shots, prefix_ids = [], [], []
    for group in groups:
        exclude = set(group) if task.fewshot_same_split else set()
        shots = int(rng.integers(lo, hi + 1))
        picked = tasks_lib.sample_fewshot(task, shots, rng, exclude)
        examples = [task.fewshot_pool[i] for i in picked]
        if spec.prefix_tokens:
            examples = _extend(task, examples, picked, exclude, spec.prefix_tokens, tokenizer, rng)
        text = tasks_lib.fewshot_text(examples)
        prefix_texts.append(text)
        prefix_shots.append(len(examples))
        prefix_ids.append(enc.prefix(text))

    requests = []
    for rid, (p, j) in enumerate(_arrival_order(groups, rng, spec.interleave)):
        doc = task.docs[groups[p][j]]
        query_ids, choice_ids = enc.query(doc.context, doc.continuations())
        requests.append(Request(rid, p, groups[p][j], prefix_ids[p], query_ids, choice_ids, doc.choices, doc.gold))
    return Workload(tuple(requests), tuple(prefix_texts), tuple(prefix_shots))


def _extend(task, examples, picked, exclude, target_tokens, tokenizer, rng):
    """Add further few-shot examples until the prefix reaches `target_tokens` tokens."""
    used = set(picked)
    fresh = [i for i in rng.permutation(len(task.fewshot_pool)) if i not in used and i not in exclude]
    allowed = [i for i in range(len(task.fewshot_pool)) if i not in exclude]
    examples = list(examples)
    tokens = sum(len(tokenizer.encode(e.fewshot_block() + tasks_lib.FEWSHOT_DELIMITER)) for e in examples)
    while tokens < target_tokens:
        # when the pool runs out, examples repeat (a long prefix matters more than novelty here)
        i = int(fresh.pop()) if fresh else int(rng.choice(allowed))
        examples.append(task.fewshot_pool[i])
        tokens += len(tokenizer.encode(task.fewshot_pool[i].fewshot_block() + tasks_lib.FEWSHOT_DELIMITER))
    return examples


def needle_facts_for(tokenizer, prefix_tokens: int | None, spec: synthetic.NeedleSpec) -> int:
    """How many facts make a needle prefix of about `prefix_tokens` tokens."""
    if not prefix_tokens:
        return spec.num_facts
    header = len(tokenizer.encode(synthetic.NEEDLE_HEADER))

    def facts_needed(probe_spec):
        probe = synthetic.make_needle_doc(np.random.default_rng(0), dataclasses.replace(probe_spec, num_facts=20))
        per_fact = (len(tokenizer.encode(probe.text())) - header) / 20
        return max(4, int(math.ceil((prefix_tokens - header) / per_fact)))

    n = facts_needed(spec)
    if n > len(spec.names):  # long prefixes use "<adjective> <animal>" keys, which are longer
        n = facts_needed(dataclasses.replace(spec, names=()))
    return n


def _build_needle(tokenizer, spec: WorkloadSpec) -> Workload:
    rng = np.random.default_rng(spec.seed)
    needle = dataclasses.replace(
        spec.needle, values=synthetic.single_token_words(tokenizer, spec.needle.values),
        names=synthetic.single_token_words(tokenizer, spec.needle.names))
    needle = dataclasses.replace(needle, num_facts=needle_facts_for(tokenizer, spec.prefix_tokens, needle))
    n = 50 if spec.limit is None else spec.limit
    counts = reuse_counts(n, spec.reuse_mean, spec.reuse_std, rng)
    enc = _Encoder(tokenizer, spec.add_bos)
    docs, questions = [], []
    for count in counts:
        doc = synthetic.make_needle_doc(rng, needle)
        # facts asked are spread over the whole prefix (depth), distinct while they last
        asked = rng.choice(needle.num_facts, count, replace=count > needle.num_facts)
        docs.append(doc)
        questions.append([(int(i), tasks_lib.needle_question(doc, int(i), rng, needle.num_choices)) for i in asked])
    prefix_ids = [enc.prefix(d.text()) for d in docs]
    requests = []
    for rid, (p, j) in enumerate(_arrival_order(questions, rng, spec.interleave)):
        fact, ex = questions[p][j]
        query_ids, choice_ids = enc.query(ex.context, ex.continuations())
        requests.append(Request(rid, p, fact, prefix_ids[p], query_ids, choice_ids, ex.choices, ex.gold))
    return Workload(tuple(requests), tuple(d.text() for d in docs), tuple(needle.num_facts for _ in docs))


def _build_rag(tokenizer, spec: WorkloadSpec) -> Workload:
    """Contexts of a header chunk + 4-6 pool chunks in a seeded order, each asked `reuse_counts` questions."""
    rng = np.random.default_rng(spec.seed)
    needle = dataclasses.replace(spec.needle, names=synthetic.single_token_words(tokenizer, spec.needle.names))
    rag = spec.rag
    pool = synthetic.make_rag_pool(rng, rag, needle)
    pool_ids = [tuple(tokenizer.encode(c.body())) for c in pool]
    header_ids = _Encoder(tokenizer, spec.add_bos).prefix(synthetic.RAG_HEADER)
    n = 50 if spec.limit is None else spec.limit
    enc = _Encoder(tokenizer, False)
    lo, hi = rag.chunks_per_request
    contexts, questions = [], []
    for count in reuse_counts(n, spec.reuse_mean, spec.reuse_std, rng):
        picked = [int(i) for i in rng.choice(len(pool), int(rng.integers(lo, hi + 1)), replace=False)]
        chunks = [pool[i] for i in picked]
        facts = [(c, f) for c, chunk in enumerate(chunks) for f in range(len(chunk.keys))]
        asked = rng.choice(len(facts), count, replace=count > len(facts))
        contexts.append(picked)
        questions.append([(picked[facts[a][0]] * rag.facts_per_chunk + facts[a][1],
                           tasks_lib.rag_question(chunks, *facts[a], rng, rag.num_choices)) for a in asked])
    requests = []
    for rid, (p, j) in enumerate(_arrival_order(questions, rng, spec.interleave)):
        fact, ex = questions[p][j]
        chunk_ids = (header_ids,) + tuple(pool_ids[i] for i in contexts[p])
        query_ids, choice_ids = enc.query(ex.context, ex.continuations())
        requests.append(Request(rid, p, fact, sum(chunk_ids, ()), query_ids, choice_ids, ex.choices, ex.gold,
                                chunk_ids))
    texts = tuple(synthetic.RAG_HEADER + "".join(pool[i].body() for i in picked) for picked in contexts)
    return Workload(tuple(requests), texts, tuple(len(picked) for picked in contexts))
