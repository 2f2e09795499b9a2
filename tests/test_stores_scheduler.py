"""The read scheduler: demand before speculative, expedite, withdraw unread, bounded bytes in flight, the measured
rate; on a real (here: controlled) disk and on the emulated link, which is the same queue with a bandwidth model."""

import concurrent.futures
import threading
import time

import numpy as np
import pytest

from specjax.stores import K, KVStore
from specjax.stores.scheduler import ISSUED, QUEUED, WITHDRAWN, Read, ReadScheduler


class _Disk:
    """A disk whose reads complete when the test says so; records the order reads were issued in."""

    def __init__(self):
        self.issued, self.pending = [], {}

    def read(self, name, nbytes, speculative=False, background=False, order=0):
        def issue():
            self.issued.append(name)
            self.pending[name] = concurrent.futures.Future()
            return self.pending[name]

        return Read(issue, nbytes, speculative, background, order=order)

    def finish(self, name):
        self.pending.pop(name).set_result(name)


def test_real_disk_path_orders_bounds_expedites_and_withdraws():
    disk = _Disk()
    sched = ReadScheduler(max_inflight_bytes=300)
    first = sched.submit(disk.read("d0", 200))
    spec = [sched.submit(disk.read(f"s{i}", 100, speculative=True)) for i in range(3)]
    assert disk.issued == ["d0", "s0"]  # 300 bytes in flight: the bound holds the rest in the queue
    demand = sched.submit(disk.read("d1", 100))
    sched.expedite(spec[2])
    assert sched.withdraw(spec[1]) and spec[1].state == WITHDRAWN and spec[1].future.cancelled()
    assert not sched.withdraw(spec[0])  # issued: reads already at the disk are never interrupted
    assert not sched.withdraw(spec[2])  # expedited: a demand read now
    disk.finish("d0")
    assert disk.issued == ["d0", "s0", "d1", "s2"]  # demand first, then the expedited one; s1 never read
    assert first.future.result() == "d0"
    for name in ("s0", "d1", "s2"):
        disk.finish(name)
    assert demand.future.result() == "d1" and spec[2].future.result() == "s2"
    assert spec[1].state == WITHDRAWN and "s1" not in disk.issued


def test_demand_reads_go_out_by_the_layer_that_needs_them():
    """A request plans every layer's certain reads at its start; a selective read of layer 1 asked later still goes
    before the queued reads of layers 2 and 3 (and an expedited guess of layer 2 before layer 3's)."""
    disk = _Disk()
    sched = ReadScheduler(max_inflight_bytes=100)
    for layer in range(4):
        sched.submit(disk.read(f"keys{layer}", 100, order=layer))
    guess = sched.submit(disk.read("guess2", 100, speculative=True, order=2))
    sched.submit(disk.read("values1", 100, order=1))
    sched.expedite(guess)
    for name in ("keys0", "keys1", "values1", "keys2", "guess2"):
        disk.finish(name)
    assert disk.issued == ["keys0", "keys1", "values1", "keys2", "guess2", "keys3"]


def test_background_reads_go_out_only_when_the_disk_is_otherwise_idle():
    disk = _Disk()
    sched = ReadScheduler(max_inflight_bytes=1000)
    sched.submit(disk.read("d0", 100))
    bg = [sched.submit(disk.read(f"b{i}", 100, speculative=True, background=True)) for i in range(4)]
    sched.submit(disk.read("s0", 100, speculative=True))
    assert disk.issued == ["d0", "s0"]  # room for 1000 bytes, but background reads wait for an idle disk
    assert sched.queued_bytes() == 0  # a new speculative read queues behind no background one
    disk.finish("d0")
    disk.finish("s0")
    assert disk.issued == ["d0", "s0", "b0"]  # idle: one background read, and only one, in flight
    demand = sched.submit(disk.read("d1", 100))
    assert disk.issued[-1] == "d1"  # a demand read never waits behind queued background reads
    sched.expedite(bg[2])
    assert disk.issued[-1] == "b2" and not bg[2].background  # needed now: issued at once, as a demand read
    assert sched.withdraw(bg[1]) and bg[1].future.cancelled() and not sched.waiting(bg[1])
    assert sched.waiting(bg[3]) and not sched.waiting(bg[0])
    for name in ("b0", "d1", "b2"):
        disk.finish(name)
    assert disk.issued == ["d0", "s0", "b0", "d1", "b2", "b3"] and demand.future.result() == "d1"
    with pytest.raises(ValueError, match="speculative"):
        sched.submit(disk.read("x", 1, background=True))


