"""Tasks: one declaration each, loading the shared data and the hub, lm-eval prompt formats, few-shot
sampling, mc_jsonl, needle."""

import dataclasses
import json
import os
import pathlib
import re
import string
import sys
import types
import zipfile

import numpy as np
import pytest

from specjax.eval import metrics, synthetic, tasks, workload
from specjax.eval.errors import EvalError

from eval_fakes import FakeModel

SIZES = {  # (items asked, few-shot pool) per ../shared/data/README.md
    "piqa": (1838, 1838), "copa": (100, 100), "openbookqa": (500, 500), "rte": (277, 2490),
    "sst2": (872, 6920), "subj": (2000, 8000), "trec": (500, 5452),
}


@pytest.mark.parametrize("name", sorted(SIZES))
def test_shared_data_loads(shared_data_dir, name):
    task = tasks.load_task(name, str(shared_data_dir))
    assert (len(task.docs), len(task.fewshot_pool)) == SIZES[name]
    assert task.fewshot_same_split == (name in ("piqa", "copa", "openbookqa"))
    assert task.balanced_fewshot == (name in ("rte", "sst2", "subj", "trec"))
    assert task.source == str(shared_data_dir) and task.prompt_format == tasks.TASKS[name].prompt_format
    for ex in task.docs[:50]:
        assert 0 <= ex.gold < len(ex.choices)


def test_prompt_formats_first_items(shared_data_dir):
    d = str(shared_data_dir)
    piqa = tasks.load_task("piqa", d).docs[0]
    assert piqa.context == "Question: How do I ready a guinea pig cage for it's new occupants?\nAnswer:"
    assert piqa.continuations()[0].startswith(" Provide the guinea pig with a cage full of a few inches of bedding "
                                              "made of ripped paper strips")
    assert piqa.gold == 0
    rte = tasks.load_task("rte", d).docs[0]
    assert rte.context.startswith("Dana Reeve, the widow of the actor Christopher Reeve, has died")
    assert rte.context.endswith("\nQuestion: Christopher Reeve had an accident. True or False?\nAnswer:")
    assert rte.continuations() == [" True", " False"] and rte.gold == 1  # not_entailment -> False
    copa = tasks.load_task("copa", d).docs[0]
    assert copa.context == "The man turned on the faucet, therefore"
    assert copa.continuations() == [" the toilet filled with water.", " water flowed from the spout."]
    assert copa.gold == 1
    obqa = tasks.load_task("openbookqa", d).docs[1]
    assert obqa.context == "There is most likely going to be fog around:"
    assert obqa.continuations() == [" a marsh", " a tundra", " the plains", " a desert"] and obqa.gold == 0
    sst2 = tasks.load_task("sst2", d).docs[0]
    assert sst2.context == "one long string of cliches .\nQuestion: Is this sentence positive or negative?\nAnswer:"
    assert sst2.continuations() == [" negative", " positive"] and sst2.gold == 0
    subj = tasks.load_task("subj", d).docs[0]
    assert subj.context == "Input: smart and alert , thirteen conversations about one thing is a small gem .\nType:"
    assert subj.continuations() == [" subjective", " objective"] and subj.gold == 0
    trec = tasks.load_task("trec", d).docs[0]
    assert trec.context == "Question: How far is it from Denver to Aspen ?\nType:"
    assert trec.choices[trec.gold] == "number"


def _hub_example(name: str, record: dict) -> tasks.Example:
    """What `name` makes of one Hugging Face hub record."""
    spec = tasks.TASKS[name]
    return spec.example(spec.data.hub.row(record))


def test_fewshot_block_is_lm_eval_layout():
    ex = tasks.TASKS["piqa"].example({"goal": "Goal?", "sol1": "a", "sol2": "b", "gold": 1})
    assert tasks.fewshot_text([ex, ex]) == "Question: Goal?\nAnswer: b\n\nQuestion: Goal?\nAnswer: b\n\n"


