"""MemPool: allocation, the index, eviction and offload, transfer, audits."""

from __future__ import annotations

import pytest
import torch

from minimemserve.blocks.layout import PER_LAYER, KVLayout
from minimemserve.errors import ConfigError, PoolExhausted
from minimemserve.mempool import MemPool, PoolAccountingError

BS = 4
LAYOUT = KVLayout(num_layers=2, block_size=BS, num_kv_heads=1, head_dim=2)
BLOCK_BYTES = LAYOUT.block_bytes(4)  # fp32


def seq(*blocks: int, tail: int = 0) -> list[int]:
    """Tokens made of whole blocks, each block filled with its given token id."""
    return [t for b in blocks for t in [b] * BS] + [99] * tail


def write(pool: MemPool, blocks: list[int], values: list[float], tier: str = "hbm") -> None:
    for b, v in zip(blocks, values, strict=True):
        pool.kv(tier)[b] = v


def read(pool: MemPool, blocks: list[int], tier: str = "hbm") -> list[float]:
    kv = pool.kv(tier)
    out = []
    for b in blocks:
        block = kv[b]
        assert torch.equal(block, torch.full_like(block, block.flatten()[0].item()))
        out.append(block.flatten()[0].item())
    return out


def prefill(pool: MemPool, tokens: list[int], values: list[float]) -> list[int]:
    """What an engine does: match, allocate the rest, write the new KV."""
    cached = pool.match(tokens)
    rest = pool.alloc_mem(LAYOUT.num_blocks_for(len(tokens)) - len(cached))
    write(pool, rest, values[len(cached) :])
    return cached + rest


def cache(pool: MemPool, tokens: list[int], values: list[float]) -> list[int]:
    """Prefill, insert and finish a request: its whole blocks stay cached only."""
    blocks = prefill(pool, tokens, values)
    pool.insert(tokens, blocks)
    pool.free_mem(blocks)
    pool.check()
    return blocks


def state(pool: MemPool) -> tuple:
    """Everything but the counters, for 'this call changed nothing' checks."""
    s = pool.stats()
    s.pop("counters")
    tiers = {t: [pool.refcount(b, t) for b in range(pool.capacity(t))] for t in pool.tiers}
    nodes = sorted((n.tier, tuple(n.values)) for n in pool.index.nodes())
    return s, tiers, nodes


# -- construction -------------------------------------------------------------------------


def test_construction_and_tiers():
    pool = MemPool(LAYOUT, 6, dram_blocks=3, dtype=torch.float16, instance_id="p0")
    assert pool.kv().shape == LAYOUT.pool_shape(6) and pool.kv().dtype == torch.float16
    assert pool.kv("dram").shape == LAYOUT.pool_shape(3)
    assert pool.kv("dram").device.type == "cpu"
    assert pool.tiers == ("hbm", "dram") and pool.capacity("dram") == 3
    assert (pool.block_size, pool.instance_id, pool.layout) == (BS, "p0", LAYOUT)
    assert not pool.kv().any()
    solo = MemPool(LAYOUT, 2)
    assert solo.tiers == ("hbm",)
    with pytest.raises(ValueError, match="no 'dram' tier"):
        solo.kv("dram")
    with pytest.raises(ValueError, match="unknown tier"):
        solo.alloc_mem(1, "ssd")
    with pytest.raises(ConfigError):
        MemPool(LAYOUT, 0)
    with pytest.raises(ConfigError):
        MemPool(LAYOUT, 2, dram_blocks=-1)
    with pytest.raises(TypeError):
        MemPool("layout", 2)


def test_tensor_factory_makes_every_tier_tensor():
    made = []

    def factory(shape, dtype, device):
        made.append((shape, dtype, torch.device(device).type))
        return torch.full(shape, 0.0, dtype=dtype, device=device)

    pool = MemPool(LAYOUT, 3, dram_blocks=2, tensor_factory=factory)
    assert made == [
        (LAYOUT.pool_shape(3), torch.float32, "cpu"),
        (LAYOUT.pool_shape(2), torch.float32, "cpu"),
    ]
    assert pool.kv().shape == LAYOUT.pool_shape(3)


