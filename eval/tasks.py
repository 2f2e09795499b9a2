"""Evaluation tasks: data + prompt template + choices + metric, in lm-evaluation-harness formats.

A task yields `Example`s (context text, choice strings, gold index). Few-shot blocks are
`context + target_delimiter + choices[gold]` joined by "\\n\\n", as lm-eval renders them.
Data is read from `--data_dir`, then `$SPECJAX_DATA`, then the Hugging Face hub (when the
`datasets` package is installed and the hub is reachable). `needle` needs no data files.
"""

from __future__ import annotations

import dataclasses
import json
import os
import pathlib
from collections.abc import Sequence

import numpy as np

from specjax.eval.errors import EvalError

FEWSHOT_DELIMITER = "\n\n"
TARGET_DELIMITER = " "


@dataclasses.dataclass(frozen=True)
class Example:
    """One multiple-choice item: the model scores `target_delimiter + choice` after `context`."""

    context: str
    choices: tuple[str, ...]
    gold: int
    label: str | None = None  # class name, for class-balanced few-shot sampling
    target_delimiter: str = TARGET_DELIMITER

    def continuations(self) -> list[str]:
        return [self.target_delimiter + c for c in self.choices]

    def fewshot_block(self) -> str:
        """The example with its answer, as it appears inside a few-shot prefix."""
        return self.context + self.target_delimiter + self.choices[self.gold]


@dataclasses.dataclass(frozen=True)
class Task:
    """Evaluation items plus where few-shot examples come from."""

    name: str
    docs: tuple[Example, ...]  # the items asked
    fewshot_pool: tuple[Example, ...]  # where few-shot examples are drawn
    fewshot_same_split: bool  # pool is `docs` itself: never show the asked item
    balanced_fewshot: bool  # draw few-shot examples round-robin over classes
    prompt_format: str  # which harness / paper the template follows
    source: str  # where the data was read from
    synthetic: bool = False


# ---------------------------------------------------------------- data resolution

HF_SOURCES = {
    "piqa": ("baber/piqa", None, "validation", "train"),
    "copa": ("aps/super_glue", "copa", "validation", "train"),
    "openbookqa": ("allenai/openbookqa", "main", "test", "train"),
    "rte": ("aps/super_glue", "rte", "validation", "train"),
    "sst2": ("nyu-mll/glue", "sst2", "validation", "train"),
    "subj": ("SetFit/subj", None, "test", "train"),
    "trec": ("CogComp/trec", None, "test", "train"),
}

# The files each task needs under a data directory (see ../shared/data/README.md).
LOCAL_FILES = {
    "piqa": ("piqa/valid.jsonl", "piqa/valid-labels.lst"),
    "copa": ("copa/copa.jsonl",),
    "openbookqa": ("openbookqa/openbook_qa.jsonl",),
    "rte": ("rte/val.jsonl", "rte/train.jsonl"),
    "sst2": ("sst2/stsa.binary.dev", "sst2/stsa.binary.train"),
    "subj": ("subj/test.jsonl", "subj/train.jsonl"),
    "trec": ("trec/test.jsonl", "trec/train.jsonl"),
}


def candidate_data_dirs(data_dir: str | None) -> list[tuple[str, pathlib.Path]]:
    """Where to look for task files, in order, each with the setting that named it."""
    found = []
    if data_dir:
        found.append(("--data_dir", pathlib.Path(data_dir).expanduser()))
    if os.environ.get("SPECJAX_DATA"):
        found.append(("$SPECJAX_DATA", pathlib.Path(os.environ["SPECJAX_DATA"]).expanduser()))
    return found


def resolve_task_dir(task: str, data_dir: str | None) -> pathlib.Path | None:
    """The first data directory holding all of `task`'s files; None if none does."""
    if data_dir and not pathlib.Path(data_dir).expanduser().is_dir():
        raise EvalError(f"--data_dir {data_dir} is not a directory")
    for _, root in candidate_data_dirs(data_dir):
        if all((root / f).is_file() for f in LOCAL_FILES[task]):
            return root
    return None


