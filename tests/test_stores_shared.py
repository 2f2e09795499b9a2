"""One store, many processes: concurrent commits lose nothing, handles see others' commits, orphan collection
spares live writers, a writer killed mid-commit harms no one, reordering merges with concurrent inserts.

Every test runs real processes on localhost (this file run as a script is the child:
`python tests/test_stores_shared.py ROLE DIR JSON`); each asserts what the store before issue 21 got wrong.
"""

import json
import os
import pathlib
import random
import signal
import subprocess
import sys
import time

import numpy as np
import pytest

import toy_kv
from toy_kv import insert, kv_for
FP = toy_kv.fingerprint("shared-toy", kv_bits=(4, 2))  # commits of every kind, low-bit ones too
ENV = dict(os.environ, PYTHONUNBUFFERED="1")


def own_prefix(writer: int, i: int, n: int = 40) -> list:
    """Prefix i of writer `writer`: its first token is unique to the pair, so every prefix is a new branch."""
    rng = np.random.default_rng(1000 * writer + i)
    return [100_000 + 1000 * writer + i] + rng.integers(0, 500, n - 1).tolist()


def shared_prefix(i: int) -> list:
    """Prefix i of a family shared by every process: fresh, or a cut of an earlier one plus new tokens."""
    rng = np.random.default_rng(7_000 + i)
    new = rng.integers(0, 50, int(rng.integers(10, 50))).tolist()
    if i < 4:
        return [i] + new
    base = shared_prefix(int(rng.integers(0, i)))
    return base[:int(rng.integers(1, len(base) + 1))] + new


def check(store, tokens, full: bool = True) -> int:
    """Reads of whatever prefix of `tokens` is matched are bit-exact; returns the matched length."""
    with store.match(tokens) as m:
        assert not full or m.length == len(tokens), f"prefix of {len(tokens)} tokens matches only {m.length}"
        want = kv_for(tokens[:m.length])
        for layer in range(FP["num_layers"]):
            for kind in store.layout.kinds():
                got = toy_kv.read(store, m, layer, kind).result()
                assert got.ok.all(), "a chunk fails its checksum or was deleted"
                np.testing.assert_array_equal(got.array, toy_kv.expected(store, m, layer, want[layer], kind))
        return m.length


def wait_for(path: pathlib.Path, timeout: float = 60.0) -> None:
    deadline = time.monotonic() + timeout
    while not path.exists():
        assert time.monotonic() < deadline, f"{path} never appeared"
        time.sleep(0.005)


# -- children ---------------------------------------------------------------------------------------

def child(role: str, directory: str, args: dict) -> None:
    from specjax.stores import KVStore

    if role == "stall":  # freeze inside the first insert's publish: manifest written, lock held, not renamed
        from specjax.stores import PrefixWriter, manifest

        real_replace, real_durable, durable = manifest.os.replace, PrefixWriter.wait_durable, []

        def stalled(src, dst):
            if durable:
                print("stalled", flush=True)
                time.sleep(600)
            real_replace(src, dst)

        def wait_durable(self):
            real_durable(self)
            durable.append(True)  # the next manifest replaced is this insert's

        manifest.os.replace, PrefixWriter.wait_durable = stalled, wait_durable
    store = KVStore.open(directory, FP)
    print("ready", flush=True)
    if "go" in args:
        wait_for(pathlib.Path(args["go"]))
    if role in ("writer", "stall"):
        for i in range(args["n"]):
            insert(store, own_prefix(args["writer"], i))
            print(f"committed {i}", flush=True)
    elif role == "hold":  # write every layer durably, then wait before committing
        tokens = own_prefix(9, 0)
        writer = store.begin_insert(tokens)
        for layer, kv in enumerate(kv_for(tokens)):
            writer.write_layer(layer, *kv)
        writer.wait_durable()
        print("written", flush=True)
        wait_for(pathlib.Path(args["commit"]))
        writer.commit()
        print("committed", flush=True)
    elif role == "mixed":
        mixed(store, args)
    store.close()


def mixed(store, args: dict) -> None:
    """Inserts of prefixes sharing branches with every other process's, matches checked bit-exact, and
    reordering of matched nodes (a repack racing other processes' inserts below and beside it)."""
    from specjax.stores.reorder import reorder_node

    rng = random.Random(args["seed"])
    mine = list(range(args["seed"], args["total"], args["procs"]))
    done = []
    for _ in range(args["ops"]):
        op = rng.random()
        if mine and (op < 0.55 or not done):
            i = mine.pop(0)
            insert(store, shared_prefix(i))
            check(store, shared_prefix(i))
            done.append(i)
            print(f"committed {i}", flush=True)
        elif op < 0.9:
            check(store, shared_prefix(rng.randrange(args["total"])), full=False)
        else:
            with store.match(shared_prefix(rng.choice(done))) as m:
                store.record_importance(m, np.asarray([rng.random() for _ in range(m.length)]))
                node = m.steps[-1].node_id
            try:
                if reorder_node(store, node, min_tokens=8):
                    print(f"reordered {node}", flush=True)
            except KeyError:
                pass  # split or gone meanwhile


