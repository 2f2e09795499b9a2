"""Evaluation tasks, each declared once: data source, prompt, choices, few-shot source, metric.

`TASKS` maps a name to its `TaskSpec`, as lm-evaluation-harness keeps one YAML per task; adding a
task is adding one declaration. A task yields `Example`s (context text, choice strings, gold
index) in lm-eval's formats. Few-shot blocks are `context + target_delimiter + choices[gold]`
joined by "\\n\\n", as lm-eval renders them. File tasks are read from `--data_dir`, then
`$SPECJAX_DATA`, then the Hugging Face hub (when the `datasets` package is installed and the hub
is reachable); `mc_jsonl` reads `--data_path`; `needle` and `rag` are generated (`synthetic`).
"""

from __future__ import annotations

import dataclasses
import json
import os
import pathlib
from collections.abc import Callable, Sequence

import numpy as np

from specjax.eval import metrics
from specjax.eval.errors import EvalError
from specjax.eval.synthetic import NEEDLE_QUESTION, NeedleDoc, question_row, rag_row

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


# ---------------------------------------------------------------- declarations
# A row is a dict holding the fields a task's prompt and choices name, and "gold" (the index of
# the right choice). A data source (Files, UserFile, Synthetic) turns its records into rows, and
# its `examples(spec, data_dir, data_path)` gives (the items asked, the few-shot split's items or
# [] when the task declares no such split, where they were read from).

FROM_DOCS = "docs"  # few-shot examples come from the items asked, never the asked item itself
NO_FEWSHOT = "none"  # synthetic tasks: the workload generates prefixes, no examples in them


@dataclasses.dataclass(frozen=True)
class Split:
    """One split of a file task: its files under a data directory, and its name on the hub."""

    files: tuple[str, ...]  # read together into rows (PIQA: the items, then their labels)
    hub_split: str


@dataclasses.dataclass(frozen=True)
class Hub:
    """A Hugging Face hub dataset, read when no data directory holds the task's files."""

    path: str
    name: str | None
    row: Callable[[dict], dict]  # a hub record -> a row


@dataclasses.dataclass(frozen=True)
class Files:
    """Rows from files under --data_dir or $SPECJAX_DATA (laid out as docs/data.md describes), else the hub."""

    docs: Split  # the items asked
    read: Callable[..., list[dict]]  # a split's files (paths, in `Split.files` order) -> rows
    hub: Hub

    def examples(self, spec: TaskSpec, data_dir: str | None, data_path: str | None):
        splits = [self.docs] + ([spec.fewshot] if isinstance(spec.fewshot, Split) else [])
        files = [f for s in splits for f in s.files]
        if data_dir and not pathlib.Path(data_dir).expanduser().is_dir():
            raise EvalError(f"--data_dir {data_dir} is not a directory")
        for _, root in _data_dirs(data_dir):
            if all((root / f).is_file() for f in files):
                read = [_examples(spec, self.read, [root / f for f in s.files]) for s in splits]
                return read[0], read[1] if len(read) > 1 else [], str(root)
        return self._hub_examples(spec, splits, files, data_dir)

    def _hub_examples(self, spec: TaskSpec, splits: list[Split], files: list[str], data_dir: str | None):
        hub = self.hub
        dataset = hub.path + (f" ({hub.name})" if hub.name else "")
        folder = (f"pass --data_dir DIR holding {' and '.join('DIR/' + f for f in files)} (docs/data.md in the "
                  "specjax repository says where to download them and how they are laid out)")

        def missing(note: str, fix: str) -> EvalError:
            where = ", ".join(f"{how}={root}" for how, root in _data_dirs(data_dir))
            looked = f"looked for {', '.join(files)} in {where}" if where else \
                "no --data_dir given and $SPECJAX_DATA unset"
            return EvalError(f"no data for task '{spec.name}': {looked}{note}. To get it: {fix}.")

        try:
            import datasets  # optional: only used when no local files are found
        except ImportError:
            raise missing(", and the `datasets` package (for the Hugging Face hub) is not installed",
                          f"`pip install datasets` (then the hub's {dataset} is read), or {folder}") from None
        try:
            read = [[spec.example(hub.row(r)) for r in datasets.load_dataset(hub.path, hub.name, split=s.hub_split)]
                    for s in splits]
        except Exception as e:  # network, missing dataset, schema drift: all end the run the same way
            raise missing(f"; the Hugging Face hub ({dataset}) failed: {type(e).__name__}: {str(e)[:200]}",
                          f"check the network, or {folder}") from None
        name = f"/{hub.name}" if hub.name else ""
        return read[0], read[1] if len(read) > 1 else [], f"huggingface:{hub.path}{name}:{self.docs.hub_split}"