def test_one_read_always_goes_out_even_past_the_bound():
    disk = _Disk()
    sched = ReadScheduler(max_inflight_bytes=10)
    sched.submit(disk.read("big", 1000))
    queued = sched.submit(disk.read("next", 1))
    assert disk.issued == ["big"] and queued.state == QUEUED and sched.queued_bytes() == 1
    disk.finish("big")
    assert disk.issued == ["big", "next"] and queued.state == ISSUED


def test_reads_that_complete_as_they_are_issued_are_delivered_in_a_loop_not_a_nested_call_each():
    """An in-memory store's read is done when issued, so it lands inside its predecessor's delivery; thousands queued
    behind one slow read must all reach their readers, in order, without overflowing the stack."""
    import sys

    disk = _Disk()
    sched = ReadScheduler(max_inflight_bytes=0)  # one read at a time: each issued by the one before it landing
    first = sched.submit(disk.read("first", 1))
    done_order = []

    def instant(i):
        def issue():
            done_order.append(i)
            f = concurrent.futures.Future()
            f.set_result(i)
            return f
        return Read(issue, 1, False)

    n = 3 * sys.getrecursionlimit()
    queued = [sched.submit(instant(i)) for i in range(n)]
    assert done_order == [] and all(r.state == QUEUED for r in queued)
    disk.finish("first")
    assert first.future.result(timeout=1) == "first"
    assert [r.future.result(timeout=1) for r in queued] == list(range(n))
    assert done_order == list(range(n)) and sched.queued_bytes() == 0


def test_measured_rate_is_bytes_over_time_with_reads_in_flight():
    disk = _Disk()
    sched = ReadScheduler()
    assert sched.rate_bytes_per_s() is None
    sched.submit(disk.read("a", 1_000_000))
    time.sleep(0.1)
    disk.finish("a")
    time.sleep(0.2)  # idle time does not count
    rate = sched.rate_bytes_per_s()
    assert 5e6 < rate <= 1e7, rate  # 1 MB in about 0.1 s


def test_a_failed_read_reaches_its_reader_and_frees_the_queue():
    def fail():
        raise OSError("boom")

    disk = _Disk()
    sched = ReadScheduler(max_inflight_bytes=0)
    bad = sched.submit(Read(fail, 10, False))
    good = sched.submit(disk.read("ok", 10))
    assert isinstance(bad.future.exception(timeout=1), OSError)
    disk.finish("ok")
    assert good.future.result(timeout=1) == "ok"


def test_emulated_link_is_the_same_queue_with_a_bandwidth_model():
    """1 MB/s: 10 kB reads take 10 ms each, back to back; speculative reads wait for demand ones."""
    done = []
    sched = ReadScheduler(bytes_per_s=1e6)  # one read on the link at a time by default

    def read(name, speculative):
        f = concurrent.futures.Future()
        f.set_result(name)  # the disk itself is instant here: the link sets the pace
        r = Read(lambda: f, 10_000, speculative)
        r.future.add_done_callback(lambda f: f.cancelled() or done.append((name, time.monotonic())))
        return r

    start = time.monotonic()
    first = sched.submit(read("d0", False))
    spec = [sched.submit(read(f"s{i}", True)) for i in range(3)]
    second = sched.submit(read("d1", False))
    sched.withdraw(spec[1])
    deadline = time.monotonic() + 2
    while len(done) < 4 and time.monotonic() < deadline:
        time.sleep(0.01)
    assert [n for n, _ in done] == ["d0", "d1", "s0", "s2"]
    assert 0.04 <= done[-1][1] - start < 0.1  # four 10 ms transfers, back to back
    # booked back to back exactly, as a device working through its queue: the time the host takes to hand the
    # link its next read is not link time
    crossed = [r.deliver_at for r in (first, second, spec[0], spec[2])]
    np.testing.assert_allclose(np.diff(crossed), 0.01, rtol=0, atol=1e-9)
    assert 0.7e6 < sched.rate_bytes_per_s() <= 1.05e6


