"""Radix index: longest-prefix match, split on divergence, reuse of concurrently stored tokens."""

import numpy as np
import pytest

from specjax.stores.radix import RadixTree


def _total(steps):
    return sum(s.length for s in steps)


def test_match_empty_and_full():
    tree = RadixTree()
    assert tree.match([1, 2, 3]) == []
    node, created = tree.insert([1, 2, 3, 4], seg_id=7, base=0)
    assert created == []
    steps = tree.match([1, 2, 3, 4, 5])
    assert _total(steps) == 4 and steps[0].node_id == node and steps[0].seg_id == 7
    assert _total(tree.match([1, 2, 9])) == 2
    assert _total(tree.match([2, 1])) == 0


def test_split_on_divergence_keeps_segment_offsets():
    tree = RadixTree()
    a, _ = tree.insert([1, 2, 3, 4, 5, 6], seg_id=1, base=0)
    # diverges after 3 tokens: node a splits into [1,2,3] -> [4,5,6] and the new [7,8] hangs off the split
    b, created = tree.insert([1, 2, 3, 7, 8], seg_id=2, base=3)
    assert len(created) == 1
    upper = tree.nodes[created[0]]
    assert list(upper.tokens) == [1, 2, 3] and upper.seg_id == 1 and upper.seg_start == 0
    lower = tree.nodes[a]
    assert list(lower.tokens) == [4, 5, 6] and lower.seg_id == 1 and lower.seg_start == 3
    assert lower.parent == upper.node_id and tree.nodes[b].parent == upper.node_id
    steps = tree.match([1, 2, 3, 4, 5, 6, 0])
    assert [(s.node_id, s.seg_id, s.seg_start, s.prefix_start, s.length) for s in steps] == [
        (upper.node_id, 1, 0, 0, 3), (a, 1, 3, 3, 3)]
    steps = tree.match([1, 2, 3, 7, 8])
    assert [(s.seg_id, s.seg_start, s.length) for s in steps] == [(1, 0, 3), (2, 0, 2)]
    assert list(tree.prefix_tokens(b)) == [1, 2, 3, 7, 8]


def test_insert_reuses_tokens_stored_meanwhile():
    tree = RadixTree()
    tree.insert([1, 2], seg_id=1, base=0)
    tree.insert([1, 2, 3, 4], seg_id=2, base=2)
    # a writer that matched only [1, 2] stores [3, 4, 5]: only token 5 becomes new, at offset 2 of its segment
    node, _ = tree.insert([1, 2, 3, 4, 5], seg_id=3, base=2)
    assert tree.nodes[node].seg_start == 2 and list(tree.nodes[node].tokens) == [5]
    assert tree.insert([1, 2, 3], seg_id=4, base=2)[0] is None  # everything already stored (after a split)
    with pytest.raises(KeyError):
        tree.insert([9, 9, 9], seg_id=5, base=2)


def test_records_roundtrip_and_leaf_removal():
    tree = RadixTree()
    tree.insert([1, 2, 3], 1, 0)
    leaf, _ = tree.insert([1, 2, 3, 4, 5], 2, 3)
    tree.insert([1, 9], 3, 1)
    again = RadixTree.from_records(tree.to_records())
    for tokens in ([1, 2, 3, 4, 5], [1, 9], [1, 2, 7]):
        assert [(s.node_id, s.length) for s in again.match(tokens)] == [(s.node_id, s.length)
                                                                          for s in tree.match(tokens)]
    tree.remove_leaf(leaf)
    assert sum(s.length for s in tree.match([1, 2, 3, 4, 5])) == 3
    with pytest.raises(ValueError):
        tree.remove_leaf(tree.match([1])[0].node_id)  # has children
    assert np.array_equal(tree.prefix_tokens(tree.match([1, 9])[-1].node_id), [1, 9])