def _data_dirs(data_dir: str | None) -> list[tuple[str, pathlib.Path]]:
    """Where to look for task files, in order, each with the setting that named it."""
    found = []
    if data_dir:
        found.append(("--data_dir", pathlib.Path(data_dir).expanduser()))
    if os.environ.get("SPECJAX_DATA"):
        found.append(("$SPECJAX_DATA", pathlib.Path(os.environ["SPECJAX_DATA"]).expanduser()))
    return found


@dataclasses.dataclass(frozen=True)
class UserFile:
    """Rows from the JSONL file given by --data_path: one {"query", "choices", "gold"} object per line."""

    def examples(self, spec: TaskSpec, data_dir: str | None, data_path: str | None):
        if not data_path:
            raise EvalError(f"--task {spec.name} needs --data_path FILE (one {{\"query\",\"choices\",\"gold\"}} "
                            f"per line)")
        file = pathlib.Path(data_path).expanduser()
        if not file.is_file():
            raise EvalError(f"--data_path {data_path}: no such file")
        docs = []
        for n, line in enumerate(_utf8_lines(file), 1):
            if line.strip():
                docs.append(spec.example(_mc_row(file, n, line)))
        if not docs:
            raise EvalError(f"{file}: no items")
        return docs, [], str(file)


def _utf8_lines(file: pathlib.Path) -> list[str]:
    try:
        return file.read_text(encoding="utf-8").splitlines()
    except UnicodeDecodeError as e:
        line = file.read_bytes()[:e.start].count(b"\n") + 1
        raise EvalError(f"{file}:{line}: not UTF-8 text (byte {e.object[e.start]:#04x}); save the file as "
                        "UTF-8") from None


def _mc_row(file: pathlib.Path, n: int, line: str) -> dict:
    """One mc_jsonl line as a row, checked: a text query, a list of at least two text choices, an integer gold
    index into them. Anything else is refused (one line naming the file and line), never coerced."""
    def refuse(why: str) -> EvalError:
        return EvalError(f"{file}:{n}: {why}; each line must be {{\"query\": text, \"choices\": [two or more "
                         f"texts], \"gold\": index of the right choice}}")

    try:
        r = json.loads(line)
    except ValueError as e:
        raise refuse(f"not JSON ({e})") from None
    if not isinstance(r, dict):
        raise refuse(f"a JSON {type(r).__name__}, not an object")
    missing = [k for k in ("query", "choices", "gold") if k not in r]
    if missing:
        raise refuse(f"no {', '.join(missing)}")
    query, choices, gold = r["query"], r["choices"], r["gold"]
    if not isinstance(query, str):
        raise refuse(f"query is {json.dumps(query)}, not text")
    if not isinstance(choices, list) or not all(isinstance(c, str) for c in choices):
        raise refuse(f"choices is {json.dumps(choices)[:80]}, not a list of texts")
    if len(choices) < 2:
        raise refuse(f"{len(choices)} choices; a multiple-choice item needs at least two")
    if isinstance(gold, bool) or not isinstance(gold, int) or not 0 <= gold < len(choices):
        raise refuse(f"gold {json.dumps(gold)} is not an index into {len(choices)} choices")
    return {"query": query, "choices": choices, "gold": gold}


@dataclasses.dataclass(frozen=True)
class Synthetic:
    """No stored items: the workload (eval/workload.py) generates each request with its prefix."""

    def examples(self, spec: TaskSpec, data_dir: str | None, data_path: str | None):
        return [], [], "synthetic (seeded)"