@pytest.mark.skipif(torch.cuda.is_available(), reason="pinning works with CUDA")
def test_pinning_without_cuda_is_an_error():
    with pytest.raises(ConfigError, match="pin_memory"):
        MemPool(LAYOUT, 2, dram_blocks=2, pin_memory=True)


# -- alloc and free -----------------------------------------------------------------------


def test_alloc_and_free():
    pool = MemPool(LAYOUT, 4)
    a = pool.alloc_mem(3)
    assert len(set(a)) == 3 and all(pool.refcount(b) == 1 for b in a)
    assert pool.num_free() == 1 and pool.num_available() == 1
    pool.check()
    assert pool.stats()["hbm"] == {"total": 4, "free": 1, "referenced": 3, "cached_only": 0}
    pool.free_mem(a[:2])
    assert pool.num_free() == 3
    with pytest.raises(ValueError, match="double free"):
        pool.free_mem([a[2], a[2]])
    with pytest.raises(ValueError, match="out of range"):
        pool.free_mem([7])
    pool.check()


def test_free_of_the_index_reference_is_refused():
    pool = MemPool(LAYOUT, 4)
    blocks = cache(pool, seq(1, 2), [1, 2])
    before = state(pool)
    with pytest.raises(ValueError, match="reserved"):
        pool.free_mem(blocks[:1])
    held = pool.match(seq(1))
    with pytest.raises(ValueError, match="reserved"):
        pool.free_mem(held * 2)
    pool.free_mem(held)
    assert state(pool) == before


def test_failed_alloc_names_counts_and_changes_nothing():
    pool = MemPool(LAYOUT, 6, dram_blocks=2)
    cache(pool, seq(1, 2), [1, 2])
    held = pool.alloc_mem(3)
    before = state(pool)
    with pytest.raises(PoolExhausted, match=r"asked for 4 hbm blocks but only 1 are free and 2"):
        pool.alloc_mem(4)
    assert state(pool) == before
    assert pool.stats()["counters"]["evicted_blocks"] == 0
    assert pool.stats()["counters"]["offloaded_blocks"] == 0
    pool.free_mem(held)
    pool.check()


# -- insert, match, delete ----------------------------------------------------------------


def test_insert_takes_its_own_references_and_never_the_callers():
    pool = MemPool(LAYOUT, 8)
    blocks = prefill(pool, seq(1, 2, tail=2), [1, 2, 3])
    assert pool.insert(seq(1, 2, tail=2), blocks) == 2  # the partial block is not indexed
    assert [pool.refcount(b) for b in blocks] == [2, 2, 1]
    assert [pool.is_cached(b) for b in blocks] == [True, True, False]
    assert pool.stats()["hbm"]["referenced"] == 3
    pool.free_mem(blocks)
    assert pool.stats()["hbm"] == {"total": 8, "free": 6, "referenced": 0, "cached_only": 2}
    pool.check()


def test_insert_of_a_cached_prefix_keeps_the_index_blocks():
    pool = MemPool(LAYOUT, 8)
    first = cache(pool, seq(1, 2), [1, 2])
    dup = pool.alloc_mem(3)  # recomputed the same prefix without matching
    write(pool, dup, [5, 6, 7])
    assert pool.insert(seq(1, 2, 3), dup) == 1
    assert pool.cached_prefix_len(seq(1, 2, 3)) == 3 * BS
    pool.free_mem(dup)  # the two duplicates go back to the free list
    assert pool.stats()["hbm"]["free"] == 8 - 3
    got = pool.match(seq(1, 2, 3))
    assert got == first[:2] + dup[2:]
    assert read(pool, got) == [1, 2, 7]
    pool.free_mem(got)
    pool.check()


def test_insert_rejects_bad_blocks():
    pool = MemPool(LAYOUT, 8)
    cache(pool, seq(1), [1])
    (cached,) = pool.match(seq(1))
    pool.free_mem([cached])
    own = pool.alloc_mem(2)
    with pytest.raises(ValueError, match="not held by the caller"):
        pool.insert(seq(1), [cached])  # the index's reference is not the caller's
    with pytest.raises(ValueError, match="fill 2 blocks"):
        pool.insert(seq(1, 2), own[:1])
    with pytest.raises(ValueError, match="twice"):
        pool.insert(seq(5, 6), [own[0], own[0]])
    held = pool.match(seq(1))
    with pytest.raises(ValueError, match="already cached"):
        pool.insert(seq(7), held)  # a cached block under another prefix
    assert pool.insert([1, 2], own) == 0  # less than a block: nothing to index
    pool.free_mem(held + own)
    pool.check()


