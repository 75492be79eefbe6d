"""MemPool's state (:class:`TierStore`, which a pool composes): the tiers' bookkeeping, the
radix index, the logical clock and the counters; the evictable counts, eviction (a block
goes one tier down the chain, or out of the last), and promotion of a hit back to the top.
Plain Python: moves between tiers are booked here and copied by the pool.

A cached block is evictable when it and every block below it in the index (later in its
node, and in all descendants of any tier) are cached-only. Each tier keeps that count up
to date from per-node state."""

from __future__ import annotations

import heapq
import itertools
from array import array
from collections.abc import Callable

from minimemserve.blocks.allocator import BlockAllocator
from minimemserve.mempool.radix import Match, RadixNode, RadixTree

HBM = "hbm"  # the top of every chain: the tier the model computes from
LRU_SLACK = 1024  # stale eviction-heap entries tolerated beyond twice the node count
# match: calls, whole-block tokens asked, tokens hit; blocks newly inserted, deleted, evicted
# (dropped from the last tier that took them), offloaded (a tier down), onloaded back to the
# top by match; transfers: blocks and bytes each way, calls, blocks sent from below the top
COUNTERS = (
    "match_calls query_tokens hit_tokens inserted_blocks deleted_blocks evicted_blocks "
    "offloaded_blocks onloaded_blocks sent_blocks sent_bytes recv_blocks recv_bytes "
    "transfers_sent transfers_recv transfers_aborted dram_sent_blocks"
).split()
# per tier, one denominator (the pool's query_tokens): tokens a match found in the tier;
# blocks promoted from it to the top, demoted from it a tier down, dropped from it out of the
# chain (evicted, refused by a full write queue, or failing a checksum); bytes read, written
TIER_COUNTERS = (
    "hit_tokens promoted_blocks demoted_blocks dropped_blocks read_bytes written_bytes"
).split()


class PoolAccountingError(AssertionError):
    """MemPool's bookkeeping is inconsistent (raised by ``MemPool.check``)."""


class PoolNode(RadixNode):
    """An index node with the state behind its tier's evictable count: ``run`` trailing
    cached-only blocks, ``below`` children whose subtree holds a pinned (referenced) block;
    ``blocked`` and ``evictable`` are what the parent's ``below`` and the count include."""

    __slots__ = ("run", "below", "blocked", "evictable")

    def __init__(self, *args) -> None:
        super().__init__(*args)
        self.run = len(self.values)
        self.below = 0
        self.blocked = False
        self.evictable = 0


class Tier:
    """One tier's allocator, indexed blocks and evictable count, and ``lru``:
    a heap of ``(last access, order, node)`` holding at least one entry for every node that
    eviction may take (stale entries are checked, re-keyed or dropped when they surface)."""

    __slots__ = (
        "name",
        "rank",
        "alloc",
        "indexed",
        "node_of",
        "evictable",
        "lru",
        "order",
        "counters",
        "intake",
        "readable",
    )

    def __init__(self, name: str, num_blocks: int, rank: int = 0) -> None:
        self.name = name
        self.rank = rank  # its place in the chain, 0 at the top
        self.alloc = BlockAllocator(num_blocks)
        self.indexed = bytearray(num_blocks)  # 1 where the index holds a reference
        self.node_of: list[PoolNode | None] = [None] * num_blocks  # the node listing a block
        self.evictable = 0
        self.lru: list[tuple[int, int, PoolNode]] = []
        self.order = itertools.count()
        self.counters = dict.fromkeys(TIER_COUNTERS, 0)
        # how many of n blocks the tier's store takes now (it reserves them): a write queue
        # may refuse some, which are then dropped instead of demoted
        self.intake: Callable[[int], int] = _all
        # how many leading blocks of a node's first n are intact in the store (a disk tier
        # reads and checks them; the token path given ends at the node's last block)
        self.readable: Callable[[list[int], array], int] | None = None


