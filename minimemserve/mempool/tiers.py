"""MemPool's tiers: per-tier bookkeeping, the evictable counts, eviction, offload and onload.

A cached block is *pinned* when someone besides the index holds it (refcount > 1). A
cached block is evictable when it and every block below it in the index (later in its
node, and in all descendant nodes of any tier) are cached-only. Each tier keeps the count
of its evictable blocks up to date, from per-node state (see ``PoolNode``) changed only
where a call touches the index or the references of indexed blocks.
"""

from __future__ import annotations

import heapq

import torch

from minimemserve.blocks.allocator import BlockAllocator
from minimemserve.blocks.copy import move_blocks
from minimemserve.mempool.radix import Match, RadixNode, RadixTree

HBM = "hbm"
DRAM = "dram"
TIERS = (HBM, DRAM)


class PoolAccountingError(AssertionError):
    """MemPool's bookkeeping is inconsistent (raised by ``MemPool.check``)."""


class PoolNode(RadixNode):
    """A node of MemPool's index, with the state behind its tier's evictable count.

    ``run``: trailing blocks whose only reference is the index's; ``below``: children
    holding a pinned block in their subtree. ``blocked`` (this subtree holds one) and
    ``evictable`` (``run`` when ``below`` is 0) are what is counted now in the parent's
    ``below`` and in the tier's count.
    """

    __slots__ = ("run", "below", "blocked", "evictable")

    def __init__(self, *args) -> None:
        super().__init__(*args)
        self.run = len(self.values)
        self.below = 0
        self.blocked = False
        self.evictable = 0


class Tier:
    """One tier's pool tensor, allocator, indexed blocks and evictable count."""

    __slots__ = ("name", "kv", "alloc", "indexed", "node_of", "evictable")

    def __init__(self, name: str, kv: torch.Tensor, num_blocks: int) -> None:
        self.name = name
        self.kv = kv
        self.alloc = BlockAllocator(num_blocks)
        self.indexed = bytearray(num_blocks)  # 1 where the index holds a reference
        self.node_of: list[PoolNode | None] = [None] * num_blocks  # the node listing a block
        self.evictable = 0