def test_match_holds_references_and_counts_hits():
    pool = MemPool(LAYOUT, 8)
    blocks = cache(pool, seq(1, 2, 3), [1, 2, 3])
    got = pool.match(seq(1, 2, 9, tail=1))
    assert got == blocks[:2]
    assert [pool.refcount(b) for b in got] == [2, 2]
    assert pool.cached_prefix_len(seq(1, 2, 9)) == 2 * BS
    assert pool.cached_prefix_len([1]) == 0 and pool.match([1]) == []
    c = pool.stats()["counters"]
    assert (c["hit_tokens"], c["query_tokens"]) == (2 * BS, 3 * BS + 3 * BS)  # cache() matched too
    pool.free_mem(got)
    pool.check()


def test_what_a_peer_sends_is_no_hit_of_the_receiving_cache():
    """A transfer's receiving side matches what it holds already (only the rest moves) without
    counting a query or a hit: those are prompts' lookups alone."""
    src, dst = MemPool(LAYOUT, 8), MemPool(LAYOUT, 8)
    cache(src, seq(1, 2, 3), [1, 2, 3])
    cache(dst, seq(1), [1])
    blocks = src.match(seq(1, 2, 3))  # held while they are sent
    before = dict(dst.stats()["counters"])
    got = src.transfer_with_insert(dst, seq(1, 2, 3), blocks)
    after = dst.stats()["counters"]
    assert len(got) == 3 and after["transfers_recv"] == before["transfers_recv"] + 1
    for key in ("query_tokens", "hit_tokens", "match_calls"):
        assert after[key] == before[key], key
    assert after["tiers"]["hbm"]["hit_tokens"] == before["tiers"]["hbm"]["hit_tokens"]
    dst.free_mem(got)
    src.free_mem(blocks)
    dst.check()


def test_delete_drops_the_unshared_suffix_and_extensions():
    pool = MemPool(LAYOUT, 12)
    a = cache(pool, seq(1, 2, 3, 4), [1, 2, 3, 4])
    cache(pool, seq(1, 2, 5), [1, 2, 5])
    held = pool.match(seq(1, 2, 3, 4))
    assert pool.delete(seq(1, 2, 3, 4)) == 2  # blocks 3, 4: below the branch at block 2
    assert pool.cached_prefix_len(seq(1, 2, 3, 4)) == 2 * BS
    assert pool.cached_prefix_len(seq(1, 2, 5)) == 3 * BS
    assert [pool.refcount(b) for b in held] == [2, 2, 1, 1]  # caller still holds 3, 4
    pool.free_mem(held)
    assert pool.refcount(a[3]) == 0
    pool.check()
    assert pool.delete(seq(1, 2, 7)) == 0  # diverges: the cached part is shared
    assert pool.delete(seq(8)) == 0
    assert pool.delete(seq(1)) == 3  # the whole tree extends [1]
    assert pool.index.num_blocks == 0
    assert pool.stats()["hbm"]["free"] == 12
    assert pool.stats()["counters"]["deleted_blocks"] == 5
    pool.check()


def test_delete_takes_shorter_sequences_inside_the_unshared_suffix():
    pool = MemPool(LAYOUT, 8)
    cache(pool, seq(1, 2), [1, 2])
    cache(pool, seq(1, 2, 3, 4), [1, 2, 3, 4])
    cache(pool, seq(5), [5])
    assert pool.delete(seq(1, 2, 3, 4)) == 4  # [1, 2] ends inside it: no sequence ends recorded
    assert pool.cached_prefix_len(seq(1, 2)) == 0
    assert pool.cached_prefix_len(seq(5)) == BS
    pool.check()