def test_store_coalesces_adjacent_chunks_and_verifies_each(tmp_path):
    """Adjacent chunks go to the disk as one read; every chunk is still checked and served on its own."""
    fp = {"arch": "t", "num_layers": 1, "kv_heads": 2, "head_dim": 8, "probe_heads": 0, "chunk_tokens": 4}
    rng = np.random.default_rng(0)
    k = rng.standard_normal((2, 40, 8)).astype(np.float32)
    with KVStore.open(str(tmp_path / "s"), fp) as store:
        store.insert(np.arange(40), [(k, k, None)])
    with KVStore.open(str(tmp_path / "s"), fp, max_read_bytes=3 * 2 * 4 * 8 * 4) as store:
        reads = store.read_chunks(0, K, [0, 1, 2, 3, 7, 9])
        got = [r.future.result(timeout=10) for r in reads]
        for chunk, array in zip([0, 1, 2, 3, 7, 9], got):
            np.testing.assert_array_equal(array, k[:, chunk * 4:(chunk + 1) * 4])
        counts = store.metrics.snapshot()
        assert counts["chunks_read"] == 6
        assert counts["read_requests"] == 4  # [0, 1, 2] [3] [7] [9]: runs of at most 3 chunks
        assert len({id(r.run) for r in reads}) == 4
        # the runs of any chunk ids, in any order and repeated: sorted, adjacent ids joined up to the cap
        runs = store.read_runs(0, K, [9, 3, 2, 7, 1, 0, 2])
        assert [(r.first_chunk, r.n_chunks) for r in runs] == [(0, 3), (3, 1), (7, 1), (9, 1)]
        for r in runs:
            arrays, ok = r.verified.result(timeout=10)
            assert ok.all()
            np.testing.assert_array_equal(arrays[-1], k[:, (r.first_chunk + r.n_chunks - 1) * 4:][:, :4])


def _store_of_two_segments(tmp_path, **options):
    """A store of two 16-token prefixes (one segment each, chunks 0-3 and 4-7), opened with `options`; the KV."""
    fp = {"arch": "t", "num_layers": 1, "kv_heads": 2, "head_dim": 8, "probe_heads": 0, "chunk_tokens": 4}
    k = np.random.default_rng(1).standard_normal((2, 2, 16, 8)).astype(np.float32)
    with KVStore.open(str(tmp_path / "s"), fp) as store:
        store.insert(np.arange(16), [(k[0], k[0], None)])
        store.insert(np.arange(100, 116), [(k[1], k[1], None)])
    return KVStore.open(str(tmp_path / "s"), fp, **options), k


