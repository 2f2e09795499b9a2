"""Landing buffers and local reads (stores.landing): aligned buffers used again only once nothing can read them;
preadv reads equal the file's bytes, aligned or not, with and without O_DIRECT; a read's buffer is free again as soon
as its readers let go (no reference cycle waits for the collector)."""

import gc
import os

import numpy as np
import pytest

import toy_kv
from specjax.stores import K, KVStore, landing
from specjax.stores.landing import ALIGN, LandingBuffers, LocalFiles


def test_a_buffer_is_aligned_and_used_again_only_after_every_view_of_it_is_gone():
    buffers = LandingBuffers()
    a = buffers.empty((3, 1000), np.float32)
    assert a.ctypes.data % ALIGN == 0 and a.shape == (3, 1000) and a.dtype == np.float32
    view = a[1:]  # a view keeps the buffer lent
    address = a.ctypes.data
    del a
    b = buffers.empty((3, 1000), np.float32)
    assert b.ctypes.data != address and buffers.stats["reused"] == 0
    del view
    c = buffers.empty((2, 1500), np.float32)  # the same size class
    assert c.ctypes.data == address and buffers.stats["reused"] == 1
    del b, c


def test_free_buffers_kept_are_bounded():
    buffers = LandingBuffers(keep_bytes=3 * 65536)
    lent = [buffers.empty((65536,), np.uint8) for _ in range(5)]
    assert buffers.stats["mapped_bytes"] == 5 * 65536
    del lent
    assert buffers.free_bytes == 3 * 65536 and buffers.stats["mapped_bytes"] == 3 * 65536


class _Runtime:
    """A stand-in for an accelerator's client: what it registered for DMA, address -> size."""

    def __init__(self, fail: bool = False):
        self.fail, self.mapped, self.calls = fail, {}, []

    def dma_map(self, address, size):
        self.calls.append(("map", address, size))
        if self.fail:
            raise RuntimeError("cudaHostRegister failed")
        assert address % ALIGN == 0 and address not in self.mapped
        self.mapped[address] = size

    def dma_unmap(self, address):
        self.calls.append(("unmap", address))
        del self.mapped[address]


def test_buffers_are_registered_for_dma_once_when_mapped_and_unregistered_before_they_are_unmapped(monkeypatch):
    runtime = _Runtime()
    monkeypatch.setattr(landing, "dma_client", lambda choice=None: runtime)
    buffers = LandingBuffers(keep_bytes=2 * 65536)
    before = buffers.empty((65536,), np.uint8)  # mapped before the device was up: stays pageable
    assert not buffers.pinned_for_dma and buffers.enable_dma() and buffers.pinned_for_dma
    lent = [buffers.empty((65536,), np.uint8) for _ in range(4)]
    assert before.ctypes.data not in runtime.mapped
    assert buffers.pinned_for_dma and sorted(runtime.mapped) == sorted(a.ctypes.data for a in lent)
    assert buffers.stats["dma_mapped_bytes"] == 4 * 65536
    del lent  # two are kept (still registered: they are lent again), two unmapped
    assert len(runtime.mapped) == 2 and buffers.stats["dma_mapped_bytes"] == 2 * 65536
    again = buffers.empty((65536,), np.uint8)
    assert again.ctypes.data in runtime.mapped and len([c for c in runtime.calls if c[0] == "map"]) == 4
    del again, before
    buffers.close()  # the free ones unregistered and dropped
    assert runtime.mapped == {} and buffers.stats["dma_mapped_bytes"] == 0 and buffers.free_bytes == 0


def test_a_runtime_that_refuses_registration_leaves_pageable_buffers_that_still_work(monkeypatch, capsys):
    runtime = _Runtime(fail=True)
    monkeypatch.setattr(landing, "dma_client", lambda choice=None: runtime)
    buffers = LandingBuffers(keep_bytes=0)
    buffers.enable_dma()
    a = buffers.empty((3, 1000), np.float32)
    a[:] = 1
    b = buffers.empty((3, 1000), np.float32)
    assert not buffers.pinned_for_dma and len(runtime.calls) == 1  # asked once, then never again
    assert "stay pageable" in capsys.readouterr().out and buffers.stats["dma_mapped_bytes"] == 0
    del a, b  # dropped without unregistering anything
    assert [c[0] for c in runtime.calls] == ["map"]


def test_no_dma_registration_on_a_cpu_or_when_turned_off(monkeypatch):
    assert landing.dma_client("off") is None and landing.dma_client("on") is None  # this suite's backend is a CPU
    monkeypatch.setenv(landing.DMA_ENV, "sometimes")
    with pytest.raises(ValueError, match="SPECJAX_DMA_MAP"):
        landing.dma_client()
    monkeypatch.setenv(landing.DMA_ENV, "off")
    buffers = LandingBuffers()
    assert not buffers.enable_dma() and landing.dma_client() is None
    buffers.empty((8,), np.uint8)
    assert not buffers.pinned_for_dma


