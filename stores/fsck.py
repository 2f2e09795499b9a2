"""`python -m specjax.stores.fsck DIR`: verify a KV store's manifest and every chunk checksum.

DIR is one store, or a folder holding several (such as the base stores an evaluation's --store folder keeps):
each store found under it is checked, its lines prefixed with its path, and a summary says how many were checked.
Each store's lines say which weights, tokenizer and layout it belongs to (its fingerprint).
Exits 0 when clean, 1 when any problem was found, 2 when a store (or any store at all) cannot be opened or read:
whatever fails while one store is opened or read is reported for that store in one line, and the other stores of
the folder are still checked.
DIR may also be a kvstore URL or JSON spec. Orphan chunk files (left by an insert a crash interrupted) are
reported but are not a problem: they were never committed, and the next writable open deletes them. Chunks
that registered writers (other processes sharing the store) have written but not committed yet are counted
apart: as in flight while their writer lives, as abandoned once it is dead (killed before it committed; how
liveness is known: stores/leases.py), which the next writable open deletes too. The check reads one generation;
it may run while other processes use the store. A chunk is bad where its own bytes fail their checksum or are
missing (an extent cut short fails only the chunks whose bytes it lost).
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import json
import logging
import os
import pathlib
import sys
import time

import numpy as np
import tensorstore as ts

from specjax.stores import leases
from specjax.stores.errors import StoreError
from specjax.stores.manifest import MANIFEST_KEY, describe_weights
from specjax.stores.index import StoreIndex
from specjax.stores.reads import ChunkReader
from specjax.stores.store import KVStore


@dataclasses.dataclass
class FsckReport:
    nodes: int = 0
    segments: int = 0
    chunks_checked: int = 0
    bad_chunks: int = 0
    orphan_chunks: int = 0
    inflight_chunks: int = 0
    abandoned_chunks: int = 0  # uncommitted chunks of registered writers that are dead
    dead_writers: list = dataclasses.field(default_factory=list)  # "pid P on this host" per dead writer that left some
    belongs_to: str = ""  # the weights, tokenizer and layout the store was written for
    problems: list = dataclasses.field(default_factory=list)

    @property
    def ok(self) -> bool:
        return not self.problems


def _check_structure(index: StoreIndex, report: FsckReport) -> None:
    lay = index.layout
    tree, segments = index.tree, {s.seg_id: s for s in index.segments(referenced=True)}
    report.nodes, report.segments = len(tree.nodes) - 1, len(segments)
    spans = sorted((s.first_chunk, s.first_chunk + s.n_chunks, s.seg_id) for s in segments.values())
    for (a0, a1, a), (b0, _, b) in zip(spans, spans[1:]):
        if b0 < a1:
            report.problems.append(f"segments {a} and {b} share chunks {b0}..{a1 - 1}")
    for s in segments.values():
        if s.n_chunks * lay.chunk_tokens < s.n_tokens:
            report.problems.append(f"segment {s.seg_id}: {s.n_tokens} tokens do not fit {s.n_chunks} chunks")
        if s.checksums.shape != (lay.num_layers, lay.kind_slots, s.n_chunks, lay.max_heads):
            report.problems.append(f"segment {s.seg_id}: checksum table has shape {s.checksums.shape}")
        if s.mapping is not None and s.mapping.ndim == 2 and len(s.mapping) != lay.num_layers:
            report.problems.append(f"segment {s.seg_id}: {len(s.mapping)} per-layer mapping lists for "
                                   f"{lay.num_layers} layers")
        elif s.mapping is not None and not all(np.array_equal(np.sort(row), np.arange(s.n_tokens))
                                               for row in np.atleast_2d(s.mapping)):
            report.problems.append(f"segment {s.seg_id}: mapping list is not a permutation")
    children_seen = {}
    for node in tree.nodes.values():
        if node.node_id == tree.ROOT:
            continue
        if node.parent not in tree.nodes:
            report.problems.append(f"node {node.node_id}: parent {node.parent} missing")
            continue
        key = (node.parent, int(node.tokens[0]) if len(node.tokens) else None)
        if key[1] is None or key in children_seen:
            report.problems.append(f"node {node.node_id}: empty or duplicate child of node {node.parent}")
        children_seen[key] = node.node_id
        seg = segments.get(node.seg_id)
        if seg is None:
            report.problems.append(f"node {node.node_id}: segment {node.seg_id} missing")
        elif node.seg_start < 0 or node.seg_start + len(node) > seg.n_tokens:
            report.problems.append(f"node {node.node_id}: token range outside segment {seg.seg_id}")


def belongs_to(store: KVStore) -> str:
    """The weights, tokenizer and layout a store's fingerprint names, in one line."""
    fp, lay = store.fingerprint, store.layout
    tokenizer = fp.get("tokenizer")
    tokenizer = (f"tokenizer {tokenizer[:12]}" if tokenizer else "no tokenizer") if "tokenizer" in fp else \
        "tokenizer not recorded"
    return (f"{describe_weights(fp)}; {tokenizer}; layout {fp.get('arch', '?')}, {lay.num_layers} layers x "
            f"{lay.kv_heads} KV heads x {lay.head_dim}, {lay.chunk_tokens}-token chunks, {lay.dtype}, "
            f"{lay.probe_heads} probe heads")


