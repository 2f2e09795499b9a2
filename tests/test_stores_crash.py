"""Crash safety: a child process inserts prefixes in a loop and is SIGKILLed at random moments; every insert
that returned must be served bit-exact after reopening, none half-visible, fsck clean, new inserts working.

Run as a script (`python tests/test_stores_crash.py --child DIR START`) it is the child.
"""

import functools
import os
import random
import signal
import subprocess
import sys
import time

import numpy as np
import pytest

import toy_kv
from toy_kv import insert, kv_for
FP = toy_kv.fingerprint("crash-toy", kv_bits=(4,))  # its low-bit K and V too
TRIALS = 20


@functools.lru_cache(maxsize=None)
def tokens_for(i: int) -> tuple:
    """Prefix i: fresh, or a (possibly cut) earlier prefix plus new tokens, to exercise splits."""
    rng = np.random.default_rng(i)
    new = rng.integers(0, 500, int(rng.integers(5, 60)))
    if i % 3 == 0:
        return tuple(new.tolist())
    base = tokens_for(int(rng.integers(0, i)))
    cut = int(rng.integers(1, len(base) + 1))
    return tuple(base[:cut]) + tuple(new.tolist())


def child(directory: str, start: int) -> None:
    from specjax.stores import KVStore

    store = KVStore.open(directory, FP)
    print("ready", flush=True)
    i = start
    while True:
        insert(store, tokens_for(i))
        print(f"committed {i}", flush=True)
        i += 1


def verify(store, tokens, exact: bool) -> bool:
    """True if fully served bit-exact; with exact=False a missing prefix is acceptable (never a partial one
    beyond what other prefixes explain)."""
    tokens = np.asarray(tokens, np.int64)
    with store.match(tokens) as m:
        if m.length < len(tokens):
            assert not exact, f"committed prefix of {len(tokens)} tokens only matches {m.length}"
        if m.length == 0:
            return False
        want = kv_for(tokens[:m.length])
        for layer in range(FP["num_layers"]):
            for kind in store.layout.kinds():
                got = toy_kv.read(store, m, layer, kind).result()
                assert got.ok.all()
                np.testing.assert_array_equal(got.array, toy_kv.expected(store, m, layer, want[layer], kind))
        return m.length == len(tokens)


@pytest.mark.slow
def test_sigkill_during_inserts(tmp_path):
    from specjax.stores import KVStore
    from specjax.stores.fsck import fsck

    directory = str(tmp_path / "store")
    rng = random.Random(0)
    committed, next_i = set(), 0
    env = dict(os.environ, PYTHONUNBUFFERED="1")
    for trial in range(TRIALS):
        proc = subprocess.Popen([sys.executable, __file__, "--child", directory, str(next_i)],
                                stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env)
        assert proc.stdout.readline().strip() == "ready", proc.stderr.read()
        time.sleep(rng.uniform(0.0, 0.4))
        proc.send_signal(signal.SIGKILL)
        out, _ = proc.communicate()
        done = [int(line.split()[1]) for line in out.splitlines() if line.startswith("committed")]
        committed.update(done)
        in_flight = (max(done) + 1) if done else next_i
        with KVStore.open(directory, FP) as store:
            for i in committed:
                verify(store, tokens_for(i), exact=True)
            if verify(store, tokens_for(in_flight), exact=False):
                committed.add(in_flight)     # it committed but was killed before saying so
        report = fsck(directory)
        assert report.ok, report.problems
        assert report.orphan_chunks == 0     # reopening removed what the killed insert left behind
        next_i = in_flight + 1
    assert len(committed) > TRIALS           # the loop made progress
    with KVStore.open(directory, FP) as store:
        extra = tokens_for(10_000)
        insert(store, extra)
        verify(store, extra, exact=True)


if __name__ == "__main__" and len(sys.argv) == 4 and sys.argv[1] == "--child":
    child(sys.argv[2], int(sys.argv[3]))