@dataclasses.dataclass(frozen=True)
class TaskSpec:
    """Everything that makes one task, in one declaration."""

    name: str
    description: str  # one line, for --task's help
    data: Files | UserFile | Synthetic  # data source
    prompt: str  # the context: a str.format template over a row's fields
    choices: tuple[str, ...] | str  # a template per choice (fixed ones name no field), or the row key listing them
    fewshot: Split | str  # few-shot source: another split of the files, FROM_DOCS or NO_FEWSHOT
    balanced_fewshot: bool  # few-shot examples round-robin over gold classes
    metric: Callable[..., dict]  # scores (choice loglikelihoods, choices, gold) per request
    prompt_format: str  # which harness / paper the prompt follows (recorded with results)

    def __post_init__(self):
        if not (isinstance(self.fewshot, Split) and isinstance(self.data, Files)
                or self.fewshot in (FROM_DOCS, NO_FEWSHOT)):
            raise ValueError(f"task {self.name}: few-shot source {self.fewshot!r} is not a Split of its files, "
                             f"FROM_DOCS or NO_FEWSHOT")

    def example(self, row: dict) -> Example:
        """A row as the model reads it: the prompt, the choices and the gold index."""
        if isinstance(self.choices, str):
            choices = row[self.choices]
        else:
            choices = [c.format(**row) for c in self.choices]
        gold = int(row["gold"])
        return Example(self.prompt.format(**row), tuple(str(c) for c in choices), gold,
                       label=str(gold) if self.balanced_fewshot else None)

    def load(self, data_dir: str | None = None, data_path: str | None = None) -> Task:
        """The task with its data (see `load_task`)."""
        docs, pool, source = self.data.examples(self, data_dir, data_path)
        same = self.fewshot == FROM_DOCS
        return Task(self.name, tuple(docs), tuple(docs if same else pool), same, self.balanced_fewshot,
                    self.prompt_format, source, synthetic=isinstance(self.data, Synthetic))


# ---------------------------------------------------------------- file readers (records -> rows)


class DamagedFile(EvalError):
    """A task's data file that cannot be read as its format (cut short, not UTF-8, a record without its fields)."""

    def __init__(self, where: str, why: str):
        super().__init__(f"{where}: {why}; the task's data file is damaged: restore it from its source (docs/data.md "
                         "in the specjax repository names each file's)")


def _examples(spec, read, paths: list[pathlib.Path]) -> list[Example]:
    """A split's files read into examples; a record without the fields the task reads is a damaged file."""
    try:
        return [spec.example(r) for r in read(*paths)]
    except (KeyError, ValueError, TypeError, IndexError) as e:
        raise DamagedFile(", ".join(map(str, paths)), f"a record lacks what task '{spec.name}' reads "
                          f"({type(e).__name__}: {str(e)[:80]})") from None


def _read_jsonl(path: pathlib.Path) -> list[dict]:
    rows = []
    for n, line in enumerate(_utf8_lines(path), 1):
        if line.strip():
            try:
                rows.append(json.loads(line))
            except ValueError as e:
                raise DamagedFile(f"{path}:{n}", f"not JSON ({e})") from None
    return rows


def _piqa_rows(items: pathlib.Path, labels: pathlib.Path) -> list[dict]:
    rows, golds = _read_jsonl(items), " ".join(_utf8_lines(labels)).split()
    if len(rows) != len(golds):
        raise EvalError(f"{items.parent}: {len(rows)} items but {len(golds)} labels")
    return [{**r, "gold": y} for r, y in zip(rows, golds)]


def _rte_rows(path: pathlib.Path) -> list[dict]:
    # label 0 = entailment = "True", as lm-eval's GLUE / SuperGLUE RTE
    return [{**r, "gold": 0 if r["label"] == "entailment" else 1} for r in _read_jsonl(path)]


def _sst2_rows(path: pathlib.Path) -> list[dict]:
    # one "<label> <sentence>" per line
    pairs = [(n, line.strip().split(" ", 1)) for n, line in enumerate(_utf8_lines(path), 1) if line.strip()]
    bad = next((n for n, pair in pairs if len(pair) != 2), None)
    if bad is not None:
        raise DamagedFile(f"{path}:{bad}", "not a '<label> <sentence>' line")
    return [{"sentence": sentence, "gold": label} for _, (label, sentence) in pairs]


def _ordered_prompt_rows(path: pathlib.Path) -> list[dict]:
    # ordered-prompt's jsonl keeps the CSV quoting of some sentences ("\"...\"")
    def unquote(s: str) -> str:
        return s[1:-1] if len(s) >= 2 and s[0] == s[-1] == '"' else s
    return [{"sentence": unquote(r["sentence"]), "gold": r["label"]} for r in _read_jsonl(path)]