def start(role: str, directory, **args) -> subprocess.Popen:
    proc = subprocess.Popen([sys.executable, __file__, role, str(directory), json.dumps(args)],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=ENV)
    line = proc.stdout.readline().strip()
    assert line == "ready", proc.stderr.read()
    return proc


def finish(proc: subprocess.Popen, timeout: float = 120) -> list[str]:
    out, err = proc.communicate(timeout=timeout)
    assert proc.returncode == 0, err
    return out.splitlines()


def committed(lines: list[str]) -> list[int]:
    return [int(line.split()[1]) for line in lines if line.startswith("committed ")]


def fsck_clean(directory) -> None:
    from specjax.stores.fsck import fsck, main as fsck_main

    report = fsck(directory)
    assert report.ok and report.bad_chunks == 0, report.problems
    assert fsck_main([str(directory)]) == 0


# -- tests ------------------------------------------------------------------------------------------

def test_two_writers_at_once_lose_nothing(tmp_path):
    from specjax.stores import KVStore

    directory, go = tmp_path / "store", tmp_path / "go"
    KVStore.open(directory, FP).close()
    procs = [start("writer", directory, writer=w, n=10, go=str(go)) for w in range(2)]
    go.touch()
    for w, proc in enumerate(procs):
        assert committed(finish(proc)) == list(range(10))
    with KVStore.open(directory, FP) as store:
        for w in range(2):
            for i in range(10):
                check(store, own_prefix(w, i))   # before issue 21: about half were lost
        assert store.stats()["nodes"] == 20
    fsck_clean(directory)


def test_handle_sees_commits_made_after_it_opened(tmp_path):
    from specjax.stores import KVStore

    directory = tmp_path / "store"
    store = KVStore.open(directory, FP)
    insert(store, own_prefix(0, 0))
    finish(start("writer", directory, writer=1, n=2))
    check(store, own_prefix(1, 0))              # committed by the other process after this handle opened
    check(store, own_prefix(1, 1))
    insert(store, own_prefix(0, 1))             # and this handle's next commit keeps them
    store.close()
    with KVStore.open(directory, FP) as reopened:
        for w, i in [(0, 0), (0, 1), (1, 0), (1, 1)]:
            check(reopened, own_prefix(w, i))


def test_open_spares_a_live_writers_uncommitted_chunks(tmp_path):
    from specjax.stores import KVStore
    from specjax.stores.fsck import fsck

    directory, go = tmp_path / "store", tmp_path / "commit"
    KVStore.open(directory, FP).close()
    holder = start("hold", directory, commit=str(go))
    assert holder.stdout.readline().strip() == "written"
    with KVStore.open(directory, FP) as store:     # collects orphans: must not take the holder's chunks
        assert store.collect_orphans() == 0
        report = fsck(directory)
        assert report.inflight_chunks > 0 and report.orphan_chunks == 0
        go.touch()
        assert finish(holder) == ["committed"]
        check(store, own_prefix(9, 0))           # before issue 21: its chunks were deleted, reads failed
    fsck_clean(directory)

    killed = start("hold", directory, commit=str(tmp_path / "never"))   # a writer that dies before committing
    assert killed.stdout.readline().strip() == "written"
    killed.kill()
    killed.communicate()
    report = fsck(directory)
    assert report.abandoned_chunks > 0 and report.inflight_chunks == 0  # dead, not in flight
    with KVStore.open(directory, FP) as store:     # its process is gone: its chunks are collected
        check(store, own_prefix(9, 0))
    report = fsck(directory)
    assert report.ok and report.orphan_chunks == 0 and report.inflight_chunks == 0


def test_writer_killed_mid_commit_harms_no_other_commit(tmp_path):
    from specjax.stores import KVStore
    from specjax.stores.fsck import fsck

    directory, go = tmp_path / "store", tmp_path / "go"
    KVStore.open(directory, FP).close()
    staller = start("stall", directory, writer=2, n=5)
    assert staller.stdout.readline().strip() == "stalled"  # new manifest written, not yet renamed, lock held
    writers = [start("writer", directory, writer=w, n=8, go=str(go)) for w in range(2)]
    go.touch()
    time.sleep(0.5)                                         # they queue behind the stalled commit
    staller.send_signal(signal.SIGKILL)
    staller.communicate()
    for proc in writers:
        assert committed(finish(proc)) == list(range(8))
    cli = subprocess.run([sys.executable, "-m", "specjax.stores.fsck", str(directory)], capture_output=True,
                         text=True, env=ENV)
    assert cli.returncode == 0 and "bad chunks 0" in cli.stdout, cli.stdout + cli.stderr
    with KVStore.open(directory, FP) as store:
        for w in range(2):
            for i in range(8):
                check(store, own_prefix(w, i))
        with store.match(own_prefix(2, 0)) as m:
            assert m.length == 0                            # the killed commit is not half-visible
    report = fsck(directory)
    assert report.ok and report.orphan_chunks == 0 and report.inflight_chunks == 0