def test_leaf_not_fully_cached_is_deleted_when_query_ends_past_it():
    pool = MemPool(LAYOUT, 8)
    cache(pool, seq(1, 2), [1, 2])
    cache(pool, seq(3), [3])
    # the cached path [1, 2] is a leaf that nothing else shares
    assert pool.delete(seq(1, 2, 9)) == 2
    assert pool.cached_prefix_len(seq(3)) == BS
    pool.check()


# -- eviction -----------------------------------------------------------------------------


def test_eviction_takes_least_recently_used_leaves_first():
    pool = MemPool(LAYOUT, 6)
    cache(pool, seq(1, 2), [1, 2])
    cache(pool, seq(3, 4), [3, 4])
    cache(pool, seq(5, 6), [5, 6])
    pool.free_mem(pool.match(seq(1, 2)))  # [1, 2] is now the most recent
    got = pool.alloc_mem(2)
    assert pool.cached_prefix_len(seq(3, 4)) == 0
    assert pool.cached_prefix_len(seq(1, 2)) == 2 * BS
    assert pool.cached_prefix_len(seq(5, 6)) == 2 * BS
    assert pool.stats()["counters"]["evicted_blocks"] == 2
    pool.free_mem(got)
    pool.check()


def test_eviction_trims_tails_and_keeps_shared_prefixes_last():
    pool = MemPool(LAYOUT, 6)
    cache(pool, seq(1, 2, 3), [1, 2, 3])
    cache(pool, seq(1, 2, 4), [1, 2, 4])
    cache(pool, seq(7), [7])  # newest
    got = pool.alloc_mem(3)  # 1 free + the two leaves' tails (3 and 4)
    assert pool.cached_prefix_len(seq(1, 2, 3)) == 2 * BS
    assert pool.cached_prefix_len(seq(7)) == BS
    got += pool.alloc_mem(1)  # then the LRU leaf's tail: block 2 of the shared path
    assert pool.cached_prefix_len(seq(1, 2)) == BS
    assert pool.cached_prefix_len(seq(7)) == BS
    pool.free_mem(got)
    pool.check()


