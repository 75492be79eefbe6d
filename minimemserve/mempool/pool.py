"""MemPool: the one allocator of KV memory, its tiers and its radix index.

A pool's tiers are one ordered chain (``chain.py``): ``hbm`` (a tensor on the compute
device), then optionally ``dram`` (host memory, pinned when CUDA is present), ``disk`` (block
files, kept across restarts) or any tier a caller defines, each with its own
``BlockAllocator`` and store. Eviction demotes a block a tier down, a match promotes its
hit to ``hbm``. The radix index maps token prefixes to cached blocks and holds one
reference on each block it lists. Every block of a tier is in one of three states:

- free: no reference;
- cached-only: its only reference is the index's (evictable);
- referenced: someone other than the index holds it.

``check`` audits that ``free + cached-only + referenced == num_blocks`` per tier, every
block in exactly one state. Caching and disaggregation recipes are sequences of calls on
this class. Bookkeeping is plain Python, torch only moves data; one owner calls a pool."""

from __future__ import annotations

import itertools
from array import array
from collections.abc import Callable, Sequence
from typing import Any

import torch

from ..blocks.copy import check_pool_tensor, move_blocks
from ..blocks.layout import KVLayout
from ..errors import ConfigError, PoolExhausted
from .audit import audit, tier_states, tree_counts
from .chain import HBM, TIERS, StoreContext, TierSpec, full_chain, open_stores
from .radix import RadixTree, as_tokens
from .stores import BlockStore
from .tiers import COUNTERS, PoolAccountingError, Tier, TierStore
from .transfer import KVReceiver

__all__ = ["COUNTERS", "MemPool"]


def _checked_pin(layout, num_blocks, pin_memory: bool | None) -> bool:
    """Whether host-memory tiers are pinned (default: when CUDA is there), once the arguments
    of a ``MemPool`` are checked."""
    if not isinstance(layout, KVLayout):
        raise TypeError(f"layout must be a KVLayout, got {type(layout).__name__}")
    if not isinstance(num_blocks, int) or isinstance(num_blocks, bool) or num_blocks < 1:
        raise ConfigError(f"num_blocks must be an int >= 1, got {num_blocks!r}")
    cuda = torch.cuda.is_available()
    pin = cuda if pin_memory is None else bool(pin_memory)
    if pin and not cuda:
        raise ConfigError("pin_memory=True needs CUDA, which is not available")
    return pin


