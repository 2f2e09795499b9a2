"""An evaluation's --store folder: kept apart per weights, reused across runs and processes, private copies per
process, damage reported and repaired, a full disk during the copy a one-line error that leaves nothing behind."""

import errno
import json
import os
import pathlib
import shutil
import subprocess
import sys

import numpy as np
import pytest
from absl import flags

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

import specjax  # noqa: E402
import toy_kv  # noqa: E402
from hf_checkpoints import convert_two_llamas  # noqa: E402
from specjax.engine import fingerprint  # noqa: E402
from specjax.eval import __main__ as cli  # noqa: E402
from specjax.eval import runner  # noqa: E402
from specjax.eval.errors import EvalError  # noqa: E402
from specjax.stores import KVStore, StoreMismatchError  # noqa: E402
from specjax.stores.fsck import fsck  # noqa: E402

REPO = pathlib.Path(__file__).resolve().parents[1]
TOL = 1e-3


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    """Two converted Llamas of one shape, other weights, and a small mc_jsonl file (the README's example)."""
    root = tmp_path_factory.mktemp("eval_store")
    _, converted = convert_two_llamas(root)
    rows = [{"query": f"Q{i}: {i} plus 2 is", "choices": [str(i + 2), str(i + 3)], "gold": 0} for i in range(12)]
    items = root / "items.jsonl"
    items.write_text("\n".join(json.dumps(r) for r in rows) + "\n")
    return converted, items


def _args(model_dir, items, store, out, systems="recompute,as_full"):
    return [f"--model={model_dir}", "--task=mc_jsonl", f"--data_path={items}", "--num_fewshot=2", "--chunk_tokens=16",
            f"--systems={systems}", "--retention=0.5", f"--store={store}", f"--output_dir={out}", "--noprogress"]


def _eval(model_dir, items, store, out) -> dict:
    flags.FLAGS(["prog", *_args(model_dir, items, store, out)])
    try:
        cli.main(["prog"])
    finally:
        flags.FLAGS.unparse_flags()
    return json.loads((out / "results.json").read_text())


def _logprobs(out) -> dict:
    """system -> [choice log-probabilities per request] from requests.jsonl."""
    found = {}
    for line in (out / "requests.jsonl").read_text().splitlines():
        r = json.loads(line)
        found.setdefault(r["system"], []).append(r["choice_logprobs"])
    return {k: np.asarray(v) for k, v in found.items()}


def _assert_answers_its_own(out) -> None:
    """as_full, which loads every stored token, answers as the model's own recompute: nothing of other weights (or
    of a damaged chunk) was served."""
    lp = _logprobs(out)
    np.testing.assert_allclose(lp["as_full"], lp["recompute"], atol=TOL, rtol=0)


def _bases(store) -> list[str]:
    return sorted(p.name for p in store.iterdir() if p.is_dir() and p.name.startswith("base-"))


