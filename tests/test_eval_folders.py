"""The folders and files an evaluation is given or finds, handled as a careless user would hand them over: kvstore
URLs as --store, an output folder that holds another run's results, a user's folder among the store's run copies,
read-only folders, lock paths that are folders, damaged saved runs and task files, a full disk, Ctrl-C. Each ends in
one line naming the fix (or works), and nothing a user made is deleted or written over."""

import errno
import json
import os
import pathlib
import shutil
import signal
import subprocess
import sys
import time

import numpy as np
import pytest
from absl import flags

import toy_kv
from eval_fakes import FakeModel, PlainRecompute
from specjax.eval import __main__ as cli
from specjax.eval import folders, partial, registry, report, runner, tasks
from specjax.eval.errors import EvalError
from specjax.stores import KVStore
from specjax.stores.errors import ManifestError

REPO = pathlib.Path(__file__).resolve().parents[1]
READ_ONLY = pathlib.Path("/sys/specjax-test")  # not even root may make a folder there


@pytest.fixture
def fake(monkeypatch):
    monkeypatch.setattr(cli, "load_model", lambda *a, **k: FakeModel())
    monkeypatch.setattr(registry, "factories", lambda: {})
    monkeypatch.setitem(registry.PLUGINS, "recompute", PlainRecompute)


def _main(*args):
    flags.FLAGS(["prog", "--limit=4", "--noprogress", *args])
    try:
        cli.main(["prog"])
    finally:
        flags.FLAGS.unparse_flags()


def _one_line(error) -> str:
    text = str(error.value)
    assert "\n" not in text
    return text


# ---------------------------------------------------------------- --store given a URL, a bad path


@pytest.mark.parametrize("url", ["memory://", "gs://bucket/kv", "s3://x/y", "bogus://x", "file:///tmp/kv|ocdbt",
                                 "ocdbt://x"])
