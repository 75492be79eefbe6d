"""MemPool: the one allocator of KV memory, its tiers and its radix index.

A pool has an ``hbm`` tier (a pool tensor on the compute device) and optionally a
``dram`` tier (a host tensor, pinned when CUDA is present). Each tier has its own
``BlockAllocator``. The radix index maps token prefixes to cached blocks and holds
exactly one reference on each block it lists. Every block of a tier is in one of three
states:

- free: no reference;
- cached-only: its only reference is the index's (evictable);
- referenced: someone other than the index holds it.

Caching and disaggregation recipes are sequences of calls on this class. Bookkeeping is
plain Python; torch only moves data. A pool is not thread-safe: one owner calls it.

Tier layout of the index: along every root-to-leaf path, ``hbm`` nodes come first and
``dram`` nodes after. Eviction keeps that order (it takes ``hbm`` nodes with no ``hbm``
child), ``match`` onloads a path top-down, and ``insert`` moves a ``dram`` prefix back
to the caller's ``hbm`` blocks.
"""

from __future__ import annotations

import heapq
from collections.abc import Callable, Sequence
from typing import Any

import torch

from minimemserve.blocks.allocator import BlockAllocator
from minimemserve.blocks.copy import check_packed, check_pool_tensor, move_blocks
from minimemserve.blocks.layout import KVLayout
from minimemserve.errors import ConfigError, PoolExhausted
from minimemserve.mempool.radix import RadixNode, RadixTree, as_tokens

HBM = "hbm"
DRAM = "dram"
TIERS = (HBM, DRAM)

COUNTERS = (
    "match_calls",
    "query_tokens",  # whole-block tokens asked of match
    "hit_tokens",  # tokens match returned from the cache
    "inserted_blocks",  # blocks newly indexed by insert
    "deleted_blocks",  # blocks dropped from the index by delete
    "evicted_blocks",  # cached blocks dropped to make room
    "offloaded_blocks",  # cached hbm blocks moved to dram to make room
    "onloaded_blocks",  # cached dram blocks brought back to hbm by match
    "swapped_blocks",
    "sent_blocks",
    "sent_bytes",
    "recv_blocks",
    "recv_bytes",
    "transfers_sent",
    "transfers_recv",
    "transfers_aborted",
)


# makes one zero-filled pool tensor: (shape, dtype, device) -> tensor
TensorFactory = Callable[[tuple[int, ...], torch.dtype, torch.device], torch.Tensor]


class PoolAccountingError(AssertionError):
    """MemPool's bookkeeping is inconsistent (raised by ``MemPool.check``)."""


class _Tier:
    """One tier's pool tensor, allocator and the blocks the index holds."""

    __slots__ = ("name", "kv", "alloc", "indexed")

    def __init__(self, name: str, kv: torch.Tensor, num_blocks: int) -> None:
        self.name = name
        self.kv = kv
        self.alloc = BlockAllocator(num_blocks)
        self.indexed = bytearray(num_blocks)  # 1 where the index holds a reference