# ---- lm-eval's own task YAMLs -------------------------------------------------------------
# lm-evaluation-harness 0.4.13, lm_eval/tasks/...: the templates below are copied from
#   piqa/piqa.yaml               doc_to_text "Question: {{goal}}\nAnswer:", choices [sol1, sol2]
#   glue/rte/default.yaml        "{{sentence1}}\nQuestion: {{sentence2}} True or False?\nAnswer:", ["True","False"]
#   super_glue/rte/default.yaml  "{{premise}}\nQuestion: {{hypothesis}} True or False?\nAnswer:"
#   glue/sst2/default.yaml       "{{sentence}}\nQuestion: Is this sentence positive or negative?\nAnswer:"
#   openbookqa/openbookqa.yaml   doc_to_text question_stem, choices choices.text
#   super_glue/copa/utils.py     premise[:-1] + " because"/" therefore"; choice with lower-cased first letter
# target_delimiter " " and fewshot_delimiter "\n\n" (lm_eval/config/task.py defaults).
LM_EVAL_TEMPLATES = {
    "piqa/piqa.yaml": "Question: {{goal}}\nAnswer:",
    "glue/rte/default.yaml": "{{sentence1}}\nQuestion: {{sentence2}} True or False?\nAnswer:",
    "super_glue/rte/default.yaml": "{{premise}}\nQuestion: {{hypothesis}} True or False?\nAnswer:",
    "glue/sst2/default.yaml": "{{sentence}}\nQuestion: Is this sentence positive or negative?\nAnswer:",
}


def _render(template: str, doc: dict) -> str:
    return re.sub(r"\{\{\s*(\w+)\s*\}\}", lambda m: str(doc[m.group(1)]), template)


def test_formats_match_lm_eval_templates():
    doc = {"goal": "G", "sol1": "s1", "sol2": "s2", "sentence1": "P", "sentence2": "H", "premise": "P",
           "hypothesis": "H", "sentence": "S"}
    piqa = _hub_example("piqa", {"goal": "G", "sol1": "s1", "sol2": "s2", "label": 1})
    assert piqa.context == _render(LM_EVAL_TEMPLATES["piqa/piqa.yaml"], doc)
    assert piqa.choices == ("s1", "s2") and piqa.gold == 1
    rte = _hub_example("rte", {"premise": "P", "hypothesis": "H", "label": 0})
    assert rte.context == _render(LM_EVAL_TEMPLATES["glue/rte/default.yaml"], doc)
    assert rte.context == _render(LM_EVAL_TEMPLATES["super_glue/rte/default.yaml"], doc)
    assert rte.choices == ("True", "False") and rte.gold == 0  # GLUE label 0 = entailment
    sst2 = _hub_example("sst2", {"sentence": "S", "label": 1})
    assert sst2.context == _render(LM_EVAL_TEMPLATES["glue/sst2/default.yaml"], doc) and sst2.choices[1] == "positive"
    copa = _hub_example("copa", {"premise": "The man fell.", "question": "cause",
                                 "choice1": "He slipped.", "choice2": "He ran.", "label": 0})
    assert copa.context == "The man fell because" and copa.choices == ("he slipped.", "he ran.")
    obqa = _hub_example("openbookqa", {"question_stem": "Q", "choices": {"text": ["w", "x", "y", "z"],
                                                                         "label": ["A", "B", "C", "D"]},
                                       "answerKey": "C"})
    assert obqa.context == "Q" and obqa.choices == ("w", "x", "y", "z") and obqa.gold == 2


def test_hub_labels_map_to_local_classes():
    # CogComp/trec coarse_label order ABBR, ENTY, DESC, HUM, LOC, NUM; ordered-prompt's class names
    trec = [_hub_example("trec", {"text": "Q?", "coarse_label": i}) for i in range(6)]
    assert [e.choices[e.gold] for e in trec] == ["expression", "entity", "description", "human", "location", "number"]
    # SetFit/subj: 0 = objective, 1 = subjective
    subj = [_hub_example("subj", {"text": "T", "label": y}) for y in (0, 1)]
    assert [e.choices[e.gold] for e in subj] == ["objective", "subjective"]
    assert _hub_example("rte", {"premise": "P", "hypothesis": "H", "label": 1}).gold == 1  # not_entailment
    assert _hub_example("rte", {"premise": "P", "hypothesis": "H", "label": 1}).label == "1"  # balanced few-shot


