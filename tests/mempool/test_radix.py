"""RadixTree: matching, inserting, splitting, removal, LRU leaves and TTL expiry."""

from __future__ import annotations

import random
from array import array

import pytest

from minimemserve.mempool.radix import RadixNode, RadixTree, as_tokens

BS = 4


def seq(*blocks: int, tail: int = 0) -> list[int]:
    """Tokens made of whole blocks, each block filled with its given token id."""
    out = [t for b in blocks for t in [b] * BS]
    return out + [99] * tail


def leaves(tree: RadixTree) -> list[RadixNode]:
    return [n for n in tree.nodes() if not n.children]


def test_empty_tree_matches_nothing():
    tree = RadixTree(BS)
    m = tree.match_prefix(seq(1, 2))
    assert (m.num_tokens, m.values, m.nodes) == (0, [], [])
    assert tree.num_blocks == 0 and tree.num_nodes == 0


def test_insert_then_match_whole_and_partial_prefixes():
    tree = RadixTree(BS)
    assert tree.insert(seq(1, 2, 3), [10, 20, 30]) == 0
    assert tree.match_prefix(seq(1, 2, 3)).values == [10, 20, 30]
    m = tree.match_prefix(seq(1, 2, 7, 8))
    assert (m.num_tokens, m.values) == (2 * BS, [10, 20])
    # a partial trailing block never matches; tokens past the cached run are ignored
    assert tree.match_prefix(seq(1, 2, 3, tail=3)).values == [10, 20, 30]
    assert tree.match_prefix(seq(1, 2, 3)[: 3 * BS - 1]).values == [10, 20]
    # a difference inside a block stops the match at that block
    toks = seq(1, 2, 3)
    toks[BS + 1] = 5
    assert tree.match_prefix(toks).values == [10]
    assert tree.match_prefix(seq(2)).values == []


def test_existing_prefix_keeps_its_values_and_new_suffix_splits_the_node():
    tree = RadixTree(BS)
    tree.insert(seq(1, 2, 3), [10, 20, 30])
    assert tree.insert(seq(1, 2, 4, 5), [11, 21, 41, 51]) == 2
    assert tree.match_prefix(seq(1, 2, 4, 5)).values == [10, 20, 41, 51]
    assert tree.match_prefix(seq(1, 2, 3)).values == [10, 20, 30]
    assert tree.num_blocks == 5 and tree.num_nodes == 3
    assert sorted(len(n.values) for n in leaves(tree)) == [1, 2]
    # inserting a stored prefix adds nothing and returns its full length
    assert tree.insert(seq(1), [0]) == 1
    assert tree.num_blocks == 5 and tree.num_nodes == 4  # the split at block 1 remains


def test_insert_checks_its_arguments():
    tree = RadixTree(BS)
    with pytest.raises(ValueError, match="multiple of 4"):
        tree.insert(seq(1, tail=1), [1])
    with pytest.raises(ValueError, match="2 blocks but 1 values"):
        tree.insert(seq(1, 2), [1])
    with pytest.raises(ValueError, match="ttl"):
        tree.insert(seq(1), [1], ttl=0)
    with pytest.raises(ValueError, match="int64"):
        tree.match_prefix(["a"] * BS)
    with pytest.raises(ValueError):
        RadixTree(0)


def test_list_and_array_tokens_agree():
    tree = RadixTree(BS)
    toks = seq(3, 1, 4, 1, 5)
    tree.insert(array("q", toks), list(range(5)))
    assert tree.match_prefix(toks).values == tree.match_prefix(as_tokens(toks)).values
    a = as_tokens(toks)
    assert as_tokens(a) is a


def test_split_keeps_tail_in_the_original_node():
    tree = RadixTree(BS)
    tree.insert(seq(1, 2, 3, 4), [1, 2, 3, 4], tier="dram", holder="i0")
    (node,) = tree.root.children.values()
    head = tree.split(node, 1)
    assert head.values == [1] and node.values == [2, 3, 4]
    assert node.parent is head and head.children == {node.key: node}
    assert (head.tier, head.holder, node.tier) == ("dram", "i0", "dram")
    assert (head.tokens + node.tokens).tolist() == seq(1, 2, 3, 4)
    assert tree.match_prefix(seq(1, 2, 3, 4)).values == [1, 2, 3, 4]
    assert tree.num_blocks == 4 and tree.num_nodes == 2
    for bad in (0, 3):
        with pytest.raises(ValueError):
            tree.split(node, bad)


