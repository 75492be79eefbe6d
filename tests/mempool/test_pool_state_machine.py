"""Random call sequences on two MemPools, checked against a naive model after every step.
Pool ``a`` has three tiers (hbm, dram and a disk whose write queue is short enough to
refuse blocks); pool ``b`` has hbm only.

The model keeps, in plain dicts, what the caller holds (references per block) and what
each held block must contain. Block contents are a function of the tokens they cover, as
real KV is, so any block ``match`` returns can be checked whatever the pool evicted.
"""

from __future__ import annotations

import shutil
import tempfile
import zlib
from collections import Counter
from dataclasses import dataclass

import hypothesis.strategies as st
import torch
from hypothesis import HealthCheck, settings
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from minimemserve.blocks.layout import KVLayout
from minimemserve.errors import PoolExhausted
from minimemserve.mempool import Disk, Dram, MemPool

BS = 4
LAYOUT = KVLayout(num_layers=1, block_size=BS, num_kv_heads=1, head_dim=1)
BASES = (
    [0, 1, 2, 3] * 5,
    [0, 1, 2, 3, 0, 1, 2, 3, 3, 2, 1, 0, 3, 3, 3, 3, 1, 1],
    [2, 2, 2, 2, 1, 0, 1, 0, 2, 2, 2, 2],
)

tokens_st = st.builds(
    lambda base, cut, tail: BASES[base][:cut] + tail,
    st.integers(0, len(BASES) - 1),
    st.sampled_from([4, 8, 12, 16, 20]),
    st.lists(st.integers(0, 3), max_size=3),
)
pick = st.integers(0, 10_000)


def kv_tag(tokens: list[int], i: int) -> float:
    """Contents of block ``i`` of ``tokens``: a function of the tokens up to its end."""
    return float(zlib.crc32(bytes(tokens[: (i + 1) * BS])) % 65536)


@dataclass
class Request:
    pool: str
    tokens: list[int]
    blocks: list[int]