def _missing_data_message(task: str, data_dir: str | None, hub_note: str) -> str:
    looked = [f"{how}={root}" for how, root in candidate_data_dirs(data_dir)]
    where = ", ".join(looked) if looked else "no --data_dir given and $SPECJAX_DATA unset"
    files = ", ".join(LOCAL_FILES[task])
    return (
        f"data for task '{task}' not found: looked for {files} in {where}; {hub_note}. "
        f"Pass --data_dir DIR (a folder laid out like ../shared/data, see its README.md)"
    )


# ---------------------------------------------------------------- file readers


def _read_jsonl(path: pathlib.Path) -> list[dict]:
    with open(path, encoding="utf-8") as f:
        return [json.loads(line) for line in f if line.strip()]


def piqa_example(goal: str, sol1: str, sol2: str, label: int) -> Example:
    # lm-eval tasks/piqa/piqa.yaml: "Question: {{goal}}\nAnswer:", choices [sol1, sol2]
    return Example(f"Question: {goal}\nAnswer:", (sol1, sol2), int(label))


def copa_example(query: str, choices: Sequence[str], gold: int) -> Example:
    # lm-eval tasks/super_glue/copa/utils.py: premise without its period + " because"/" therefore",
    # choices with a lower-cased first letter; llm-foundry's copa.jsonl stores exactly that.
    return Example(query, tuple(choices), int(gold))


def openbookqa_example(query: str, choices: Sequence[str], gold: int) -> Example:
    # lm-eval tasks/openbookqa/openbookqa.yaml: doc_to_text = question_stem, choices = choices.text
    return Example(query, tuple(choices), int(gold))


def rte_example(premise: str, hypothesis: str, entailed: bool) -> Example:
    # lm-eval tasks/glue/rte/default.yaml and super_glue/rte: label 0 = entailment = "True"
    text = f"{premise}\nQuestion: {hypothesis} True or False?\nAnswer:"
    gold = 0 if entailed else 1
    return Example(text, ("True", "False"), gold, label=str(gold))


def sst2_example(sentence: str, label: int) -> Example:
    # lm-eval tasks/glue/sst2/default.yaml
    text = f"{sentence}\nQuestion: Is this sentence positive or negative?\nAnswer:"
    return Example(text, ("negative", "positive"), int(label), label=str(label))


SUBJ_LABELS = ("subjective", "objective")
TREC_LABELS = ("description", "entity", "expression", "human", "location", "number")


def subj_example(sentence: str, label: int) -> Example:
    # yaolu/ordered-prompt config/subj.yaml (the data's source; lm-eval has no SUBJ task)
    return Example(f"Input: {sentence}\nType:", SUBJ_LABELS, int(label), label=str(label))


def trec_example(sentence: str, label: int) -> Example:
    # yaolu/ordered-prompt config/trec.yaml (the data's source; lm-eval has no TREC task)
    return Example(f"Question: {sentence}\nType:", TREC_LABELS, int(label), label=str(label))


def _strip_quotes(sentence: str) -> str:
    # ordered-prompt's jsonl keeps the CSV quoting of some sentences ("\"...\"")
    if len(sentence) >= 2 and sentence[0] == sentence[-1] == '"':
        return sentence[1:-1]
    return sentence


def _read_sst2(path: pathlib.Path) -> list[Example]:
    out = []
    with open(path, encoding="utf-8") as f:
        for line in f:
            line = line.strip()
            if line:
                label, sentence = line.split(" ", 1)
                out.append(sst2_example(sentence, int(label)))
    return out


