"""KVStore: bit-exact write/read, persistence, reordering, fingerprints, corruption, full disk, throttle."""

import errno
import os
import time

import numpy as np
import pytest
import tensorstore as ts

import toy_kv
from specjax.stores import DiskFullError, K, PROBE, V, KVStore, StoreError, StoreMismatchError
from specjax.stores.fsck import fsck, main as fsck_main
from specjax.stores.reorder import Reorderer, reorder_node

FP = {"arch": "toy", "num_layers": 3, "kv_heads": 2, "head_dim": 8, "probe_heads": 1, "dtype": "float32"}


def random_kv(rng, n, fp=FP, dtype=np.float32):
    return [tuple(rng.standard_normal((h, n, fp["head_dim"])).astype(dtype)
                  for h in (fp["kv_heads"], fp["kv_heads"], fp["probe_heads"]))
            for _ in range(fp["num_layers"])]


def concat_kv(a, b):
    return [tuple(np.concatenate([x, y], axis=1) for x, y in zip(la, lb)) for la, lb in zip(a, b)]


def assert_serves(store, tokens, kv, positions=None):
    with store.match(tokens) as m:
        assert m.length == len(tokens)
        for layer, arrays in enumerate(kv):
            for kind in (K, V, PROBE):
                got = toy_kv.read(store, m, layer, kind, positions).result()
                want = arrays[kind] if positions is None else arrays[kind][:, positions]
                assert got.ok.all()
                np.testing.assert_array_equal(got.array, want)


@pytest.fixture
def memory_location():
    return {"driver": "memory", "path": f"store{time.monotonic_ns()}/"}, ts.Context()


@pytest.mark.parametrize("chunk_tokens", [16, 64, 256])
def test_write_then_read_bit_exact(tmp_path, chunk_tokens):
    rng = np.random.default_rng(chunk_tokens)
    fp = dict(FP, chunk_tokens=chunk_tokens)
    tokens = rng.integers(0, 1000, 300)
    kv = random_kv(rng, 300)
    with KVStore.open(tmp_path / "s", fp) as store:
        store.insert(tokens, kv)
        assert_serves(store, tokens, kv)
        perm = rng.permutation(300)[:77]
        with store.match(tokens) as m:
            got = toy_kv.read(store, m, 1, V, perm).result()
            np.testing.assert_array_equal(got.array, kv[1][V][:, perm])


def test_the_index_reader_and_writer_work_without_the_store_handle(tmp_path):
    """A store's three parts, opened over one location by hand: the writer stores a prefix the index then matches and
    locates, the reader serves its bytes and finds a flipped byte; the index sees what a KVStore handle wrote."""
    import functools

    from specjax.stores import ChunkReader, StoreIndex, StoreMetrics, StoreWriter
    from specjax.stores.kvarray import KVArrays, make_context
    from specjax.stores.manifest import ManifestIO
    from specjax.stores.summaries import KeySummaries

    rng = np.random.default_rng(11)
    tokens, kv = rng.integers(0, 1000, 100), random_kv(rng, 100)
    spec, context = {"driver": "file", "path": str(tmp_path / "s")}, make_context()

    def parts(fingerprint=None):
        index = StoreIndex(ManifestIO(spec, context), functools.partial(KVArrays, spec, context=context),
                           fingerprint)
        metrics, summaries = StoreMetrics(), KeySummaries()
        return index, ChunkReader(index, metrics, summaries), StoreWriter(index, metrics, summaries)

    index, reader, writer = parts(FP)
    assert writer.insert(tokens, kv) is not None
    writer.close()
    with index.match(tokens) as m:
        assert m.length == 100
        loc = index.locate(m, np.arange(100), 1)
        got = reader.read_locations(1, V, loc).result()
        assert got.ok.all()
        np.testing.assert_array_equal(got.array, kv[1][V])
        seg = index.segment_of(int(loc.chunks[0]))
        assert index.expected_checksums(1, V, int(loc.chunks[0])) == tuple(
            seg.checksums[1, V, loc.chunks[0] - seg.first_chunk, :FP["kv_heads"]].tolist())
        key, offset = index.extent_of(1, V, int(loc.chunks[0]))
        path = tmp_path / "s" / key
        data = bytearray(path.read_bytes())
        data[offset] ^= 0xFF
        path.write_bytes(bytes(data))
        assert not reader.read_locations(1, V, loc).result().ok[0] and reader.metrics.bad_chunks >= 1
        assert reader.failing_nodes(m) == m.node_ids()
    index.release()

    with KVStore.open(tmp_path / "s", FP) as store:  # the handle's parts see the same store
        more = rng.integers(0, 1000, 40)
        store.insert(more, random_kv(rng, 40))
    index, _, _ = parts()
    with index.match(more) as m:
        assert m.length == 40
    index.release()