class PoolMachine(RuleBasedStateMachine):
    def __init__(self) -> None:
        super().__init__()
        self.dir = tempfile.mkdtemp(prefix="kv-disk-")
        self.pools = {
            "a": MemPool(LAYOUT, 8, tiers=[Dram(3), Disk(5, self.dir, 3)], instance_id="a"),
            "b": MemPool(LAYOUT, 9, instance_id="b"),
        }
        # The disk's writer thread ends here and the machine drains the write queue itself
        # after each rule (``drain_disk``): what the queue has room for then depends on the
        # calls alone, never on the thread's timing, so every example replays the same.
        self.disk = self.pools["a"].store("disk")
        self.disk._queue.put(None)
        self.disk._writer.join()
        # model: caller references and expected contents per (pool, tier, block)
        self.held: Counter[tuple[str, str, int]] = Counter()
        self.tags: dict[tuple[str, str, int], float] = {}
        self.requests: list[Request] = []
        self.scratch: list[tuple[str, str, int]] = []  # blocks the caller holds alone
        self.next_tag = -1.0
        # sequences inserted since the pool last evicted, offloaded or deleted
        self.surely_cached: dict[str, list[list[int]]] = {"a": [], "b": []}
        self.evictions_seen = {"a": 0, "b": 0}

    def teardown(self) -> None:
        for pool in self.pools.values():
            pool.close()
        shutil.rmtree(self.dir)

    # -- helpers --------------------------------------------------------------------------

    def _take(self, name: str, tier: str, blocks: list[int], tags: list[float]) -> None:
        for b, tag in zip(blocks, tags, strict=True):
            key = (name, tier, b)
            if self.held[key]:
                assert self.tags[key] == tag, "a block holding other contents was handed out"
            self.held[key] += 1
            self.tags[key] = tag

    def _drop(self, name: str, tier: str, blocks: list[int]) -> None:
        for b in blocks:
            key = (name, tier, b)
            self.held[key] -= 1
            if not self.held[key]:
                del self.held[key]
                del self.tags[key]

    def _write(self, name: str, tier: str, blocks: list[int], tags: list[float]) -> None:
        kv = self.pools[name].kv(tier)
        for b, tag in zip(blocks, tags, strict=True):
            kv[b] = tag

    def _snapshot(self, name: str) -> tuple:
        pool = self.pools[name]
        s = pool.stats()
        s.pop("counters")
        refs = {t: [pool.refcount(b, t) for b in range(pool.capacity(t))] for t in pool.tiers}
        nodes = sorted((n.tier, tuple(n.values)) for n in pool.index.nodes())
        return s, refs, nodes

    def _note_pressure(self, name: str) -> None:
        c = self.pools[name].stats()["counters"]
        seen = c["evicted_blocks"] + c["offloaded_blocks"] + c["deleted_blocks"]
        if seen != self.evictions_seen[name]:
            self.evictions_seen[name] = seen
            self.surely_cached[name] = []

    def _alloc_or_nothing(self, name: str, n: int, tier: str = "hbm") -> list[int] | None:
        """alloc_mem, checking that a failure is predicted and changes nothing."""
        pool = self.pools[name]
        available = pool.num_available(tier)
        before = self._snapshot(name)
        try:
            blocks = pool.alloc_mem(n, tier)
        except PoolExhausted:
            assert n > available
            assert self._snapshot(name) == before
            return None
        assert n <= available and len(set(blocks)) == n
        assert all(pool.refcount(b, tier) == 1 and not pool.is_cached(b, tier) for b in blocks)
        return blocks

    # -- rules ----------------------------------------------------------------------------

    @rule(name=st.sampled_from("ab"), tokens=tokens_st)
    def start_request(self, name: str, tokens: list[int]) -> None:
        pool = self.pools[name]
        whole = len(tokens) // BS
        expected = pool.cached_prefix_len(tokens)
        cached = pool.match(tokens)
        self._note_pressure(name)
        assert len(cached) * BS == expected <= whole * BS
        for s in self.surely_cached[name]:
            if tokens[: len(s)] == s:
                assert len(cached) * BS >= len(s), "an inserted prefix vanished without eviction"
        tags = [kv_tag(tokens, i) for i in range(LAYOUT.num_blocks_for(len(tokens)))]
        self._take(name, "hbm", cached, tags[: len(cached)])
        rest = self._alloc_or_nothing(name, len(tags) - len(cached))
        self._note_pressure(name)
        if rest is None:
            pool.free_mem(cached)
            self._drop(name, "hbm", cached)
            return
        self._write(name, "hbm", rest, tags[len(cached) :])
        self._take(name, "hbm", rest, tags[len(cached) :])
        self.requests.append(Request(name, tokens, cached + rest))

    @precondition(lambda self: self.requests)
    @rule(i=pick)
    def insert_request(self, i: int) -> None:
        self.insert_request_obj(self.requests[i % len(self.requests)])

    def insert_request_obj(self, req: Request) -> None:
        pool = self.pools[req.pool]
        added = pool.insert(req.tokens, req.blocks)
        whole = len(req.tokens) // BS
        assert 0 <= added <= whole
        assert pool.cached_prefix_len(req.tokens) == whole * BS
        self.surely_cached[req.pool].append(req.tokens[: whole * BS])

    @precondition(lambda self: self.requests)
    @rule(i=pick, cache=st.booleans())
    def finish_request(self, i: int, cache: bool) -> None:
        req = self.requests.pop(i % len(self.requests))
        if cache:
            self.insert_request_obj(req)
        self.pools[req.pool].free_mem(req.blocks)
        self._drop(req.pool, "hbm", req.blocks)

    @rule(name=st.sampled_from("ab"), n=st.integers(0, 6), to_dram=st.booleans())
    def alloc_scratch(self, name: str, n: int, to_dram: bool) -> None:
        tier = "dram" if to_dram and name == "a" else "hbm"
        blocks = self._alloc_or_nothing(name, n, tier)
        self._note_pressure(name)
        if blocks is None:
            return
        tags = []
        for _ in blocks:
            tags.append(self.next_tag)
            self.next_tag -= 1
        self._write(name, tier, blocks, tags)
        self._take(name, tier, blocks, tags)
        self.scratch += [(name, tier, b) for b in blocks]

    @rule(name=st.sampled_from("ab"), extra=st.integers(0, 4))
    def pressure(self, name: str, extra: int) -> None:
        """Allocate every free block and a few more, then give them back: forces eviction."""
        n = self.pools[name].num_free() + extra
        blocks = self._alloc_or_nothing(name, n)
        self._note_pressure(name)
        if blocks is not None:
            self.pools[name].free_mem(blocks)

    @rule(tokens=st.lists(tokens_st, min_size=1, max_size=4), extra=st.integers(1, 4))
    def sink(self, tokens: list[list[int]], extra: int) -> None:
        """Cache requests on pool a, push them down its chain (dram overflows to disk), then
        ask for them again (promoted from wherever they went)."""
        for t in tokens:
            self.start_request("a", t)
            if self.requests and self.requests[-1].tokens is t:
                self.finish_request(len(self.requests) - 1, cache=True)
        for _ in range(3):
            self.pressure("a", extra)
        for t in tokens:
            self.start_request("a", t)

    @rule(name=st.sampled_from("ab"), tokens=tokens_st, extra=st.integers(0, 4))
    def cache_evict_rematch(self, name: str, tokens: list[int], extra: int) -> None:
        """Cache a request, push it out (to dram, on pool a), then ask for it again."""
        self.start_request(name, tokens)
        if self.requests and self.requests[-1].tokens is tokens:
            self.finish_request(len(self.requests) - 1, cache=True)
        self.pressure(name, extra)
        self.start_request(name, tokens)

    @precondition(lambda self: self.scratch)
    @rule(i=pick)
    def free_scratch(self, i: int) -> None:
        name, tier, b = self.scratch.pop(i % len(self.scratch))
        self.pools[name].free_mem([b], tier)
        self._drop(name, tier, [b])

    @rule(name=st.sampled_from("ab"), tokens=tokens_st)
    def delete(self, name: str, tokens: list[int]) -> None:
        pool = self.pools[name]

        def cached() -> int:  # in any tier
            return pool.index.match_prefix(tokens, touch=False).num_tokens

        before, blocks = cached(), pool.index.num_blocks
        dropped = pool.delete(tokens)
        self._note_pressure(name)
        assert pool.index.num_blocks == blocks - dropped
        if dropped:
            assert cached() < before
        else:
            assert cached() == before

    @precondition(lambda self: self.requests)
    @rule(i=pick, with_insert=st.booleans())
    def transfer(self, i: int, with_insert: bool) -> None:
        req = self.requests[i % len(self.requests)]
        src = self.pools[req.pool]
        dst_name = "b" if req.pool == "a" else "a"
        dst = self.pools[dst_name]
        before = self._snapshot(dst_name)
        sent = src.stats()["counters"]["sent_blocks"]
        cached = dst.cached_prefix_len(req.tokens) // BS if with_insert else 0
        try:
            if with_insert:
                got = src.transfer_with_insert(dst, req.tokens, req.blocks)
            else:
                got = src.transfer(dst, req.blocks)
        except PoolExhausted:
            assert self._snapshot(dst_name) == before
            return
        finally:
            self._note_pressure(dst_name)
        assert len(got) == len(req.blocks)
        tags = [self.tags[(req.pool, "hbm", b)] for b in req.blocks]
        self._take(dst_name, "hbm", got, tags)
        if with_insert:
            assert src.stats()["counters"]["sent_blocks"] - sent == len(got) - cached
            self.requests.append(Request(dst_name, req.tokens, got))
            self.surely_cached[dst_name].append(req.tokens[: len(req.tokens) // BS * BS])
        else:
            self.scratch += [(dst_name, "hbm", b) for b in got]

    # -- invariants -----------------------------------------------------------------------

    @invariant()
    def drain_disk(self) -> None:
        """Write every queued block, as the writer thread would have by now."""
        self.disk._queue.put(None)
        self.disk._drain()

    @invariant()
    def books_balance(self) -> None:
        for name, pool in self.pools.items():
            pool.check()
            for tier in pool.tiers:
                if tier == "disk":  # no block there is ever held; what match reads is checked
                    assert pool.stats()[tier]["referenced"] == 0
                    continue
                kv = pool.kv(tier)
                free = 0
                for b in range(pool.capacity(tier)):
                    key = (name, tier, b)
                    caller = pool.refcount(b, tier) - pool.is_cached(b, tier)
                    assert caller == self.held[key], (key, caller, self.held[key])
                    free += pool.refcount(b, tier) == 0
                    if key in self.tags:
                        assert torch.all(kv[b] == self.tags[key]), f"contents of {key} changed"
                assert pool.stats()[tier]["free"] == free == pool.num_free(tier)


PoolMachine.TestCase.settings = settings(
    max_examples=50,
    stateful_step_count=40,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow],
)
TestPoolStateMachine = PoolMachine.TestCase