def _load_local(task: str, root: pathlib.Path) -> tuple[list[Example], list[Example] | None]:
    """(docs, fewshot pool or None when the pool is the docs themselves)."""
    if task == "piqa":
        rows = _read_jsonl(root / "piqa/valid.jsonl")
        labels = (root / "piqa/valid-labels.lst").read_text().split()
        if len(rows) != len(labels):
            raise EvalError(f"{root}/piqa: {len(rows)} items but {len(labels)} labels")
        return [piqa_example(r["goal"], r["sol1"], r["sol2"], int(y)) for r, y in zip(rows, labels)], None
    if task == "copa":
        return [copa_example(r["query"], r["choices"], r["gold"]) for r in _read_jsonl(root / "copa/copa.jsonl")], None
    if task == "openbookqa":
        rows = _read_jsonl(root / "openbookqa/openbook_qa.jsonl")
        return [openbookqa_example(r["query"], r["choices"], r["gold"]) for r in rows], None
    if task == "rte":
        def read(name):
            return [rte_example(r["premise"], r["hypothesis"], r["label"] == "entailment")
                    for r in _read_jsonl(root / "rte" / name)]
        return read("val.jsonl"), read("train.jsonl")
    if task == "sst2":
        return _read_sst2(root / "sst2/stsa.binary.dev"), _read_sst2(root / "sst2/stsa.binary.train")
    if task in ("subj", "trec"):
        make = subj_example if task == "subj" else trec_example
        def read(name):
            return [make(_strip_quotes(r["sentence"]), int(r["label"])) for r in _read_jsonl(root / task / name)]
        return read("test.jsonl"), read("train.jsonl")
    raise AssertionError(task)


def _from_hub_row(task: str, r: dict) -> Example:
    if task == "piqa":
        return piqa_example(r["goal"], r["sol1"], r["sol2"], r["label"])
    if task == "copa":
        connector = {"cause": "because", "effect": "therefore"}[r["question"]]
        lower = [c[0].lower() + c[1:] for c in (r["choice1"], r["choice2"])]
        return copa_example(r["premise"].strip()[:-1] + f" {connector}", lower, r["label"])
    if task == "openbookqa":
        gold = r["choices"]["label"].index(r["answerKey"].strip())
        return openbookqa_example(r["question_stem"], r["choices"]["text"], gold)
    if task == "rte":
        return rte_example(r["premise"], r["hypothesis"], r["label"] == 0)
    if task == "sst2":
        return sst2_example(r["sentence"], r["label"])
    if task == "subj":
        # SetFit/subj: label 0 = objective, 1 = subjective (the opposite of ordered-prompt)
        return subj_example(r["text"], 1 - int(r["label"]))
    if task == "trec":
        # CogComp/trec coarse_label: ABBR, ENTY, DESC, HUM, LOC, NUM
        remap = {0: 2, 1: 1, 2: 0, 3: 3, 4: 4, 5: 5}
        return trec_example(r["text"], remap[int(r["coarse_label"])])
    raise AssertionError(task)


def _load_hub(task: str, data_dir: str | None) -> tuple[list[Example], list[Example] | None, str]:
    try:
        import datasets  # optional: only used when no local files are found
    except ImportError:
        raise EvalError(_missing_data_message(task, data_dir, "the `datasets` package is not installed, "
                                              "so the Hugging Face hub was not tried")) from None
    path, name, split, train_split = HF_SOURCES[task]
    try:
        docs_ds = datasets.load_dataset(path, name, split=split)
        docs = [_from_hub_row(task, r) for r in docs_ds]
        pool = None
        if task in ("rte", "sst2", "subj", "trec"):
            pool = [_from_hub_row(task, r) for r in datasets.load_dataset(path, name, split=train_split)]
    except Exception as e:  # network, missing dataset, schema drift: all end the run the same way
        raise EvalError(_missing_data_message(
            task, data_dir, f"the Hugging Face hub ({path}) failed: {type(e).__name__}: {str(e)[:200]}")) from None
    return docs, pool, f"huggingface:{path}" + (f"/{name}" if name else "") + f":{split}"


# ---------------------------------------------------------------- mc_jsonl


def load_mc_jsonl(path: str | None) -> Task:
    """Any multiple-choice JSONL: one {"query", "choices", "gold"} object per line."""
    if not path:
        raise EvalError("--task mc_jsonl needs --data_path FILE (one {\"query\",\"choices\",\"gold\"} per line)")
    file = pathlib.Path(path).expanduser()
    if not file.is_file():
        raise EvalError(f"--data_path {path}: no such file")
    docs = []
    with open(file, encoding="utf-8") as f:
        for n, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                r = json.loads(line)
                query, choices, gold = r["query"], list(r["choices"]), int(r["gold"])
            except (ValueError, KeyError, TypeError) as e:
                raise EvalError(f"{file}:{n}: expected {{\"query\",\"choices\",\"gold\"}}: {e}") from None
            if not choices or not 0 <= gold < len(choices):
                raise EvalError(f"{file}:{n}: gold {gold} is not an index into {len(choices)} choices")
            docs.append(Example(query, tuple(str(c) for c in choices), gold))
    if not docs:
        raise EvalError(f"{file}: no items")
    return Task("mc_jsonl", tuple(docs), tuple(docs), True, False,
                "lm-eval multiple_choice: context = query, continuation = ' ' + choice", str(file))