def test_a_store_url_is_refused_in_one_line_and_makes_no_folder(url, fake, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    with pytest.raises(EvalError) as e:
        _main(f"--store={url}", f"--output_dir={tmp_path / 'out'}")
    assert f"--store {url}: the evaluation keeps its stores in a local folder" in _one_line(e)
    assert "give a folder path (or file:///path)" in str(e.value)
    assert not any(tmp_path.iterdir())  # no ./gs:/bucket/kv and the like, refused before anything is made


def test_a_file_url_is_its_folder(fake, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    assert folders.store_folder(f"file://{tmp_path / 'kv'}") == tmp_path / "kv"
    _main(f"--store=file://{tmp_path / 'kv'}", f"--output_dir={tmp_path / 'out'}")
    assert (tmp_path / "out" / "results.json").is_file()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["out"]  # no ./file: folder


def test_a_store_path_that_is_not_utf8_is_one_line(fake, tmp_path):
    store = os.fsdecode(os.fsencode(str(tmp_path)) + b"/st\xffre")
    with pytest.raises(EvalError) as e:
        _main(f"--store={store}", f"--output_dir={tmp_path / 'out'}")
    assert "the path is not UTF-8 text (byte 0xff); give a folder whose path is UTF-8" in _one_line(e)


@pytest.mark.skipif(not pathlib.Path("/sys").is_dir(), reason="needs Linux's /sys")
@pytest.mark.parametrize("flag", ["--store", "--output_dir"])
def test_a_folder_that_takes_no_files_fails_before_any_work(flag, fake, tmp_path, monkeypatch):
    ran = []
    monkeypatch.setattr(runner, "run_all", lambda *a, **k: ran.append(1))
    other = "--output_dir" if flag == "--store" else "--store"
    with pytest.raises(EvalError) as e:
        _main(f"{flag}={READ_ONLY}", f"{other}={tmp_path / 'other'}")
    assert f"{flag} {READ_ONLY}: cannot write there" in _one_line(e) and "give a folder you can write to" in str(e.value)
    assert not ran


# ---------------------------------------------------------------- --output_dir holding another run's results


def test_a_second_evaluation_never_writes_over_the_firsts_results(fake, tmp_path, capsys):
    out = tmp_path / "out"
    _main(f"--output_dir={out}")
    first = {p.name: p.read_bytes() for p in out.iterdir()}
    _main(f"--output_dir={out}", "--seed=1")
    assert {p.name: p.read_bytes() for p in out.iterdir()} == first  # untouched
    moved = tmp_path / "out-2"
    results = json.loads((moved / "results.json").read_text())
    assert results["config"]["seed"] == 1
    assert f"written into {moved}: {out} holds another evaluation's results" in results["notes"]
    assert f"note: {out} holds another evaluation's results; writing into {moved}" in capsys.readouterr().err
    assert not (out / folders.CLAIM).exists() and not (moved / folders.CLAIM).exists()


def test_a_stale_figure_is_never_left_beside_new_results(fake, tmp_path):
    out = tmp_path / "out"
    out.mkdir()
    (out / "tradeoff.png").write_bytes(b"an older run's figure")
    (out / "my-notes.txt").write_text("mine")
    _main(f"--output_dir={out}")
    assert sorted(p.name for p in out.iterdir()) == ["my-notes.txt", "tradeoff.png"]
    assert (out / "tradeoff.png").read_bytes() == b"an older run's figure"
    assert (tmp_path / "out-2" / "results.json").is_file()


def test_two_evaluations_at_once_write_two_folders(tmp_path):
    out = tmp_path / "out"
    with folders.OutputFolder(out) as first, folders.OutputFolder(out) as second:
        assert first.path == out and second.path == tmp_path / "out-2" and second.moved_from == out
        with pytest.raises(EvalError) as e:
            with folders.OutputFolder(out, resume=True):
                pass
        assert "another evaluation is writing into it now" in _one_line(e)
    with folders.OutputFolder(out) as again:  # both let go
        assert again.path == out


def test_resuming_into_a_finished_evaluation_is_refused(fake, tmp_path):
    out = tmp_path / "out"
    _main(f"--output_dir={out}")
    before = (out / "results.json").read_bytes()
    with pytest.raises(EvalError) as e:
        _main(f"--output_dir={out}", "--resume")
    assert "holds the results of an evaluation that finished (nothing to resume)" in _one_line(e)
    assert (out / "results.json").read_bytes() == before


# ---------------------------------------------------------------- --store's own files and the user's beside them


def _toy_base(root) -> pathlib.Path:
    base = root / "base-toy"
    with KVStore.open(base, toy_kv.fingerprint("folders-toy")) as store:
        toy_kv.insert(store, np.random.default_rng(0).integers(0, 1000, 40))
    return base


def test_a_users_folder_among_the_run_copies_is_never_deleted(tmp_path):
    base = _toy_base(tmp_path)
    runs = tmp_path / "runs"
    for name in ("X", "4242-deadbeef"):  # the second is named like a run copy but lacks the mark
        (runs / name).mkdir(parents=True)
        (runs / name / "thesis.tex").write_text("mine")
        (runs / f"{name}.lock").touch()  # free: no process holds it
    (runs / "lockdir.lock").mkdir()
    with runner.StoreFolder(tmp_path) as folder:
        folder.private_copy(base, "as_full")
    for name in ("X", "4242-deadbeef"):
        assert (runs / name / "thesis.tex").read_text() == "mine" and (runs / f"{name}.lock").is_file()
    assert (runs / "lockdir.lock").is_dir()


def test_a_lock_path_that_is_a_folder_is_one_line(tmp_path):
    base = _toy_base(tmp_path)
    (tmp_path / "base-toy.lock").mkdir()
    with runner.StoreFolder(tmp_path) as folder, pytest.raises(EvalError) as e:
        folder.private_copy(base, "as_full")
    assert f"the store's lock file {tmp_path / 'base-toy.lock'} is a folder" in _one_line(e)
    assert "move that folder away or give --store another folder" in str(e.value)

    store = tmp_path / "other"
    (store / "manifest.lock").mkdir(parents=True)
    with pytest.raises(ManifestError) as e:
        with KVStore.open(store, toy_kv.fingerprint("folders-toy")) as s:
            toy_kv.insert(s, np.arange(40))
    assert f"the store's lock file {store / 'manifest.lock'} is a folder" in _one_line(e)


# ---------------------------------------------------------------- damaged files, a full disk


@pytest.mark.parametrize("content, why", [(b"", "(empty)"), (b'{"fingerprint": {"seed"', "(unreadable: JSONDecode")])
def test_a_damaged_saved_run_is_one_line_with_resume(content, why, fake, tmp_path):
    saved = tmp_path / ".partial" / "recompute.json"
    saved.parent.mkdir()
    saved.write_bytes(content)
    with pytest.raises(EvalError) as e:
        _main(f"--output_dir={tmp_path}", "--resume")
    assert f"cannot resume: {saved} is damaged {why}" in _one_line(e)
    assert "delete that file to run recompute again" in str(e.value) and saved.read_bytes() == content


def _task_copy(shared_data_dir, tmp_path, task: str) -> pathlib.Path:
    data = tmp_path / "data"
    shutil.copytree(shared_data_dir / task, data / task)
    return data


def test_a_truncated_task_file_is_one_line(shared_data_dir, tmp_path):
    data = _task_copy(shared_data_dir, tmp_path, "copa")
    path = data / "copa" / "copa.jsonl"
    lines = path.read_bytes().splitlines()
    path.write_bytes(b"\n".join(lines[:5]) + b"\n" + lines[5][: len(lines[5]) // 2])
    with pytest.raises(EvalError) as e:
        tasks.load_task("copa", str(data))
    assert f"{path}:6: not JSON" in _one_line(e) and "the task's data file is damaged: restore it" in str(e.value)


def test_a_task_file_line_not_utf8_is_one_line(shared_data_dir, tmp_path):
    data = _task_copy(shared_data_dir, tmp_path, "rte")
    path = data / "rte" / "val.jsonl"
    lines = path.read_bytes().splitlines()
    lines[3] = lines[3].replace(b"the", b"th\xe9", 1)
    path.write_bytes(b"\n".join(lines) + b"\n")
    with pytest.raises(EvalError) as e:
        tasks.load_task("rte", str(data))
    assert f"{path}:4: not UTF-8 text (byte 0xe9)" in _one_line(e)


def _full(*args, **kwargs):
    raise OSError(errno.ENOSPC, "No space left on device")


def test_a_full_disk_while_writing_results_keeps_the_runs_to_resume(fake, tmp_path, monkeypatch):
    monkeypatch.setattr(report, "write_all", _full)
    with pytest.raises(EvalError) as e:
        _main(f"--output_dir={tmp_path}")
    assert f"could not write the results into {tmp_path} (No space left on device)" in _one_line(e)
    assert "run the same command with --resume" in str(e.value)
    assert (tmp_path / ".partial" / "recompute.json").is_file()
    monkeypatch.undo()
    monkeypatch.setattr(cli, "load_model", lambda *a, **k: FakeModel())
    monkeypatch.setattr(registry, "factories", lambda: {})
    monkeypatch.setitem(registry.PLUGINS, "recompute", PlainRecompute)
    _main(f"--output_dir={tmp_path}", "--resume")
    assert json.loads((tmp_path / "results.json").read_text())["resumed"].keys() == {"recompute"}


def test_a_full_disk_while_saving_a_run_is_one_line(tmp_path, monkeypatch):
    runs = partial.PartialRuns(tmp_path, {"seed": 0}, resume=False)
    monkeypatch.setattr(pathlib.Path, "write_text", _full)
    with pytest.raises(EvalError) as e:
        runs.save("spec@r=0.25", runner.Run("spec", 0.25, [], 0.0, 0.0))
    assert "could not save the finished run spec@r=0.25 into" in _one_line(e)
    assert not any(runs.dir.iterdir())


# ---------------------------------------------------------------- Ctrl-C

_SLOW_EVAL = """
import signal, sys, time, pathlib
signal.signal(signal.SIGINT, signal.default_int_handler)  # Ctrl-C as in a terminal, also under a background job
sys.path.insert(0, {tests!r})
from eval_fakes import FakeModel, PlainRecompute
from specjax.eval import __main__ as cli, registry

class Slow(PlainRecompute):
    def run(self, request):
        pathlib.Path({started!r}).touch()
        time.sleep(0.5)
        return super().run(request)

cli.load_model = lambda *a, **k: FakeModel()
registry.factories = lambda: {{}}
registry.PLUGINS["recompute"] = Slow
sys.argv = ["prog", "--limit=40", "--noprogress", "--output_dir={out}"]
cli.run()
"""


def test_ctrl_c_is_one_line_naming_resume(tmp_path):
    started = tmp_path / "started"
    script = _SLOW_EVAL.format(tests=str(REPO / "tests"), started=str(started), out=tmp_path / "out")
    proc = subprocess.Popen([sys.executable, "-c", script], cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True, env=dict(os.environ, JAX_PLATFORMS="cpu"))
    deadline = time.time() + 120
    while not started.exists() and proc.poll() is None and time.time() < deadline:
        time.sleep(0.1)
    proc.send_signal(signal.SIGINT)
    _, err = proc.communicate(timeout=60)
    assert proc.returncode == 130, err
    assert "Traceback" not in err and "KeyboardInterrupt" not in err
    errors = [line for line in err.splitlines() if line.startswith("error:")]
    assert len(errors) == 1 and "run the same command with --resume to run only the rest" in errors[0], err


def test_no_free_inodes_while_copying_the_base_store_says_inodes(tmp_path, monkeypatch):
    base = _toy_base(tmp_path)
    monkeypatch.setattr(os, "link", lambda *a, **k: _full())
    monkeypatch.setattr(shutil, "copyfile", lambda *a, **k: _full())
    monkeypatch.setattr(os, "statvfs", lambda path: os.statvfs_result((4096,) * 2 + (10**6,) * 3 + (10**5, 0, 0)
                                                                       + (0, 255)))
    with runner.StoreFolder(tmp_path) as folder, pytest.raises(EvalError) as e:
        folder.private_copy(base, "as_full")
    assert "no free inodes at" in _one_line(e) and "too many files, not too many bytes" in str(e.value)
    assert "disk is full" not in str(e.value)