class TierMixin:
    """MemPool's tier half: index references, evictable counts, eviction, offload, onload.

    Along every root-to-leaf path of the index, ``hbm`` nodes come first and ``dram``
    nodes after. Eviction keeps that order (it takes ``hbm`` nodes with no ``hbm`` child)
    and onload brings a path to ``hbm`` top-down.
    """

    _tiers: dict[str, Tier]
    _tree: RadixTree
    _counters: dict[str, int]
    _block_dim: int

    # -- index references and per-node state ----------------------------------------------

    def _index(self, t: Tier, node: PoolNode, incref: bool = True) -> None:
        """The index lists ``node``'s blocks (taking a reference unless the caller's is it)."""
        for b in node.values:
            t.indexed[b] = 1
            t.node_of[b] = node
        if incref:
            t.alloc.incref(node.values)

    def _unindex(self, t: Tier, values: list[int]) -> None:
        for b in values:
            t.indexed[b] = 0
            t.node_of[b] = None
        t.alloc.decref(values)

    def _restate(self, node: PoolNode) -> None:
        """Bring the tier counts and the ancestors' ``below`` in line with ``node``'s state."""
        root = self._tree.root
        while node is not root:
            ev = 0 if node.below else node.run
            if ev != node.evictable:
                self._tiers[node.tier].evictable += ev - node.evictable
                node.evictable = ev
            blocked = node.below > 0 or node.run < len(node.values)
            if blocked == node.blocked:
                return
            node.blocked = blocked
            node = node.parent
            node.below += 1 if blocked else -1

    def _settle(self, node: PoolNode, fresh: bool = False) -> None:
        """Recount ``node.run`` (from scratch when ``fresh``, else from where it ended, as
        after pins were dropped) and restate the node."""
        rc = self._tiers[node.tier].alloc.refcounts()
        values = node.values
        i = len(values) - (0 if fresh else node.run)
        while i and rc[values[i - 1]] == 1:
            i -= 1
        node.run = len(values) - i
        self._restate(node)

    def _uncount(self, node: PoolNode) -> None:
        """Take ``node`` out of its tier's count (before it changes tier or leaves)."""
        self._tiers[node.tier].evictable -= node.evictable
        node.evictable = 0

    def _hold(self, t: Tier, nodes: list[PoolNode], blocks: list[int]) -> None:
        """Take a reference on ``blocks``, the first blocks along ``nodes`` (index blocks:
        no checks), and pin them in the nodes' state."""
        t.alloc.share(blocks)
        left = len(blocks)
        for node in nodes:
            n = len(node.values)
            c = min(left, n)
            left -= c
            if node.run > n - c:
                node.run = n - c
                self._restate(node)

    def _unhold(self, t: Tier, blocks: list[int], floor: bytearray | None = None) -> None:
        """Drop a reference on each of ``blocks`` and settle the nodes that list them."""
        t.alloc.decref(blocks, floor)
        nodes = set(map(t.node_of.__getitem__, blocks))
        nodes.discard(None)
        for node in nodes:
            self._settle(node)

    def _hold_cost(self, nodes: list[PoolNode], count: int) -> int:
        """Evictable blocks that holding the first ``count`` blocks along ``nodes`` pins."""
        lost = 0
        for node in nodes:
            n = len(node.values)
            c = min(count, n)
            count -= c
            lost += node.evictable - (0 if node.below else min(node.run, n - c))
        return lost

    def _split(self, node: PoolNode, k: int) -> PoolNode:
        """``RadixTree.split`` keeping the state: returns the head (the first ``k`` blocks)."""
        head = self._tree.split(node, k)
        node_of = self._tiers[node.tier].node_of
        for b in head.values:
            node_of[b] = head
        # the head takes the node's place under its parent; the node is the head's child
        head.below, head.blocked = int(node.blocked), node.blocked
        tail = len(node.values)
        whole_tail = node.run >= tail
        head.run, node.run = (node.run - tail, tail) if whole_tail else (0, node.run)
        self._restate(node)
        self._settle(head, fresh=not whole_tail)
        return head

    def _drop(self, dropped: list[tuple[PoolNode, list[int]]]) -> int:
        """Give back the index's references on values cut from the tree; uncount the nodes
        that left it. Returns the number of values."""
        n = 0
        for node, values in dropped:
            if node.parent is None:
                self._uncount(node)
            self._unindex(self._tiers[node.tier], values)
            n += len(values)
        return n

    @staticmethod
    def _hbm_prefix(match: Match) -> tuple[list[PoolNode], list[int]]:
        """The nodes and values of a match up to its first non-hbm node."""
        nodes = match.nodes
        k = len(nodes)
        while k and nodes[k - 1].tier != HBM:
            k -= 1
        if k == len(nodes):
            return nodes, match.values
        return nodes[:k], match.values[: sum(len(n.values) for n in nodes[:k])]

    # -- eviction, offload and onload --------------------------------------------------------

    def _take(self, t: Tier, n: int, contiguous: bool) -> list[int]:
        """``n`` blocks of ``t``, evicting first if too few are free (the caller has checked
        that enough are evictable)."""
        short = n - t.alloc.num_free
        if short > 0:
            self._evict(t, short)
        return t.alloc.alloc(n, contiguous)

    def _evict(self, t: Tier, need: int) -> None:
        """Free ``need`` blocks of ``t`` by evicting cached-only blocks, LRU first."""
        dram = self._tiers.get(DRAM) if t.name == HBM else None
        if dram is not None:
            # make room in dram first, so every evicted hbm block can move there
            want = min(need, dram.alloc.num_free + dram.evictable)
            if dram.alloc.num_free < want:
                self._evict(dram, want - dram.alloc.num_free)
        root = self._tree.root
        ready = [  # children before parents, as ties in access time go
            n
            for n in reversed(list(self._tree.nodes()))
            if n.tier == t.name
            and n.evictable
            and not any(c.tier == t.name for c in n.children.values())
        ]
        heap = [(n.last_access, i, n) for i, n in enumerate(ready)]
        heapq.heapify(heap)
        seq = len(heap)
        while need > 0:
            if not heap:
                raise PoolAccountingError(f"eviction of {t.name} fell {need} blocks short")
            node = heapq.heappop(heap)[2]
            if node.parent is None or node.tier != t.name or not node.evictable:
                continue
            k = min(node.evictable, need)
            parent = node.parent
            gone = k == len(node.values)
            self._evict_tail(t, node, k, dram)
            need -= k
            if (
                gone
                and parent is not root
                and parent.tier == t.name
                and all(c.tier != t.name and not c.blocked for c in parent.children.values())
            ):
                heapq.heappush(heap, (parent.last_access, seq, parent))
                seq += 1

    def _evict_tail(self, t: Tier, node: PoolNode, k: int, dram: Tier | None) -> None:
        """Evict the last ``k`` blocks of ``node``: move them to dram when it has free
        blocks, drop the rest (with everything below them)."""
        moved = min(k, dram.alloc.num_free) if dram is not None else 0
        cut = k - moved
        if cut:
            self._counters["evicted_blocks"] += self._drop(self._tree.truncate(node, cut))
            if node.parent is not None:
                node.run -= cut
                self._restate(node)
        if not moved:
            return
        assert dram is not None
        if moved < len(node.values):
            self._split(node, len(node.values) - moved)  # node keeps the tail
        new = dram.alloc.alloc(moved, contiguous=True)
        self._move(node, t, dram, new)
        self._counters["offloaded_blocks"] += moved

    def _move(self, node: PoolNode, src: Tier, dst: Tier, new: list[int]) -> None:
        """Copy ``node``'s blocks to ``new`` blocks of ``dst``, whose fresh references
        become the index's; the old blocks lose theirs."""
        move_blocks(dst.kv, new, src.kv, node.values, self._block_dim)
        self._unindex(src, node.values)
        self._uncount(node)
        node.values = new
        node.tier = dst.name
        self._index(dst, node, incref=False)
        self._settle(node, fresh=True)

    def _onload(self, toks, now: int) -> None:
        """Bring the dram part of ``toks``' cached path to hbm, top-down, while hbm has
        room (possibly by evicting other cached blocks)."""
        hbm, dram = self._tiers[HBM], self._tiers[DRAM]
        while True:
            match = self._tree.match_prefix(toks, now=now)
            nodes, held = self._hbm_prefix(match)
            if len(held) == len(match.values):
                return
            node = match.nodes[len(nodes)]
            want = min(len(match.values) - len(held), len(node.values))
            pinned = node.values[:want]
            # pin the path so making room in hbm (and then dram) cannot evict it
            self._hold(hbm, nodes, held)
            self._hold(dram, [node], pinned)
            try:
                j = min(want, hbm.alloc.num_free + hbm.evictable)
                if j:
                    new = self._take(hbm, j, contiguous=True)
                    if j < len(node.values):
                        node = self._split(node, j)
                    self._move(node, dram, hbm, new)
                    self._counters["onloaded_blocks"] += j
            finally:
                self._unhold(hbm, held)
                self._unhold(dram, pinned)
            if j < want or not j:
                return