def _check_chunks(index: StoreIndex, reader: ChunkReader, report: FsckReport) -> None:
    lay, bad = index.layout, []
    for seg in index.segments(referenced=True):
        chunks = range(seg.first_chunk, seg.first_chunk + seg.n_chunks)
        runs = [(layer, kind, run) for layer in range(lay.num_layers) for kind in lay.kinds()
                for run in reader.read_runs(layer, kind, chunks)]
        bad += [(layer, kind, chunk, why) for layer, kind, run in runs
                for chunk, why in _bad_chunks(reader, layer, kind, run)]
        report.chunks_checked += len(chunks) * lay.num_layers * len(lay.kinds())
    report.bad_chunks = len(bad)
    if bad:
        report.problems.append(_bad_chunks_problem(index, bad))


def _bad_chunks(reader: ChunkReader, layer: int, kind: int, run) -> list[tuple[int, str]]:
    """(chunk, why) of each chunk of a run that fails its checksum or cannot be read. A run that cannot be read as a
    whole (its extent cut short, say) is read again a chunk at a time: only chunks whose own bytes are lost are bad."""
    arrays, ok = run.verified.result()
    if arrays is None and run.n_chunks > 1:
        singles = [r for c in range(run.first_chunk, run.first_chunk + run.n_chunks)
                   for r in reader.read_runs(layer, kind, [c])]
        return [bad for r in singles for bad in _bad_chunks(reader, layer, kind, r)]
    why = "cannot be read" if arrays is None else "fails its checksum"
    return [(run.first_chunk + j, why) for j in np.flatnonzero(~ok).tolist()]


def _bad_chunks_problem(index: StoreIndex, bad: list, shown: int = 5) -> str:
    where = ", ".join(f"chunk {chunk} in {index.extent_of(layer, kind, chunk)[0]} {why}"
                      for layer, kind, chunk, why in bad[:shown])
    more = f" and {len(bad) - shown} more" if len(bad) > shown else ""
    return (f"{len(bad)} chunks fail their checksum or cannot be read ({where}{more}); they are never served: a "
            f"request that reaches them is recomputed, and an engine that may write the store stores its prefix anew")


def _writers(index: StoreIndex) -> tuple[list[tuple[int, int]], dict[str, dict]]:
    """(the chunk-id ranges of the registered writers that live, the dead ones' entries by writer id)."""
    catalog, now = index.catalog, time.time()
    live, dead = [], {}
    for wid, entry in catalog.writers.items():
        if leases.alive(wid, entry, lambda w: leases.read_heartbeat(catalog.io, w), catalog.lease_s, now):
            live += [tuple(r) for r in entry.get("ranges", [])]
        else:
            dead[wid] = entry
    return live, dead


def _describe_writer(entry: dict) -> str:
    if entry.get("host") == leases.host_key():
        return f"pid {entry.get('pid')} on this host"
    return f"pid {entry.get('pid')} on host {str(entry.get('host', '?')).split('|')[0]}"


def _count_uncommitted(index: StoreIndex, report: FsckReport) -> None:
    """Sort the chunks on disk that no segment owns: a live writer's (in flight), a dead one's (abandoned), or
    nobody's (orphans)."""
    owned = set()
    for seg in index.segments():
        owned.update(range(seg.first_chunk, seg.first_chunk + seg.n_chunks))
    unowned = index.stored_chunk_ids() - owned
    live, dead = _writers(index)
    left = {wid: sum(any(lo <= c < hi for lo, hi in entry.get("ranges", [])) for c in unowned)
            for wid, entry in dead.items()}
    report.inflight_chunks = sum(any(lo <= c < hi for lo, hi in live) for c in unowned)
    report.abandoned_chunks = sum(left.values())  # writers' ranges are disjoint
    report.orphan_chunks = len(unowned) - report.inflight_chunks - report.abandoned_chunks
    report.dead_writers = [_describe_writer(dead[wid]) for wid, n in left.items() if n]


def fsck(location, context: ts.Context | None = None) -> FsckReport:
    """Check a store; raises StoreError if its manifest cannot be read at all."""
    report = FsckReport()
    with KVStore.open(location, None, read_only=True, create=False, context=context, gc_orphans=False) as store:
        index = store.index
        report.belongs_to = belongs_to(store)
        _check_structure(index, report)
        _check_chunks(index, store.reader, report)
        _count_uncommitted(index, report)
    return report