def _lm_eval_task_files() -> dict[str, str] | None:
    """lm_eval's task YAML texts, from an installed lm_eval or the wheel named by $LM_EVAL_WHEEL."""
    wanted = list(LM_EVAL_TEMPLATES) + ["openbookqa/openbookqa.yaml", "super_glue/copa/utils.py"]
    wheel = os.environ.get("LM_EVAL_WHEEL")
    if wheel and pathlib.Path(wheel).is_file():
        with zipfile.ZipFile(wheel) as z:
            return {w: z.read(f"lm_eval/tasks/{w}").decode() for w in wanted}
    import importlib.util

    spec = importlib.util.find_spec("lm_eval")  # locates the package without importing it
    if spec is None or not spec.submodule_search_locations:
        return None
    root = pathlib.Path(list(spec.submodule_search_locations)[0]) / "tasks"
    return {w: (root / w).read_text() for w in wanted}


def test_formats_match_installed_lm_eval():
    files = _lm_eval_task_files()
    if files is None:
        pytest.skip("lm_eval not installed (pip install --no-deps lm_eval, or set LM_EVAL_WHEEL)")
    for path, template in LM_EVAL_TEMPLATES.items():
        line = next(l for l in files[path].splitlines() if l.startswith("doc_to_text:"))
        assert json.loads(line.split(":", 1)[1].strip()) == template, path
    assert "doc_to_text: question_stem" in files["openbookqa/openbookqa.yaml"]
    namespace: dict = {}
    exec(files["super_glue/copa/utils.py"], namespace)  # plain functions, no imports
    doc = {"premise": "The man fell.", "question": "effect", "choice1": "He slipped.", "choice2": "He ran.",
           "label": 1}
    ours = _hub_example("copa", doc)
    assert namespace["doc_to_text"](doc) == ours.context
    # lm-eval's COPA choices carry their own leading space *and* get target_delimiter " ";
    # we keep a single space (the text the model would read), see TASKS["copa"].prompt_format.
    assert namespace["doc_to_choice"](doc) == [" " + c for c in ours.choices]


# ---- few-shot sampling ------------------------------------------------------------------------


def test_fewshot_never_shows_the_asked_item(shared_data_dir):
    task = tasks.load_task("copa", str(shared_data_dir))
    model = FakeModel()
    wl = workload.build_workload(task, model.tokenizer, workload.WorkloadSpec(fewshot=(8, 10), seed=3))
    texts = wl.prefix_texts
    assert len(wl.requests) == 100
    for r in wl.requests:
        assert task.docs[r.doc_index].fewshot_block() not in texts[r.prefix_id]


def test_fewshot_is_class_balanced(shared_data_dir):
    task = tasks.load_task("sst2", str(shared_data_dir))
    picked = tasks.sample_fewshot(task, 6, np.random.default_rng(0))
    labels = [task.fewshot_pool[i].label for i in picked]
    assert sorted(labels) == ["0", "0", "0", "1", "1", "1"]
    assert picked == tasks.sample_fewshot(task, 6, np.random.default_rng(0))


# ---- declarations ---------------------------------------------------------------------------------