def _copa_hub_row(r: dict) -> dict:
    # lm-eval super_glue/copa/utils.py: premise without its period + " because"/" therefore", choices
    # with a lower-cased first letter (llm-foundry's copa.jsonl stores exactly that)
    connector = {"cause": "because", "effect": "therefore"}[r["question"]]
    return {"query": r["premise"].strip()[:-1] + f" {connector}",
            "choices": [c[0].lower() + c[1:] for c in (r["choice1"], r["choice2"])], "gold": r["label"]}


def _openbookqa_hub_row(r: dict) -> dict:
    return {"query": r["question_stem"], "choices": r["choices"]["text"],
            "gold": r["choices"]["label"].index(r["answerKey"].strip())}


# ---------------------------------------------------------------- synthetic tasks' questions (eval/synthetic.py)


def needle_question(doc: NeedleDoc, i: int, rng: np.random.Generator, num_choices: int) -> Example:
    """Ask about fact i in the words of the needle task's prompt; the distractors are other values of the
    document."""
    return TASKS["needle"].example(question_row(doc, i, rng, num_choices))


def rag_question(chunks: Sequence[NeedleDoc], chunk: int, fact: int, rng: np.random.Generator,
                 num_choices: int) -> Example:
    """Ask about fact `fact` of chunks[chunk] in the words of the rag task's prompt (a new line after the
    last chunk); distractors are other codes of the same context."""
    return TASKS["rag"].example(rag_row(chunks, chunk, fact, rng, num_choices))


# ---------------------------------------------------------------- registry