def find_stores(folder: pathlib.Path) -> list[pathlib.Path]:
    """The stores in `folder` or below it (itself if it is one): directories with a manifest, or with KV arrays
    whose manifest is lost (they fail to open, which is reported rather than skipped)."""
    found = []
    for root, dirs, files in os.walk(folder):
        if MANIFEST_KEY in files or "kv" in dirs:
            found.append(pathlib.Path(root))
            dirs.clear()  # a store's own subfolders are its arrays, not more stores
    return sorted(found)


def _check(location, label: str = "") -> int:
    """Check one store, print what was found (each line after `label`); its exit code."""
    prefix = f"{label}: " if label else ""
    try:
        report = fsck(location)
    except StoreError as e:
        print(f"{prefix}error: {e}", file=sys.stderr)
        return 2
    except Exception as e:  # noqa: BLE001 -- whatever breaks one store is reported; the others are still checked
        print(f"{prefix}error: cannot open or read this store ({type(e).__name__}: {_one_line(e)}); its metadata "
              f"or arrays are damaged: rebuild it, or delete it and let the next run write it anew", file=sys.stderr)
        return 2
    print(f"{prefix}belongs to {report.belongs_to}")
    print(f"{prefix}nodes {report.nodes}  segments {report.segments}  chunks checked {report.chunks_checked}  "
          f"bad chunks {report.bad_chunks}  orphan chunks {report.orphan_chunks} (uncommitted, harmless)  "
          f"in flight {report.inflight_chunks} (live writers)  abandoned {report.abandoned_chunks} (dead writers)")
    if report.abandoned_chunks:
        print(f"{prefix}note: {_abandoned_note(report, location)}")
    for problem in report.problems:
        print(f"{prefix}problem: {problem}")
    print(f"{prefix}OK" if report.ok else f"{prefix}FAILED: {len(report.problems)} problem(s)")
    return 0 if report.ok else 1


def _abandoned_note(report: FsckReport, location) -> str:
    return (f"{report.abandoned_chunks} uncommitted chunks were left by {len(report.dead_writers)} writer(s) that "
            f"died before committing them ({', '.join(report.dead_writers)}): abandoned, never served and safe to "
            f"reclaim; the next writable open of the store deletes them, e.g. python -c \"from specjax.stores import "
            f"KVStore; KVStore.open({location!r}).close()\"")


def _one_line(e: BaseException, limit: int = 300) -> str:
    text = " ".join(str(e).split())
    return text if len(text) <= limit else text[:limit] + "..."


def _check_folder(folder: pathlib.Path) -> int:
    stores = find_stores(folder)
    if not stores:
        print(f"error: no KV store in {folder} (no {MANIFEST_KEY} in it or below it)", file=sys.stderr)
        return 2
    if stores == [folder]:
        return _check(str(folder))
    codes = [_check(str(store), str(store.relative_to(folder))) for store in stores]
    print(f"checked {len(stores)} stores under {folder}: {codes.count(0)} OK, {codes.count(1)} with problems, "
          f"{codes.count(2)} could not be opened")
    return max(codes)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="python -m specjax.stores.fsck", description=__doc__.splitlines()[0])
    parser.add_argument("store", help="store directory, a folder of stores, a kvstore URL (gs://bucket/kv/) "
                                      "or a TensorStore kvstore JSON spec")
    args = parser.parse_args(argv)
    with _quiet_reads():
        if args.store.lstrip().startswith("{"):
            return _check(json.loads(args.store))
        if "://" in args.store:
            return _check(args.store)
        path = pathlib.Path(args.store)
        if path.exists() and not path.is_dir():
            print(f"error: {_not_a_folder(path)}", file=sys.stderr)
            return 2
        return _check_folder(path) if path.is_dir() else _check(args.store)


def _not_a_folder(path: pathlib.Path) -> str:
    if path.name == MANIFEST_KEY:
        return (f"{path} is a store's manifest, not its folder; check the folder: "
                f"python -m specjax.stores.fsck {path.parent}")
    return (f"{path} is a file, not a KV store folder; give fsck a store's folder (the one holding {MANIFEST_KEY}) "
            f"or a folder of stores")


@contextlib.contextmanager
def _quiet_reads():
    """The read path's own warnings off while fsck runs: fsck reports each bad chunk itself, and only those."""
    logger = logging.getLogger("specjax.stores.reads")
    level = logger.level
    logger.setLevel(logging.ERROR)
    try:
        yield
    finally:
        logger.setLevel(level)


if __name__ == "__main__":
    sys.exit(main())