def test_the_store_alone_asks_for_no_dma_registration_and_a_device_pool_does(monkeypatch):
    asked = []
    monkeypatch.setattr(landing.BUFFERS, "enable_dma", lambda choice=None: asked.append(choice) or False)
    landing.BUFFERS.empty((8,), np.uint8)  # what a store's reads (fsck's among them) do
    assert asked == []
    from specjax.stores.kvarray import Layout
    from specjax.stores.pool import DevicePool

    DevicePool(Layout(num_layers=1, kv_heads=2, head_dim=8, probe_heads=0, chunk_tokens=16), 0)
    assert asked == [None]


@pytest.mark.parametrize("direct", [False, True])
@pytest.mark.parametrize("ranges", [[(0, 3 * ALIGN)], [(ALIGN, 2 * ALIGN), (5 * ALIGN, 6 * ALIGN)],
                                    [(100, 5000)], [(7 * ALIGN, 8 * ALIGN + 123)], [(3, 4), (4, 9000)]])
def test_local_reads_are_the_files_bytes_aligned_or_not(tmp_path, direct, ranges):
    data = np.random.default_rng(0).integers(0, 255, 8 * ALIGN + 123, np.uint8)
    (tmp_path / "extent").write_bytes(data.tobytes())
    files = LocalFiles(str(tmp_path), direct)
    want = np.concatenate([data[a:b] for a, b in ranges])
    out = landing.BUFFERS.empty((len(want),), np.uint8)
    got = files.read("extent", [slice(a, b) for a, b in ranges], out).result(timeout=30)
    assert got is out
    np.testing.assert_array_equal(got, want)


@pytest.mark.parametrize("direct", [False, True])
def test_a_missing_or_short_file_fails_the_read(tmp_path, direct):
    (tmp_path / "short").write_bytes(bytes(2 * ALIGN))
    files = LocalFiles(str(tmp_path), direct)
    out = np.empty(3 * ALIGN, np.uint8)
    with pytest.raises(FileNotFoundError):
        files.read("absent", [slice(0, ALIGN)], out[:ALIGN]).result(timeout=30)
    with pytest.raises(ValueError, match="holds 8192 bytes"):
        files.read("short", [slice(0, 3 * ALIGN)], out).result(timeout=30)


def test_a_reads_buffer_is_free_again_once_its_readers_let_go_without_the_cycle_collector(tmp_path):
    layout_fp = {"arch": "t", "num_layers": 2, "kv_heads": 2, "head_dim": 64, "dtype": "float32",
                 "chunk_tokens": 16, "probe_heads": 0}
    store = KVStore(str(tmp_path / "s"), layout_fp, direct_io=True)
    tokens = list(range(64))
    rng = np.random.default_rng(0)
    kv = rng.standard_normal((2, 2, 64, 64)).astype(np.float32)
    writer = store.begin_insert(tokens)
    with writer:
        for layer in range(2):
            writer.write_layer(layer, kv[layer], kv[layer], None)
        writer.commit()
    gc.collect()
    gc.disable()
    try:
        before = landing.BUFFERS.free_bytes
        with store.match(tokens) as m:
            reads = store.read_chunks(1, K, list(m_chunks(store, m)))
            arrays, ok = reads[0].run.verified.result(timeout=30)
            assert ok.all()
            np.testing.assert_array_equal(arrays.transpose(1, 0, 2, 3).reshape(2, 64, 64), kv[1])
            lent = landing.BUFFERS.free_bytes
            del reads, arrays, ok
        assert landing.BUFFERS.free_bytes > lent and landing.BUFFERS.free_bytes >= before
    finally:
        gc.enable()
        store.close()


def m_chunks(store, match):
    return store.locate(match, np.arange(match.length), 1).unique_chunks()


def test_reads_of_a_local_store_go_to_its_files_and_another_kvstore_still_reads(tmp_path):
    fp = {"arch": "t", "num_layers": 1, "kv_heads": 1, "head_dim": 16, "dtype": "float32", "chunk_tokens": 4,
          "probe_heads": 0}
    kv = np.arange(16 * 16, dtype=np.float32).reshape(1, 16, 16)
    for location in (str(tmp_path / "local"), "memory://"):
        store = KVStore(location, fp)
        assert (store.index.arrays._files is not None) == (location != "memory://")
        writer = store.begin_insert(list(range(16)))
        with writer:
            writer.write_layer(0, kv, kv, None)
            writer.commit()
        with store.match(list(range(16))) as m:
            got = toy_kv.read(store, m, 0, K, np.arange(16)).result(timeout=30)
        assert got.ok.all()
        np.testing.assert_array_equal(got.array, kv)
        store.close()
    assert os.path.isdir(tmp_path / "local" / "kv")