class MemPool:
    """Elastic KV memory pool of one instance: tiers, refcounted blocks, a radix index. Block ids
    are per tier. Every call that hands out blocks (``alloc_mem``, ``match``, ``transfer*``) gives
    the caller one reference per block, released with ``free_mem``. Below ``num_blocks`` of
    ``hbm`` come ``tiers`` (:mod:`~minimemserve.mempool.chain`, ``default_chain`` by sizes) or
    a dram tier of ``dram_blocks``; ``model`` names the model whose KV a persistent tier keeps;
    ``tensor_factory(shape, dtype, device)``, when given, makes the zero-filled tensors."""

    def __init__(
        self,
        layout: KVLayout,
        num_blocks: int,
        *,
        dram_blocks: int = 0,
        tiers: Sequence[TierSpec] | None = None,
        model: str = "",
        device: str | torch.device = "cpu",
        dtype: torch.dtype = torch.float32,
        instance_id: str = "0",
        pin_memory: bool | None = None,
        tensor_factory: Callable[..., torch.Tensor] | None = None,
    ) -> None:
        pin = _checked_pin(layout, num_blocks, pin_memory)
        chain = full_chain(num_blocks, dram_blocks, tiers)
        self.layout = layout
        self.block_size = layout.block_size
        self.dtype = dtype
        self.device = torch.device(device)
        self.instance_id = str(instance_id)
        self._block_dim = layout.block_dim
        self.block_bytes = layout.block_bytes(dtype.itemsize)
        self._store = TierStore({t.name: t.blocks for t in chain}, self.block_size)  # the books
        ctx = StoreContext(layout, dtype, self.device, pin, tensor_factory, model)
        # the data: where each tier's blocks live
        self._stores = open_stores(chain, ctx, self._store, self.instance_id)
        # a pool tensor per tier that has one (the rest keep blocks elsewhere, as files)
        self._kv = {name: st.kv for name, st in self._stores.items() if st.kv is not None}

    def close(self) -> None:
        """Release what the tiers' stores hold open (a disk tier finishes its queued writes)."""
        for store in self._stores.values():
            store.close()

    def store(self, tier: str) -> BlockStore:
        """Where ``tier``'s blocks live."""
        self._tier(tier)
        return self._stores[tier]

    @property
    def counters(self) -> dict[str, int]:
        """The :data:`COUNTERS` by name (read them; the pool updates them)."""
        return self._store.counters

    @property
    def on_change(self) -> Callable[[bool, array], None] | None:
        """Told ``(True, tokens)`` when tokens are newly cached, ``(False, path)`` when the
        subtree whose token path ends with path's last block is evicted (in order)."""
        return self._store.on_change

    @on_change.setter
    def on_change(self, fn: Callable[[bool, array], None] | None) -> None:
        self._store.on_change = fn

    def copy_tier(self, dst: str, dst_ids: list[int], src: str, src_ids: list[int]) -> None:
        """Copy blocks between tiers (a hook: a tensor-parallel pool's ranks copy theirs too)."""
        move_blocks(self._kv[dst], dst_ids, self._kv[src], src_ids, self._block_dim)

    def _copy_moves(self) -> None:
        """Copy the data of the tier moves the books made, in the order they made them."""
        moves, self._store.moves = self._store.moves, []
        tiers, stores = self._store.tiers, self._stores
        try:
            for dst, dst_ids, src, src_ids, path in moves:
                if dst in self._kv and src in self._kv:
                    self.copy_tier(dst, dst_ids, src, src_ids)
                else:
                    stores[dst].write(dst_ids, stores[src].read(src_ids), path)
                moved = len(dst_ids) * self.block_bytes
                tiers[src].counters["read_bytes"] += moved
                tiers[dst].counters["written_bytes"] += moved
        finally:
            for store in stores.values():
                store.done()

    @property
    def tiers(self) -> tuple[str, ...]:
        """Names of the tiers this pool has."""
        return tuple(self._store.tiers)

    @property
    def index(self) -> RadixTree:
        """The radix index (read it; change it only through the pool)."""
        return self._store.tree

    def kv(self, tier: str = HBM) -> torch.Tensor:
        """The pool tensor of ``tier``, shaped ``layout.pool_shape(capacity(tier))``."""
        self._tier(tier)
        if tier not in self._kv:
            raise ValueError(f"the {tier!r} tier keeps its blocks in {self._stores[tier]!r}")
        return self._kv[tier]

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
        if (t := self._store.tiers.get(tier)) is None:
            if tier in TIERS:
                raise ValueError(f"this pool has no {tier!r} tier ({tier}_blocks=0)")
            raise ValueError(f"unknown tier {tier!r}; this pool's tiers are {self.tiers}")
        return t

    def alloc_mem(self, n: int, tier: str = HBM, contiguous: bool = False) -> list[int]:
        """``n`` blocks of ``tier``, held by the caller; evicts cached-only blocks LRU-first
        (hbm ones to dram if it has room) or raises ``PoolExhausted``, changing nothing.
        ``contiguous`` asks for one ascending run of ids when the free blocks hold one."""
        t = self._tier(tier)
        if tier not in self._kv:
            raise ValueError(f"the {tier!r} tier takes blocks only from the tier above it")
        if not isinstance(n, int) or isinstance(n, bool) or n < 0:
            raise ValueError(f"block count must be a non-negative int, got {n!r}")
        if n - t.alloc.num_free > t.evictable:
            total, free = t.alloc.num_blocks, t.alloc.num_free
            raise PoolExhausted(
                f"instance {self.instance_id}: asked for {n} {tier} blocks but only "
                f"{free} are free and {t.evictable} cached blocks are evictable "
                f"({total} in total, {total - free - t.evictable} in use)"
            )
        try:
            return self._store.take(t, n, contiguous)
        finally:
            self._copy_moves()

    def free_mem(self, blocks: Sequence[int], tier: str = HBM) -> None:
        """Drop one of the caller's references on each block (never the index's own)."""
        t = self._tier(tier)
        self._store.unhold(t, list(blocks), t.indexed)

    def insert(self, tokens: Sequence[int], blocks: Sequence[int]) -> int:
        """Index the whole blocks of ``tokens`` (``blocks[i]`` holds block ``i``), taking the
        index's own references; return how many blocks were newly indexed. A prefix cached
        in hbm keeps its blocks; one cached in dram takes the caller's."""
        toks, bs = as_tokens(tokens), self.block_size
        nb, blocks = len(toks) // bs, list(blocks)
        if len(blocks) < nb:
            raise ValueError(f"{len(toks)} tokens fill {nb} blocks but {len(blocks)} were given")
        _check_held(self._store.tiers[HBM], blocks[:nb])
        if nb == 0:
            return 0
        return self._store.insert(toks[: nb * bs], blocks[:nb], self.instance_id)

    def match(self, tokens: Sequence[int], *, count: bool = True) -> list[int]:
        """Longest cached prefix of ``tokens`` in whole blocks, as hbm block ids the caller
        holds a new reference on. Cached dram blocks are onloaded while hbm has room. Counted
        (queries, hits per tier) unless ``count=False``: a transfer's receiving side."""
        toks, store = as_tokens(tokens), self._store
        now = store.tick()
        match = store.tree.match_prefix(toks, now=now)
        found = [(n.tier, len(n.values)) for n in match.nodes]  # before any block comes up
        if match.nodes and match.nodes[-1].tier != HBM:
            try:
                store.onload(toks, now)
            finally:
                self._copy_moves()
            match = store.tree.match_prefix(toks, now=now)
        nodes, blocks = store.hbm_prefix(match)
        if blocks:
            store.hold(store.tiers[HBM], nodes, blocks)
        if count:
            _count_lookup(self, store.tiers, len(toks), len(blocks), found)
        return blocks

    def cached_prefix_len(self, tokens: Sequence[int]) -> int:
        """Tokens ``match(tokens)`` would return now, taking no references (unless a block
        below the top fails its check when read)."""
        in_hbm, in_dram, room = self._store.match_room(as_tokens(tokens))
        return (in_hbm + min(in_dram, room)) * self.block_size

    def delete(self, tokens: Sequence[int]) -> int:
        """Drop the cached path of ``tokens`` below its last branch, with every extension
        (nothing if the cached part continues with other tokens; a shorter sequence inside
        goes too); return how many blocks left the index."""
        return self._store.delete(as_tokens(tokens))

    def recv_alloc(
        self, tokens: Sequence[int] | None, num_blocks: int
    ) -> tuple[list[int], list[int]]:
        """Receiving side, step 1: ``(matched, allocated)``, ``num_blocks`` held blocks in all
        (a cached prefix of ``tokens`` is matched first; the rest is one run if possible)."""
        if not isinstance(num_blocks, int) or isinstance(num_blocks, bool) or num_blocks < 0:
            raise ValueError(f"num_blocks must be a non-negative int, got {num_blocks!r}")
        if tokens is None:
            return [], self.alloc_mem(num_blocks, contiguous=True)
        toks = as_tokens(tokens)
        # every block missing from hbm costs one hbm block, onloaded or allocated: fail
        # before matching, so a refused transfer leaves the pool as it was
        in_hbm, _, room = self._store.match_room(toks)
        if num_blocks - in_hbm > room:
            raise PoolExhausted(
                f"instance {self.instance_id}: receiving {num_blocks} blocks needs "
                f"{num_blocks - in_hbm} hbm blocks beyond the {in_hbm} cached there, "
                f"but only {room} are free or evictable"
            )
        matched = self.match(toks, count=False)
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
        """Receiving side, step 2, when the sender's pool tensor ``src`` is in this process:
        copy its blocks ``src_ids`` straight into ``blocks`` (one pass when they are a run)."""
        check_pool_tensor(self.layout, self.dtype, src, "recv_copy")
        blocks = self.held_blocks(blocks, "recv_copy into")
        move_blocks(self._kv[HBM], blocks, src, src_ids, self._block_dim)
        self.counters["recv_blocks"] += len(blocks)
        self.counters["recv_bytes"] += len(blocks) * self.block_bytes

    def recv_commit(self, tokens: Sequence[int] | None, blocks: Sequence[int]) -> None:
        """Receiving side, step 3: index ``tokens -> blocks`` when tokens are given."""
        if tokens is not None:
            self.insert(tokens, blocks)
        self.counters["transfers_recv"] += 1

    def recv_abort(self, blocks: Sequence[int]) -> None:
        """Receiving side, on failure: release every block taken for this transfer."""
        self.free_mem(blocks)
        self.counters["transfers_aborted"] += 1

    def transfer(self, dst: KVReceiver, src_blocks: Sequence[int]) -> list[int]:
        """Send hbm blocks to ``dst``, which allocates them; return its ids, held by the caller."""
        return self._send(dst, None, src_blocks)

    def transfer_with_insert(
        self, dst: KVReceiver, tokens: Sequence[int], src_blocks: Sequence[int]
    ) -> list[int]:
        """Send the KV of ``tokens`` to ``dst``, which receives only the blocks its index
        lacks and indexes them; returns every block on ``dst``, each held by the caller."""
        toks, n = as_tokens(tokens), len(src_blocks)
        lo, hi = len(toks) // self.block_size, self.layout.num_blocks_for(len(toks))
        if not lo <= n <= hi:
            raise ValueError(f"{len(toks)} tokens need {hi} blocks (or {lo} whole ones), got {n}")
        return self._send(dst, toks, src_blocks)

    def _check_peer(self, dst: KVReceiver) -> None:
        if dst.model_layout != self.model_layout or dst.dtype != self.dtype:
            raise ValueError(
                f"cannot transfer between pools of different layout or dtype: "
                f"{self.model_layout}/{self.dtype} -> {dst.model_layout}/{dst.dtype}"
            )

    def _send(self, dst: KVReceiver, toks: array | None, src_blocks: Sequence[int]) -> list[int]:
        """dst allocates what it lacks, this pool's tensor is read straight into dst's blocks
        (here, or one-sided into a peer's mapping), dst commits; or dst releases it all."""
        self._check_peer(dst)
        src = self.held_blocks(src_blocks, "cannot send")
        matched, new = dst.recv_alloc(toks, len(src))
        src = src[len(matched) :]
        try:
            if src:
                self.send_blocks(dst, new, src)
                self.counters["sent_blocks"] += len(src)
                self.counters["sent_bytes"] += len(src) * self.block_bytes
            dst.recv_commit(toks, matched + new)
        except BaseException:
            dst.recv_abort(matched + new)
            raise
        self.counters["transfers_sent"] += 1
        return matched + new

    def held_blocks(self, blocks: Sequence[int], what: str) -> list[int]:
        """``blocks`` as a list, each checked to be held by someone (``what`` names the use)."""
        alloc, blocks = self._store.tiers[HBM].alloc, list(blocks)
        rc, capacity = alloc.refcounts(), alloc.num_blocks
        for b in blocks:
            if type(b) is not int or not 0 <= b < capacity:
                alloc.check_id(b)
            if rc[b] < 1:
                raise ValueError(f"{what} free block {b}")
        return blocks

    @property
    def model_layout(self) -> KVLayout:
        """The layout of the model's whole KV (every head), which transfers must agree on; a
        tensor-parallel pool's own tensor holds one rank's heads of it."""
        return self.layout

    def send_blocks(
        self, dst: KVReceiver, blocks: list[int], src: list[int], tier: str = HBM
    ) -> None:
        """The data movement of a send: this pool's ``tier`` blocks ``src`` into ``dst``'s
        (hbm) ``blocks`` (a hook: a tensor-parallel pool gathers its ranks' shards)."""
        dst.recv_copy(blocks, self.kv(tier), src)

    def send_cached(self, dst: KVReceiver, tokens: Sequence[int]) -> list[int]:
        """Send the cached whole blocks of ``tokens`` to ``dst`` and index them there, each
        block read from the tier that holds it: a block cached in dram goes to ``dst`` without
        being onloaded to hbm first (``dram_sent_blocks`` counts those sent from below the
        top). The path stops at a tier with no pool tensor (a disk's blocks are checked and
        promoted by ``match`` first). Only what ``dst`` lacks moves; returns ``dst``'s
        blocks, held by the caller."""
        toks, store = as_tokens(tokens), self._store
        match = store.tree.match_prefix(toks, now=store.tick())
        spans: list[tuple[str, list, list[int]]] = []  # runs of nodes in one tier, in order
        pos = 0
        for node in match.nodes:
            if node.tier not in self._kv:
                break
            c = min(len(node.values), len(match.values) - pos)
            if not spans or spans[-1][0] != node.tier:
                spans.append((node.tier, [], []))
            spans[-1][1].append(node)
            spans[-1][2].extend(match.values[pos : pos + c])
            pos += c
        if not spans:
            return []
        for tier, nodes, blocks in spans:  # pinned: a peer's call may evict while we send
            store.hold(store.tiers[tier], nodes, blocks)
        try:
            return self._send_spans(dst, toks[: pos * self.block_size], spans)
        finally:
            for tier, _, blocks in spans:
                store.unhold(store.tiers[tier], blocks)

    def _send_spans(self, dst: KVReceiver, toks: array, spans: list[tuple]) -> list[int]:
        """Send ``send_cached``'s pinned spans, each run of blocks from the tier holding it."""
        self._check_peer(dst)
        pairs = [(tier, b) for tier, _, blocks in spans for b in blocks]
        matched, new = dst.recv_alloc(toks, len(pairs))
        todo, at, c = pairs[len(matched) :], 0, self.counters
        try:
            for tier, run in itertools.groupby(todo, key=lambda p: p[0]):
                src = [b for _, b in run]
                self.send_blocks(dst, new[at : at + len(src)], src, tier)
                at += len(src)
                if tier != HBM:
                    c["dram_sent_blocks"] += len(src)
            dst.recv_commit(toks, matched + new)
        except BaseException:
            dst.recv_abort(matched + new)
            raise
        c["sent_blocks"] += len(todo)
        c["sent_bytes"] += len(todo) * self.block_bytes
        c["transfers_sent"] += 1
        return matched + new

    def stats(self) -> dict[str, Any]:
        """Per tier ``{"total", "free", "referenced", "cached_only"}``; index size; counters,
        with ``counters["tiers"]``: per tier its :data:`~minimemserve.mempool.tiers.TIER_COUNTERS`
        (hit tokens share the denominator ``counters["query_tokens"]``) and its store's own."""
        counters = {"counters": dict(self.counters) | {"tiers": self.tier_counters()}}
        return tier_states(self._store.tiers) | tree_counts(self._store.tree) | counters

    def tier_counters(self) -> dict[str, dict[str, int]]:
        """Per tier, in chain order: its counters and its store's (no block scan)."""
        return {
            name: dict(t.counters) | self._stores[name].stats()
            for name, t in self._store.tiers.items()
        }

    def check(self) -> None:
        """Audit the bookkeeping by a full scan; raise ``PoolAccountingError`` if it is off."""
        if errors := audit(self._store.tiers, self._store.tree, self.block_size):
            raise PoolAccountingError("MemPool accounting: " + "; ".join(errors[:20]))

    def __repr__(self) -> str:
        sizes = ", ".join(f"{n}={t.alloc.num_blocks}" for n, t in self._store.tiers.items())
        return f"MemPool(instance={self.instance_id!r}, {sizes}, block_size={self.block_size})"


