"""Radix tree over token ids: each node is a run of tokens whose KV lives in a range of one segment.

A node's tokens `tokens[i]` are the segment's original-order tokens `seg_start + i`; splitting a node only
changes these offsets, never the stored data.
"""

from __future__ import annotations

import dataclasses
import itertools

import numpy as np


@dataclasses.dataclass
class Node:
    node_id: int
    parent: int | None
    tokens: np.ndarray            # int64 token ids of this run
    seg_id: int | None            # None only for the root
    seg_start: int = 0
    children: dict = dataclasses.field(default_factory=dict)  # first token id -> child node id
    last_access: int = 0

    def __len__(self) -> int:
        return len(self.tokens)


@dataclasses.dataclass(frozen=True)
class PathStep:
    """Part of a match: `length` tokens of `node` from its start, covering prefix positions [start, start+length)."""
    node_id: int
    seg_id: int
    seg_start: int
    prefix_start: int
    length: int


def _common_length(a: np.ndarray, b: np.ndarray) -> int:
    n = min(len(a), len(b))
    if n == 0:
        return 0
    diff = np.flatnonzero(a[:n] != b[:n])
    return int(diff[0]) if len(diff) else n


class RadixTree:
    """Insert, longest-prefix match and split on divergence. Not thread-safe: the store holds the lock."""

    ROOT = 0

    def __init__(self):
        self.nodes: dict[int, Node] = {self.ROOT: Node(self.ROOT, None, np.zeros(0, np.int64), None)}
        self.next_id = 1                  # node ids are never reused, not even across processes (persisted)
        self._clock = itertools.count(1)

    def _new_id(self) -> int:
        self.next_id += 1
        return self.next_id - 1

    def keep_recency_of(self, old: "RadixTree") -> None:
        """Take over `old`'s access clock and the last access of the nodes both trees hold (a tree rebuilt from the
        manifest keeps the eviction order this process has seen)."""
        self._clock = old._clock
        for node_id, node in self.nodes.items():
            if node_id in old.nodes:
                node.last_access = old.nodes[node_id].last_access

    def match(self, tokens, touch: bool = True) -> list[PathStep]:
        """Longest stored prefix of `tokens` as path steps (the last step may cover part of its node)."""
        tokens = np.asarray(tokens, np.int64)
        steps, pos, node = [], 0, self.nodes[self.ROOT]
        while pos < len(tokens):
            child_id = node.children.get(int(tokens[pos]))
            if child_id is None:
                break
            child = self.nodes[child_id]
            n = _common_length(child.tokens, tokens[pos:])
            steps.append(PathStep(child_id, child.seg_id, child.seg_start, pos, n))
            if touch:
                child.last_access = next(self._clock)
            pos += n
            if n < len(child):
                break
            node = child
        return steps

    def split(self, node_id: int, at: int) -> int:
        """Split `node_id` so its first `at` tokens become a new parent node; returns the parent's id."""
        node = self.nodes[node_id]
        if not 0 < at < len(node):
            raise ValueError(f"split point {at} outside node of {len(node)} tokens")
        upper = Node(self._new_id(), node.parent, node.tokens[:at], node.seg_id, node.seg_start,
                     last_access=node.last_access)
        self.nodes[upper.node_id] = upper
        self.nodes[node.parent].children[int(node.tokens[0])] = upper.node_id
        node.tokens = node.tokens[at:]
        node.seg_start += at
        node.parent = upper.node_id
        upper.children[int(node.tokens[0])] = node_id
        return upper.node_id

    def insert(self, tokens, seg_id: int, base: int) -> tuple[int | None, list[int]]:
        """Store `tokens[base:]`, held by segment `seg_id` from its token 0, below the existing `tokens[:base]`.

        Returns (new node id or None when every token was already stored, ids of nodes created by splits).
        Tokens already present beyond `base` (a concurrent insert) are reused, not duplicated.
        """
        tokens = np.asarray(tokens, np.int64)
        steps = self.match(tokens)
        matched = sum(s.length for s in steps)
        if matched < base:
            raise KeyError(f"base prefix of {base} tokens is not stored (only {matched})")
        created = []
        parent = self.ROOT
        if steps:
            last = steps[-1]
            parent = last.node_id
            if last.length < len(self.nodes[last.node_id]):
                parent = self.split(last.node_id, last.length)
                created.append(parent)
        if matched == len(tokens):
            return None, created
        node = Node(self._new_id(), parent, tokens[matched:].copy(), seg_id, matched - base,
                    last_access=next(self._clock))
        self.nodes[node.node_id] = node
        self.nodes[parent].children[int(node.tokens[0])] = node.node_id
        return node.node_id, created

    def remove_leaf(self, node_id: int) -> Node:
        node = self.nodes[node_id]
        if node.children or node_id == self.ROOT:
            raise ValueError(f"node {node_id} is not a removable leaf")
        del self.nodes[node.parent].children[int(node.tokens[0])]
        return self.nodes.pop(node_id)

    def leaves_below(self, node_id: int) -> list[int]:
        """The leaves of the subtree rooted at `node_id` (itself if it is one)."""
        below, leaves = [node_id], []
        while below:
            node = self.nodes[below.pop()]
            below.extend(node.children.values())
            if not node.children:
                leaves.append(node.node_id)
        return leaves

    def remove_subtree(self, node_id: int) -> None:
        """Remove a node and every node below it."""
        node = self.nodes[node_id]
        if node_id == self.ROOT:
            raise ValueError("the root cannot be removed")
        del self.nodes[node.parent].children[int(node.tokens[0])]
        below = [node_id]
        while below:
            below.extend(self.nodes.pop(below.pop()).children.values())

    def leaves(self) -> list[Node]:
        return [n for n in self.nodes.values() if not n.children and n.node_id != self.ROOT]

    def prefix_tokens(self, node_id: int) -> np.ndarray:
        """All tokens from the root to the end of `node_id`."""
        parts = []
        while node_id != self.ROOT:
            node = self.nodes[node_id]
            parts.append(node.tokens)
            node_id = node.parent
        return np.concatenate(parts[::-1]) if parts else np.zeros(0, np.int64)

    # -- persistence -------------------------------------------------------------------------

    def to_records(self) -> list[dict]:
        return [{"id": n.node_id, "parent": n.parent, "tokens": n.tokens, "seg": n.seg_id,
                 "seg_start": n.seg_start} for n in self.nodes.values() if n.node_id != self.ROOT]

    @classmethod
    def from_records(cls, records: list[dict], next_id: int = 0) -> "RadixTree":
        tree = cls()
        for r in records:
            tree.nodes[r["id"]] = Node(r["id"], r["parent"], np.asarray(r["tokens"], np.int64), r["seg"],
                                       r["seg_start"])
        for node in list(tree.nodes.values()):
            if node.parent is not None:
                tree.nodes[node.parent].children[int(node.tokens[0])] = node.node_id
        tree.next_id = max(max(tree.nodes) + 1, next_id)
        return tree