class MemPool:
    """Elastic KV memory pool of one instance: tiers, refcounted blocks, a radix index.

    Block ids are per tier. Every call that hands out blocks (``alloc_mem``, ``match``,
    ``swap``, ``transfer*``) gives the caller one reference per block, released with
    ``free_mem``. ``insert`` never consumes the caller's references.
    """

    def __init__(
        self,
        layout: KVLayout,
        num_blocks: int,
        *,
        dram_blocks: int = 0,
        device: str | torch.device = "cpu",
        dtype: torch.dtype = torch.float32,
        instance_id: str = "0",
        pin_memory: bool | None = None,
        tensor_factory: TensorFactory | None = None,
    ) -> None:
        """Allocate the pool tensors (zero-filled) and the bookkeeping.

        ``tensor_factory(shape, dtype, device)``, when given, makes every tier's tensor
        (for instance in shared memory) instead of ``torch.zeros``; it then decides about
        pinning too.
        """
        if not isinstance(layout, KVLayout):
            raise TypeError(f"layout must be a KVLayout, got {type(layout).__name__}")
        for name, value, least in (("num_blocks", num_blocks, 1), ("dram_blocks", dram_blocks, 0)):
            if not isinstance(value, int) or isinstance(value, bool) or value < least:
                raise ConfigError(f"{name} must be an int >= {least}, got {value!r}")
        self.layout = layout
        self.block_size = layout.block_size
        self.device = torch.device(device)
        self.dtype = dtype
        self.instance_id = str(instance_id)
        self._block_dim = layout.block_dim
        cuda = torch.cuda.is_available()
        pin = cuda if pin_memory is None else bool(pin_memory)
        if pin and not cuda:
            raise ConfigError("pin_memory=True needs CUDA, which is not available")
        host = torch.device("cpu")
        if tensor_factory is None:
            hbm_kv = torch.zeros(layout.pool_shape(num_blocks), dtype=dtype, device=self.device)
        else:
            hbm_kv = tensor_factory(layout.pool_shape(num_blocks), dtype, self.device)
        self._tiers: dict[str, _Tier] = {HBM: _Tier(HBM, hbm_kv, num_blocks)}
        if dram_blocks:
            shape = layout.pool_shape(dram_blocks)
            if tensor_factory is None:
                dram_kv = torch.zeros(shape, dtype=dtype, device=host, pin_memory=pin)
            else:
                dram_kv = tensor_factory(shape, dtype, host)
            self._tiers[DRAM] = _Tier(DRAM, dram_kv, dram_blocks)
        self._tree = RadixTree(self.block_size)
        self._clock = 0  # logical time: one tick per call, so LRU order is deterministic
        self._version = 0  # bumped whenever the evictable counts may change
        self._evictable_cache: dict[str, tuple[int, int]] = {}
        self._counters = dict.fromkeys(COUNTERS, 0)

    @classmethod
    def from_budget(
        cls, layout: KVLayout, hbm_bytes: int, dram_bytes: int = 0, **kw: Any
    ) -> MemPool:
        """A pool holding as many whole blocks as ``hbm_bytes`` (and ``dram_bytes``) allow."""
        dtype = kw.get("dtype", torch.float32)
        block_bytes = layout.block_bytes(torch.empty((), dtype=dtype).element_size())
        num_blocks = hbm_bytes // block_bytes
        if num_blocks < 1:
            raise ConfigError(
                f"an hbm budget of {hbm_bytes} bytes holds no block of {block_bytes} bytes"
            )
        return cls(layout, num_blocks, dram_blocks=max(0, dram_bytes) // block_bytes, **kw)

    # -- tiers -------------------------------------------------------------------------

    @property
    def tiers(self) -> tuple[str, ...]:
        """Names of the tiers this pool has."""
        return tuple(self._tiers)

    @property
    def index(self) -> RadixTree:
        """The radix index (read it; change it only through the pool)."""
        return self._tree

    def kv(self, tier: str = HBM) -> torch.Tensor:
        """The pool tensor of ``tier``, shaped ``layout.pool_shape(capacity(tier))``."""
        return self._tier(tier).kv

    def capacity(self, tier: str = HBM) -> int:
        """Total blocks of ``tier``."""
        return self._tier(tier).alloc.num_blocks

    def num_free(self, tier: str = HBM) -> int:
        """Blocks of ``tier`` with no reference."""
        return self._tier(tier).alloc.num_free

    def num_available(self, tier: str = HBM) -> int:
        """Blocks ``alloc_mem`` can provide now: free plus evictable cached-only blocks."""
        t = self._tier(tier)
        return t.alloc.num_free + self._evictable(t)

    def refcount(self, block: int, tier: str = HBM) -> int:
        """References on ``block`` (the index's included)."""
        return self._tier(tier).alloc.refcount(block)

    def is_cached(self, block: int, tier: str = HBM) -> bool:
        """Whether the index holds ``block``."""
        t = self._tier(tier)
        t.alloc.check_id(block)
        return bool(t.indexed[block])

    def _tier(self, tier: str) -> _Tier:
        t = self._tiers.get(tier)
        if t is None:
            if tier in TIERS:
                raise ValueError(f"this pool has no {tier!r} tier (dram_blocks=0)")
            raise ValueError(f"unknown tier {tier!r}; tiers are {TIERS}")
        return t

    def _tick(self) -> int:
        self._clock += 1
        return self._clock

    # -- allocation --------------------------------------------------------------------

    def alloc_mem(self, n: int, tier: str = HBM, contiguous: bool = False) -> list[int]:
        """``n`` blocks of ``tier`` with one reference each, held by the caller.

        Evicts cached-only blocks, least recently used leaves first, when too few are
        free; an evicted hbm block moves to dram when there is a dram tier with room (or
        room it can make by evicting). Raises ``PoolExhausted`` without changing
        anything when free plus evictable blocks fall short. ``contiguous`` asks for one
        ascending run of ids when the free blocks hold one (data then lands in one piece).
        """
        t = self._tier(tier)
        if not isinstance(n, int) or isinstance(n, bool) or n < 0:
            raise ValueError(f"block count must be a non-negative int, got {n!r}")
        short = n - t.alloc.num_free
        if short > 0:
            evictable = self._evictable(t)
            if evictable < short:
                total = t.alloc.num_blocks
                raise PoolExhausted(
                    f"instance {self.instance_id}: asked for {n} {tier} blocks but only "
                    f"{t.alloc.num_free} are free and {evictable} cached blocks are evictable "
                    f"({total} in total, {total - t.alloc.num_free - evictable} in use)"
                )
            self._evict(t, short)
        return t.alloc.alloc(n, contiguous)

    def free_mem(self, blocks: Sequence[int], tier: str = HBM) -> None:
        """Drop one of the caller's references on each block.

        The index's own reference on a cached block is not the caller's: freeing it is an
        error, like a double free.
        """
        t = self._tier(tier)
        blocks = list(blocks)
        t.alloc.decref(blocks, floor=t.indexed)
        if any(map(t.indexed.__getitem__, blocks)):
            self._version += 1  # a cached block may have become evictable

    # -- the index ---------------------------------------------------------------------

    def insert(self, tokens: Sequence[int], blocks: Sequence[int]) -> int:
        """Index the whole blocks of ``tokens``; ``blocks[i]`` holds tokens ``[i*bs, (i+1)*bs)``.

        The index takes its own reference on each block it adds. Where a prefix is
        already cached in hbm it keeps its blocks and the caller's duplicates are not
        taken; a prefix cached only in dram is replaced by the caller's hbm blocks. The
        caller keeps its references and frees them as usual. Returns how many blocks were
        newly indexed.
        """
        toks = as_tokens(tokens)
        bs = self.block_size
        nb = len(toks) // bs
        blocks = list(blocks)
        if len(blocks) < nb:
            raise ValueError(f"{len(toks)} tokens fill {nb} blocks but {len(blocks)} were given")
        hbm = self._tiers[HBM]
        rc, indexed, capacity = hbm.alloc.refcounts(), hbm.indexed, hbm.alloc.num_blocks
        for b in blocks[:nb]:
            if type(b) is not int or not 0 <= b < capacity:
                hbm.alloc.check_id(b)
            if rc[b] - indexed[b] < 1:
                raise ValueError(f"block {b} is not held by the caller (refcount {rc[b]})")
        if nb == 0:
            return 0
        if len(toks) != nb * bs:
            toks = toks[: nb * bs]
        now = self._tick()
        match = self._tree.match_prefix(toks, now=now)
        matched = len(match.values)
        # blocks the index will take from the caller: dram-cached positions and the new tail
        spans = []
        pos = 0
        for node in match.nodes:
            c = min(len(node.values), matched - pos)
            if node.tier != HBM:
                spans.append((node, pos, c))
            pos += c
        taken = [b for _, p, c in spans for b in blocks[p : p + c]] + blocks[matched:nb]
        if len(set(taken)) != len(taken):
            raise ValueError("insert got the same block id twice")
        if any(map(indexed.__getitem__, taken)):
            b = next(b for b in taken if indexed[b])
            raise ValueError(f"block {b} is already cached under another prefix")
        dram = self._tiers.get(DRAM)
        for node, p, c in spans:
            if c < len(node.values):
                node = self._tree.split(node, c)
            assert dram is not None and node.tier == DRAM
            self._index_drop(dram, node.values)
            node.values = blocks[p : p + c]
            node.tier = HBM
            node.holder = self.instance_id
            self._index_add(hbm, node.values)
        existing = self._tree.insert(toks, blocks[:nb], now=now, tier=HBM, holder=self.instance_id)
        assert existing == matched, (existing, matched)
        self._index_add(hbm, blocks[matched:nb])
        added = len(taken)
        self._counters["inserted_blocks"] += added
        return added

    def match(self, tokens: Sequence[int]) -> list[int]:
        """Longest cached prefix of ``tokens`` in whole blocks, as hbm block ids.

        The caller holds one new reference on each returned block. Cached blocks in dram
        are onloaded first while hbm has room; the match ends at the first block that
        cannot be brought to hbm.
        """
        toks = as_tokens(tokens)
        now = self._tick()
        match = self._tree.match_prefix(toks, now=now)
        if DRAM in self._tiers and any(n.tier != HBM for n in match.nodes):
            self._onload(toks, now)
            match = self._tree.match_prefix(toks, now=now)
        blocks = self._hbm_prefix(match.nodes, len(match.values))
        hbm = self._tiers[HBM]
        if blocks:
            hbm.alloc.incref(blocks)
            self._version += 1
        c = self._counters
        c["match_calls"] += 1
        c["query_tokens"] += len(toks) - len(toks) % self.block_size
        c["hit_tokens"] += len(blocks) * self.block_size
        return blocks

    def cached_prefix_len(self, tokens: Sequence[int]) -> int:
        """Tokens ``match(tokens)`` would return now, taking no references."""
        in_hbm, in_dram, room = self._match_room(as_tokens(tokens))
        return (in_hbm + min(in_dram, room)) * self.block_size

    def _match_room(self, toks) -> tuple[int, int, int]:
        """For a match of ``toks`` now: cached blocks in hbm (a prefix), cached blocks in
        dram after them, and hbm blocks that can be made available with that prefix held."""
        match = self._tree.match_prefix(toks, touch=False)
        hbm_blocks = self._hbm_prefix(match.nodes, len(match.values))
        in_dram = len(match.values) - len(hbm_blocks)
        if not hbm_blocks:
            return 0, in_dram, self.num_available(HBM)
        hbm = self._tiers[HBM]
        # a match pins the hbm part of the path before it makes room for the dram part
        hbm.alloc.incref(hbm_blocks)
        self._version += 1
        try:
            room = self.num_available(HBM)
        finally:
            hbm.alloc.decref(hbm_blocks)
            self._version += 1
        return len(hbm_blocks), in_dram, room

    def delete(self, tokens: Sequence[int]) -> int:
        """Drop the cached entries of ``tokens`` that no other cached sequence shares.

        That is the path's suffix below its last branching node, together with every
        cached extension of ``tokens``. If ``tokens`` is cached only in part and the
        cached part continues with other tokens, all of it is shared and nothing is
        dropped. The index records no sequence ends, so a shorter sequence cached inside
        the dropped suffix goes too. Blocks free once nobody else holds them. Returns the
        number of blocks dropped from the index.
        """
        toks = as_tokens(tokens)
        bs = self.block_size
        nb = len(toks) // bs
        match = self._tree.match_prefix(toks, touch=False)
        if not match.nodes:
            return 0
        matched = len(match.values)
        path = match.nodes
        last_whole = sum(len(n.values) for n in path) == matched
        if matched < nb and (not last_whole or path[-1].children):
            return 0
        cut = path[0]
        for i in range(len(path) - 1, 0, -1):
            if len(path[i - 1].children) > 1:
                cut = path[i]
                break
        dropped = self._release(self._tree.remove(cut))
        self._counters["deleted_blocks"] += dropped
        return dropped

    def _hbm_prefix(self, nodes: list[RadixNode], matched: int) -> list[int]:
        """Values of the matched path up to its first non-hbm node."""
        out: list[int] = []
        for node in nodes:
            if node.tier != HBM:
                break
            out += node.values[: matched - len(out)]
        return out

    def _index_add(self, t: _Tier, blocks: list[int]) -> None:
        for b in blocks:
            t.indexed[b] = 1
        t.alloc.incref(blocks)
        self._version += 1

    def _index_drop(self, t: _Tier, blocks: list[int]) -> None:
        for b in blocks:
            t.indexed[b] = 0
        t.alloc.decref(blocks)
        self._version += 1

    def _release(self, dropped: list[tuple[RadixNode, list[int]]]) -> int:
        """Give back the index's references on values removed from the tree."""
        n = 0
        for node, values in dropped:
            self._index_drop(self._tiers[node.tier], values)
            n += len(values)
        return n

    # -- eviction, offload and onload --------------------------------------------------

    def _tail_run(self, node: RadixNode) -> int:
        """Trailing blocks of ``node`` whose only reference is the index's."""
        rc = self._tiers[node.tier].alloc.refcounts()
        values = node.values
        i = len(values)
        while i and rc[values[i - 1]] == 1:
            i -= 1
        return len(values) - i

    def _scan(self, t: _Tier) -> tuple[int, list[RadixNode], dict[RadixNode, bool]]:
        """Evictable blocks of tier ``t``, the nodes evictable now, and which subtrees
        hold only cached-only blocks.

        A block is evictable when it and everything below it are cached-only; the nodes
        evictable now are those of tier ``t`` with such a tail and no child of tier ``t``.
        """
        whole: dict[RadixNode, bool] = {}
        count = 0
        ready = []
        for node in reversed(list(self._tree.nodes())):  # children before parents
            kids = node.children.values()
            kids_whole = all(whole[c] for c in kids)
            run = self._tail_run(node)
            whole[node] = kids_whole and run == len(node.values)
            if node.tier == t.name and kids_whole and run:
                count += run
                if not any(c.tier == t.name for c in kids):
                    ready.append(node)
        return count, ready, whole

    def _evictable(self, t: _Tier) -> int:
        cached = self._evictable_cache.get(t.name)
        if cached is not None and cached[0] == self._version:
            return cached[1]
        count = self._scan(t)[0]
        self._evictable_cache[t.name] = (self._version, count)
        return count

    def _evict(self, t: _Tier, need: int) -> None:
        """Free ``need`` blocks of ``t`` by evicting cached-only blocks, LRU first.

        The caller has checked that enough are evictable.
        """
        dram = self._tiers.get(DRAM) if t.name == HBM else None
        if dram is not None:
            # make room in dram first, so every evicted hbm block can move there
            want = min(need, dram.alloc.num_free + self._evictable(dram))
            if dram.alloc.num_free < want:
                self._evict(dram, want - dram.alloc.num_free)
        _, ready, whole = self._scan(t)
        heap = [(n.last_access, i, n) for i, n in enumerate(ready)]
        heapq.heapify(heap)
        seq = len(heap)
        while need > 0:
            if not heap:
                raise PoolAccountingError(f"eviction of {t.name} fell {need} blocks short")
            _, _, node = heapq.heappop(heap)
            if node.parent is None or node.tier != t.name:
                continue
            run = self._tail_run(node)
            if not run:
                continue
            k = min(run, need)
            parent = node.parent
            gone = k == len(node.values)
            self._evict_tail(t, node, k, dram)
            need -= k
            if (
                gone
                and parent is not self._tree.root
                and parent.tier == t.name
                and all(c.tier != t.name and whole.get(c, True) for c in parent.children.values())
            ):
                heapq.heappush(heap, (parent.last_access, seq, parent))
                seq += 1
        self._evictable_cache.pop(t.name, None)

    def _evict_tail(self, t: _Tier, node: RadixNode, k: int, dram: _Tier | None) -> None:
        """Evict the last ``k`` blocks of ``node``: move them to dram when it has free
        blocks, drop the rest (with everything below them)."""
        moved = min(k, dram.alloc.num_free) if dram is not None else 0
        if k > moved:
            self._counters["evicted_blocks"] += self._release(self._tree.truncate(node, k - moved))
        if not moved:
            return
        assert dram is not None
        if moved < len(node.values):
            self._tree.split(node, len(node.values) - moved)  # node keeps the tail
        new = dram.alloc.alloc(moved, contiguous=True)
        self._copy(t, node.values, dram, new)
        self._index_drop(t, node.values)
        node.values = new
        node.tier = DRAM
        for b in new:  # the fresh reference is the index's
            dram.indexed[b] = 1
        self._version += 1
        self._counters["offloaded_blocks"] += moved

    def _onload(self, toks, now: int) -> None:
        """Bring the dram part of ``toks``' cached path to hbm, top-down, while hbm has
        room (possibly by evicting other cached blocks)."""
        hbm, dram = self._tiers[HBM], self._tiers[DRAM]
        while True:
            match = self._tree.match_prefix(toks, now=now)
            pinned_hbm = self._hbm_prefix(match.nodes, len(match.values))
            if len(pinned_hbm) == len(match.values):
                return
            node = next(n for n in match.nodes if n.tier != HBM)
            want = min(len(match.values) - len(pinned_hbm), len(node.values))
            pinned_dram = list(node.values[:want])
            # pin the path so making room in hbm (and then dram) cannot evict it
            hbm.alloc.incref(pinned_hbm)
            dram.alloc.incref(pinned_dram)
            self._version += 1
            try:
                j = min(want, hbm.alloc.num_free + self._evictable(hbm))
                if j:
                    new = self.alloc_mem(j, HBM, contiguous=True)  # references: the index's
                    if j < len(node.values):
                        node = self._tree.split(node, j)
                    old = node.values
                    self._copy(dram, old, hbm, new)
                    self._index_drop(dram, old)
                    node.values = new
                    node.tier = HBM
                    for b in new:
                        hbm.indexed[b] = 1
                    self._counters["onloaded_blocks"] += j
            finally:
                hbm.alloc.decref(pinned_hbm)
                dram.alloc.decref(pinned_dram)
                self._version += 1
            if j < want or not j:
                return

    def _copy(self, src: _Tier, src_ids: list[int], dst: _Tier, dst_ids: list[int]) -> None:
        """Copy whole blocks between tiers (one pass when ``dst_ids`` is one run)."""
        move_blocks(dst.kv, dst_ids, src.kv, src_ids, self._block_dim)

    # -- swap and transfer -------------------------------------------------------------

    def swap(self, blocks: Sequence[int], src_tier: str, dst_tier: str) -> list[int]:
        """Move blocks the caller holds alone (refcount 1, not cached) to the other tier.

        Returns the new block ids, held by the caller; the old ones are freed.
        """
        src, dst = self._tier(src_tier), self._tier(dst_tier)
        if src is dst:
            raise ValueError(f"swap needs two different tiers, got {src_tier!r} twice")
        blocks = list(blocks)
        if len(set(blocks)) != len(blocks):
            raise ValueError("swap got the same block id twice")
        for b in blocks:
            if src.alloc.refcount(b) != 1 or src.indexed[b]:
                raise ValueError(
                    f"swap moves blocks the caller holds alone: {src_tier} block {b} has "
                    f"refcount {src.alloc.refcount(b)}{' and is cached' if src.indexed[b] else ''}"
                )
        new = self.alloc_mem(len(blocks), dst_tier, contiguous=True)
        self._copy(src, blocks, dst, new)
        src.alloc.decref(blocks)
        self._counters["swapped_blocks"] += len(blocks)
        return new

    def recv_alloc(
        self, tokens: Sequence[int] | None, num_blocks: int
    ) -> tuple[list[int], list[int]]:
        """Receiving side, step 1: blocks for an incoming transfer of ``num_blocks``.

        With ``tokens``, the cached prefix is matched first and only the rest is
        allocated: returns ``(matched, allocated)``. Without, ``([], allocated)``. The
        caller holds a reference on every returned block. The allocated blocks are one
        ascending run when the free blocks hold one, so the data lands in one piece.
        """
        if not isinstance(num_blocks, int) or num_blocks < 0:
            raise ValueError(f"num_blocks must be a non-negative int, got {num_blocks!r}")
        if tokens is None:
            return [], self.alloc_mem(num_blocks, contiguous=True)
        toks = as_tokens(tokens)
        # onloaded or freshly allocated, every block missing from hbm costs one hbm block:
        # fail before matching, so a refused transfer leaves the pool as it was
        in_hbm, _, room = self._match_room(toks)
        if num_blocks - in_hbm > room:
            raise PoolExhausted(
                f"instance {self.instance_id}: receiving {num_blocks} blocks needs "
                f"{num_blocks - in_hbm} hbm blocks beyond the {in_hbm} cached there, "
                f"but only {room} are free or evictable"
            )
        matched = self.match(toks)
        if len(matched) > num_blocks:
            self.free_mem(matched[num_blocks:])
            matched = matched[:num_blocks]
        try:
            new = self.alloc_mem(num_blocks - len(matched), contiguous=True)
        except BaseException:
            self.free_mem(matched)
            raise
        return matched, new

    def recv_write(self, blocks: Sequence[int], data: torch.Tensor) -> None:
        """Receiving side, step 2 from a packed buffer: copy ``data``
        (``layout.pool_shape(len(blocks))``) into ``blocks`` of the hbm tier."""
        check_packed(self.layout, len(blocks), data, "recv_write")
        self.recv_copy(blocks, data, range(len(blocks)))

    def recv_copy(self, blocks: Sequence[int], src: torch.Tensor, src_ids: Sequence[int]) -> None:
        """Receiving side, step 2 when the sender's pool tensor ``src`` is reachable from
        here (same process): copy its blocks ``src_ids`` straight into ``blocks``.

        One pass over the data when ``blocks`` is one run (what ``recv_alloc`` hands out
        when it can); no packed copy in between.
        """
        blocks, src_ids = list(blocks), list(src_ids)
        check_pool_tensor(self.layout, self.dtype, src, "recv_copy")
        hbm = self._tiers[HBM]
        for b in blocks:
            if hbm.alloc.refcount(b) < 1:
                raise ValueError(f"recv_copy into free block {b}")
        move_blocks(hbm.kv, blocks, src, src_ids, self._block_dim)
        self._counters["recv_blocks"] += len(blocks)
        self._counters["recv_bytes"] += len(blocks) * self.layout.block_bytes(src.element_size())

    def recv_commit(self, tokens: Sequence[int] | None, blocks: Sequence[int]) -> None:
        """Receiving side, step 3: index ``tokens -> blocks`` when tokens are given."""
        if tokens is not None:
            self.insert(tokens, blocks)
        self._counters["transfers_recv"] += 1

    def recv_abort(self, blocks: Sequence[int]) -> None:
        """Receiving side, on failure: release every block taken for this transfer."""
        self.free_mem(blocks)
        self._counters["transfers_aborted"] += 1

    def transfer(self, dst: MemPool, src_blocks: Sequence[int]) -> list[int]:
        """Send hbm blocks to ``dst``: dst allocates, data moves, dst returns its ids.

        The caller holds one reference on each returned block of ``dst``.
        """
        src = self._check_send(dst, src_blocks)
        matched, new = dst.recv_alloc(None, len(src))
        try:
            self._send(dst, src, new)
            dst.recv_commit(None, matched + new)
        except BaseException:
            dst.recv_abort(matched + new)
            raise
        self._counters["transfers_sent"] += 1
        return new

    def transfer_with_insert(
        self, dst: MemPool, tokens: Sequence[int], src_blocks: Sequence[int]
    ) -> list[int]:
        """Send the KV of ``tokens`` to ``dst`` and index it there.

        ``dst`` matches its own index first and receives only the blocks it lacks, then
        inserts ``tokens``. Returns the full block list on ``dst`` (the caller holds a
        reference on each).
        """
        toks = as_tokens(tokens)
        src = self._check_send(dst, src_blocks)
        lo, hi = len(toks) // self.block_size, self.layout.num_blocks_for(len(toks))
        if not lo <= len(src) <= hi:
            raise ValueError(
                f"{len(toks)} tokens need {hi} blocks (or {lo} whole ones), got {len(src)}"
            )
        matched, new = dst.recv_alloc(toks, len(src))
        try:
            self._send(dst, src[len(matched) :], new)
            dst.recv_commit(toks, matched + new)
        except BaseException:
            dst.recv_abort(matched + new)
            raise
        self._counters["transfers_sent"] += 1
        return matched + new

    def _check_send(self, dst: MemPool, src_blocks: Sequence[int]) -> list[int]:
        if dst.layout != self.layout or dst.dtype != self.dtype:
            raise ValueError(
                f"cannot transfer between pools of different layout or dtype: "
                f"{self.layout}/{self.dtype} -> {dst.layout}/{dst.dtype}"
            )
        src = list(src_blocks)
        hbm = self._tiers[HBM]
        for b in src:
            if hbm.alloc.refcount(b) < 1:
                raise ValueError(f"cannot send free block {b}")
        return src

    def _send(self, dst: MemPool, src_ids: list[int], dst_ids: list[int]) -> None:
        """Move blocks into the receiver's: it reads this pool's tensor straight into its
        blocks (a pool in this process, or a peer's mapped pool written one-sided)."""
        if not src_ids:
            return
        kv = self._tiers[HBM].kv
        dst.recv_copy(dst_ids, kv, src_ids)
        self._counters["sent_blocks"] += len(src_ids)
        self._counters["sent_bytes"] += len(src_ids) * self.layout.block_bytes(kv.element_size())

    # -- audit -------------------------------------------------------------------------

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
                elif b in held[node.tier]:
                    errors.append(f"{node.tier} block {b} is cached twice")
                held[node.tier].add(b)
        if num_values != self._tree.num_blocks:
            errors.append(f"index counts {self._tree.num_blocks} blocks but lists {num_values}")
        for name, t in self._tiers.items():
            rc = t.alloc.refcounts()
            free_list = t.alloc.free_blocks()
            free_set = set(free_list)
            if len(free_set) != len(free_list):
                errors.append(f"{name}: the free list has duplicates")
            counts = {"free": 0, "cached_only": 0, "referenced": 0}
            for b in range(t.alloc.num_blocks):
                in_index = b in held[name]
                if bool(t.indexed[b]) != in_index:
                    errors.append(
                        f"{name} block {b}: index flag {t.indexed[b]}, in tree {in_index}"
                    )
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
                if in_index and rc[b] == 1:
                    counts["cached_only"] += 1
                else:
                    counts["referenced"] += 1
                if name == DRAM and in_index and rc[b] != 1:
                    errors.append(f"dram block {b} is cached and held elsewhere too")
            if sum(counts.values()) != t.alloc.num_blocks or counts["free"] != len(free_list):
                errors.append(f"{name}: states {counts} do not add up to {t.alloc.num_blocks}")
        if errors:
            raise PoolAccountingError("MemPool accounting: " + "; ".join(errors[:20]))

    def __repr__(self) -> str:
        sizes = ", ".join(f"{n}={t.alloc.num_blocks}" for n, t in self._tiers.items())
        return f"MemPool(instance={self.instance_id!r}, {sizes}, block_size={self.block_size})"