def test_four_processes_mixed_inserts_matches_and_reorders(tmp_path):
    from specjax.stores import KVStore
    from specjax.stores.fsck import fsck

    directory, go = tmp_path / "store", tmp_path / "go"
    KVStore.open(directory, FP).close()
    procs = [start("mixed", directory, seed=p, procs=4, total=120, ops=50, go=str(go)) for p in range(4)]
    go.touch()
    lines = [line for proc in procs for line in finish(proc)]
    done = sorted(committed(lines))
    assert len(done) >= 4 * 20 and any(line.startswith("reordered") for line in lines)
    report = fsck(directory)
    assert report.ok and report.bad_chunks == 0, report.problems
    assert report.inflight_chunks == 0                  # every writer unregistered when it closed
    with KVStore.open(directory, FP) as store:          # collects what reorders retired within their grace
        for i in done:
            check(store, shared_prefix(i))
    report = fsck(directory)
    assert report.ok and report.orphan_chunks == report.inflight_chunks == 0


def test_another_hosts_writer_lives_by_its_heartbeat(tmp_path):
    """A writer on another host keeps its uncommitted chunks while its heartbeat is fresh; once stale it is
    removed (before its chunks go), and if it was only slow its commit then fails instead of publishing them."""
    from specjax.stores import KVStore, StoreError, leases
    from specjax.stores.fsck import fsck

    directory = tmp_path / "store"
    lease = 30.0
    with KVStore.open(directory, FP, lease_s=lease) as slow:
        tokens = own_prefix(5, 0)
        writer = slow.begin_insert(tokens)
        for layer, kv in enumerate(kv_for(tokens)):
            writer.write_layer(layer, *kv)
        writer.wait_durable()
        wid = slow.index.catalog.writer_id

        def elsewhere():                                    # pretend the writer runs on another host
            from specjax.stores.catalog import Change
            slow.index.catalog.writers[wid]["host"] = "another-host"
            return Change()

        slow.index.catalog.transact(elsewhere)
        with KVStore.open(directory, FP, lease_s=lease) as other:
            assert other.collect_orphans() == 0             # its heartbeat is fresh
        old = json.dumps({"time": time.time() - 2 * lease}).encode()
        slow.index.catalog._heartbeat.stop()                         # the slow writer's heartbeat stops ...
        slow.index.catalog.io.put(leases.HEARTBEAT_PREFIX + wid, old)  # ... long ago
        with KVStore.open(directory, FP, lease_s=lease) as other:
            assert wid not in other.index.catalog.writers
        assert fsck(directory).orphan_chunks == 0           # its chunks are gone
        with pytest.raises(StoreError, match="revoked"):
            writer.commit()
        slow.index.catalog._heartbeat = None
        insert(slow, own_prefix(5, 1))                      # it registers again for new inserts
        check(slow, own_prefix(5, 1))
        with slow.match(tokens) as m:
            assert m.length == 0
    fsck_clean(directory)


def test_conditional_writes_merge_on_a_kvstore():
    """Off a local directory (object stores), publishing is a conditional write: a handle that loses the race
    adopts the winner's generation and applies its change again; nothing is lost, from threads either."""
    import concurrent.futures

    import tensorstore as ts

    from specjax.stores import KVStore

    location, ctx = {"driver": "memory", "path": f"shared{time.monotonic_ns()}/"}, ts.Context()
    a, b, c = (KVStore.open(location, FP, context=ctx) for _ in range(3))
    insert(b, own_prefix(1, 0))
    publish = b.index.catalog.io.publish

    def race(body, expect):                    # another handle commits between b's read and b's write
        b.index.catalog.io.publish = publish
        insert(a, own_prefix(0, 0))
        return publish(body, expect)

    b.index.catalog.io.publish = race
    insert(b, own_prefix(1, 1))
    assert b.stats()["commit_conflicts"] == 1
    with concurrent.futures.ThreadPoolExecutor(3) as pool:
        list(pool.map(lambda w: [insert((a, b, c)[w], own_prefix(w, i)) for i in range(2, 6)], range(3)))
    for store in (a, b, c):
        for w, i in [(0, 0), (1, 0), (1, 1)] + [(w, i) for w in range(3) for i in range(2, 6)]:
            check(store, own_prefix(w, i))
        store.close()


def test_store_addressed_by_url(tmp_path):
    from specjax.stores import KVStore
    from specjax.stores.fsck import main as fsck_main

    directory = tmp_path / "store"
    with KVStore.open(f"file://{directory}", FP) as store:
        insert(store, own_prefix(0, 0))
    with KVStore.open(directory, FP) as store:
        check(store, own_prefix(0, 0))
    assert fsck_main([f"file://{directory}"]) == 0
    ocdbt = f"file://{tmp_path / 'db'}|ocdbt"            # the whole store inside an OCDBT database
    with KVStore.open(ocdbt, FP, refresh_s=0) as a, KVStore.open(ocdbt, FP) as b:
        insert(a, own_prefix(0, 0))
        insert(b, own_prefix(1, 0))
        check(a, own_prefix(1, 0))
    assert fsck_main([ocdbt]) == 0


if __name__ == "__main__" and len(sys.argv) == 4:
    child(sys.argv[1], sys.argv[2], json.loads(sys.argv[3]))