def test_every_task_declares_all_five_parts():
    for name, spec in tasks.TASKS.items():
        assert spec.name == name and spec.description and spec.prompt_format, name
        # data source
        assert isinstance(spec.data, (tasks.Files, tasks.UserFile, tasks.Synthetic)), name
        if isinstance(spec.data, tasks.Files):
            assert spec.data.docs.files and spec.data.docs.hub_split and spec.data.hub.path, name
            assert callable(spec.data.read) and callable(spec.data.hub.row), name
        # few-shot source
        assert isinstance(spec.fewshot, tasks.Split) or spec.fewshot in (tasks.FROM_DOCS, tasks.NO_FEWSHOT), name
        assert (spec.fewshot == tasks.NO_FEWSHOT) == isinstance(spec.data, tasks.Synthetic), name
        # metric: lm-eval's acc over (choice loglikelihoods, choices, gold)
        assert spec.metric([([0.0, -1.0], ["a", "b"], 0), ([0.0, -1.0], ["a", "b"], 1)])["acc"] == 0.5, name
        # prompt and choices: a row holding the fields they name renders every field
        fields = {f for text in (spec.prompt, *([] if isinstance(spec.choices, str) else spec.choices))
                  for _, f, _, _ in string.Formatter().parse(text) if f}
        row = {f: f"<{f}>" for f in fields} | {"gold": 0}
        if isinstance(spec.choices, str):
            row[spec.choices] = ["<c0>", "<c1>"]
        ex = spec.example(row)
        assert all(f"<{f}>" in ex.context + "".join(ex.choices) for f in fields), name
        assert "{" not in ex.context and len(ex.choices) >= 2 and ex.gold == 0, name


def test_declarations_reject_an_unknown_fewshot_source():
    spec = tasks.TASKS["mc_jsonl"]
    with pytest.raises(ValueError, match="few-shot source 'train'"):
        dataclasses.replace(spec, fewshot="train")
    with pytest.raises(ValueError, match="few-shot source"):  # a split of files only for a file task
        dataclasses.replace(spec, fewshot=tasks.Split(("x.jsonl",), "train"))


def _toy_spec(name: str = "toy") -> tasks.TaskSpec:
    """A task none of the code knows about: files toy/{test,train}.jsonl of {"q", "a", "y"} rows."""
    def rows(path):
        return [{"q": r["q"], "a": r["a"], "gold": r["y"]} for r in map(json.loads, path.read_text().splitlines())]
    return tasks.TaskSpec(
        name, "a toy task",
        data=tasks.Files(tasks.Split(("toy/test.jsonl",), "test"), rows,
                         tasks.Hub("org/toy", None, lambda r: {"q": r["question"], "a": r["answer"], "gold": r["y"]})),
        prompt="Q: {q}\nA:", choices=("{a}", "not {a}"),
        fewshot=tasks.Split(("toy/train.jsonl",), "train"), balanced_fewshot=True, metric=metrics.accuracy,
        prompt_format="toy format")


def test_a_new_declaration_loads_from_files_with_no_other_change(tmp_path, monkeypatch):
    monkeypatch.setitem(tasks.TASKS, "toy", _toy_spec())
    (tmp_path / "toy").mkdir()
    (tmp_path / "toy/test.jsonl").write_text('{"q": "1+1", "a": "2", "y": 0}\n{"q": "2+2", "a": "5", "y": 1}\n')
    (tmp_path / "toy/train.jsonl").write_text('{"q": "3+3", "a": "6", "y": 0}\n')
    task = tasks.load_task("toy", str(tmp_path))
    assert [(e.context, e.choices, e.gold, e.label) for e in task.docs] == [
        ("Q: 1+1\nA:", ("2", "not 2"), 0, "0"), ("Q: 2+2\nA:", ("5", "not 5"), 1, "1")]
    assert [e.fewshot_block() for e in task.fewshot_pool] == ["Q: 3+3\nA: 6"]
    assert (task.fewshot_same_split, task.balanced_fewshot, task.prompt_format, task.source) == (
        False, True, "toy format", str(tmp_path))
    wl = workload.build_workload(task, FakeModel().tokenizer, workload.WorkloadSpec(fewshot=(1, 1)))
    assert wl.prefix_texts == ("Q: 3+3\nA: 6\n\n",) and len(wl.requests) == 2
    (tmp_path / "toy/train.jsonl").unlink()  # every declared file is needed
    with pytest.raises(EvalError, match="looked for toy/test.jsonl, toy/train.jsonl in"):
        tasks.load_task("toy", str(tmp_path))


