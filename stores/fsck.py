"""`python -m specjax.stores.fsck DIR`: verify a KV store's manifest and every chunk checksum.

Prints counts and exits 0 when clean, 1 when any problem was found, 2 when the store cannot be opened.
Orphan chunk files (left by an insert a crash interrupted) are reported but are not a problem: they were never
committed, and the next writable open deletes them.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys

import numpy as np
import tensorstore as ts

from specjax.stores.errors import StoreError
from specjax.stores.store import KVStore


@dataclasses.dataclass
class FsckReport:
    nodes: int = 0
    segments: int = 0
    chunks_checked: int = 0
    bad_chunks: int = 0
    orphan_chunks: int = 0
    problems: list = dataclasses.field(default_factory=list)

    @property
    def ok(self) -> bool:
        return not self.problems


def _check_structure(store: KVStore, report: FsckReport) -> None:
    lay = store.layout
    tree, segments = store._tree, {s.seg_id: s for s in store._segments.values() if s.refs > 0}
    report.nodes, report.segments = len(tree.nodes) - 1, len(segments)
    spans = sorted((s.first_chunk, s.first_chunk + s.n_chunks, s.seg_id) for s in segments.values())
    for (a0, a1, a), (b0, _, b) in zip(spans, spans[1:]):
        if b0 < a1:
            report.problems.append(f"segments {a} and {b} share chunks {b0}..{a1 - 1}")
    for s in segments.values():
        if s.n_chunks * lay.chunk_tokens < s.n_tokens:
            report.problems.append(f"segment {s.seg_id}: {s.n_tokens} tokens do not fit {s.n_chunks} chunks")
        if s.checksums.shape != (lay.num_layers, len(lay.kinds()), s.n_chunks):
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


def _check_chunks(store: KVStore, report: FsckReport) -> None:
    before = store.metrics.bad_chunks
    for seg in [s for s in store._segments.values() if s.refs > 0]:
        futures = [store.read_chunk(layer, kind, c)
                   for layer in range(store.layout.num_layers) for kind in store.layout.kinds()
                   for c in range(seg.first_chunk, seg.first_chunk + seg.n_chunks)]
        for f in futures:
            f.result()
        report.chunks_checked += len(futures)
    report.bad_chunks = store.metrics.bad_chunks - before
    if report.bad_chunks:
        report.problems.append(f"{report.bad_chunks} chunks fail their checksum or cannot be read")


def fsck(location, context: ts.Context | None = None) -> FsckReport:
    """Check a store; raises StoreError if its manifest cannot be read at all."""
    report = FsckReport()
    with KVStore.open(location, None, read_only=True, create=False, context=context, gc_orphans=False) as store:
        _check_structure(store, report)
        _check_chunks(store, report)
        owned = set()
        for seg in store._segments.values():
            owned.update(range(seg.first_chunk, seg.first_chunk + seg.n_chunks))
        root = ts.KvStore.open(store.kvstore_spec, context=store.context).result()
        report.orphan_chunks = len(store._arrays.stored_chunk_ids(root) - owned)
    return report


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="python -m specjax.stores.fsck", description=__doc__.splitlines()[0])
    parser.add_argument("store", help="store directory, or a TensorStore kvstore JSON spec")
    args = parser.parse_args(argv)
    location = json.loads(args.store) if args.store.lstrip().startswith("{") else args.store
    try:
        report = fsck(location)
    except StoreError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    print(f"nodes {report.nodes}  segments {report.segments}  chunks checked {report.chunks_checked}  "
          f"bad chunks {report.bad_chunks}  orphan chunks {report.orphan_chunks} (uncommitted, harmless)")
    for problem in report.problems:
        print(f"problem: {problem}")
    print("OK" if report.ok else f"FAILED: {len(report.problems)} problem(s)")
    return 0 if report.ok else 1


if __name__ == "__main__":
    sys.exit(main())
