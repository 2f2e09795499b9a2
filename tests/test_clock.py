"""The request clock's exposed host time: host work that neither a disk read, a wait for the device nor device work
the host went on past overlapped (specjax.engine.clock.Clock)."""

import dataclasses
import os
import threading
import time

import jax
import numpy as np
import pytest
import tensorstore as ts

import specjax
from specjax.api import Model
from specjax.engine import EngineConfig, Request, fingerprint, make_engine, make_system
from specjax.engine import engine as engine_module
from specjax.engine.blend import blend_fingerprint, chunk_keys
from specjax.engine.clock import Clock
from specjax.stores import KVStore


class FakeWork:
    """Device work whose results are ready once `done` is set (jax.block_until_ready calls this method)."""

    def __init__(self, fail: bool = False):
        self.done = threading.Event()
        self.fail = fail

    def block_until_ready(self):
        self.done.wait()
        if self.fail:
            raise RuntimeError("the device step failed")
        return self


def run_request(host_s: float, works, *, watch: bool) -> float:
    """A request that hands `works` to the device, does `host_s` of host work, then sees them done: exposed ms."""
    clock = Clock()
    dispatched = time.monotonic()
    if watch:
        for work in works:
            clock.device_work(dispatched, work)
    time.sleep(host_s)  # host work while the device computes
    for work in works:
        work.done.set()
    time.sleep(0.01)  # the watcher notes them done (the engine's first token waits for the last layer itself)
    clock.finish()
    return clock.exposed_host_ms([])


def test_device_work_the_host_went_on_past_overlaps_its_host_work():
    watched = run_request(0.2, [FakeWork(), FakeWork()], watch=True)
    unwatched = run_request(0.2, [FakeWork(), FakeWork()], watch=False)
    assert unwatched >= 190  # nothing overlapped the host's 200 ms
    assert watched < 60  # the device was busy from the dispatch until the work was done


def test_a_failed_device_step_counts_as_no_device_work_and_does_not_hang_the_clock():
    start = time.monotonic()
    exposed = run_request(0.1, [FakeWork(fail=True)], watch=True)
    assert exposed >= 95
    assert time.monotonic() - start < 30


def test_device_work_counts_from_its_dispatch_or_the_previous_work_done_whichever_is_later():
    clock = Clock()
    t0 = clock.start_monotonic
    clock._watched = 3  # as if handed over by `device_work`; the watcher's notes follow
    clock._noted(t0 + 1.0, t0 + 2.0)
    clock._noted(t0 + 0.5, t0 + 3.0)  # queued behind the first: its device time starts when the first is done
    clock._noted(t0 + 3.5, t0 + 4.0)
    assert clock._device_busy == [(t0 + 1.0, t0 + 2.0), (t0 + 2.0, t0 + 3.0), (t0 + 3.5, t0 + 4.0)]
    clock.end_monotonic = t0 + 5.0
    # uncovered: [0, 1), [3, 3.5), [4, 5); a disk read in flight over [0, 0.5)
    assert abs(clock.exposed_host_ms([(t0 - 1.0, t0 + 0.5)]) - 2000.0) < 1e-6


def test_cpu_time_counts_work_not_waiting():
    """`cpu_ms` is the process's CPU time to the first token: a request that sleeps has little, one that computes
    has its computing time, whatever its wall time."""
    clock = Clock()
    time.sleep(0.2)
    clock.finish()
    assert clock.cpu_ms < 100

    clock = Clock()
    spent = time.thread_time()
    while time.thread_time() - spent < 0.15:  # 150 ms of this thread's CPU
        sum(range(1000))
    ttft, _ = clock.finish()
    assert 150 <= clock.cpu_ms <= ttft * len(os.sched_getaffinity(0)) + 1


class Untimed(Clock):
    """A clock that times nothing: the engine as it would run without a breakdown."""

    def timed(self, phase, fn, *args, **kwargs):
        return fn(*args, **kwargs)

    def device_work(self, dispatched_at, tree, *, phase=None):
        pass


@pytest.mark.parametrize("name", ["spec", "as_h2o_lfu", "spec_gqa", "full_reuse"])
def test_a_timed_request_waits_for_the_device_where_an_untimed_one_does(name, monkeypatch):
    """The breakdown adds no synchronisation: the request's thread blocks on the device as often timed as not, in the
    layer loop and in CacheBlend's schedule alike (both run the engine's one request loop and its clock)."""
    model = specjax.load_model("tiny-llama", init="random", seed=1)
    blend = name == "full_reuse"
    if blend:  # a BOS token: CacheBlend's chunk sink
        model = Model("tiny-llama-bos", dataclasses.replace(model.config, bos_token_id=3), model.params, "random")
    rng = np.random.default_rng(0)
    prefix = rng.integers(0, 512, 100).tolist()
    req = Request(prefix, rng.integers(0, 512, 7).tolist(), [], chunks=[prefix[:40], prefix[40:]])
    main = threading.current_thread()
    waits = []
    block = jax.block_until_ready

    def counted(tree):
        if threading.current_thread() is main:
            waits.append(1)
        return block(tree)

    def main_thread_waits(clock_class) -> int:
        monkeypatch.setattr(engine_module, "Clock", clock_class)
        store = KVStore.open({"driver": "memory", "path": f"kv{rng.integers(1 << 30)}/"},
                             (blend_fingerprint if blend else fingerprint)(model, 16), context=ts.Context())
        engine = make_engine(model, make_system(name), store, EngineConfig(retention=0.25))
        for key in chunk_keys(req.chunks, engine.sink) if blend else [req.prefix]:
            engine.warm(key)
        engine.run(req)  # compiled, not counted
        waits.clear()
        monkeypatch.setattr(jax, "block_until_ready", counted)
        result = engine.run(req)
        monkeypatch.setattr(jax, "block_until_ready", block)
        assert result.reused_tokens == 100
        return len(waits)

    timed = main_thread_waits(Clock)
    assert timed == main_thread_waits(Untimed)
    assert timed >= 1  # the first token itself