def test_bfloat16_roundtrip(memory_location):
    import ml_dtypes

    location, ctx = memory_location
    fp = dict(FP, dtype="bfloat16", chunk_tokens=16)
    rng = np.random.default_rng(0)
    kv = random_kv(rng, 40, dtype=ml_dtypes.bfloat16)
    tokens = np.arange(40)
    with KVStore.open(location, fp, context=ctx) as store:
        store.insert(tokens, kv)
        assert_serves(store, tokens, kv)


def test_extend_split_and_reopen(tmp_path):
    rng = np.random.default_rng(1)
    fp = dict(FP, chunk_tokens=16)
    t1 = rng.integers(0, 50, 70)
    kv1 = random_kv(rng, 70)
    t2 = np.concatenate([t1[:40], rng.integers(50, 100, 30)])      # diverges inside node 1
    kv2_new = random_kv(rng, 30)
    t3 = np.concatenate([t2, rng.integers(0, 50, 25)])              # extends node 2
    kv3_new = random_kv(rng, 25)
    with KVStore.open(tmp_path / "s", fp) as store:
        store.insert(t1, kv1)
        m = store.match(t2)
        assert m.length == 40
        store.insert(t2, kv2_new, base=m)
        m = store.match(t3)
        assert m.length == 70 and len(m.steps) == 2
        store.insert(t3, kv3_new, base=m)
    generation = store.generation  # as published last (closing unregisters the handle as a writer: a commit)
    kv2 = concat_kv([tuple(a[:, :40] for a in layer) for layer in kv1], kv2_new)
    kv3 = concat_kv(kv2, kv3_new)
    with KVStore.open(tmp_path / "s", fp) as store:
        assert store.generation == generation
        assert_serves(store, t1, kv1)
        assert_serves(store, t2, kv2)
        assert_serves(store, t3, kv3)
        with store.match(t3) as m:
            assert len(m.steps) == 3  # [0,40) split node, [40,70) of t2, the t3 tail
    assert fsck(tmp_path / "s").ok


def test_fingerprint_mismatch_is_refused(tmp_path):
    KVStore.open(tmp_path / "s", FP).close()
    with pytest.raises(StoreMismatchError, match="head_dim: store=8 model=16"):
        KVStore.open(tmp_path / "s", dict(FP, head_dim=16))
    with pytest.raises(StoreMismatchError, match="chunk_tokens"):
        KVStore.open(tmp_path / "s", dict(FP, chunk_tokens=16))
    with pytest.raises(StoreMismatchError, match="arch"):
        KVStore.open(tmp_path / "s", dict(FP, arch="other"))
    KVStore.open(tmp_path / "s", dict(FP)).close()
    with pytest.raises(StoreError, match="no KV store"):
        KVStore.open(tmp_path / "missing", None)


def test_a_store_of_other_weights_is_refused_naming_the_weights_that_wrote_it(tmp_path):
    written = dict(FP, weights="a" * 64, tokenizer="t" * 64, weights_source="base-model (pretrained, /models/base)")
    KVStore.open(tmp_path / "s", written).close()
    tuned = dict(written, weights="b" * 64, weights_source="tuned (pretrained, /models/tuned)")
    with pytest.raises(StoreMismatchError) as e:
        KVStore.open(tmp_path / "s", tuned)
    text = str(e.value)
    assert "\n" not in text and "holds the KV of weights aaaaaaaaaaaa of base-model (pretrained, /models/base)" in text
    assert "not of this model's weights bbbbbbbbbbbb of tuned" in text and "use another store directory" in text
    # the same weights under another name are the same weights: where they came from is not compared
    KVStore.open(tmp_path / "s", dict(written, weights_source="copied (pretrained, /elsewhere)")).close()
    KVStore.open(tmp_path / "old", FP).close()  # an older store: it never recorded whose KV it holds
    with pytest.raises(StoreMismatchError, match="older specjax that did not record whose weights"):
        KVStore.open(tmp_path / "old", written)