# ---------------------------------------------------------------- needle (synthetic)

# A document interleaves plain filler sentences with facts "The secret code of the <adjective>
# <object> is <4-digit code>.", one sentence per line; a question repeats one fact's own words
# up to the code ("The secret code of the red door is") and the choices are codes of other facts
# of the same document, so only retrieval from the prefix tells them apart (all choices have the
# same length, so acc and acc_norm agree). Design notes, measured with recompute on smollm2-135m
# (Q4_1 GGUF) over 40-item seeded workloads:
# - facts must read as natural text and the question must be a near-copy of the fact: the model
#   copies natural text but not lists of unrelated words; a "Question: ...? Answer: ..." wrapper
#   or one-token name keys ("The secret word of Alice is apple.", 60 facts) stay near 60%;
# - keys whose adjective and object each occur once in the document (unique words, not merely
#   unique pairs) and numeric codes rather than word values: about 95-100% vs 75-85%;
# - filler sentences between facts and one sentence per line help a little more, and make it a
#   needle in a haystack: about half the prefix tokens are facts, the rest can be dropped.
# Past len(adjectives) facts per document, adjectives and objects are reused in distinct pairs
# (long --prefix_tokens prefixes), which makes retrieval harder.
NEEDLE_ADJECTIVES = (
    "red", "blue", "green", "black", "white", "silver", "golden", "brown", "purple", "orange",
    "yellow", "pink", "gray", "wooden", "iron", "old", "new", "small", "big", "tall",
    "round", "heavy", "broken", "painted", "narrow", "wide", "dark", "bright", "plain", "square",
    "front", "back", "upper", "lower", "hidden", "main", "little", "long", "short", "empty",
)
NEEDLE_OBJECTS = (
    "door", "box", "gate", "room", "car", "house", "boat", "book", "chest", "lamp",
    "clock", "bag", "desk", "shelf", "bottle", "tower", "bridge", "window", "cabinet", "drawer",
    "safe", "locker", "garage", "shed", "trunk", "case", "barn", "cellar", "office", "kitchen",
    "garden", "wall", "truck", "train", "van", "table", "basket", "tent", "cart", "phone",
)
NEEDLE_FILLER = (
    "The morning was cool and the streets were still quiet.",
    "A small bakery on the corner opened its doors at seven.",
    "Children walked to school with their bags on their backs.",
    "The river ran slowly past the old stone mill.",
    "Farmers in the valley were busy bringing in the harvest.",
    "A light rain fell for most of the afternoon.",
    "The library was full of students preparing for their exams.",
    "Trains to the city left every half hour from the station.",
    "Most of the shops on the main street closed early on Sunday.",
    "A group of tourists stopped to take pictures of the bridge.",
    "The museum opened a new exhibition about ancient maps.",
    "In the park, an old man fed the pigeons with bread crumbs.",
    "The town council met on Tuesday to discuss the new road.",
    "Fresh vegetables were sold at the market every Saturday.",
    "The wind picked up in the evening and the sky grew dark.",
    "A cat slept in the sun on the steps of the post office.",
    "The football team trained on the field behind the school.",
    "Many people in the village kept chickens in their gardens.",
    "The old clock tower rang the hour across the square.",
    "A fishing boat came back to the harbor late at night.",
    "The teacher read a story to the class after lunch.",
    "Snow covered the hills for most of the winter.",
    "The hospital added a new wing for children last year.",
    "Two friends sat in the cafe and talked for hours.",
    "The road through the forest was narrow and full of turns.",
    "A new bookshop opened next to the pharmacy.",
    "The festival drew visitors from all over the region.",
    "Workers repaired the roof of the church during the summer.",
    "The lake froze early that year, and people went skating.",
    "A long line of cars waited at the border crossing.",
    "The orchestra practiced every evening in the town hall.",
    "Birds sang in the trees along the edge of the field.",
    "The bus was late again because of the heavy traffic.",
    "An old woman sold flowers from a cart near the fountain.",
    "The factory on the hill had been closed for many years.",
    "Students painted a large mural on the wall of the gym.",
    "The price of bread went up slightly in the spring.",
    "A storm knocked down several trees near the river.",
    "The neighbors held a small party to welcome the new family.",
    "Lights in the windows came on one by one as night fell.",
    "The baker's son delivered bread to the houses on the hill.",
    "A dog barked at the mail carrier every single morning.",
    "The ferry crossed the bay twice a day in good weather.",
    "Apple trees bloomed in the orchard behind the farmhouse.",
    "The mayor gave a short speech at the opening of the park.",
    "A thick fog rolled in from the sea before dawn.",
    "The children built a snowman in front of the school.",
    "Old photographs of the town hung in the hallway of the inn.",
    "The market square was crowded on the first day of summer.",
    "A young couple opened a small restaurant near the station.",
)
NEEDLE_HEADER = "Read the notes below and remember the secret codes.\n"