class TierStore:
    """A MemPool's state and what keeps it consistent: its tiers, one ordered chain (the first
    is the one the model computes from), its index, its logical clock (one tick per call, so
    LRU order is deterministic) and its :data:`COUNTERS`; the evictable counts, eviction a tier
    down the chain (out of the last) and promotion of a hit to the top. Along every path of the
    index, tiers never rise: a node's children are in its tier or below. Eviction takes nodes
    with no child in their tier; promotion goes top-down, straight to the top (the data passes
    the tiers between). A move between tiers is booked at once and queued in ``moves`` as
    ``(dst, dst_ids, src, src_ids, path)`` (``path``: the token path through the moved blocks)
    for the pool to copy, in order, before the call returns; ``on_change`` is told what
    eviction drops from the index."""

    def __init__(self, sizes: dict[str, int], block_size: int) -> None:
        self.tiers = {name: Tier(name, n, rank) for rank, (name, n) in enumerate(sizes.items())}
        self.chain = list(self.tiers.values())
        self.top = self.chain[0]
        self.tree = RadixTree(block_size, node_type=PoolNode)
        self.block_size = block_size
        self.clock = 0
        self.counters = dict.fromkeys(COUNTERS, 0)
        self.moves: list[tuple[str, list[int], str, list[int], array]] = []
        # told (True, tokens) when tokens are newly cached, (False, path) when the subtree
        # whose token path ends with path's last block is evicted; in the order they happen
        self.on_change: Callable[[bool, array], None] | None = None

    def below(self, t: Tier) -> Tier | None:
        """The tier after ``t`` in the chain (None for the last)."""
        return self.chain[t.rank + 1] if t.rank + 1 < len(self.chain) else None

    def tick(self) -> int:
        """Advance the logical clock; return the new time."""
        self.clock += 1
        return self.clock

    def insert(self, toks: array, blocks: list[int], holder: str) -> int:
        """Index ``toks`` (whole blocks) -> ``blocks``, top-tier blocks the caller holds: the
        index takes a reference on those of the new tail and of any prefix cached lower down
        (whose blocks there it releases); a prefix cached at the top keeps its blocks. Return
        how many blocks it took."""
        bs, nb, hbm = self.block_size, len(blocks), self.top
        now = self.tick()
        match = self.tree.match_prefix(toks, now=now)
        matched = len(match.values)
        spans, pos = [], 0  # (node, first position, blocks matched in it)
        for node in match.nodes:
            c = min(len(node.values), matched - pos)
            spans.append((node, pos, c))
            pos += c
        # the index takes the caller's blocks where the prefix is lower down, and the new tail
        taken = [b for n, p, c in spans if n.tier != hbm.name for b in blocks[p : p + c]]
        taken += blocks[matched:nb]
        _check_new(hbm, taken)
        parent = self.tree.root
        for node, p, c in spans:
            if c < len(node.values):  # the match ends inside this node: cut it there
                node = self.split(node, c)
            if node.tier != hbm.name:
                self.unindex(self.tiers[node.tier], node.values)
                self.uncount(node)
                node.values, node.tier, node.holder = blocks[p : p + c], hbm.name, holder
                self.index(hbm, node, adopt=True)
            parent = node
        self.tree.insert(toks, blocks, now=now, tier=hbm.name, holder=holder)
        if matched < nb:
            new = parent.children[toks[matched * bs : (matched + 1) * bs].tobytes()]
            self.index(hbm, new, adopt=True)
        self.counters["inserted_blocks"] += len(taken)
        if matched < nb and self.on_change is not None:
            self.on_change(True, toks)
        return len(taken)

    def delete(self, toks: array) -> int:
        """``MemPool.delete``: drop the cached path of ``toks`` below its last branch."""
        match = self.tree.match_prefix(toks, touch=False)
        path, matched = match.nodes, len(match.values)
        ends_inside = sum(len(n.values) for n in path) != matched
        short = matched < len(toks) // self.block_size
        if not path or (short and (ends_inside or path[-1].children)):
            return 0
        # drop the path below its last branching node (all of it when it never branches)
        forks = [i for i in range(1, len(path)) if len(path[i - 1].children) > 1]
        cut = path[forks[-1] if forks else 0]
        parent, blocked = cut.parent, cut.blocked
        dropped = self.drop(self.tree.remove(cut))
        if blocked:
            parent.below -= 1
            self.restate(parent)
        self.candidate(parent)  # perhaps a leaf of its tier now
        self.counters["deleted_blocks"] += dropped
        return dropped

    def index(self, t: Tier, node: PoolNode, adopt: bool) -> None:
        """List ``node``'s blocks: with ``adopt`` blocks the caller holds (so pinned), which
        the index takes a reference on; else blocks whose references are the index's."""
        for b in node.values:
            t.indexed[b] = 1
            t.node_of[b] = node
        if adopt:
            t.alloc.incref(node.values)
            node.run = 0
            self.restate(node)
        else:
            self.settle(node, fresh=True)

    def unindex(self, t: Tier, values: list[int]) -> None:
        """Unlist ``values`` of tier ``t`` and drop the index's reference on each."""
        for b in values:
            t.indexed[b] = 0
            t.node_of[b] = None
        t.alloc.decref(values)

    def restate(self, node: PoolNode) -> None:
        """Bring the tier counts and the ancestors' ``below`` in line with ``node``'s state."""
        root = self.tree.root
        while node is not root:
            ev = 0 if node.below else node.run
            if ev != node.evictable:
                self.tiers[node.tier].evictable += ev - node.evictable
                node.evictable = ev
                self.candidate(node)
            blocked = node.below > 0 or node.run < len(node.values)
            if blocked == node.blocked:
                return
            node.blocked = blocked
            node = node.parent
            node.below += 1 if blocked else -1

    def settle(self, node: PoolNode, fresh: bool = False) -> None:
        """Recount ``node.run`` (all of it when ``fresh``, else past where it ended) and restate."""
        rc, values = self.tiers[node.tier].alloc.refcounts(), node.values
        i = len(values) - (0 if fresh else node.run)
        while i and rc[values[i - 1]] == 1:
            i -= 1
        node.run = len(values) - i
        self.restate(node)

    def candidate(self, node: PoolNode) -> None:
        """Give ``node`` an entry in its tier's eviction heap if it has evictable blocks (it may
        have just become a leaf of its tier, or evictable)."""
        if node.parent is not None and node.evictable:
            t = self.tiers[node.tier]
            heapq.heappush(t.lru, (node.last_access, next(t.order), node))
            if len(t.lru) > 2 * self.tree.num_nodes + LRU_SLACK:  # mostly stale: renew
                self.renew_lru(t)

    def uncount(self, node: PoolNode) -> None:
        """Take ``node`` out of its tier's count before it changes tier or leaves."""
        self.tiers[node.tier].evictable -= node.evictable
        node.evictable = 0

    def hold(self, t: Tier, nodes: list[PoolNode], blocks: list[int]) -> None:
        """Take a reference on ``blocks``, the first blocks along ``nodes``, and pin them."""
        t.alloc.share(blocks)
        left = len(blocks)
        for node in nodes:
            n = len(node.values)
            c = min(left, n)
            left -= c
            if node.run > n - c:
                node.run = n - c
                self.restate(node)

    def unhold(self, t: Tier, blocks: list[int], floor: bytearray | None = None) -> None:
        """Drop a reference on each of ``blocks`` and settle the nodes that list them."""
        t.alloc.decref(blocks, floor)
        if not self.tree.num_blocks:  # nothing indexed: no node lists them
            return
        nodes = set(map(t.node_of.__getitem__, blocks))
        nodes.discard(None)
        for node in nodes:
            self.settle(node)

    def match_room(self, toks) -> tuple[int, int, int]:
        """Cached blocks of ``toks`` at the top, then lower down, and the top's room with the
        first held."""
        match = self.tree.match_prefix(toks, touch=False)
        nodes, blocks = self.hbm_prefix(match)
        hbm, left = self.top, len(blocks)
        room = hbm.alloc.num_free + hbm.evictable
        for node in nodes:
            n = len(node.values)
            c = min(left, n)
            left -= c
            room -= node.evictable - (0 if node.below else min(node.run, n - c))
        return len(blocks), len(match.values) - len(blocks), room

    def split(self, node: PoolNode, k: int) -> PoolNode:
        """``RadixTree.split`` keeping the state: returns the head (the first ``k`` blocks)."""
        head = self.tree.split(node, k)
        node_of = self.tiers[node.tier].node_of
        for b in head.values:
            node_of[b] = head
        # the head takes the node's place under its parent; the node is the head's child
        head.below, head.blocked = int(node.blocked), node.blocked
        tail = len(node.values)
        whole_tail = node.run >= tail
        head.run, node.run = (node.run - tail, tail) if whole_tail else (0, node.run)
        self.restate(node)
        self.settle(head, fresh=not whole_tail)
        return head

    def drop(self, dropped: list[tuple[PoolNode, list[int]]]) -> int:
        """Release values cut from the tree, uncounting the nodes that left it; count them."""
        for node, values in dropped:
            if node.parent is None:
                self.uncount(node)
            self.unindex(self.tiers[node.tier], values)
        return sum(len(values) for _, values in dropped)

    def hbm_prefix(self, match: Match) -> tuple[list[PoolNode], list[int]]:
        """The nodes and values of a match up to its first node below the top tier."""
        nodes, k, top = match.nodes, len(match.nodes), self.top.name
        while k and nodes[k - 1].tier != top:
            k -= 1
        if k == len(nodes):
            return nodes, match.values
        return nodes[:k], match.values[: sum(len(n.values) for n in nodes[:k])]

    def take(self, t: Tier, n: int, contiguous: bool) -> list[int]:
        """``n`` blocks of ``t`` for a caller, evicting cached-only ones first if needed."""
        if n > t.alloc.num_free:
            self.evict(t, n - t.alloc.num_free)
        return t.alloc.alloc(n, contiguous)

    def evict(self, t: Tier, need: int) -> None:
        """Free ``need`` blocks of ``t``: cached-only ones, LRU first, each a tier down the
        chain while the tier below has room (which it makes first), else dropped."""
        lower = self.below(t)
        if lower is not None and lower.alloc.num_free < need and lower.evictable:  # room first
            self.evict(lower, min(need - lower.alloc.num_free, lower.evictable))
        name, heap = t.name, t.lru
        renewed = False
        while need > 0:
            if not heap:
                if renewed:
                    raise PoolAccountingError(f"eviction of {name} fell {need} blocks short")
                self.renew_lru(t)
                renewed = True
                continue
            key, _, node = heapq.heappop(heap)
            if node.parent is None or node.tier != name or not node.evictable:
                continue  # gone, moved or pinned: it gets a new entry if that changes
            if any(c.tier == name for c in node.children.values()):
                continue  # not a leaf of its tier: one comes when its last such child goes
            if key != node.last_access:  # touched since: back in at its access time
                heapq.heappush(heap, (node.last_access, next(t.order), node))
                continue
            k, parent = min(node.evictable, need), node.parent
            gone = k == len(node.values)
            self.evict_tail(t, node, k, lower)
            need -= k
            if gone:
                self.candidate(parent)  # perhaps a leaf of its tier now

    def renew_lru(self, t: Tier) -> None:
        """Rebuild ``t``'s eviction heap from a walk of the index: every node of the tier with
        evictable blocks (which includes all its evictable leaves)."""
        t.lru[:] = [  # in place: an eviction in progress holds the list
            (n.last_access, next(t.order), n)
            for n in self.tree.nodes()
            if n.tier == t.name and n.evictable
        ]
        heapq.heapify(t.lru)

    def evict_tail(self, t: Tier, node: PoolNode, k: int, lower: Tier | None) -> None:
        """Evict ``node``'s last ``k`` blocks: to the tier ``lower`` as far as it has free blocks
        and its store takes them, the rest dropped."""
        moved = min(k, lower.alloc.num_free) if lower is not None else 0
        if moved and t.readable is not None:  # what goes down is read first: damaged, dropped
            end = len(node.values) - (k - moved)
            moved = t.readable(node.values[end - moved : end], self.path_to(node, end))
        moved = lower.intake(moved) if moved else 0
        cut = k - moved
        if cut:
            self.cut(t, node, cut)
            self.counters["evicted_blocks"] += cut
        if moved:
            if moved < len(node.values):
                self.split(node, len(node.values) - moved)  # node keeps the tail
            self.move(node, t, lower, lower.alloc.alloc(moved, contiguous=True))
            self.counters["offloaded_blocks"] += moved
            t.counters["demoted_blocks"] += moved

    def cut(self, t: Tier, node: PoolNode, cut: int) -> None:
        """Drop ``node``'s last ``cut`` blocks and everything below them (all cached-only):
        ``on_change`` hears of it, ``dropped_blocks`` counts it in each block's tier."""
        if self.on_change is not None:  # the token path through the first dropped block
            self.on_change(False, self.path_to(node, len(node.values) - cut + 1))
        parent = node.parent
        dropped = self.tree.truncate(node, cut)
        for gone, values in dropped:
            self.tiers[gone.tier].counters["dropped_blocks"] += len(values)
        self.drop(dropped)
        if node.parent is not None:
            self.settle(node, fresh=True)
        else:
            self.candidate(parent)  # perhaps a leaf of its tier now

    def path_to(self, node: PoolNode, k: int) -> array:
        """The token path from the root through ``node``'s first ``k`` blocks."""
        path, up = node.tokens[: k * self.block_size], node.parent
        while up is not None and up is not self.tree.root:
            path, up = up.tokens + path, up.parent
        return path

    def move(self, node: PoolNode, src: Tier, dst: Tier, new: list[int]) -> None:
        """Move ``node``'s blocks to ``new`` blocks of ``dst``; the index's references go along."""
        path = self.path_to(node, len(node.values))
        self.moves.append((dst.name, new, src.name, list(node.values), path))
        self.unindex(src, node.values)
        self.uncount(node)
        node.values, node.tier = new, dst.name
        self.index(dst, node, adopt=False)

    def onload(self, toks, now: int) -> None:
        """Bring the part of ``toks``' cached path below the top to the top, node by node
        top-down, as far as the top has room. What may come up is checked first by stores
        that read their blocks back (a damaged block is dropped with everything below it),
        then pinned with the path above it, so that making room (which demotes, and may drop,
        blocks down the chain) cannot take it."""
        hbm = self.top
        match = self.tree.match_prefix(toks, now=now)
        nodes, held = self.hbm_prefix(match)
        if len(held) == len(match.values):
            return
        self.hold(hbm, nodes, held)
        pins: list[tuple[Tier, list[int]]] = [(hbm, held)]  # released when done
        try:
            rising = self.rising(match, len(nodes), hbm.alloc.num_free + hbm.evictable)
            lower = [(self.tiers[node.tier], blocks) for node, blocks in rising]
            for node, blocks in rising:
                self.hold(self.tiers[node.tier], [node], blocks)
            pins += lower
            for src, blocks in lower:
                j = min(len(blocks), hbm.alloc.num_free + hbm.evictable)
                if not j:
                    return
                new = self.take(hbm, j, contiguous=True)
                # making room may have split the node (its unpinned tail went down): the
                # pinned blocks lead the node that lists them now
                node = src.node_of[blocks[0]]
                if j < len(node.values):
                    node = self.split(node, j)
                self.move(node, src, hbm, new)
                self.hold(hbm, [node], new)
                pins.append((hbm, new))
                self.counters["onloaded_blocks"] += j
                src.counters["promoted_blocks"] += j
                if j < len(blocks):
                    return
        finally:
            for t, blocks in pins:
                self.unhold(t, blocks)

    def rising(self, match: Match, first: int, room: int) -> list[tuple[PoolNode, list[int]]]:
        """The nodes of ``match`` from its ``first`` below the top, with the blocks of each that
        may come up (``room`` in all), each checked by its store when it reads blocks back: the
        first damaged block is dropped with everything below it, and ends the list."""
        out, pos = [], sum(len(n.values) for n in match.nodes[:first])
        for node in match.nodes[first:]:
            c = min(len(node.values), len(match.values) - pos, room)
            if c <= 0:
                break
            pos, room = pos + c, room - c
            t = self.tiers[node.tier]
            good = c if t.readable is None else t.readable(node.values[:c], self.path_to(node, c))
            if good < c:
                self.cut(t, node, len(node.values) - good)
            if good:
                out.append((node, node.values[:good]))
            if good < c:
                break
        return out

    def restore(self, tier: str, toks: array, blocks: list[int], holder: str) -> None:
        """Index ``toks`` -> ``blocks`` of ``tier`` found in its store at start (a disk tier's
        files): the path's blocks already indexed keep theirs, the rest are taken from the
        tier's free blocks, the index's references alone."""
        t, bs = self.tiers[tier], self.block_size
        match = self.tree.match_prefix(toks, touch=False)
        matched = len(match.values)
        if matched == len(blocks):
            return
        if match.nodes:
            last, ends = match.nodes[-1], sum(len(n.values) for n in match.nodes)
            if ends > matched:  # the match ends inside this node: cut it there
                self.split(last, len(last.values) - (ends - matched))
        self.tree.insert(toks, blocks, now=self.tick(), tier=tier, holder=holder)
        parent = self.tree.match_prefix(toks[: matched * bs], touch=False).nodes
        up = parent[-1] if parent else self.tree.root
        new = up.children[toks[matched * bs : (matched + 1) * bs].tobytes()]
        t.alloc.take(new.values)
        self.index(t, new, adopt=False)


def _all(n: int) -> int:
    """A store that takes every block it is given."""
    return n


def _check_new(hbm: Tier, taken: list[int]) -> None:
    """Blocks the index is about to take: distinct, and cached nowhere yet."""
    if len(set(taken)) != len(taken):
        raise ValueError("insert got the same block id twice")
    for b in taken:
        if hbm.indexed[b]:
            raise ValueError(f"block {b} is already cached under another prefix")
