"""MemPool: the one allocator of KV memory, its tiers and its radix index.

A pool has an ``hbm`` tier (a tensor on the compute device) and optionally a ``dram`` tier
(host memory, pinned when CUDA is present), each with its own ``BlockAllocator``. The
radix index maps token prefixes to cached blocks and holds one reference on each block it
lists. Every block of a tier is in one of three states:

- free: no reference;
- cached-only: its only reference is the index's (evictable);
- referenced: someone other than the index holds it.

``check`` audits that ``free + cached-only + referenced == num_blocks`` per tier, every
block in exactly one state. Caching and disaggregation recipes are sequences of calls on
this class. Bookkeeping is plain Python, torch only moves data; one owner calls a pool."""

from __future__ import annotations

import functools
from array import array
from collections.abc import Callable, Sequence
from typing import Any

import torch

from ..blocks.copy import check_pool_tensor, move_blocks
from ..blocks.layout import KVLayout
from ..errors import ConfigError, PoolExhausted
from .audit import audit, tier_states, tree_counts
from .radix import RadixTree, as_tokens
from .tiers import DRAM, HBM, TIERS, PoolAccountingError, Tier, TierStore
from .transfer import KVReceiver, receive_alloc, send, send_cached_path

# match: calls, whole-block tokens asked, tokens hit; blocks newly inserted, deleted, evicted,
# offloaded to dram, onloaded back by match; transfers: blocks and bytes each way, calls
COUNTERS = (
    "match_calls query_tokens hit_tokens inserted_blocks deleted_blocks evicted_blocks "
    "offloaded_blocks onloaded_blocks sent_blocks sent_bytes recv_blocks recv_bytes "
    "transfers_sent transfers_recv transfers_aborted dram_sent_blocks"
).split()


def _checked_pin(layout, num_blocks, dram_blocks, pin_memory: bool | None) -> bool:
    """Whether the dram tier is pinned (default: when CUDA is there), once the arguments of
    a ``MemPool`` are checked."""
    if not isinstance(layout, KVLayout):
        raise TypeError(f"layout must be a KVLayout, got {type(layout).__name__}")
    for name, value, least in (("num_blocks", num_blocks, 1), ("dram_blocks", dram_blocks, 0)):
        if not isinstance(value, int) or isinstance(value, bool) or value < least:
            raise ConfigError(f"{name} must be an int >= {least}, got {value!r}")
    cuda = torch.cuda.is_available()
    pin = cuda if pin_memory is None else bool(pin_memory)
    if pin and not cuda:
        raise ConfigError("pin_memory=True needs CUDA, which is not available")
    return pin