@pytest.mark.parametrize("direct_io", [False, True])
def test_the_runs_of_one_call_share_a_disk_request_from_the_page_cache_and_each_is_checked_on_its_own(tmp_path,
                                                                                                     direct_io):
    """From the page cache, one call's runs are one request (one task, landing and callback); with O_DIRECT each run
    is its own, so the disk works through them at its queue depth. Either way each run is verified and counted as a
    disk read of its own, and one run's unreadable extent is that run's miss only."""
    store, k = _store_of_two_segments(tmp_path, direct_io=direct_io)
    with store:
        runs = store.read_runs(0, K, [0, 2, 3, 5, 7])
        assert [(r.first_chunk, r.n_chunks) for r in runs] == [(0, 1), (2, 2), (5, 1), (7, 1)]
        for r in runs:
            arrays, ok = r.verified.result(timeout=10)
            assert ok.all()
            rows = k[r.first_chunk // 4][:, (r.first_chunk % 4) * 4:(r.first_chunk % 4 + r.n_chunks) * 4]
            np.testing.assert_array_equal(arrays.transpose(1, 0, 2, 3).reshape(2, -1, 8), rows)
        requests = {id(r.request) for r in runs}
        assert len(requests) == (4 if direct_io else 1)
        assert store.metrics.snapshot()["read_requests"] == 4
        # the second prefix's extent gone: its runs are misses, the first prefix's runs in the same request are not
        (second,) = [f for f in (tmp_path / "s").rglob("0/k") if "000000000004+" in str(f)]
        second.unlink()
        runs = store.read_runs(0, K, [0, 2, 5])
        assert [bool(r.verified.result(timeout=10)[1].all()) for r in runs] == [True, True, False]
        assert len({id(r.request) for r in runs}) == (3 if direct_io else 1)


def test_a_shared_speculative_request_is_withdrawn_only_when_none_of_its_runs_is_wanted(tmp_path):
    """Speculative runs read together from the page cache share a request: withdrawing one run leaves it queued for
    the others; once none is wanted, nothing is read. On an emulated disk each speculative run is its own request,
    withdrawn on its own."""
    gate = threading.Event()
    store, _ = _store_of_two_segments(tmp_path, max_inflight_bytes=0)
    with store:
        blocker = Read(lambda: _after(gate), 1, False)
        store.scheduler.submit(blocker)  # holds the disk, so the reads below stay queued
        runs = store.read_runs(0, K, [0, 2, 5], speculative=True)
        assert len({id(r.request) for r in runs}) == 1
        store.withdraw(runs[0])
        store.withdraw(runs[2])
        assert runs[1].read.state == QUEUED  # chunk 2 is still wanted
        store.withdraw(runs[1])
        assert all(r.verified.cancelled() for r in runs)
        gate.set()
        blocker.future.result(timeout=5)
        assert store.metrics.snapshot()["chunks_read"] == 0
    store, _ = _store_of_two_segments(tmp_path, disk_bandwidth=1e6)
    with store:
        speculative, demand = store.read_runs(0, K, [0, 2, 5], speculative=True), store.read_runs(0, K, [1, 3, 6])
        assert len({id(r.request) for r in speculative}) == 3
        assert len({id(r.request) for r in demand}) == 1
        assert all(r.verified.result(timeout=10)[1].all() for r in speculative + demand)


def test_store_withdraws_a_run_only_when_none_of_its_chunks_is_wanted(tmp_path):
    fp = {"arch": "t", "num_layers": 1, "kv_heads": 1, "head_dim": 8, "probe_heads": 0, "chunk_tokens": 4}
    k = np.ones((1, 16, 8), np.float32)
    with KVStore.open(str(tmp_path / "s"), fp) as store:
        store.insert(np.arange(16), [(k, k, None)])
    gate = threading.Event()
    with KVStore.open(str(tmp_path / "s"), fp, max_inflight_bytes=0) as store:
        blocker = Read(lambda: _after(gate), 1, False)
        store.scheduler.submit(blocker)  # holds the disk, so the reads below stay queued
        run = store.read_chunks(0, K, [0, 1], speculative=True)
        store.withdraw(run[0].run)
        assert run[1].run.read.state == QUEUED  # chunk 1 is still wanted
        store.withdraw(run[1].run)
        assert run[0].future.cancelled() and run[1].future.cancelled()
        gate.set()
        blocker.future.result(timeout=5)
        assert store.metrics.snapshot()["chunks_read"] == 0


def _after(event):
    f = concurrent.futures.Future()
    threading.Thread(target=lambda: (event.wait(5), f.set_result(None)), daemon=True).start()
    return f
