"""MemPool's audit: block states per tier, and a full check of the bookkeeping.

``check`` recounts everything the pool keeps incrementally (the states of the blocks, the
index's listing of them, the evictable count of each tier) by scanning the whole tree and
every block, so tests can run it after each step of a workload.
"""

from __future__ import annotations

from typing import Any

from minimemserve.mempool.radix import RadixTree
from minimemserve.mempool.tiers import DRAM, HBM, PoolAccountingError, PoolNode, Tier


class AuditMixin:
    """MemPool's ``stats`` and ``check``."""

    _tiers: dict[str, Tier]
    _tree: RadixTree
    _counters: dict[str, int]
    block_size: int

    def stats(self) -> dict[str, Any]:
        """Per tier ``{"total", "free", "referenced", "cached_only"}``, the index size and
        the counters."""
        out: dict[str, Any] = {}
        for name, t in self._tiers.items():
            rc = t.alloc.refcounts()
            cached_only = sum(1 for b, i in enumerate(t.indexed) if i and rc[b] == 1)
            free = t.alloc.num_free
            out[name] = {
                "total": t.alloc.num_blocks,
                "free": free,
                "referenced": t.alloc.num_blocks - free - cached_only,
                "cached_only": cached_only,
            }
        out["index"] = {"blocks": self._tree.num_blocks, "nodes": self._tree.num_nodes}
        out["counters"] = dict(self._counters)
        return out

    def check(self) -> None:
        """Audit the bookkeeping; raise ``PoolAccountingError`` listing every problem."""
        errors: list[str] = []
        held = self._check_tree(errors)
        for t in self._tiers.values():
            self._check_tier(t, held[t.name], errors)
        self._check_evictable(errors)
        if errors:
            raise PoolAccountingError("MemPool accounting: " + "; ".join(errors[:20]))

    def _check_tree(self, errors: list[str]) -> dict[str, set[int]]:
        """Check the shape of the index; return the blocks it lists per tier."""
        bs = self.block_size
        held: dict[str, set[int]] = {name: set() for name in self._tiers}
        num_values = 0
        for node in self._tree.nodes():
            where = f"node {node!r}"
            if node.tier not in self._tiers:
                errors.append(f"{where} has tier {node.tier!r}")
                continue
            if not node.values or len(node.tokens) != len(node.values) * bs:
                errors.append(f"{where}: {len(node.tokens)} tokens, {len(node.values)} blocks")
            if node.key != node.tokens[:bs].tobytes():
                errors.append(f"{where}: key does not match its first block")
            parent = node.parent
            if parent is None or parent.children.get(node.key) is not node:
                errors.append(f"{where} is not its parent's child")
            elif parent.tier == DRAM and node.tier == HBM:
                errors.append(f"{where} is in hbm below a dram node")
            t = self._tiers[node.tier]
            for b in node.values:
                num_values += 1
                if not 0 <= b < t.alloc.num_blocks:
                    errors.append(f"{where} lists {node.tier} block {b}, out of range")
                    continue
                if b in held[node.tier]:
                    errors.append(f"{node.tier} block {b} is cached twice")
                if t.node_of[b] is not node:
                    errors.append(f"{node.tier} block {b} is mapped to another node")
                held[node.tier].add(b)
        if num_values != self._tree.num_blocks:
            errors.append(f"index counts {self._tree.num_blocks} blocks but lists {num_values}")
        return held

    @staticmethod
    def _check_tier(t: Tier, held: set[int], errors: list[str]) -> None:
        """Check that each block of ``t`` is in exactly one state: free, cached-only or
        referenced."""
        name, rc = t.name, t.alloc.refcounts()
        free_list = t.alloc.free_blocks()
        free_set = set(free_list)
        if len(free_set) != len(free_list):
            errors.append(f"{name}: the free list has duplicates")
        counts = {"free": 0, "cached_only": 0, "referenced": 0}
        for b in range(t.alloc.num_blocks):
            in_index = b in held
            if bool(t.indexed[b]) != in_index:
                errors.append(f"{name} block {b}: index flag {t.indexed[b]}, in tree {in_index}")
            if rc[b] < 0:
                errors.append(f"{name} block {b} has refcount {rc[b]}")
            if rc[b] == 0:
                if b not in free_set:
                    errors.append(f"{name} block {b} has no reference but is not free")
                if in_index:
                    errors.append(f"{name} block {b} is cached without a reference")
                counts["free"] += 1
                continue
            if b in free_set:
                errors.append(f"{name} block {b} is in the free list with refcount {rc[b]}")
            counts["cached_only" if in_index and rc[b] == 1 else "referenced"] += 1
            if name == DRAM and in_index and rc[b] != 1:
                errors.append(f"dram block {b} is cached and held elsewhere too")
        if sum(counts.values()) != t.alloc.num_blocks or counts["free"] != len(free_list):
            errors.append(f"{name}: states {counts} do not add up to {t.alloc.num_blocks}")

    def _check_evictable(self, errors: list[str]) -> None:
        """Recount the evictable blocks of every tier by a full scan; compare with the
        counts kept up to date."""
        whole: dict[PoolNode, bool] = {}  # the subtree holds cached-only blocks only
        count = dict.fromkeys(self._tiers, 0)
        for node in reversed(list(self._tree.nodes())):  # children before parents
            t = self._tiers.get(node.tier)
            if t is None:
                continue
            rc, values = t.alloc.refcounts(), node.values
            i = len(values)
            while i and rc[values[i - 1]] == 1:
                i -= 1
            run = len(values) - i
            kids_whole = all(whole.get(c, False) for c in node.children.values())
            whole[node] = kids_whole and run == len(values)
            if kids_whole:
                count[node.tier] += run
        for name, t in self._tiers.items():
            if t.evictable != count[name]:
                errors.append(f"{name}: {t.evictable} blocks counted evictable, {count[name]} are")