class MemPool:
    """Elastic KV memory pool of one instance: tiers, refcounted blocks, a radix index. Block ids
    are per tier. Every call that hands out blocks (``alloc_mem``, ``match``, ``transfer*``) gives
    the caller one reference per block, released with ``free_mem``. When given,
    ``tensor_factory(shape, dtype, device)`` makes the zero-filled tensors."""

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
        tensor_factory: Callable[..., torch.Tensor] | None = None,
    ) -> None:
        pin = _checked_pin(layout, num_blocks, dram_blocks, pin_memory)
        self.layout = layout
        self.block_size = layout.block_size
        self.dtype = dtype
        self.device = torch.device(device)
        self.instance_id = str(instance_id)
        self._block_dim = layout.block_dim
        self.block_bytes = layout.block_bytes(dtype.itemsize)
        make = functools.partial(_make_tier, layout=layout, dtype=dtype, factory=tensor_factory)
        self._tiers = {HBM: make(HBM, num_blocks, self.device, False)}
        if dram_blocks:
            self._tiers[DRAM] = make(DRAM, dram_blocks, torch.device("cpu"), pin)
        self._clock = 0  # logical time: one tick per call, so LRU order is deterministic
        self.counters = dict.fromkeys(COUNTERS, 0)
        self._store = TierStore(self._tiers, self.block_size, self.counters, self.copy_tier)
        self._tree = self._store.tree

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
        t = self._tiers
        move_blocks(t[dst].kv, dst_ids, t[src].kv, src_ids, self._block_dim)

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
        if (t := self._tiers.get(tier)) is None:
            if tier in TIERS:
                raise ValueError(f"this pool has no {tier!r} tier (dram_blocks=0)")
            raise ValueError(f"unknown tier {tier!r}; tiers are {TIERS}")
        return t

    def alloc_mem(self, n: int, tier: str = HBM, contiguous: bool = False) -> list[int]:
        """``n`` blocks of ``tier``, held by the caller; evicts cached-only blocks LRU-first
        (hbm ones to dram if it has room) or raises ``PoolExhausted``, changing nothing.
        ``contiguous`` asks for one ascending run of ids when the free blocks hold one."""
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
        return self._store.take(t, n, contiguous)

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
        hbm = self._tiers[HBM]
        _check_held(hbm, blocks[:nb])
        if nb == 0:
            return 0
        if len(toks) != nb * bs:
            toks = toks[: nb * bs]
        self._clock += 1
        now = self._clock
        match = self._tree.match_prefix(toks, now=now)
        matched = len(match.values)
        spans, pos = [], 0  # (node, first position, blocks matched in it)
        for node in match.nodes:
            c = min(len(node.values), matched - pos)
            spans.append((node, pos, c))
            pos += c
        # the index takes the caller's blocks where the prefix is in dram, and the new tail
        taken = [b for n, p, c in spans if n.tier != HBM for b in blocks[p : p + c]]
        taken += blocks[matched:nb]
        _check_new(hbm, taken)
        parent = self._tree.root
        for node, p, c in spans:
            if c < len(node.values):  # the match ends inside this node: cut it there
                node = self._store.split(node, c)
            if node.tier != HBM:
                self._store.unindex(self._tiers[node.tier], node.values)
                self._store.uncount(node)
                node.values, node.tier, node.holder = blocks[p : p + c], HBM, self.instance_id
                self._store.index(hbm, node, adopt=True)
            parent = node
        self._tree.insert(toks, blocks[:nb], now=now, tier=HBM, holder=self.instance_id)
        if matched < nb:
            new = parent.children[toks[matched * bs : (matched + 1) * bs].tobytes()]
            self._store.index(hbm, new, adopt=True)
        self.counters["inserted_blocks"] += len(taken)
        if matched < nb and self.on_change is not None:
            self.on_change(True, toks)
        return len(taken)

    def match(self, tokens: Sequence[int]) -> list[int]:
        """Longest cached prefix of ``tokens`` in whole blocks, as hbm block ids the caller
        holds a new reference on. Cached dram blocks are onloaded while hbm has room."""
        toks = as_tokens(tokens)
        self._clock += 1
        now = self._clock
        match = self._tree.match_prefix(toks, now=now)
        if match.nodes and match.nodes[-1].tier != HBM:
            self._store.onload(toks, now)
            match = self._tree.match_prefix(toks, now=now)
        nodes, blocks = self._store.hbm_prefix(match)
        if blocks:
            self._store.hold(self._tiers[HBM], nodes, blocks)
        c = self.counters
        c["match_calls"] += 1
        c["query_tokens"] += len(toks) - len(toks) % self.block_size
        c["hit_tokens"] += len(blocks) * self.block_size
        return blocks

    def cached_prefix_len(self, tokens: Sequence[int]) -> int:
        """Tokens ``match(tokens)`` would return now, taking no references."""
        in_hbm, in_dram, room = self._store.match_room(as_tokens(tokens))
        return (in_hbm + min(in_dram, room)) * self.block_size

    def delete(self, tokens: Sequence[int]) -> int:
        """Drop the cached path of ``tokens`` below its last branch, with every extension
        (nothing if the cached part continues with other tokens; a shorter sequence inside
        goes too); return how many blocks left the index."""
        toks, bs = as_tokens(tokens), self.block_size
        match = self._tree.match_prefix(toks, touch=False)
        path, matched = match.nodes, len(match.values)
        ends_inside = sum(len(n.values) for n in path) != matched
        if not path or (matched < len(toks) // bs and (ends_inside or path[-1].children)):
            return 0
        # drop the path below its last branching node (all of it when it never branches)
        forks = [i for i in range(1, len(path)) if len(path[i - 1].children) > 1]
        cut = path[forks[-1] if forks else 0]
        parent, blocked = cut.parent, cut.blocked
        dropped = self._store.drop(self._tree.remove(cut))
        if blocked:
            parent.below -= 1
            self._store.restate(parent)
        self._store.candidate(parent)  # perhaps a leaf of its tier now
        self.counters["deleted_blocks"] += dropped
        return dropped

    def recv_alloc(
        self, tokens: Sequence[int] | None, num_blocks: int
    ) -> tuple[list[int], list[int]]:
        """Receiving side, step 1: ``(matched, allocated)``, ``num_blocks`` held blocks in all
        (a cached prefix of ``tokens`` is matched first; the rest is one run if possible)."""
        return receive_alloc(self, tokens, num_blocks)

    def recv_copy(self, blocks: Sequence[int], src: torch.Tensor, src_ids: Sequence[int]) -> None:
        """Receiving side, step 2, when the sender's pool tensor ``src`` is in this process:
        copy its blocks ``src_ids`` straight into ``blocks`` (one pass when they are a run)."""
        check_pool_tensor(self.layout, self.dtype, src, "recv_copy")
        blocks = self.held_blocks(blocks, "recv_copy into")
        move_blocks(self._tiers[HBM].kv, blocks, src, src_ids, self._block_dim)
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
        return send(self, dst, None, src_blocks)

    def transfer_with_insert(
        self, dst: KVReceiver, tokens: Sequence[int], src_blocks: Sequence[int]
    ) -> list[int]:
        """Send the KV of ``tokens`` to ``dst``, which receives only the blocks its index
        lacks and indexes them; returns every block on ``dst``, each held by the caller."""
        toks, n = as_tokens(tokens), len(src_blocks)
        lo, hi = len(toks) // self.block_size, self.layout.num_blocks_for(len(toks))
        if not lo <= n <= hi:
            raise ValueError(f"{len(toks)} tokens need {hi} blocks (or {lo} whole ones), got {n}")
        return send(self, dst, toks, src_blocks)

    def held_blocks(self, blocks: Sequence[int], what: str) -> list[int]:
        """``blocks`` as a list, each checked to be held by someone (``what`` names the use)."""
        alloc, blocks = self._tiers[HBM].alloc, list(blocks)
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
        dst.recv_copy(blocks, self._tiers[tier].kv, src)

    def send_cached(self, dst: KVReceiver, tokens: Sequence[int]) -> list[int]:
        """Send the cached whole blocks of ``tokens`` to ``dst`` and index them there, each
        block read from the tier that holds it: a block cached in dram goes to ``dst`` without
        being onloaded to hbm first (``dram_sent_blocks`` counts those). Only what ``dst``
        lacks moves; returns ``dst``'s blocks, held by the caller."""
        return send_cached_path(self, dst, tokens)

    def counter(self, name: str) -> int:
        """One of the :data:`COUNTERS` (what :meth:`stats` reports, without its block scan)."""
        return self.counters[name]

    def stats(self) -> dict[str, Any]:
        """Per tier ``{"total", "free", "referenced", "cached_only"}``; index size; counters."""
        counters = {"counters": dict(self.counters)}
        return tier_states(self._tiers) | tree_counts(self._tree) | counters

    def check(self) -> None:
        """Audit the bookkeeping by a full scan; raise ``PoolAccountingError`` if it is off."""
        if errors := audit(self._tiers, self._tree, self.block_size):
            raise PoolAccountingError("MemPool accounting: " + "; ".join(errors[:20]))

    def __repr__(self) -> str:
        sizes = ", ".join(f"{n}={t.alloc.num_blocks}" for n, t in self._tiers.items())
        return f"MemPool(instance={self.instance_id!r}, {sizes}, block_size={self.block_size})"


def _check_new(hbm: Tier, taken: list[int]) -> None:
    """Blocks the index is about to take: distinct, and cached nowhere yet."""
    if len(set(taken)) != len(taken):
        raise ValueError("insert got the same block id twice")
    for b in taken:
        if hbm.indexed[b]:
            raise ValueError(f"block {b} is already cached under another prefix")


def _check_held(hbm: Tier, blocks: list[int]) -> None:
    rc, indexed, capacity = hbm.alloc.refcounts(), hbm.indexed, hbm.alloc.num_blocks
    for b in blocks:
        if type(b) is not int or not 0 <= b < capacity:
            hbm.alloc.check_id(b)
        if rc[b] - indexed[b] < 1:
            raise ValueError(f"block {b} is not held by the caller (refcount {rc[b]})")


def _make_tier(name: str, n: int, where: torch.device, pinned: bool, *, layout, dtype, factory):
    """A tier of ``n`` zero-filled blocks on ``where`` (made by ``factory`` when given)."""
    shape = layout.pool_shape(n)
    if factory is not None:
        return Tier(name, factory(shape, dtype, where), n)
    return Tier(name, torch.zeros(shape, dtype=dtype, device=where, pin_memory=pinned), n)
