"""fsck of a folder holding several stores (as an evaluation's --store folder keeps its base stores): every store
is checked, and a flipped byte in any one of them fails the folder."""

import os
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


def test_folder_without_stores(tmp_path, capsys):
    (tmp_path / "empty").mkdir()
    assert fsck_main([str(tmp_path)]) == 2
    assert "no KV store in" in capsys.readouterr().err
