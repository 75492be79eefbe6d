"""The audit of a pool's bookkeeping: a full scan that checks every block is in exactly one
state (free, cached-only, referenced) and the index, counts and heaps agree with them."""

from __future__ import annotations

from .radix import RadixTree
from .tiers import PoolNode, Tier


def audit(tiers: dict[str, Tier], tree: RadixTree, block_size: int) -> list[str]:
    """Everything wrong with a pool's bookkeeping, by a full scan of its ``tiers`` and its
    index ``tree``: the index's shape, each block in exactly one state, the evictable counts
    and the eviction heaps. Empty when it balances."""
    errors: list[str] = []
    held = _check_tree(tiers, tree, block_size, errors)
    count = dict.fromkeys(tiers, 0)  # evictable blocks, recounted
    whole: dict[PoolNode, bool] = {}  # the subtree holds cached-only blocks only
    for node in reversed(list(tree.nodes())):  # children before parents
        if (t := tiers.get(node.tier)) is None:
            continue
        rc, values = t.alloc.refcounts(), node.values
        i = len(values)
        while i and rc[values[i - 1]] == 1:
            i -= 1
        kids_whole = all(whole.get(c, False) for c in node.children.values())
        whole[node] = kids_whole and i == 0
        count[node.tier] += (len(values) - i) if kids_whole else 0
    for name, t in tiers.items():
        _check_tier(t, held[name], errors)
        if t.evictable != count[name]:
            errors.append(f"{name}: {t.evictable} blocks counted evictable, {count[name]} are")
        queued = {id(n) for *_, n in t.lru}
        for node in tree.nodes():  # eviction must find every leaf it may take
            leaf = all(c.tier != name for c in node.children.values())
            if node.tier == name and node.evictable and leaf and id(node) not in queued:
                errors.append(f"{name}: an evictable leaf is missing from the LRU heap")
                break
    return errors


def _check_tree(
    tiers: dict[str, Tier], tree: RadixTree, bs: int, errors: list[str]
) -> dict[str, set[int]]:
    """Check the shape of the index; return the blocks it lists per tier."""
    held: dict[str, set[int]] = {name: set() for name in tiers}
    num_values = 0
    for node in tree.nodes():
        where, tier, parent = f"node {node!r}", node.tier, node.parent
        if tier not in tiers:
            errors.append(f"{where} has tier {tier!r}")
            continue
        if not node.values or len(node.tokens) != len(node.values) * bs:
            errors.append(f"{where}: {len(node.tokens)} tokens, {len(node.values)} blocks")
        if node.key != node.tokens[:bs].tobytes():
            errors.append(f"{where}: key does not match its first block")
        if parent is None or parent.children.get(node.key) is not node:
            errors.append(f"{where} is not its parent's child")
        elif parent.tier in tiers and tiers[parent.tier].rank > tiers[tier].rank:
            errors.append(f"{where} is in {tier} below a {parent.tier} node")
        num_values += len(node.values)
        _check_node_blocks(tiers[tier], node, held[tier], errors)
    if num_values != tree.num_blocks:
        errors.append(f"index counts {tree.num_blocks} blocks but lists {num_values}")
    return held


def _check_node_blocks(t: Tier, node: PoolNode, held: set[int], errors: list[str]) -> None:
    """Check the blocks one index node lists against its tier; adds them to ``held``."""
    for b in node.values:
        if not 0 <= b < t.alloc.num_blocks:
            errors.append(f"node {node!r} lists {node.tier} block {b}, out of range")
            continue
        if b in held:
            errors.append(f"{node.tier} block {b} is cached twice")
        if t.node_of[b] is not node:
            errors.append(f"{node.tier} block {b} is mapped to another node")
        held.add(b)


def _check_tier(t: Tier, held: set[int], errors: list[str]) -> None:
    """Check that each block of ``t`` is in one state: free, cached-only or referenced."""
    name, rc = t.name, t.alloc.refcounts()
    free_list = t.alloc.free_blocks()  # each free block once, in queue order
    free = set(free_list)
    counts = {"free": 0, "cached_only": 0, "referenced": 0}
    for b in range(t.alloc.num_blocks):
        r, cached, listed = rc[b], b in held, b in free
        if t.indexed[b] != cached:
            errors.append(f"{name} block {b}: index flag {t.indexed[b]}, in tree {cached}")
        if r < 0 or (r == 0) != listed:
            where = "in" if listed else "not in"
            errors.append(f"{name} block {b} has refcount {r} and is {where} the free list")
        if cached and r == 0:
            errors.append(f"{name} block {b} is cached without a reference")
        elif cached and r > 1 and t.rank:
            errors.append(f"{name} block {b} is cached and held elsewhere too")
        counts["free" if r == 0 else "cached_only" if cached and r == 1 else "referenced"] += 1
    if sum(counts.values()) != t.alloc.num_blocks or counts["free"] != len(free_list):
        errors.append(f"{name}: states {counts} do not add up to {t.alloc.num_blocks}")


def tier_states(tiers: dict[str, Tier]) -> dict[str, dict[str, int]]:
    """Per tier, blocks in each state: ``{"total", "free", "referenced", "cached_only"}``."""
    out = {}
    for name, t in tiers.items():
        rc, total, free = t.alloc.refcounts(), t.alloc.num_blocks, t.alloc.num_free
        cached_only = sum(1 for b, i in enumerate(t.indexed) if i and rc[b] == 1)
        referenced = total - free - cached_only
        out[name] = dict(total=total, free=free, referenced=referenced, cached_only=cached_only)
    return out


def tree_counts(tree: RadixTree) -> dict[str, dict[str, int]]:
    """The index's size: ``{"index": {"blocks", "nodes"}}``."""
    return {"index": {"blocks": tree.num_blocks, "nodes": tree.num_nodes}}