def _check_held(hbm: Tier, blocks: list[int]) -> None:
    rc, indexed, capacity = hbm.alloc.refcounts(), hbm.indexed, hbm.alloc.num_blocks
    for b in blocks:
        if type(b) is not int or not 0 <= b < capacity:
            hbm.alloc.check_id(b)
        if rc[b] - indexed[b] < 1:
            raise ValueError(f"block {b} is not held by the caller (refcount {rc[b]})")


def push_cached(src: MemPool, dst: KVReceiver, tokens: Sequence[int]) -> int:
    """The global scheduler's prefix push, the same in every runtime: ``src.send_cached`` to
    ``dst``, whose index keeps the blocks (no reference is left held); the tokens now cached
    there (0 when ``dst`` had no room: the request goes without them)."""
    try:
        got = src.send_cached(dst, tokens)
    except PoolExhausted:
        return 0
    if got:
        dst.free_mem(got)
    return len(got) * src.block_size


def _count_lookup(
    pool: MemPool, tiers: dict[str, Tier], tokens: int, hit: int, found: list[tuple[str, int]]
) -> None:
    """A prompt's lookup of ``tokens`` in ``pool``: its whole blocks' tokens queried, the ``hit``
    blocks' tokens, and each tier's share of them by where the lookup ``found`` them."""
    c, bs = pool.counters, pool.block_size
    c["match_calls"] += 1
    c["query_tokens"] += tokens - tokens % bs
    c["hit_tokens"] += hit * bs
    for tier, size in found:
        if not hit:
            break
        n = min(hit, size)
        tiers[tier].counters["hit_tokens"] += n * bs
        hit -= n