@pytest.mark.parametrize("background", [False, True])
def test_reorder_preserves_original_order(memory_location, background):
    location, ctx = memory_location
    rng = np.random.default_rng(2)
    fp = dict(FP, chunk_tokens=16)
    tokens = rng.integers(0, 1000, 100)
    kv = random_kv(rng, 100)
    tail = np.concatenate([tokens, rng.integers(0, 1000, 20)])
    kv_tail = random_kv(rng, 20)
    with KVStore.open(location, fp, context=ctx) as store:
        store.insert(tokens, kv)
        store.insert(tail, kv_tail, base=store.match(tail))
        important = rng.choice(100, 16, replace=False)
        with store.match(tokens) as m:
            for _ in range(3):
                store.record_importance(m, np.ones(16), positions=important)
            chunks_before = len(store.locate(m, important, 0).unique_chunks())
        reader = store.match(tokens)              # an old reader keeps its consistent version
        old = toy_kv.read(store, reader, 0, K).result().array
        node = reader.steps[0].node_id
        if background:
            reorderer = Reorderer(store, interval_s=0.05).start()
            deadline = time.time() + 20
            while reorderer.reordered == 0 and time.time() < deadline:
                time.sleep(0.02)
            reorderer.stop()
            assert reorderer.reordered >= 1
        else:
            assert reorder_node(store, node)
            assert not reorder_node(store, node)  # already in importance order
        np.testing.assert_array_equal(toy_kv.read(store, reader, 0, K).result().array, old)
        reader.close()
        store.collect_garbage()
        assert_serves(store, tokens, kv)
        assert_serves(store, tail, concat_kv(kv, kv_tail))
        with store.match(tokens) as m:
            assert len(store.locate(m, important, 0).unique_chunks()) == 1 < chunks_before


@pytest.mark.parametrize("per_layer", [True, False])
def test_reorder_packs_each_layers_important_tokens(memory_location, per_layer):
    """Per-layer reordering (SPEC keeps mapping lists per layer) packs every layer's own important set into one
    chunk; one order for all layers cannot when the layers disagree."""
    location, ctx = memory_location
    rng = np.random.default_rng(5)
    fp = dict(FP, chunk_tokens=16)
    tokens = rng.integers(0, 1000, 96)
    kv = random_kv(rng, 96)
    layers = FP["num_layers"]
    important = [rng.choice(96, 16, replace=False) for _ in range(layers)]
    imp = np.zeros((layers, 96))
    for layer, idx in enumerate(important):
        imp[layer, idx] = 1.0
    longer = np.concatenate([tokens, rng.integers(0, 1000, 40)])  # a node below the reordered one, in prefix order
    with KVStore.open(location, fp, context=ctx) as store:
        store.insert(tokens, kv)
        with store.match(tokens) as m:
            store.record_importance(m, imp)
            node = m.steps[0].node_id
        assert reorder_node(store, node, per_layer=per_layer)
        assert_serves(store, tokens, kv)
        store.insert(longer, random_kv(rng, 40), base=store.match(longer))
        with store.match(tokens) as m:
            chunks = [len(store.locate(m, idx, layer).unique_chunks()) for layer, idx in enumerate(important)]
            if per_layer:
                with pytest.raises(ValueError, match="needs the layer"):
                    store.locate(m, important[0])
        with store.match(longer) as m:  # every layer's chunk of every position at once, as `locate` gives them
            assert len(m.steps) == 2
            np.testing.assert_array_equal(store.chunks_by_layer(m), np.stack(
                [store.locate(m, np.arange(136), layer).chunks for layer in range(layers)]))
    if per_layer:
        assert chunks == [1] * layers
    else:
        assert max(chunks) > 1