@dataclasses.dataclass(frozen=True)
class NeedleDoc:
    """One synthetic document: key -> value facts, each after its filler text; its text is a request prefix."""

    keys: tuple[str, ...]  # "the red door"
    values: tuple[str, ...]  # "4821"
    filler: tuple[str, ...] = ()  # text on the line(s) before each fact ("" for none)

    def fact(self, i: int) -> str:
        return f"The secret code of {self.keys[i]} is {self.values[i]}."

    def body(self) -> str:
        """The facts, each after its filler, one sentence per line (every line ends with a newline)."""
        filler = self.filler or ("",) * len(self.keys)
        return "".join((f + "\n" if f else "") + self.fact(i) + "\n" for i, f in enumerate(filler))

    def text(self) -> str:
        return NEEDLE_HEADER + self.body() + "\n"

    def question(self, i: int, choices: Sequence[str], gold: int) -> Example:
        """The fact's own words up to its value: the answer is a near-copy from the prefix."""
        return Example(f"The secret code of {self.keys[i]} is", tuple(choices), gold)


@dataclasses.dataclass(frozen=True)
class NeedleSpec:
    num_facts: int = 28  # default prefix ~ 790 tokens with smollm2's tokenizer (20: ~565)
    num_choices: int = 4
    values: tuple[str, ...] = ()  # word values instead of codes (retrieved worse, see above); () = codes
    names: tuple[str, ...] = NEEDLE_OBJECTS  # the objects in keys "the <adjective> <object>"
    adjectives: tuple[str, ...] = NEEDLE_ADJECTIVES
    code_digits: int = 4
    filler_per_fact: int = 1  # filler sentences before each fact
    filler: tuple[str, ...] = NEEDLE_FILLER


def single_token_words(tokenizer, words: Sequence[str], minimum: int = 20) -> tuple[str, ...]:
    """The words that are one token after a space (so a key's words cannot merge with their
    neighbours differently in the prefix and in the question); all of them if fewer than
    `minimum` are."""
    kept = tuple(w for w in words if len(tokenizer.encode(" " + w)) == 1)
    return kept if len(kept) >= minimum else tuple(words)