def _flip_a_chunk_byte(store_dir) -> None:
    chunks = sorted(p for p in (store_dir / "kv").rglob("*") if p.is_file() and p.name != "zarr.json")
    victim = chunks[len(chunks) // 2]
    data = bytearray(victim.read_bytes())
    data[len(data) // 2] ^= 0xFF
    victim.write_bytes(bytes(data))


def test_two_checkpoints_in_turn_keep_their_stores_apart_and_a_rerun_reuses_its_own(models, tmp_path):
    """As a user with a fine-tuned model and its base: each model's as_full equals its own recompute; a second run of
    the first model writes no prefix the first stored, with the same accuracy and bytes as on a fresh store."""
    (model0, model1), items = models
    store = tmp_path / "store"
    first = _eval(model0, items, store, tmp_path / "out0")
    second = _eval(model1, items, store, tmp_path / "out1")
    _assert_answers_its_own(tmp_path / "out0")
    _assert_answers_its_own(tmp_path / "out1")
    digests = [specjax.load_model(str(m), verify_checksums=False).weights_digest for m in (model0, model1)]
    assert _bases(store) == sorted(f"base-prefixes-chunk16-weights-{d[:12]}-float32" for d in digests)
    (base0,) = first["stores"]
    assert base0.endswith(f"{digests[0][:12]}-float32") and first["stores"][base0]["prefixes_written"] == 2
    assert second["stores"][base0.replace(digests[0][:12], digests[1][:12])]["prefixes_reused"] == 0

    again = _eval(model0, items, store, tmp_path / "again")
    assert again["stores"][base0]["prefixes_written"] == 0 and again["stores"][base0]["prefixes_reused"] == 2
    assert any(n.startswith(f"store {base0}: 2 prefixes reused from an earlier run") for n in again["notes"])
    for key in ("recompute", "as_full"):
        assert again["systems"][key]["accuracy"] == first["systems"][key]["accuracy"]
        assert again["systems"][key]["io"]["disk_bytes"] == first["systems"][key]["io"]["disk_bytes"]
    np.testing.assert_array_equal(_logprobs(tmp_path / "again")["as_full"], _logprobs(tmp_path / "out0")["as_full"])

    # opened directly with the other weights, the store refuses, naming the weights that wrote it
    model = specjax.load_model(str(model1), verify_checksums=False)
    with pytest.raises(StoreMismatchError) as e:
        KVStore.open(store / base0, fingerprint(model, 16))
    assert f"holds the KV of weights {digests[0][:12]} of model0" in str(e.value) and "\n" not in str(e.value)
    assert f"not of this model's weights {digests[1][:12]}" in str(e.value)
    assert fsck(store / base0).ok  # the refused open changed nothing


def test_a_damaged_base_store_is_reported_and_repaired(models, tmp_path):
    (model0, _), items = models
    store = tmp_path / "store"
    fresh = _eval(model0, items, store, tmp_path / "fresh")
    (base,) = fresh["stores"]
    _flip_a_chunk_byte(store / base)
    assert fsck(store / base).bad_chunks == 1
    damaged = _eval(model0, items, store, tmp_path / "damaged")
    assert damaged["stores"][base]["prefixes_repaired"] >= 1
    note = next(n for n in damaged["notes"] if n.startswith("as_full: "))
    assert "requests recomputed because of bad chunks" in note and "were stored anew" in note
    assert f"**note**: {note}" in (tmp_path / "damaged" / "results.md").read_text()
    _assert_answers_its_own(tmp_path / "damaged")  # never served from the bad chunk
    assert damaged["systems"]["as_full"]["accuracy"] == fresh["systems"]["as_full"]["accuracy"]
    report = fsck(store / base)
    assert report.ok and report.bad_chunks == 0 and report.nodes == fsck(store / base).nodes
    later = _eval(model0, items, store, tmp_path / "later")  # the repair lasts: nothing fails again
    assert later["stores"][base]["prefixes_repaired"] == 0 and later["stores"][base]["prefixes_written"] == 0
    assert all(s["counters"].get("bad_chunks", 0) == 0 for s in later["systems"].values())


def test_two_evaluations_on_one_store_at_once(models, tmp_path):
    """Each process works on its own copies: both finish, neither meets a bad chunk, nothing is lost or left."""
    (model0, _), items = models
    store = tmp_path / "store"
    env = dict(os.environ, JAX_PLATFORMS="cpu")
    procs = [subprocess.Popen([sys.executable, "-m", "specjax.eval",
                               *_args(model0, items, store, tmp_path / f"out{i}", "recompute,as_full,as_h2o_lru")],
                              cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
             for i in range(2)]
    outputs = [p.communicate(timeout=600) for p in procs]
    assert [p.returncode for p in procs] == [0, 0], [err[-2000:] for _, err in outputs]
    written = 0
    for i in range(2):
        results = json.loads((tmp_path / f"out{i}" / "results.json").read_text())
        assert all(s["counters"].get("bad_chunks", 0) == 0 for s in results["systems"].values())
        assert not any("bad chunks" in n for n in results["notes"])
        _assert_answers_its_own(tmp_path / f"out{i}")
        (entry,) = results["stores"].values()
        assert entry["prefixes_written"] + entry["prefixes_reused"] == 2
        written += entry["prefixes_written"]
    assert written == 2  # the one that populated second found the other's prefixes stored
    (base,) = _bases(store)
    report = fsck(store / base)
    assert report.ok and report.nodes >= 2
    assert not any((store / "runs").iterdir())  # both removed their private copies


def _toy_base(root) -> pathlib.Path:
    base = root / "base-toy"
    with KVStore.open(base, toy_kv.fingerprint("copy-toy")) as store:
        for seed in range(3):
            toy_kv.insert(store, np.random.default_rng(seed).integers(0, 1000, 40))
    return base


def _files(folder) -> dict:
    return {p.relative_to(folder): p.read_bytes() for p in folder.rglob("*") if p.is_file()}


def test_a_runs_copy_links_the_base_and_what_the_run_writes_never_reaches_it(tmp_path):
    """A private copy's files are hard links to the base's (no bytes copied), and a run that stores new prefixes,
    repacks its store (SPEC's reordering) and drops nodes through its copy leaves every byte of the base as it was."""
    from specjax.stores.reorder import Reorderer

    base = _toy_base(tmp_path)
    before = _files(base)
    with runner.StoreFolder(tmp_path) as folder:
        copy = folder.private_copy(base, "spec")
        extents = [p for p in copy.rglob("*") if p.is_file() and "kv" in p.parts]
        assert extents and all(p.stat().st_nlink == 2 for p in extents)
        assert (copy / "manifest.lock").stat().st_ino != (base / "manifest.lock").stat().st_ino
        with KVStore.open(copy, toy_kv.fingerprint("copy-toy"), retire_grace_s=0.0) as store:
            toy_kv.insert(store, np.random.default_rng(9).integers(0, 1000, 70))
            for seed in range(3):
                tokens = np.random.default_rng(seed).integers(0, 1000, 40)
                with store.match(tokens) as match:
                    store.record_importance(match, np.linspace(0.0, 1.0, match.length))
            assert Reorderer(store).run_once() > 0
            with store.match(np.random.default_rng(0).integers(0, 1000, 40)) as match:
                nodes = match.node_ids()[-1:]
            store.drop_nodes(nodes)
        assert fsck(copy).ok
    assert _files(base) == before and fsck(base).ok


def test_disk_full_while_copying_the_base_store(tmp_path, monkeypatch):
    """On a filesystem without hard links the copy is a real one, and a full disk stops it cleanly."""
    base = _toy_base(tmp_path)
    before = _files(base)
    copied = []
    real = shutil.copyfile

    def no_links(src, dst, **kwargs):
        raise OSError(errno.EXDEV, "Invalid cross-device link", str(dst))

    monkeypatch.setattr(os, "link", no_links)

    def fills_the_disk(src, dst, **kwargs):
        if len(copied) == 3:
            raise OSError(errno.ENOSPC, "No space left on device", str(dst))
        copied.append(src)
        return real(src, dst, **kwargs)

    monkeypatch.setattr(shutil, "copyfile", fills_the_disk)
    with runner.StoreFolder(tmp_path) as folder:
        with pytest.raises(EvalError) as e:
            folder.private_copy(base, "as_full")
        text = str(e.value)
        assert "\n" not in text and f"could not copy the base store {base} for a run (the disk is full; the " \
            "partial copy was removed): a run needs" in text and "MB free at" in text
        assert "free space or give --store a folder on a larger disk" in text
        assert not (folder.private / "as_full").exists()
    assert not any((tmp_path / "runs").iterdir())
    assert _files(base) == before and fsck(base).ok  # the base store is untouched


def test_private_copies_of_a_process_that_died_are_removed(tmp_path):
    base = _toy_base(tmp_path)
    runs = tmp_path / "runs"
    (runs / "4242-deadbeef" / "as_full").mkdir(parents=True)
    (runs / "4242-deadbeef" / runner.RUN_MARK).touch()  # made by a StoreFolder
    (runs / "4242-deadbeef.lock").touch()  # no process holds it: its owner is gone
    with runner.StoreFolder(tmp_path) as folder, runner.StoreFolder(tmp_path) as other:
        mine = folder.private_copy(base, "as_full")
        theirs = other.private_copy(base, "as_full")  # a live process's copies are never touched
        assert mine != theirs and mine.is_dir() and theirs.is_dir()
        assert not (runs / "4242-deadbeef").exists() and not (runs / "4242-deadbeef.lock").exists()
        assert fsck(mine).ok and fsck(theirs).ok
