"""What fsck and a full disk tell the user: only the chunks whose bytes an extent cut short lost are bad; a file is
not a store folder; a killed writer's leftovers are abandoned, not in flight; inodes exhausted is not bytes full.
Each failure is one line that names the fix, and nothing on disk is deleted."""

import errno
import json
import os
import pathlib
import signal
import subprocess
import sys

import numpy as np
import pytest

from specjax.stores import V, DiskFullError, KVStore
from specjax.stores.fsck import fsck
from specjax.stores.fsck import main as fsck_main
from test_stores_store import FP, _chunk_file, _flip_bit, random_kv

FP16 = dict(FP, chunk_tokens=16)


@pytest.fixture
def store_dir(tmp_path):
    """A store of one 80-token prefix: one segment of 5 chunks."""
    rng = np.random.default_rng(0)
    with KVStore.open(tmp_path / "store", FP16) as store:
        store.insert(rng.integers(0, 1000, 80), random_kv(rng, 80))
    return str(tmp_path / "store")


def _files(folder):
    return {p: p.read_bytes() for p in pathlib.Path(folder).rglob("*") if p.is_file()}


# -- a. an extent cut short: only the chunks whose bytes are gone ---------------------------------------------------

def test_an_extent_cut_by_a_few_bytes_fails_only_its_last_chunk(store_dir, capsys):
    path, _ = _chunk_file(store_dir, 1, V, 4)
    os.truncate(path, os.path.getsize(path) - 3)
    report = fsck(store_dir)
    assert report.bad_chunks == 1 and report.chunks_checked == 45
    assert fsck_main([store_dir]) == 1
    captured = capsys.readouterr()
    assert "chunks checked 45  bad chunks 1  " in captured.out
    problems = [line for line in captured.out.splitlines() if line.startswith("problem:")]
    assert len(problems) == 1 and problems[0].startswith("problem: 1 chunks fail their checksum or cannot be read (")
    assert "(chunk 4 in kv/000000000000+5/1/v cannot be read)" in problems[0] and "recomputed" in problems[0]
    assert captured.err == ""  # the read path's own "chunks 0..4 unreadable" warning is not shown


def test_a_cut_through_a_chunk_fails_it_and_those_after_and_a_flipped_byte_still_counts(store_dir):
    path, offset = _chunk_file(store_dir, 2, V, 2)
    _flip_bit(_chunk_file(store_dir, 2, V, 0), 7, 0x01)
    os.truncate(path, offset + 10)  # chunk 2 keeps 10 bytes, chunks 3 and 4 none
    report = fsck(store_dir)
    assert report.bad_chunks == 4, report.problems  # 0 (checksum), 2, 3, 4 (cut); chunk 1 passes
    assert "chunk 0 in kv/000000000000+5/2/v fails its checksum" in report.problems[0]
    assert "chunk 1 " not in report.problems[0]


# -- b. a file is not a store folder ---------------------------------------------------------------------------------

@pytest.mark.parametrize("name", ["notes.txt", "manifest.json"])
def test_a_file_is_said_to_be_a_file_and_nothing_is_deleted(tmp_path, capsys, name):
    path = tmp_path / name
    path.write_text("the user's own file\n")
    before = _files(tmp_path)
    assert fsck_main([str(path)]) == 2
    captured = capsys.readouterr()
    errors = captured.err.splitlines()
    assert len(errors) == 1 and captured.out == ""
    assert "delete" not in errors[0] and "rebuild" not in errors[0]
    if name == "manifest.json":
        assert errors[0] == (f"error: {path} is a store's manifest, not its folder; check the folder: "
                             f"python -m specjax.stores.fsck {tmp_path}")
    else:
        assert errors[0].startswith(f"error: {path} is a file, not a KV store folder; give fsck a store's folder")
    assert _files(tmp_path) == before


# -- c. a killed writer's chunks are abandoned, a live one's in flight ------------------------------------------------

CHILD = """
import json, sys, time
import numpy as np
from specjax.stores import KVStore
fp = json.loads(sys.argv[2])
store = KVStore.open(sys.argv[1], fp)
writer = store.begin_insert(np.arange(40))
for layer in range(fp["num_layers"]):
    writer.write_layer(layer, *(np.ones((h, 40, fp["head_dim"]), np.float32)
                                for h in (fp["kv_heads"], fp["kv_heads"], fp["probe_heads"])))
writer.wait_durable()
print("ready", flush=True)
time.sleep(300)
"""