def test_reorder_persists(tmp_path):
    rng = np.random.default_rng(3)
    fp = dict(FP, chunk_tokens=16)
    tokens = rng.integers(0, 1000, 64)
    kv = random_kv(rng, 64)
    with KVStore.open(tmp_path / "s", fp) as store:
        store.insert(tokens, kv)
        with store.match(tokens) as m:
            store.record_importance(m, rng.random(64))
            node = m.steps[0].node_id
        assert reorder_node(store, node)
    with KVStore.open(tmp_path / "s", fp) as store:
        assert_serves(store, tokens, kv)
    assert fsck(tmp_path / "s").ok


def _chunk_file(root, layer, kind, chunk):
    """(path, byte offset) of a chunk on disk: inside its segment's extent of that layer and kind."""
    with KVStore.open(root, None, read_only=True, create=False, gc_orphans=False) as store:
        key, offset = store.extent_of(layer, kind, chunk)
    return os.path.join(root, key), offset


def _stored_prefix(tmp_path, seed, **more):
    """A store of one random 48-token prefix in 16-token chunks: (root, fingerprint, tokens, kv); `more`: fingerprint
    fields (kv_bits)."""
    rng = np.random.default_rng(seed)
    fp = dict(FP, chunk_tokens=16, **more)
    tokens = rng.integers(0, 1000, 48)
    kv = random_kv(rng, 48)
    root = str(tmp_path / "s")
    with KVStore.open(root, fp) as store:
        store.insert(tokens, kv)
    return root, fp, tokens, kv


def _flip_bit(where, offset, bit):
    """Flip `bit` of the byte `offset` bytes into a chunk (`where`: `_chunk_file`'s (path, chunk offset))."""
    path, base = where
    offset += base
    with open(path, "r+b") as f:
        f.seek(offset)
        byte = f.read(1)
        f.seek(offset)
        f.write(bytes([byte[0] ^ bit]))


def test_flipped_byte_is_caught_on_read_and_by_fsck(tmp_path, capsys):
    root, fp, tokens, kv = _stored_prefix(tmp_path, 4)
    assert fsck_main([root]) == 0
    _flip_bit(_chunk_file(root, 1, V, 1), 100, 0x01)  # layer 1, V, tokens 16..31
    with KVStore.open(root, fp) as store:
        with store.match(tokens) as m:
            got = toy_kv.read(store, m, 1, V).result()
        assert store.metrics.bad_chunks == 1
        assert not got.ok[16:32].any() and got.ok[:16].all() and got.ok[32:].all()
        assert not np.any(got.array[:, 16:32])        # never returned
        np.testing.assert_array_equal(got.array[:, :16], kv[1][V][:, :16])
    report = fsck(root)
    assert report.bad_chunks == 1 and not report.ok
    capsys.readouterr()
    assert fsck_main([root]) == 1
    assert "bad chunks 1" in capsys.readouterr().out


@pytest.mark.parametrize("part", ["codes", "scales", "key codes", "key range"])
@pytest.mark.parametrize("bits", [4, 2])
def test_flipped_byte_in_a_low_bit_chunk_is_caught_on_read_and_by_fsck(tmp_path, capsys, bits, part):
    """A low-bit chunk is checksummed as every chunk is: a flipped bit in a V row's codes or in its group's scale, in
    a key row's codes or in its chunk's key range is caught on read (its rows never returned) and by fsck."""
    from specjax.stores.kvarray import K_RANGE, low_bit

    root, fp, tokens, kv = _stored_prefix(tmp_path, 4, kv_bits=[bits])
    kind = {"key codes": low_bit(K, bits), "key range": K_RANGE}.get(part, low_bit(V, bits))
    with KVStore.open(root, fp) as store:
        row = store.layout.token_row_nbytes(kind)
    codes = FP["head_dim"] * bits // 8
    offset = 3 * row + (codes + 1 if part == "scales" else 1)  # token 3 of head 0: a code byte, a scale's high byte
    _flip_bit(_chunk_file(root, 1, kind, 1), offset, 0x10)
    with KVStore.open(root, fp) as store:
        with store.match(tokens) as m:
            got = toy_kv.read(store, m, 1, kind).result()
        assert store.metrics.bad_chunks == 1
        assert not got.ok[16:32].any() and got.ok[:16].all() and got.ok[32:].all()
        assert not np.any(got.array[:, 16:32])
        with store.match(tokens) as m:  # its full-precision K and V are other chunks, untouched
            assert toy_kv.read(store, m, 1, V).result().ok.all() and toy_kv.read(store, m, 1, K).result().ok.all()
    assert fsck(root).bad_chunks == 1
    capsys.readouterr()
    assert fsck_main([root]) == 1