def test_a_new_declaration_loads_from_the_hub_when_files_are_missing(tmp_path, monkeypatch):
    monkeypatch.setitem(tasks.TASKS, "toy", _toy_spec())
    monkeypatch.delenv("SPECJAX_DATA", raising=False)
    asked = []

    def load_dataset(path, name=None, split=None):
        asked.append((path, name, split))
        if path == "offline":
            raise ConnectionError("no network")
        return [{"question": f"{split} 1+1", "answer": "2", "y": 0}]

    monkeypatch.setitem(sys.modules, "datasets", types.SimpleNamespace(load_dataset=load_dataset))
    task = tasks.load_task("toy", str(tmp_path))
    assert asked == [("org/toy", None, "test"), ("org/toy", None, "train")]
    assert task.docs[0].context == "Q: test 1+1\nA:" and task.fewshot_pool[0].context == "Q: train 1+1\nA:"
    assert task.source == "huggingface:org/toy:test"
    spec = _toy_spec()
    monkeypatch.setitem(tasks.TASKS, "toy", dataclasses.replace(
        spec, data=dataclasses.replace(spec.data, hub=dataclasses.replace(spec.data.hub, path="offline"))))
    with pytest.raises(EvalError) as e:
        tasks.load_task("toy", str(tmp_path))
    assert "the Hugging Face hub (offline) failed: ConnectionError: no network" in str(e.value)
    assert f"--data_dir={tmp_path}" in str(e.value) and "\n" not in str(e.value)


def test_needle_and_rag_questions_follow_their_declared_prompt(monkeypatch):
    doc = synthetic.make_needle_doc(np.random.default_rng(0), synthetic.NeedleSpec(num_facts=6))
    ex = tasks.needle_question(doc, 2, np.random.default_rng(0), 4)
    assert doc.fact(2) == f"{ex.context} {ex.choices[ex.gold]}."  # the question is the fact up to its code
    rag = tasks.rag_question([doc, doc], 1, 2, np.random.default_rng(0), 4)
    assert rag.context == "\n" + ex.context
    monkeypatch.setitem(tasks.TASKS, "needle", dataclasses.replace(tasks.TASKS["needle"], prompt="Code of {key}:"))
    assert tasks.needle_question(doc, 2, np.random.default_rng(0), 4).context == f"Code of {doc.keys[2]}:"


# ---- mc_jsonl -------------------------------------------------------------------------------------


def test_mc_jsonl(tmp_path):
    path = tmp_path / "items.jsonl"
    rows = [{"query": f"Q{i}: 2+{i} =", "choices": [str(2 + i), str(3 + i), "x"], "gold": 0} for i in range(12)]
    path.write_text("\n".join(json.dumps(r) for r in rows) + "\n")
    task = tasks.load_task("mc_jsonl", data_path=str(path))
    assert len(task.docs) == 12 and task.fewshot_same_split
    assert task.docs[3].context == "Q3: 2+3 =" and task.docs[3].continuations() == [" 5", " 6", " x"]
    wl = workload.build_workload(task, FakeModel().tokenizer, workload.WorkloadSpec(fewshot=(2, 2)))
    assert len(wl.requests) == 12


def test_mc_jsonl_errors(tmp_path):
    with pytest.raises(EvalError, match="needs --data_path"):
        tasks.load_task("mc_jsonl")
    with pytest.raises(EvalError, match="no such file"):
        tasks.load_task("mc_jsonl", data_path=str(tmp_path / "missing.jsonl"))
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"query": "q", "choices": ["a", "b"], "gold": 3}\n')
    with pytest.raises(EvalError, match=r"bad.jsonl:1: gold 3"):
        tasks.load_task("mc_jsonl", data_path=str(bad))


GOOD_LINE = {"query": "2+2 =", "choices": ["4", "5"], "gold": 0}