def test_truncate_and_remove_return_what_they_drop():
    tree = RadixTree(BS)
    tree.insert(seq(1, 2, 3), [1, 2, 3])
    tree.insert(seq(1, 2, 3, 4, 5), [1, 2, 3, 4, 5])
    tree.insert(seq(1, 2, 6), [1, 2, 6])
    top = tree.match_prefix(seq(1, 2)).nodes[-1]
    dropped = tree.truncate(top, 1)  # block 2 and everything below it
    assert dropped[0] == (top, [2])
    assert sorted(v for _, vals in dropped for v in vals) == [2, 3, 4, 5, 6]
    assert tree.match_prefix(seq(1, 2, 3)).values == [1]
    assert tree.num_blocks == 1 and tree.num_nodes == 1
    assert tree.remove(top) == [(top, [1])]
    assert tree.num_blocks == 0 and tree.num_nodes == 0
    with pytest.raises(ValueError):
        tree.remove(top)
    with pytest.raises(ValueError):
        tree.remove(tree.root)


def test_access_times_order_the_leaves():
    tree = RadixTree(BS)
    tree.insert(seq(1, 2), [1, 2], now=1)
    tree.insert(seq(1, 3), [1, 3], now=2)
    tree.insert(seq(4), [4], now=3)

    def lru() -> list[list[int]]:
        return [n.values for n in sorted(leaves(tree), key=lambda n: n.last_access)]

    assert lru() == [[2], [3], [4]]
    tree.match_prefix(seq(1, 2), now=4)
    assert lru() == [[3], [4], [2]]
    tree.match_prefix(seq(1, 3), now=5, touch=False)
    assert lru() == [[3], [4], [2]]
    shared = tree.match_prefix(seq(1)).nodes[0]
    assert shared.children and shared.last_access >= max(
        c.last_access for c in shared.children.values()
    )


def test_ttl_expires_on_lookup_and_on_expire():
    tree = RadixTree(BS)
    tree.insert(seq(1, 2), [7, 7], now=0, ttl=10)
    tree.insert(seq(5), [8], now=0, ttl=10)
    tree.insert(seq(6), [9], now=0)  # no ttl: never expires
    tree.insert(seq(1, 2), [7, 7], now=5, ttl=10)  # refresh: now expires at 15
    assert tree.match_prefix(seq(1, 2), now=12).values == [7, 7]
    assert tree.match_prefix(seq(5), now=12).values == []  # expired, removed
    assert tree.num_blocks == 3
    dropped = tree.expire(now=20)
    assert [vals for _, vals in dropped] == [[7, 7]]
    assert tree.match_prefix(seq(6), now=1e9).values == [9]
    # an expired node is replaced on insert
    tree.insert(seq(3), [1], now=0, ttl=1)
    assert tree.insert(seq(3), [2], now=5, ttl=1) == 0
    assert tree.match_prefix(seq(3), now=5).values == [2]


def test_clock_is_used_when_no_time_is_given():
    now = [100.0]
    tree = RadixTree(BS, clock=lambda: now[0])
    tree.insert(seq(1), [1], ttl=5)
    (node,) = tree.root.children.values()
    assert node.last_access == 100.0 and node.expires_at == 105.0
    now[0] = 106.0
    assert tree.match_prefix(seq(1)).values == []


def naive_match(stored: dict[tuple, int], toks: list[int]) -> list[int]:
    out = []
    for i in range(len(toks) // BS):
        key = tuple(toks[: (i + 1) * BS])
        if key not in stored:
            break
        out.append(stored[key])
    return out


@pytest.mark.parametrize("seed", range(5))
def test_random_inserts_against_a_prefix_dict(seed):
    """The tree answers like a dict of every stored block prefix (first value wins)."""
    rng = random.Random(seed)
    tree = RadixTree(BS)
    stored: dict[tuple, int] = {}
    counter = 0
    for _ in range(200):
        toks = [rng.randrange(3) for _ in range(BS * rng.randrange(0, 7))]
        if rng.random() < 0.6:
            values = list(range(counter, counter + len(toks) // BS))
            counter += len(values)
            existing = tree.insert(toks, values)
            assert existing == len(naive_match(stored, toks))
            for i, v in enumerate(values):
                stored.setdefault(tuple(toks[: (i + 1) * BS]), v)
        else:
            toks += [rng.randrange(3) for _ in range(rng.randrange(BS))]
            m = tree.match_prefix(toks)
            assert m.values == naive_match(stored, toks)
            assert m.num_tokens == len(m.values) * BS
        assert tree.num_blocks == len(stored)
    for node in tree.nodes():
        assert len(node.tokens) == len(node.values) * BS and node.values
        assert node.parent.children[node.key] is node


def test_nodes_are_of_the_given_type():
    class Node(RadixNode):
        __slots__ = ()

    tree = RadixTree(BS, node_type=Node)
    tree.insert(seq(1, 2), [1, 2])
    tree.insert(seq(1, 3), [1, 3])  # splits
    assert type(tree.root) is Node and all(type(n) is Node for n in tree.nodes())
