"""fsck of a folder holding several stores (as an evaluation's --store folder keeps its base stores): every store
is checked, and a flipped byte in any one of them fails the folder."""

import os
import shutil
import subprocess
import sys

import numpy as np
import pytest

from specjax.stores import V, KVStore
from specjax.stores.fsck import main as fsck_main
from test_stores_store import FP, _chunk_file, random_kv

# Named as specjax.eval.runner names its base stores: base-<store key>.
STORES = ("base-prefixes-chunk16", "base-prefixes-chunk64", "base-text_chunks-sink-chunk64")


@pytest.fixture
def store_folder(tmp_path):
    rng = np.random.default_rng(0)
    for name in STORES:
        tokens = rng.integers(0, 1000, 48)
        with KVStore.open(tmp_path / name, dict(FP, chunk_tokens=16)) as store:
            store.insert(tokens, random_kv(rng, 48))
    return tmp_path


def _flip_byte(where, offset=100):
    path, base = where
    offset += base
    with open(path, "r+b") as f:
        f.seek(offset)
        byte = f.read(1)
        f.seek(offset)
        f.write(bytes([byte[0] ^ 0x01]))


def test_every_store_in_the_folder_is_checked(store_folder, capsys):
    assert fsck_main([str(store_folder)]) == 0
    out = capsys.readouterr().out
    for name in STORES:
        assert f"{name}: OK" in out and f"{name}: nodes 1  segments 1  chunks checked 27" in out
    assert f"checked 3 stores under {store_folder}: 3 OK, 0 with problems, 0 could not be opened" in out


@pytest.mark.parametrize("broken", STORES)
def test_a_flipped_byte_in_any_store_fails_the_folder(store_folder, capsys, broken):
    _flip_byte(_chunk_file(str(store_folder / broken), 1, V, 1))
    assert fsck_main([str(store_folder)]) == 1
    out = capsys.readouterr().out
    assert f"{broken}: nodes 1  segments 1  chunks checked 27  bad chunks 1" in out
    assert f"{broken}: FAILED: 1 problem(s)" in out
    assert f"{broken}: problem: 1 chunks fail their checksum" in out
    assert all(f"{name}: OK" in out for name in STORES if name != broken)
    assert "3 stores" in out and "2 OK, 1 with problems" in out


def test_cli_on_a_folder_with_a_store_that_cannot_be_opened(store_folder):
    os.remove(store_folder / STORES[0] / "manifest.json")  # its arrays remain: a store, but a broken one
    proc = subprocess.run([sys.executable, "-m", "specjax.stores.fsck", str(store_folder)], capture_output=True,
                          text=True, env=dict(os.environ, JAX_PLATFORMS="cpu"), timeout=120)
    assert proc.returncode == 2, proc.stdout + proc.stderr
    assert f"{STORES[0]}: error:" in proc.stderr
    assert "3 stores" in proc.stdout and "2 OK, 0 with problems, 1 could not be opened" in proc.stdout


def _files(folder):
    return {p: p.read_bytes() for p in folder.rglob("*") if p.is_file()}


def test_garbage_array_metadata_is_one_line_and_the_other_stores_are_still_checked(store_folder, capsys):
    """Whatever opening or reading one store raises (here: its folder of extents replaced by a file of junk, so
    TensorStore cannot list it) is that store's one error line; every other store is checked, nothing is changed on
    disk. (Format 2 kept zarr metadata in `kv/zarr.json`; overwritten with junk it raised DATA_LOSS the same way.)"""
    broken = store_folder / STORES[1]
    shutil.rmtree(broken / "kv")
    (broken / "kv").write_text("junk{")
    before = _files(store_folder)
    assert fsck_main([str(store_folder)]) == 2
    captured = capsys.readouterr()
    errors = captured.err.splitlines()
    assert len(errors) == 1 and errors[0].startswith(f"{STORES[1]}: error: cannot open or read this store (")
    assert "rebuild it, or delete it" in errors[0] and "Traceback" not in captured.err
    assert all(f"{name}: OK" in captured.out for name in STORES if name != STORES[1])
    assert "3 stores" in captured.out and "2 OK, 0 with problems, 1 could not be opened" in captured.out
    assert _files(store_folder) == before  # fsck reads only


def test_each_store_says_which_weights_tokenizer_and_layout_it_belongs_to(tmp_path, capsys):
    rng = np.random.default_rng(0)
    fp = dict(FP, chunk_tokens=16, weights="ab12" * 16, tokenizer="cd34" * 16, weights_source="tiny (pretrained, /m)")
    with KVStore.open(tmp_path / "base-a", fp) as store:
        store.insert(rng.integers(0, 1000, 20), random_kv(rng, 20))
    with KVStore.open(tmp_path / "base-b", dict(FP, chunk_tokens=16)) as store:  # written without a digest
        store.insert(rng.integers(0, 1000, 20), random_kv(rng, 20))
    assert fsck_main([str(tmp_path)]) == 0
    out = capsys.readouterr().out
    assert ("base-a: belongs to weights ab12ab12ab12 of tiny (pretrained, /m); tokenizer cd34cd34cd34; layout toy, "
            "3 layers x 2 KV heads x 8, 16-token chunks, float32, 1 probe heads") in out
    assert "base-b: belongs to unrecorded weights; tokenizer not recorded; layout toy, 3 layers" in out


def test_folder_without_stores(tmp_path, capsys):
    (tmp_path / "empty").mkdir()
    assert fsck_main([str(tmp_path)]) == 2
    assert "no KV store in" in capsys.readouterr().err