@pytest.mark.parametrize("change, message", [
    ({"choices": "yes"}, 'choices is "yes", not a list of texts'),
    ({"choices": {"a": 1, "b": 2}}, 'choices is {"a": 1, "b": 2}, not a list of texts'),
    ({"choices": ["4", 5]}, 'choices is ["4", 5], not a list of texts'),
    ({"gold": 1.9}, "gold 1.9 is not an index into 2 choices"),
    ({"gold": True}, "gold true is not an index into 2 choices"),
    ({"gold": "0"}, 'gold "0" is not an index'),
    ({"gold": -1}, "gold -1 is not an index"),
    ({"query": None}, "query is null, not text"),
    ({"choices": ["4"]}, "1 choices; a multiple-choice item needs at least two"),
    ({"choices": []}, "0 choices; a multiple-choice item needs at least two"),
    ({"gold": None}, "gold null is not an index"),
])
def test_mc_jsonl_refuses_what_it_would_otherwise_coerce(tmp_path, change, message):
    """Each malformed line is refused with one line naming the file and line number; no item is made of it."""
    path = tmp_path / "items.jsonl"
    path.write_text("\n".join(json.dumps(r) for r in [GOOD_LINE, GOOD_LINE, {**GOOD_LINE, **change}]) + "\n")
    with pytest.raises(EvalError) as e:
        tasks.load_task("mc_jsonl", data_path=str(path))
    text = str(e.value)
    assert f"{path}:3: {message}" in text and "\n" not in text
    assert "each line must be" in text  # says what a line should hold


@pytest.mark.parametrize("line, message", [
    ("[1, 2]", "a JSON list, not an object"),
    ('{"query": "q"}', "no choices, gold"),
    ("{oops", "not JSON"),
])
def test_mc_jsonl_refuses_lines_that_are_not_items(tmp_path, line, message):
    path = tmp_path / "items.jsonl"
    path.write_text(json.dumps(GOOD_LINE) + "\n\n" + line + "\n")
    with pytest.raises(EvalError, match=rf"items.jsonl:3: {message}"):
        tasks.load_task("mc_jsonl", data_path=str(path))


def test_mc_jsonl_that_is_not_utf8_names_the_line(tmp_path):
    path = tmp_path / "latin1.jsonl"
    path.write_bytes(json.dumps(GOOD_LINE).encode() + b"\n" + '{"query": "caf\u00e9", "choices": ["a", "b"], '
                     '"gold": 0}\n'.encode("latin-1"))
    with pytest.raises(EvalError, match=r"latin1.jsonl:2: not UTF-8 text \(byte 0xe9\); save the file as UTF-8"):
        tasks.load_task("mc_jsonl", data_path=str(path))


def test_mc_jsonl_too_small_for_the_fewshot_asked_hints_at_zero_shot(tmp_path):
    """The README's example with the default --num_fewshot 2-10 on a small file: the error says how to run it, and
    --num_fewshot 0 then runs every item."""
    path = tmp_path / "items.jsonl"
    path.write_text("\n".join(json.dumps(GOOD_LINE) for _ in range(5)) + "\n")
    task = tasks.load_task("mc_jsonl", data_path=str(path))
    tok = FakeModel().tokenizer
    with pytest.raises(EvalError, match=r"only 0 available .*; pass --num_fewshot 0 for zero-shot prompts"):
        workload.build_workload(task, tok, workload.WorkloadSpec(fewshot=(2, 10)))
    wl = workload.build_workload(task, tok, workload.WorkloadSpec(fewshot=(0, 0)))
    assert len(wl.requests) == 5 and all(w == "" for w in wl.prefix_texts)


# ---- errors --------------------------------------------------------------------------------------


def test_unknown_task_lists_every_registered_name(monkeypatch):
    names = ["piqa", "rte", "copa", "openbookqa", "sst2", "subj", "trec", "mc_jsonl", "needle", "rag"]
    with pytest.raises(EvalError) as e:
        tasks.load_task("nope")
    assert str(e.value) == f"unknown task 'nope'; known tasks: {', '.join(names)}"
    monkeypatch.setitem(tasks.TASKS, "toy", dataclasses.replace(tasks.TASKS["mc_jsonl"], name="toy"))
    with pytest.raises(EvalError, match=f"known tasks: {', '.join(names)}, toy$"):
        tasks.load_task("nope")