TASKS: dict[str, TaskSpec] = {spec.name: spec for spec in (
    TaskSpec(
        "piqa", "PIQA validation (1838), lm-eval format, few-shot from the same file",
        data=Files(Split(("piqa/valid.jsonl", "piqa/valid-labels.lst"), "validation"), _piqa_rows,
                   Hub("baber/piqa", None, lambda r: {**r, "gold": r["label"]})),
        prompt="Question: {goal}\nAnswer:", choices=("{sol1}", "{sol2}"),
        fewshot=FROM_DOCS, balanced_fewshot=False, metric=metrics.accuracy,
        prompt_format="lm-eval tasks/piqa/piqa.yaml"),
    TaskSpec(
        "rte", "RTE validation (277), lm-eval format, few-shot from train",
        data=Files(Split(("rte/val.jsonl",), "validation"), _rte_rows,
                   Hub("aps/super_glue", "rte", lambda r: {**r, "gold": 0 if r["label"] == 0 else 1})),
        prompt="{premise}\nQuestion: {hypothesis} True or False?\nAnswer:", choices=("True", "False"),
        fewshot=Split(("rte/train.jsonl",), "train"), balanced_fewshot=True, metric=metrics.accuracy,
        prompt_format="lm-eval tasks/glue/rte/default.yaml"),
    TaskSpec(
        "copa", "COPA validation (100), lm-eval format, few-shot from the same file",
        data=Files(Split(("copa/copa.jsonl",), "validation"), _read_jsonl,
                   Hub("aps/super_glue", "copa", _copa_hub_row)),
        prompt="{query}", choices="choices",  # llm-foundry's copa.jsonl: lm-eval's text, see _copa_hub_row
        fewshot=FROM_DOCS, balanced_fewshot=False, metric=metrics.accuracy,
        prompt_format="lm-eval tasks/super_glue/copa (single space before the choice)"),
    TaskSpec(
        "openbookqa", "OpenBookQA test (500), lm-eval format, few-shot from the same file",
        data=Files(Split(("openbookqa/openbook_qa.jsonl",), "test"), _read_jsonl,
                   Hub("allenai/openbookqa", "main", _openbookqa_hub_row)),
        prompt="{query}", choices="choices",  # lm-eval: question_stem, choices.text
        fewshot=FROM_DOCS, balanced_fewshot=False, metric=metrics.accuracy,
        prompt_format="lm-eval tasks/openbookqa/openbookqa.yaml"),
    TaskSpec(
        "sst2", "SST-2 dev (872), lm-eval GLUE format, few-shot from train",
        data=Files(Split(("sst2/stsa.binary.dev",), "validation"), _sst2_rows,
                   Hub("nyu-mll/glue", "sst2", lambda r: {"sentence": r["sentence"], "gold": r["label"]})),
        prompt="{sentence}\nQuestion: Is this sentence positive or negative?\nAnswer:",
        choices=("negative", "positive"),
        fewshot=Split(("sst2/stsa.binary.train",), "train"), balanced_fewshot=True, metric=metrics.accuracy,
        prompt_format="lm-eval tasks/glue/sst2/default.yaml"),
    TaskSpec(
        "subj", "SUBJ test (2000), ordered-prompt format, few-shot from train",
        # SetFit/subj: label 0 = objective, 1 = subjective (the opposite of ordered-prompt)
        data=Files(Split(("subj/test.jsonl",), "test"), _ordered_prompt_rows,
                   Hub("SetFit/subj", None, lambda r: {"sentence": r["text"], "gold": 1 - int(r["label"])})),
        prompt="Input: {sentence}\nType:", choices=("subjective", "objective"),  # lm-eval has no SUBJ task
        fewshot=Split(("subj/train.jsonl",), "train"), balanced_fewshot=True, metric=metrics.accuracy,
        prompt_format="yaolu/ordered-prompt config/subj.yaml"),
    TaskSpec(
        "trec", "TREC coarse test (500), ordered-prompt format, few-shot from train",
        # CogComp/trec coarse_label: ABBR, ENTY, DESC, HUM, LOC, NUM
        data=Files(Split(("trec/test.jsonl",), "test"), _ordered_prompt_rows,
                   Hub("CogComp/trec", None, lambda r: {
                       "sentence": r["text"], "gold": {0: 2, 1: 1, 2: 0, 3: 3, 4: 4, 5: 5}[int(r["coarse_label"])]})),
        prompt="Question: {sentence}\nType:",  # lm-eval has no TREC task
        choices=("description", "entity", "expression", "human", "location", "number"),
        fewshot=Split(("trec/train.jsonl",), "train"), balanced_fewshot=True, metric=metrics.accuracy,
        prompt_format="yaolu/ordered-prompt config/trec.yaml"),
    TaskSpec(
        "mc_jsonl", "any {query, choices, gold} JSONL given by --data_path",
        data=UserFile(), prompt="{query}", choices="choices",
        fewshot=FROM_DOCS, balanced_fewshot=False, metric=metrics.accuracy,
        prompt_format="lm-eval multiple_choice: context = query, continuation = ' ' + choice"),
    TaskSpec(
        "needle", "synthetic long-context key-value retrieval: secret codes among filler sentences (no data files)",
        data=Synthetic(), prompt=NEEDLE_QUESTION, choices="choices",
        fewshot=NO_FEWSHOT, balanced_fewshot=False, metric=metrics.accuracy,
        prompt_format="synthetic key-value retrieval among filler text; answer only in the prefix"),
    TaskSpec(
        "rag", "synthetic RAG: 4-6 independently cached needle chunks in varying order, one fact asked "
               "(no data files)",
        data=Synthetic(), prompt="\n" + NEEDLE_QUESTION, choices="choices",
        fewshot=NO_FEWSHOT, balanced_fewshot=False, metric=metrics.accuracy,
        prompt_format="synthetic RAG: independently cached needle chunks in varying order, question about one fact"),
)}


def load_task(name: str, data_dir: str | None = None, data_path: str | None = None) -> Task:
    """The task `name` with its data; EvalError (one line) for unknown names or missing data."""
    if name not in TASKS:
        raise EvalError(f"unknown task '{name}'; known tasks: {', '.join(TASKS)}")
    return TASKS[name].load(data_dir, data_path)


def sample_fewshot(task: Task, count: int, rng: np.random.Generator, exclude: set[int] = frozenset()) -> list[int]:
    """Indices into `task.fewshot_pool`: seeded, never in `exclude`, class-balanced when asked."""
    allowed = np.array([i for i in range(len(task.fewshot_pool)) if i not in exclude])
    if count > len(allowed):
        shared = f" (the {len(exclude)} items asked after this prefix are never its examples)" if exclude else ""
        raise EvalError(f"task {task.name}: {count} few-shot examples asked, only {len(allowed)} available{shared}; "
                        f"pass --num_fewshot 0 for zero-shot prompts, or a smaller --num_fewshot")
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