@pytest.mark.parametrize("direct_io", [False, True])
def test_each_devices_reader_reads_and_checks_its_own_heads(tmp_path, direct_io):
    """Split reads (tensor parallel): each of 2 devices reads its KV head's byte range of every chunk file, and
    its bytes are counted; the probe keys (1 head) are read whole; a flipped byte in one head is caught."""
    root, fp, tokens, kv = _stored_prefix(tmp_path, 9)
    with KVStore.open(root, fp, direct_io=direct_io) as store:
        with pytest.raises(ValueError, match="2 heads cannot be read in 3 equal parts"):
            store.split_reads({K: 3})
        store.split_reads({K: 2, V: 2})
        assert_serves(store, tokens, kv)
        kv_bytes = 2 * 3 * kv[0][K].nbytes  # K and V of 3 layers, 3 chunks each
        assert store.metrics.device_bytes() == [kv_bytes // 2] * 2
        assert store.metrics.disk_bytes == kv_bytes + store.metrics.probe_disk_bytes
        assert store.metrics.probe_disk_bytes == 3 * kv[0][PROBE].nbytes
        with pytest.raises(ValueError, match="open another handle"):
            store.split_reads({K: 1, V: 1})
    head_bytes = 16 * FP["head_dim"] * 4
    _flip_bit(_chunk_file(root, 2, K, 0), head_bytes + 5, 0x10)  # layer 2, K, tokens 0..15: the second head
    with KVStore.open(root, fp, direct_io=direct_io) as store:
        store.split_reads({K: 2, V: 2})
        with store.match(tokens) as m:
            got = toy_kv.read(store, m, 2, K).result()
        assert store.metrics.bad_chunks == 1
        assert not got.ok[:16].any() and got.ok[16:].all()
        np.testing.assert_array_equal(got.array[:, 16:], kv[2][K][:, 16:])


@pytest.mark.parametrize("direct_io", [False, True])
def test_a_process_reads_and_checks_only_its_own_heads(tmp_path, direct_io):
    """On a mesh over several processes a handle reads only its process's parts (`split_reads(own=...)`): here the
    second of 2 devices' K/V heads, and the 1 probe head whole; only those bytes are counted (per device: its own
    device only) and checked, so a flipped byte in another process's head is not its concern."""
    root, fp, tokens, kv = _stored_prefix(tmp_path, 9)
    _flip_bit(_chunk_file(root, 2, K, 0), 5, 0x10)  # layer 2, K, tokens 0..15: the first head (the other process's)
    with KVStore.open(root, fp, direct_io=direct_io) as store:
        with pytest.raises(ValueError, match="parts 1..2 of 2 to read"):
            store.split_reads({K: 2, V: 2}, own={K: range(1, 3)})
        store.split_reads({K: 2, V: 2}, own={K: range(1, 2), V: range(1, 2)})
        assert store.own_heads(K) == slice(1, 2) and store.own_heads(PROBE) == slice(0, 1)
        with store.match(tokens) as m:
            for layer in range(FP["num_layers"]):
                for kind in (K, V, PROBE):
                    got = toy_kv.read(store, m, layer, kind).result()
                    assert got.ok.all(), (layer, kind)
                    own = slice(1, 2) if kind != PROBE else slice(0, 1)
                    np.testing.assert_array_equal(got.array[own], kv[layer][kind][own])
        assert store.metrics.bad_chunks == 0
        kv_bytes = 2 * 3 * kv[0][K].nbytes  # K and V of 3 layers, 3 chunks each
        assert store.metrics.device_bytes() == [0, kv_bytes // 2]
        assert store.metrics.disk_bytes == kv_bytes // 2 + 3 * kv[0][PROBE].nbytes
    with KVStore.open(root, fp, direct_io=direct_io) as store:  # the first head's process meets the flipped byte
        store.split_reads({K: 2, V: 2}, own={K: range(0, 1), V: range(0, 1)})
        with store.match(tokens) as m:
            got = toy_kv.read(store, m, 2, K).result()
        assert store.metrics.bad_chunks == 1 and not got.ok[:16].any() and got.ok[16:].all()


@pytest.mark.parametrize("older", ["specjax-kvstore/1", "specjax-kvstore/2"])
def test_a_store_of_an_older_format_is_refused_clearly(tmp_path, older):
    """Format 1 kept one checksum per chunk (a reader of some heads cannot check it), format 2 a file per chunk
    with crc32 checksums: neither is read as this format's extents."""
    import json
    import zlib

    from specjax.stores.manifest import canonical

    root = tmp_path / "s"
    rng = np.random.default_rng(1)
    with KVStore.open(str(root), FP) as store:
        store.insert(rng.integers(0, 1000, 20), random_kv(rng, 20))
    doc = json.loads((root / "manifest.json").read_text())
    doc["body"]["format"] = older
    doc["crc32"] = zlib.crc32(canonical(doc["body"]).encode())
    (root / "manifest.json").write_text(json.dumps(doc))
    with pytest.raises(StoreError, match=f"has format '{older}' \\(an older specjax's layout: .*\\), "
                                         "expected 'specjax-kvstore/3'; delete it"):
        KVStore.open(str(root), FP)


def test_disk_full_gives_clear_error_and_reads_continue(memory_location, monkeypatch):
    location, ctx = memory_location
    rng = np.random.default_rng(5)
    fp = dict(FP, chunk_tokens=16)
    tokens = rng.integers(0, 1000, 40)
    kv = random_kv(rng, 40)
    with KVStore.open(location, fp, context=ctx) as store:
        store.insert(tokens, kv)

        def no_space(*args, **kwargs):
            raise OSError(errno.ENOSPC, "No space left on device")

        monkeypatch.setattr(store.writer.arrays, "write_range", no_space)
        more = np.concatenate([tokens, [1, 2, 3]])
        with pytest.raises(DiskFullError, match="disk full"):
            store.insert(more, random_kv(rng, 3), base=store.match(more))
        assert_serves(store, tokens, kv)
        with store.match(more) as m:
            assert m.length == 40


def test_capacity_evicts_whole_prefixes(memory_location):
    location, ctx = memory_location
    rng = np.random.default_rng(6)
    fp = dict(FP, chunk_tokens=16)
    per_chunk = 3 * (2 * 2 + 1) * 16 * 8 * 4          # layers * (K, V, probe heads) * tokens * dim * bytes
    with KVStore.open(location, fp, context=ctx, disk_capacity_bytes=4 * per_chunk) as store:
        prefixes = [(rng.integers(0, 1000, 32), random_kv(rng, 32)) for _ in range(3)]
        store.insert(*prefixes[0])
        store.insert(*prefixes[1])
        store.match(prefixes[0][0]).close()            # prefix 0 is now the most recently used
        store.insert(*prefixes[2])                     # evicts prefix 1 (least recently matched)
        assert store.disk_bytes_used <= 4 * per_chunk
        with store.match(prefixes[1][0]) as m:
            assert m.length == 0
        assert_serves(store, *prefixes[0])
        assert_serves(store, *prefixes[2])
        pins = [store.match(p[0]) for p in (prefixes[0], prefixes[2])]
        with pytest.raises(DiskFullError, match="every prefix is in use"):
            store.insert(rng.integers(0, 1000, 32), random_kv(rng, 32))
        with pytest.raises(DiskFullError, match="raise the capacity"):
            store.insert(rng.integers(0, 1000, 100), random_kv(rng, 100))
        for p in pins:
            p.close()
        assert_serves(store, *prefixes[2])


def test_write_behind_and_validation(memory_location):
    location, ctx = memory_location
    rng = np.random.default_rng(7)
    tokens = rng.integers(0, 1000, 20)
    kv = random_kv(rng, 20)
    with KVStore.open(location, FP, context=ctx) as store:
        writer = store.begin_insert(tokens)
        futures = [writer.write_layer(layer, *kv[layer]) for layer in reversed(range(3))]
        with pytest.raises(ValueError, match="already written"):
            writer.write_layer(0, *kv[0])
        with pytest.raises(ValueError, match="expected"):
            store.begin_insert(tokens[:5]).write_layer(0, kv[0][0], kv[0][1], kv[0][2])
        with store.match(tokens) as m:
            assert m.length == 0                       # not visible before commit
        for f in futures:
            f.result()
        node = writer.commit()
        assert node is not None
        assert_serves(store, tokens, kv)
        partial = store.begin_insert(np.concatenate([tokens, [5]]), base=store.match(tokens))
        partial.write_layer(0, *random_kv(rng, 1)[0])
        with pytest.raises(StoreError, match="never written"):
            partial.commit()


def test_disk_throttle_within_five_percent(memory_location):
    location, ctx = memory_location
    fp = {"arch": "toy", "num_layers": 1, "kv_heads": 4, "head_dim": 64, "probe_heads": 0, "chunk_tokens": 64}
    rng = np.random.default_rng(8)
    n = 64 * 400                                      # 26 MB: fixed start-up costs stay < 1%
    kv = [(rng.standard_normal((4, n, 64)).astype(np.float32),) * 2]
    with KVStore.open(location, fp, context=ctx) as store:
        store.insert(np.arange(n), [kv[0] + (None,)])
    bandwidth = 25e6
    with KVStore.open(location, fp, context=ctx, disk_bandwidth=bandwidth) as store:
        with store.match(np.arange(n)) as m:
            start = time.perf_counter()
            got = toy_kv.read(store, m, 0, K).result(timeout=120)
            elapsed = time.perf_counter() - start
    assert got.ok.all()
    rate = got.array.nbytes / elapsed
    # Never faster than the emulated link; on a loaded machine it may be slower, so the lower bound is loose (the
    # exact schedule is checked in test_link_books_transfers_back_to_back_from_when_each_is_ready; the benchmark
    # measures it).
    assert 0.5 * bandwidth < rate <= 1.05 * bandwidth, f"throttled rate {rate / 1e6:.2f} MB/s"


def test_link_books_transfers_back_to_back_from_when_each_is_ready():
    """Transfers booked together finish at start + cumulative bytes / bandwidth; one ready after the link is free
    starts when it is ready, one ready before waits for the link."""
    from specjax.stores import Link

    link = Link(10e6)
    before = time.monotonic()
    finish = [link.book(1_000_000) for _ in range(5)]
    after = time.monotonic()
    np.testing.assert_allclose(np.diff(finish), 0.1, rtol=1e-9)
    assert before + 0.1 <= finish[0] <= after + 0.1
    assert link.book(1_000_000, ready_at=finish[-1] + 1.0) == pytest.approx(finish[-1] + 1.1)
    assert link.book(1_000_000, ready_at=0.0) == pytest.approx(finish[-1] + 1.2)
    with pytest.raises(ValueError, match="link bandwidth must be > 0"):
        Link(0)


def test_a_failure_while_checking_a_read_makes_misses_never_a_reader_that_waits_forever(memory_location, monkeypatch):
    from specjax.stores import reads

    location, ctx = memory_location
    fp = {"arch": "toy", "num_layers": 1, "kv_heads": 4, "head_dim": 64, "probe_heads": 0, "chunk_tokens": 64}
    kv = np.random.default_rng(3).standard_normal((4, 256, 64)).astype(np.float32)
    with KVStore.open(location, fp, context=ctx) as store:
        store.insert(np.arange(256), [(kv, kv, None)])
    with KVStore.open(location, fp, context=ctx, disk_bandwidth=50e6) as store:
        monkeypatch.setattr(reads, "chunk_checksums", lambda arrays: 1 / 0)
        with store.match(np.arange(256)) as m:
            got = toy_kv.read(store, m, 0, K).result(timeout=30)
        assert not got.ok.any()
        assert store.metrics.snapshot()["bad_chunks"] == 4
        monkeypatch.undo()
        with store.match(np.arange(256)) as m:  # the link still delivers
            got = toy_kv.read(store, m, 0, K).result(timeout=30)
        assert got.ok.all()
        np.testing.assert_array_equal(got.array, kv)