def test_missing_data_dir_says_where_it_looked(tmp_path, monkeypatch):
    monkeypatch.setenv("SPECJAX_DATA", str(tmp_path / "elsewhere"))
    with pytest.raises(EvalError) as e:
        tasks.load_task("piqa", str(tmp_path))
    message = str(e.value)
    assert "piqa/valid.jsonl" in message and f"--data_dir={tmp_path}" in message
    assert f"$SPECJAX_DATA={tmp_path / 'elsewhere'}" in message and "\n" not in message
    with pytest.raises(EvalError, match="is not a directory"):
        tasks.load_task("piqa", str(tmp_path / "nope"))


# ---- needle ---------------------------------------------------------------------------------------


TOKENIZER = FakeModel().tokenizer


def _needle(seed, **kw):
    spec = workload.WorkloadSpec(limit=24, seed=seed, **kw)
    return workload.build_workload(tasks.load_task("needle"), TOKENIZER, spec)


def _asked_key(r) -> str:
    return re.fullmatch(r"The secret code of ([\w ]+) is", TOKENIZER.decode(r.query_ids)).group(1)


def test_needle_is_deterministic_and_answer_is_in_prefix():
    a, b, c = _needle(0), _needle(0), _needle(1)
    assert a == b and a.requests != c.requests
    for r in a.requests:
        prefix = a.prefix_texts[r.prefix_id]
        key, gold = _asked_key(r), r.choices[r.gold]
        assert f"The secret code of {key} is {gold}.\n" in prefix
        assert gold not in TOKENIZER.decode(r.query_ids)  # the answer is only in the prefix
        assert len(set(r.choices)) == 4
        assert all(f" is {c}.\n" in prefix for c in r.choices)  # distractors are codes of the same prefix
        assert len({len(c) for c in r.choices}) == 1  # same length: acc_norm cannot prefer one
        assert prefix.count(f"of {key} is") == 1


def test_needle_keys_use_each_word_once_and_filler_separates_facts():
    wl = _needle(0)
    spec = synthetic.NeedleSpec()
    for text in wl.prefix_texts:
        lines = text.strip("\n").split("\n")
        assert lines[0] == synthetic.NEEDLE_HEADER.strip()
        facts = [re.fullmatch(r"The secret code of the (\w+) (\w+) is (\d{4})\.", line) for line in lines[1:]]
        found = [m.groups() for m in facts if m]
        assert len(found) == spec.num_facts
        adjectives, objects, codes = zip(*found)
        assert len(set(adjectives)) == len(set(objects)) == len(set(codes)) == spec.num_facts
        fillers = [line for line, m in zip(lines[1:], facts) if not m]
        assert len(fillers) == spec.num_facts and set(fillers) <= set(synthetic.NEEDLE_FILLER)
        assert not any(ch.isdigit() for line in fillers for ch in line)  # no code can hide in the filler


def test_needle_many_facts_keep_distinct_keys():
    spec = synthetic.NeedleSpec(num_facts=300)
    doc = synthetic.make_needle_doc(np.random.default_rng(0), spec)
    assert len(set(doc.keys)) == len(set(doc.values)) == 300
    per_adjective = np.bincount([spec.adjectives.index(k.split()[1]) for k in doc.keys])
    assert per_adjective.max() - per_adjective.min() <= 1  # words reused as evenly as possible
    with pytest.raises(EvalError, match="at most"):
        synthetic.make_needle_doc(np.random.default_rng(0), dataclasses.replace(spec, num_facts=40 * 40 + 1))


def test_needle_prefix_tokens_sets_length():
    wl = _needle(0, prefix_tokens=2000)
    assert 1900 <= wl.summary()["prefix_tokens_mean"] <= 2100