def _killed_writer(directory) -> int:
    """Run a writer that writes 3 chunks but never commits them, and SIGKILL it; its pid."""
    proc = subprocess.Popen([sys.executable, "-c", CHILD, directory, json.dumps(FP16)], stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, env=dict(os.environ, JAX_PLATFORMS="cpu"))
    try:
        assert proc.stdout.readline().strip() == "ready", proc.stderr.read()
    finally:
        proc.send_signal(signal.SIGKILL)
        proc.communicate(timeout=60)
    return proc.pid


def test_a_killed_writers_chunks_are_abandoned_not_in_flight(store_dir, capsys):
    pid = _killed_writer(store_dir)
    report = fsck(store_dir)
    assert report.ok and (report.abandoned_chunks, report.inflight_chunks, report.orphan_chunks) == (3, 0, 0)
    assert fsck_main([store_dir]) == 0
    out = capsys.readouterr().out
    assert "in flight 0 (live writers)  abandoned 3 (dead writers)" in out
    note = [line for line in out.splitlines() if line.startswith("note:")]
    assert len(note) == 1 and f"by 1 writer(s) that died before committing them (pid {pid} on this host)" in note[0]
    assert "abandoned, never served and safe to reclaim" in note[0]
    command = note[0].split("e.g. ", 1)[1]  # the note's own command reclaims them
    assert command.startswith("python -c ") and f"KVStore.open({store_dir!r})" in command
    proc = subprocess.run(command.replace("python", sys.executable, 1), shell=True, capture_output=True, text=True,
                          env=dict(os.environ, JAX_PLATFORMS="cpu"), timeout=120)
    assert proc.returncode == 0, proc.stderr
    report = fsck(store_dir)
    assert (report.abandoned_chunks, report.orphan_chunks) == (0, 0) and report.ok


def test_a_live_writers_chunks_are_in_flight(store_dir, capsys):
    with KVStore.open(store_dir, FP16) as store:
        writer = store.begin_insert(np.arange(40))
        for layer, kv in enumerate(random_kv(np.random.default_rng(1), 40)):
            writer.write_layer(layer, *kv)
        writer.wait_durable()
        assert fsck_main([store_dir]) == 0
        writer.abort()
    out = capsys.readouterr().out
    assert "in flight 3 (live writers)  abandoned 0 (dead writers)" in out and "note:" not in out


# -- d. inodes exhausted is not bytes full -----------------------------------------------------------------------------

def _statvfs(bytes_free: int, inodes_free: int):
    # f_bsize, f_frsize, f_blocks, f_bfree, f_bavail, f_files, f_ffree, f_favail, f_flag, f_namemax
    blocks = bytes_free // 4096
    return lambda path: os.statvfs_result((4096, 4096, 10 ** 6, blocks, blocks, 10 ** 6, inodes_free, inodes_free,
                                           0, 255))


def _no_space(*args, **kwargs):
    raise OSError(errno.ENOSPC, "No space left on device")


@pytest.mark.parametrize("bytes_free, inodes_free, says", [(5 << 30, 0, "inodes exhausted while writing"),
                                                           (0, 1000, "disk full while writing")])
def test_no_room_to_write_says_inodes_or_bytes(store_dir, monkeypatch, bytes_free, inodes_free, says):
    rng = np.random.default_rng(2)
    with KVStore.open(store_dir, FP16) as store:
        monkeypatch.setattr(store.writer.arrays, "write_range", _no_space)
        monkeypatch.setattr(os, "statvfs", _statvfs(bytes_free, inodes_free))
        with pytest.raises(DiskFullError) as e:
            store.insert(rng.integers(0, 1000, 20), random_kv(rng, 20))
    message = str(e.value)
    assert message.startswith(says) and "\n" not in message and "reads still work" in message
    if inodes_free == 0:
        assert f"{bytes_free / 1e6:.1f} MB free but no free inodes" in message and "disk full" not in message
        assert "more inodes" in message


def test_no_inode_for_the_manifest_commit_says_inodes(store_dir, monkeypatch):
    rng = np.random.default_rng(3)
    with KVStore.open(store_dir, FP16) as store:
        monkeypatch.setattr(store.index.catalog.io, "publish", _no_space)
        monkeypatch.setattr(os, "statvfs", _statvfs(1 << 30, 0))
        with pytest.raises(DiskFullError, match="^inodes exhausted while committing the manifest of the KV store at"):
            store.insert(rng.integers(0, 1000, 20), random_kv(rng, 20))
