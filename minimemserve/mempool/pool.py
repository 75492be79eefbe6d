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

This module holds the block API, the index calls and transfers; the tiers (evictable
counts, eviction, offload, onload) are in :mod:`minimemserve.mempool.tiers` and the audit
(``stats``, ``check``) in :mod:`minimemserve.mempool.audit`. ``match`` onloads a cached
``dram`` path top-down, and ``insert`` moves a ``dram`` prefix back to the caller's
``hbm`` blocks.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch

from minimemserve.blocks.copy import check_pool_tensor, move_blocks
from minimemserve.blocks.layout import KVLayout
from minimemserve.errors import ConfigError, PoolExhausted
from minimemserve.mempool.audit import AuditMixin
from minimemserve.mempool.radix import RadixTree, as_tokens
from minimemserve.mempool.tiers import DRAM, HBM, TIERS, PoolNode, Tier, TierMixin

COUNTERS = (
    "match_calls",
    "query_tokens",  # whole-block tokens asked of match
    "hit_tokens",  # tokens match returned from the cache
    "inserted_blocks",  # blocks newly indexed by insert
    "deleted_blocks",  # blocks dropped from the index by delete
    "evicted_blocks",  # cached blocks dropped to make room
    "offloaded_blocks",  # cached hbm blocks moved to dram to make room
    "onloaded_blocks",  # cached dram blocks brought back to hbm by match
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


class MemPool(TierMixin, AuditMixin):
    """Elastic KV memory pool of one instance: tiers, refcounted blocks, a radix index.

    Block ids are per tier. Every call that hands out blocks (``alloc_mem``, ``match``,
    ``transfer*``) gives the caller one reference per block, released with ``free_mem``.
    ``insert`` never consumes the caller's references.
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
        self._tiers: dict[str, Tier] = {HBM: Tier(HBM, hbm_kv, num_blocks)}
        if dram_blocks:
            shape = layout.pool_shape(dram_blocks)
            if tensor_factory is None:
                dram_kv = torch.zeros(shape, dtype=dtype, device=host, pin_memory=pin)
            else:
                dram_kv = tensor_factory(shape, dtype, host)
            self._tiers[DRAM] = Tier(DRAM, dram_kv, dram_blocks)
        self._tree = RadixTree(self.block_size, node_type=PoolNode)
        self._clock = 0  # logical time: one tick per call, so LRU order is deterministic
        self._counters = dict.fromkeys(COUNTERS, 0)

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
        return t.alloc.num_free + t.evictable

    def refcount(self, block: int, tier: str = HBM) -> int:
        """References on ``block`` (the index's included)."""
        return self._tier(tier).alloc.refcount(block)

    def is_cached(self, block: int, tier: str = HBM) -> bool:
        """Whether the index holds ``block``."""
        t = self._tier(tier)
        t.alloc.check_id(block)
        return bool(t.indexed[block])

    def _tier(self, tier: str) -> Tier:
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
        if n - t.alloc.num_free > t.evictable:
            total, free = t.alloc.num_blocks, t.alloc.num_free
            raise PoolExhausted(
                f"instance {self.instance_id}: asked for {n} {tier} blocks but only "
                f"{free} are free and {t.evictable} cached blocks are evictable "
                f"({total} in total, {total - free - t.evictable} in use)"
            )
        return self._take(t, n, contiguous)

    def free_mem(self, blocks: Sequence[int], tier: str = HBM) -> None:
        """Drop one of the caller's references on each block.

        The index's own reference on a cached block is not the caller's: freeing it is an
        error, like a double free.
        """
        t = self._tier(tier)
        self._unhold(t, list(blocks), t.indexed)

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
        self._check_held(hbm, blocks[:nb])
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
            spans.append((node, pos, c))
            pos += c
        taken = [b for n, p, c in spans if n.tier != HBM for b in blocks[p : p + c]]
        taken += blocks[matched:nb]
        if len(set(taken)) != len(taken):
            raise ValueError("insert got the same block id twice")
        for b in taken:
            if hbm.indexed[b]:
                raise ValueError(f"block {b} is already cached under another prefix")
        parent = self._tree.root
        for node, p, c in spans:
            if c < len(node.values):  # the match ends inside this node: cut it there
                node = self._split(node, c)
            if node.tier != HBM:
                self._unindex(self._tiers[node.tier], node.values)
                self._uncount(node)
                node.values, node.tier, node.holder = blocks[p : p + c], HBM, self.instance_id
                self._adopt(hbm, node)
            parent = node
        existing = self._tree.insert(toks, blocks[:nb], now=now, tier=HBM, holder=self.instance_id)
        assert existing == matched, (existing, matched)
        if matched < nb:
            self._adopt(hbm, parent.children[toks[matched * bs : (matched + 1) * bs].tobytes()])
        self._counters["inserted_blocks"] += len(taken)
        return len(taken)

    @staticmethod
    def _check_held(hbm: Tier, blocks: list[int]) -> None:
        """Raise ValueError unless the caller holds a reference on each of ``blocks``."""
        rc, indexed, capacity = hbm.alloc.refcounts(), hbm.indexed, hbm.alloc.num_blocks
        for b in blocks:
            if type(b) is not int or not 0 <= b < capacity:
                hbm.alloc.check_id(b)
            if rc[b] - indexed[b] < 1:
                raise ValueError(f"block {b} is not held by the caller (refcount {rc[b]})")

    def _adopt(self, hbm: Tier, node: PoolNode) -> None:
        """Index ``node``'s blocks, held by the caller (so pinned)."""
        self._index(hbm, node)
        node.run = 0
        self._restate(node)

    def match(self, tokens: Sequence[int]) -> list[int]:
        """Longest cached prefix of ``tokens`` in whole blocks, as hbm block ids.

        The caller holds one new reference on each returned block. Cached blocks in dram
        are onloaded first while hbm has room; the match ends at the first block that
        cannot be brought to hbm.
        """
        toks = as_tokens(tokens)
        now = self._tick()
        match = self._tree.match_prefix(toks, now=now)
        if match.nodes and match.nodes[-1].tier != HBM:
            self._onload(toks, now)
            match = self._tree.match_prefix(toks, now=now)
        nodes, blocks = self._hbm_prefix(match)
        if blocks:
            self._hold(self._tiers[HBM], nodes, blocks)
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
        nodes, blocks = self._hbm_prefix(match)
        # a match holds the hbm part of the path before it makes room for the dram part
        room = self.num_available(HBM) - self._hold_cost(nodes, len(blocks))
        return len(blocks), len(match.values) - len(blocks), room

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
        nb = len(toks) // self.block_size
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
        parent, blocked = cut.parent, cut.blocked
        dropped = self._drop(self._tree.remove(cut))
        if blocked:
            parent.below -= 1
            self._restate(parent)
        self._counters["deleted_blocks"] += dropped
        return dropped

    # -- transfer ----------------------------------------------------------------------

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

    def __repr__(self) -> str:
        sizes = ", ".join(f"{n}={t.alloc.num_blocks}" for n, t in self._tiers.items())
        return f"MemPool(instance={self.instance_id!r}, {sizes}, block_size={self.block_size})"