def test_eviction_heap_stays_bounded_and_is_rebuilt_when_lost():
    pools = [MemPool(LAYOUT, 64), MemPool(LAYOUT, 64)]
    for pool in pools:
        for i in range(8):
            cache(pool, seq(1, 2, 10 + i), [1, 2, 10 + i])
        for _ in range(2000):  # pins and unpins re-enter nodes; nothing is evicted
            pool.free_mem(pool.match(seq(1, 2, 13)))
        assert len(pool._store.tiers["hbm"].lru) <= 2 * pool.index.num_nodes + 1024
        pool.check()
    pools[1]._store.tiers["hbm"].lru.clear()  # lost: the next eviction walks the index instead
    with pytest.raises(PoolAccountingError, match="missing from the LRU heap"):
        pools[1].check()
    left = []
    for pool in pools:
        got = pool.alloc_mem(64 - 10 + 2)  # two cached blocks go: least recently used leaves
        left.append([pool.cached_prefix_len(seq(1, 2, 10 + i)) // BS for i in range(8)])
        pool.free_mem(got)
        pool.check()
    assert left[0] == left[1]
    assert sorted(left[0]) == [2, 2, 3, 3, 3, 3, 3, 3] and left[0][3] == 3  # 13: just used
    assert left[0][:2] == [2, 2]  # 10 and 11: the oldest


def test_delete_leaving_only_dram_children_makes_the_parent_an_eviction_candidate():
    pool = MemPool(LAYOUT, 4, dram_blocks=4)
    cache(pool, seq(1, 2, 3), [1, 2, 3])
    cache(pool, seq(1, 2, 4), [1, 2, 4])
    pool.free_mem(pool.match(seq(1, 2, 4)))
    got = pool.alloc_mem(1)  # the least recently used leaf, 3, goes to dram
    assert pool.stats()["counters"]["offloaded_blocks"] == 1
    assert pool.cached_prefix_len(seq(1, 2, 4)) == 3 * BS
    (prefix,) = [n for n in pool.index.nodes() if len(n.values) == 2]
    lru = pool._store.tiers["hbm"].lru
    lru[:] = [e for e in lru if e[2] is not prefix]  # its entry surfaced while not a leaf
    pool.check()
    assert pool.delete(seq(1, 2, 4)) == 1  # now its only child is in dram: a leaf of hbm
    pool.check()  # which eviction can find: it has an entry again
    pool.free_mem(got)
    pool.check()


def test_referenced_blocks_are_never_evicted():
    pool = MemPool(LAYOUT, 4)
    cache(pool, seq(1, 2, 3), [1, 2, 3])
    held = pool.match(seq(1))  # pins block 1: its children can go, it cannot
    assert pool.num_available() == 1 + 2
    got = pool.alloc_mem(3)
    assert pool.cached_prefix_len(seq(1, 2, 3)) == BS
    with pytest.raises(PoolExhausted):
        pool.alloc_mem(1)
    assert read(pool, held) == [1]
    pool.free_mem(got + held)
    pool.check()


def test_middle_reference_blocks_eviction_of_the_prefix_above_it():
    pool = MemPool(LAYOUT, 4)
    blocks = prefill(pool, seq(1, 2, 3), [1, 2, 3])
    pool.insert(seq(1, 2, 3), blocks)
    pool.free_mem([blocks[0], blocks[2]])  # still holds block 2 (the middle one)
    assert pool.num_available() == 1 + 1  # only the tail block 3 can go
    got = pool.alloc_mem(2)
    assert pool.cached_prefix_len(seq(1, 2, 3)) == 2 * BS
    pool.free_mem(got + [blocks[1]])
    pool.check()


# -- dram tier: offload, onload -----------------------------------------------------------


def test_offload_to_dram_and_onload_on_match_keep_the_data():
    pool = MemPool(LAYOUT, 4, dram_blocks=4)
    cache(pool, seq(1, 2, 3), [1.5, 2.5, 3.5])
    got = pool.alloc_mem(4)  # all three cached blocks move to dram
    c = pool.stats()["counters"]
    assert c["offloaded_blocks"] == 3 and c["evicted_blocks"] == 0
    assert pool.stats()["dram"]["cached_only"] == 3
    assert pool.cached_prefix_len(seq(1, 2, 3)) == 0  # hbm is full of held blocks
    pool.check()
    pool.free_mem(got[:2])
    assert pool.cached_prefix_len(seq(1, 2, 3)) == 2 * BS
    part = pool.match(seq(1, 2, 3))  # onloads what fits, stops at the first that does not
    assert read(pool, part) == [1.5, 2.5]
    assert pool.stats()["counters"]["onloaded_blocks"] == 2
    pool.check()
    pool.free_mem(got[2:])
    rest = pool.match(seq(1, 2, 3))
    assert rest[:2] == part and read(pool, rest) == [1.5, 2.5, 3.5]
    assert pool.stats()["dram"]["free"] == 4
    pool.free_mem(part + rest)
    pool.check()


def test_send_cached_sends_dram_blocks_in_one_copy_without_onloading_them():
    src, dst = MemPool(LAYOUT, 4, dram_blocks=4), MemPool(LAYOUT, 8)
    cache(src, seq(1, 2, 3), [1.5, 2.5, 3.5])
    held = src.alloc_mem(3)  # two of the three cached blocks move to dram
    src.free_mem(held[2:])
    cache(dst, seq(1), [1.5])  # dst already has the first block
    before = src.stats()["counters"]
    got = src.send_cached(dst, seq(1, 2, 3, tail=2))
    after = src.stats()["counters"]
    assert len(got) == 3 and read(dst, got) == [1.5, 2.5, 3.5]
    assert after["onloaded_blocks"] == before["onloaded_blocks"]  # nothing came to hbm first
    assert after["sent_blocks"] - before["sent_blocks"] == 2  # dst lacked two blocks
    assert after["dram_sent_blocks"] - before["dram_sent_blocks"] == 2  # both from dram
    assert dst.cached_prefix_len(seq(1, 2, 3)) == 3 * BS
    dst.free_mem(got)
    src.free_mem(held[:2])
    for pool in (src, dst):
        pool.check()
        assert pool.stats()["hbm"]["referenced"] == 0
    assert src.send_cached(dst, seq(7, 8)) == []  # nothing cached: nothing sent


def test_offload_evicts_dram_lru_when_dram_is_full():
    pool = MemPool(LAYOUT, 2, dram_blocks=2)
    cache(pool, seq(1, 2), [1, 2])
    pool.free_mem(pool.alloc_mem(2))  # [1, 2] to dram
    cache(pool, seq(3, 4), [3, 4])
    held = pool.alloc_mem(2)  # [3, 4] to dram, [1, 2] dropped from dram
    c = pool.stats()["counters"]
    assert (c["offloaded_blocks"], c["evicted_blocks"]) == (4, 2)
    assert pool.cached_prefix_len(seq(1, 2)) == 0
    pool.free_mem(held)
    got = pool.match(seq(3, 4))
    assert read(pool, got) == [3, 4]
    pool.free_mem(got)
    pool.check()


def test_onload_may_offload_other_cached_blocks():
    pool = MemPool(LAYOUT, 2, dram_blocks=4)
    cache(pool, seq(1, 2), [1, 2])
    pool.free_mem(pool.alloc_mem(2))  # [1, 2] in dram
    cache(pool, seq(3, 4), [3, 4])  # hbm full of cached [3, 4]
    got = pool.match(seq(1, 2))  # [3, 4] goes to dram to make room
    assert read(pool, got) == [1, 2]
    pool.free_mem(got)
    pool.check()
    got = pool.match(seq(3, 4))
    assert read(pool, got) == [3, 4]
    pool.free_mem(got)
    pool.check()


def test_insert_over_a_dram_prefix_takes_the_callers_hbm_blocks():
    pool = MemPool(LAYOUT, 3, dram_blocks=4)
    cache(pool, seq(1, 2), [1, 2])
    held = pool.alloc_mem(3)  # [1, 2] offloaded
    pool.free_mem(held)
    fresh = pool.alloc_mem(3)  # recomputed without matching
    write(pool, fresh, [10, 20, 30])
    assert pool.insert(seq(1, 2, 3), fresh) == 3
    assert pool.stats()["dram"]["free"] == 4
    pool.free_mem(fresh)
    got = pool.match(seq(1, 2, 3))
    assert got == fresh and read(pool, got) == [10, 20, 30]
    pool.free_mem(got)
    pool.check()


def test_partial_dram_prefix_upgrade_splits_the_node():
    pool = MemPool(LAYOUT, 3, dram_blocks=4)
    cache(pool, seq(1, 2, 3), [1, 2, 3])
    pool.free_mem(pool.alloc_mem(3))  # all three in dram, one node
    fresh = pool.alloc_mem(1)
    write(pool, fresh, [10])
    assert pool.insert(seq(1), fresh) == 1
    pool.check()
    pool.free_mem(fresh)
    got = pool.match(seq(1, 2, 3))
    assert read(pool, got) == [10, 2, 3]
    pool.free_mem(got)
    pool.check()


# -- transfer -----------------------------------------------------------------------------


def test_transfer_moves_data_and_hands_references_on_dst():
    src, dst = MemPool(LAYOUT, 4, instance_id="p"), MemPool(LAYOUT, 4, instance_id="d")
    blocks = src.alloc_mem(3)
    data = torch.randn(3, *LAYOUT.pool_shape(1)[1:])
    src.kv()[blocks] = data
    got = src.transfer(dst, blocks)
    assert torch.equal(dst.kv()[got], data)
    assert all(dst.refcount(b) == 1 for b in got)
    assert src.stats()["counters"]["sent_bytes"] == 3 * BLOCK_BYTES
    assert dst.stats()["counters"]["recv_bytes"] == 3 * BLOCK_BYTES
    assert src.stats()["counters"]["transfers_sent"] == 1
    assert dst.stats()["counters"]["transfers_recv"] == 1
    assert dst.index.num_blocks == 0
    src.check()
    dst.check()


def test_received_blocks_are_one_run_in_a_churned_pool():
    src, dst = MemPool(LAYOUT, 8), MemPool(LAYOUT, 8)
    dst.alloc_mem(8)
    dst.free_mem([7, 5, 3, 1, 6])  # free list 7, 5, 3, 1, 6: a plain alloc(3) gives 7, 5, 3
    blocks = src.alloc_mem(3)
    data = torch.randn(3, *LAYOUT.pool_shape(1)[1:])
    src.kv()[blocks] = data
    got = src.transfer(dst, blocks)
    assert got == [5, 6, 7]  # the free run, so the data lands in one piece
    assert torch.equal(dst.kv()[got], data)
    got2 = src.transfer(dst, blocks[:2])  # free now: 3 and 1, no run: the free list order
    assert got2 == [3, 1]
    assert torch.equal(dst.kv()[got2], data[:2])
    dst.free_mem(got + got2 + [0, 2, 4])
    src.free_mem(blocks)
    src.check()
    dst.check()


def test_transfer_with_insert_sends_only_the_missing_blocks():
    src, dst = MemPool(LAYOUT, 8), MemPool(LAYOUT, 8)
    cache(dst, seq(1, 2), [1, 2])
    toks = seq(1, 2, 3, 4, tail=1)
    blocks = prefill(src, toks, [1, 2, 3, 4, 5])
    got = src.transfer_with_insert(dst, toks, blocks)
    assert len(got) == 5
    assert read(dst, got) == [1, 2, 3, 4, 5]
    assert src.stats()["counters"]["sent_blocks"] == 3
    assert src.stats()["counters"]["sent_bytes"] == 3 * BLOCK_BYTES
    assert dst.stats()["counters"]["recv_bytes"] == 3 * BLOCK_BYTES
    assert dst.cached_prefix_len(toks) == 4 * BS
    assert [dst.refcount(b) for b in got] == [2, 2, 2, 2, 1]
    dst.free_mem(got)
    assert dst.stats()["hbm"] == {"total": 8, "free": 4, "referenced": 0, "cached_only": 4}
    src.free_mem(blocks)
    src.check()
    dst.check()


def test_transfer_with_insert_onloads_on_dst():
    src, dst = MemPool(LAYOUT, 8), MemPool(LAYOUT, 2, dram_blocks=2)
    cache(dst, seq(1, 2), [1, 2])
    dst.free_mem(dst.alloc_mem(2))  # dst's [1, 2] now in dram
    blocks = prefill(src, seq(1, 2), [1, 2])
    got = src.transfer_with_insert(dst, seq(1, 2), blocks)
    assert read(dst, got) == [1, 2]
    assert src.stats()["counters"]["sent_blocks"] == 0
    assert dst.stats()["counters"]["onloaded_blocks"] == 2
    dst.free_mem(got)
    dst.check()


class Boom(RuntimeError):
    pass


def test_failed_transfer_releases_everything_on_dst(monkeypatch):
    src, dst = MemPool(LAYOUT, 8), MemPool(LAYOUT, 8)
    cache(dst, seq(1), [1])
    toks = seq(1, 2, 3)
    blocks = prefill(src, toks, [1, 2, 3])
    before = state(dst)

    def fail(*args, **kwargs):
        raise Boom("link down")

    monkeypatch.setattr(dst, "recv_copy", fail)
    with pytest.raises(Boom):
        src.transfer_with_insert(dst, toks, blocks)
    assert state(dst) == before
    with pytest.raises(Boom):
        src.transfer(dst, blocks)
    assert state(dst) == before
    assert dst.stats()["counters"]["transfers_aborted"] == 2
    dst.check()
    src.check()


def test_transfer_to_a_full_dst_fails_cleanly():
    src, dst = MemPool(LAYOUT, 8), MemPool(LAYOUT, 2)
    cache(dst, seq(1), [1])
    held = dst.alloc_mem(1)
    blocks = prefill(src, seq(1, 2, 3), [1, 2, 3])
    before = state(dst)
    with pytest.raises(PoolExhausted):
        src.transfer_with_insert(dst, seq(1, 2, 3), blocks)
    assert state(dst) == before
    dst.free_mem(held)
    dst.check()


def test_refused_transfer_does_not_onload_on_dst():
    src, dst = MemPool(LAYOUT, 8), MemPool(LAYOUT, 3, dram_blocks=2)
    cache(dst, seq(1, 2), [1, 2])
    dst.free_mem(dst.alloc_mem(3))  # dst's [1, 2] now in dram
    held = dst.alloc_mem(1)  # 2 hbm blocks left: enough to onload, not for the rest too
    blocks = prefill(src, seq(1, 2, 3), [1, 2, 3])
    before = state(dst)
    with pytest.raises(PoolExhausted, match="needs 3 hbm blocks"):
        src.transfer_with_insert(dst, seq(1, 2, 3), blocks)
    assert state(dst) == before
    assert dst.stats()["counters"]["onloaded_blocks"] == 0
    dst.free_mem(held)
    dst.check()


def test_transfer_checks_its_arguments():
    src = MemPool(LAYOUT, 4)
    other = MemPool(KVLayout(1, BS, 1, 2), 4)
    half = MemPool(LAYOUT, 4, dtype=torch.float16)
    blocks = src.alloc_mem(2)
    for dst in (other, half):
        with pytest.raises(ValueError, match="layout or dtype"):
            src.transfer(dst, blocks)
    with pytest.raises(ValueError, match="free block"):
        src.transfer(MemPool(LAYOUT, 4), [3])
    with pytest.raises(ValueError, match="need 2 blocks"):
        src.transfer_with_insert(MemPool(LAYOUT, 4), seq(1, tail=1), blocks[:1] * 3)


def test_per_layer_layout_pool_moves_whole_blocks():
    layout = KVLayout(2, BS, 1, 2, kind=PER_LAYER)
    src, dst = MemPool(layout, 4, dram_blocks=2), MemPool(layout, 4)
    blocks = src.alloc_mem(2)
    data = torch.randn(layout.pool_shape(2))
    src.kv()[:, :, blocks] = data
    got = src.transfer(dst, blocks)
    assert torch.equal(dst.kv()[:, :, got], data)
    src.insert(seq(1, 2), blocks)
    src.free_mem(blocks)
    src.free_mem(src.alloc_mem(4))  # offload both cached blocks
    (node,) = src.index.nodes()
    assert node.tier == "dram" and torch.equal(src.kv("dram")[:, :, node.values], data)
    src.check()


# -- audit --------------------------------------------------------------------------------


def test_check_catches_unbalanced_books():
    pool = MemPool(LAYOUT, 4)
    blocks = cache(pool, seq(1, 2), [1, 2])
    pool.check()
    pool._store.tiers["hbm"].alloc.decref([blocks[0]])  # the index's reference vanishes
    with pytest.raises(PoolAccountingError, match="cached without a reference"):
        pool.check()
    pool = MemPool(LAYOUT, 4)
    blocks = cache(pool, seq(1, 2), [1, 2])
    pool._store.tiers["hbm"].indexed[blocks[1]] = 0
    with pytest.raises(PoolAccountingError, match="index flag"):
        pool.check()
    pool = MemPool(LAYOUT, 4)
    cache(pool, seq(1, 2), [1, 2])
    pool._store.tiers["hbm"].evictable += 1
    with pytest.raises(PoolAccountingError, match="3 blocks counted evictable, 2 are"):
        pool.check()
    pool = MemPool(LAYOUT, 4)
    (held,) = pool.alloc_mem(1)
    alloc = pool._store.tiers["hbm"].alloc
    alloc._free_map[held] = 1  # listed free while referenced
    alloc._free.append(held)
    with pytest.raises(PoolAccountingError, match="refcount 1 and is in the free list"):
        pool.check()
    assert issubclass(PoolAccountingError, AssertionError)


@pytest.mark.gpu
def test_cuda_pool_with_pinned_dram():
    pool = MemPool(LAYOUT, 4, dram_blocks=4, device="cuda")
    peer = MemPool(LAYOUT, 4, device="cuda")
    assert pool.kv().is_cuda and pool.kv("dram").is_pinned()
    cache(pool, seq(1, 2, 3), [1, 2, 3])
    pool.free_mem(pool.alloc_mem(4))  # offload
    got = pool.match(seq(1, 2, 3))  # onload
    assert read(pool, got) == [1, 2, 3]
    sent = pool.transfer_with_insert(peer, seq(1, 2, 3), got)
    assert read(peer, sent) == [1, 2, 3]
    pool.check()
    peer.check()