def _needle_keys(rng: np.random.Generator, adjectives: Sequence[str], objects: Sequence[str], n: int) -> list[str]:
    """n distinct "the <adjective> <object>" keys; while n <= min(len(adjectives), len(objects)),
    every adjective and every object occurs in one key only (measured: shared words confuse
    retrieval); past that, each word is reused as evenly as possible."""
    adj = [str(a) for a in rng.permutation(adjectives)]
    obj = [str(o) for o in rng.permutation(objects)]
    a, b = len(adj), len(obj)
    if n > a * b:
        raise EvalError(f"needle: at most {a * b} facts per prefix (asked {n})")
    # round r pairs adjective i with object (i + r) mod b: distinct pairs across rounds
    if a <= b:
        pairs = [(j % a, (j % a + j // a) % b) for j in range(n)]
    else:
        pairs = [((j % b + j // b) % a, j % b) for j in range(n)]
    keys = [f"the {adj[i]} {obj[k]}" for i, k in pairs]
    return [keys[i] for i in rng.permutation(n)]


def make_needle_doc(rng: np.random.Generator, spec: NeedleSpec) -> NeedleDoc:
    n = spec.num_facts
    keys = _needle_keys(rng, spec.adjectives or NEEDLE_ADJECTIVES, spec.names or NEEDLE_OBJECTS, n)
    if spec.values:
        # distinct values while they last, so the candidates of a question are different words
        values = [str(v) for v in rng.permutation(spec.values)]
        while len(values) < n:
            values += [str(v) for v in rng.permutation(spec.values)]
    else:
        low = 10 ** (spec.code_digits - 1)
        if n > 9 * low:
            raise EvalError(f"needle: at most {9 * low} facts with {spec.code_digits}-digit codes (asked {n})")
        values = [str(low + int(c)) for c in rng.choice(9 * low, n, replace=False)]
    pool = list(spec.filler or NEEDLE_FILLER)
    order = [str(pool[i]) for i in rng.permutation(len(pool))]
    k = spec.filler_per_fact
    filler = tuple(" ".join(order[(i * k + j) % len(order)] for j in range(k)) for i in range(n))
    return NeedleDoc(tuple(keys), tuple(values[:n]), filler)


def needle_question(doc: NeedleDoc, i: int, rng: np.random.Generator, num_choices: int) -> Example:
    """Ask about fact i; the distractors are other values of the same document."""
    gold_value = doc.values[i]
    others = sorted({v for v in doc.values if v != gold_value})
    picked = [str(v) for v in rng.choice(others, min(num_choices - 1, len(others)), replace=False)]
    gold = int(rng.integers(len(picked) + 1))
    choices = picked[:gold] + [gold_value] + picked[gold:]
    return doc.question(i, choices, gold)


def needle_task() -> Task:
    """Placeholder task object: needle items are generated with their prefixes by the workload."""
    return Task("needle", (), (), False, False,
                "synthetic key-value retrieval among filler text; answer only in the prefix",
                "synthetic (seeded)", synthetic=True)


# ---------------------------------------------------------------- rag (synthetic, CacheBlend)

# A RAG-like request: a header chunk, then several text chunks drawn from a pool in a per-context order, then
# a needle question about a fact in one of them. Each chunk is a needle document's body (facts after filler
# lines, every line ending with a newline, so chunk texts join naturally) and is tokenized on its own: the
# request's prefix is exactly the concatenation of its chunks' tokens, and each chunk's KV can be cached alone
# (computed at positions 0..len-1) and reused wherever a request places it. The pool is one needle document
# split into chunks, so keys never share a word within a request (see the needle notes above).
RAG_HEADER = NEEDLE_HEADER


@dataclasses.dataclass(frozen=True)
class RagSpec:
    pool_chunks: int = 10  # text chunks in the pool (all keys use distinct words up to 40 facts in all)
    facts_per_chunk: int = 4
    chunks_per_request: tuple[int, int] = (4, 6)  # inclusive range of retrieved chunks per context
    num_choices: int = 4


def make_rag_pool(rng: np.random.Generator, spec: RagSpec, needle: NeedleSpec) -> tuple[NeedleDoc, ...]:
    """The pool's chunks: one needle document of pool_chunks * facts_per_chunk facts, cut into chunks."""
    f = spec.facts_per_chunk
    doc = make_needle_doc(rng, dataclasses.replace(needle, num_facts=spec.pool_chunks * f))
    return tuple(NeedleDoc(doc.keys[i:i + f], doc.values[i:i + f], doc.filler[i:i + f])
                 for i in range(0, len(doc.keys), f))


def rag_question(chunks: Sequence[NeedleDoc], chunk: int, fact: int, rng: np.random.Generator,
                 num_choices: int) -> Example:
    """Ask about fact `fact` of chunks[chunk]; distractors are other codes of the same context. The
    question starts on a new line after the last chunk."""
    merged = NeedleDoc(tuple(k for c in chunks for k in c.keys), tuple(v for c in chunks for v in c.values))
    index = sum(len(c.keys) for c in chunks[:chunk]) + fact
    ex = needle_question(merged, index, rng, num_choices)
    return dataclasses.replace(ex, context="\n" + ex.context)


def rag_task() -> Task:
    """Placeholder task object: rag items are generated with their chunks by the workload."""
    return Task("rag", (), (), False, False,
                "synthetic RAG: independently cached needle chunks in varying order, question about one fact",
                "synthetic (seeded)", synthetic=True)


# ---------------------------------------------------------------- registry

TASKS: dict[str, str] = {
    "piqa": "PIQA validation (1838), lm-eval format, few-shot from the same file",
    "rte": "RTE validation (277), lm-eval format, few-shot from train",
    "copa": "COPA validation (100), lm-eval format, few-shot from the same file",
    "openbookqa": "OpenBookQA test (500), lm-eval format, few-shot from the same file",
    "sst2": "SST-2 dev (872), lm-eval GLUE format, few-shot from train",
    "subj": "SUBJ test (2000), ordered-prompt format, few-shot from train",
    "trec": "TREC coarse test (500), ordered-prompt format, few-shot from train",
    "mc_jsonl": "any {query, choices, gold} JSONL given by --data_path",
    "needle": "synthetic long-context key-value retrieval: secret codes among filler sentences (no data files)",
    "rag": "synthetic RAG: 4-6 independently cached needle chunks in varying order, one fact asked (no data files)",
}

PROMPT_FORMATS = {
    "piqa": "lm-eval tasks/piqa/piqa.yaml",
    "rte": "lm-eval tasks/glue/rte/default.yaml",
    "copa": "lm-eval tasks/super_glue/copa (single space before the choice)",
    "openbookqa": "lm-eval tasks/openbookqa/openbookqa.yaml",
    "sst2": "lm-eval tasks/glue/sst2/default.yaml",
    "subj": "yaolu/ordered-prompt config/subj.yaml",
    "trec": "yaolu/ordered-prompt config/trec.yaml",
}


def load_task(name: str, data_dir: str | None = None, data_path: str | None = None) -> Task:
    """The task `name` with its data; EvalError (one line) for unknown names or missing data."""
    if name not in TASKS:
        raise EvalError(f"unknown task '{name}'; known tasks: {', '.join(TASKS)}")
    if name == "mc_jsonl":
        return load_mc_jsonl(data_path)
    if name == "needle":
        return needle_task()
    if name == "rag":
        return rag_task()
    root = resolve_task_dir(name, data_dir)
    if root is not None:
        docs, pool = _load_local(name, root)
        source = str(root)
    else:
        docs, pool, source = _load_hub(name, data_dir)
    same = pool is None
    balanced = name in ("rte", "sst2", "subj", "trec")
    return Task(name, tuple(docs), tuple(docs if same else pool), same, balanced, PROMPT_FORMATS[name], source)


def sample_fewshot(task: Task, count: int, rng: np.random.Generator, exclude: set[int] = frozenset()) -> list[int]:
    """Indices into `task.fewshot_pool`: seeded, never in `exclude`, class-balanced when asked."""
    allowed = np.array([i for i in range(len(task.fewshot_pool)) if i not in exclude])
    if count > len(allowed):
        raise EvalError(f"task {task.name}: {count} few-shot examples asked, only {len(allowed)} available")
    if not task.balanced_fewshot:
        return [int(i) for i in rng.choice(allowed, count, replace=False)]
    by_class: dict[str, list[int]] = {}
    for i in rng.permutation(allowed):
        by_class.setdefault(task.fewshot_pool[i].label, []).append(int(i))
    classes = sorted(by_class)
    order = [classes[j] for j in rng.permutation(len(classes))]
    picked: list[int] = []
    while len(picked) < count:
        for c in order:
            if by_class[c] and len(picked) < count:
                picked.append(by_class[c].pop())
    return [picked[j] for j in rng.permutation(len(picked))]


def fewshot_text(examples: Sequence[Example]) -> str:
    """The shared system prompt made of few-shot examples; empty for 0-shot."""
    return "".join(e.fewshot_block() + FEWSHOT_DELIMITER for e in examples)

