"""BlockAllocator: free list, reference counts, and errors that leave the state unchanged."""

from __future__ import annotations

import random

import hypothesis.strategies as st
import pytest
from hypothesis import given, settings

from minimemserve.blocks.allocator import BlockAllocator
from minimemserve.blocks.copy import is_run
from minimemserve.errors import PoolExhausted


def snapshot(a: BlockAllocator) -> tuple:
    return (list(a.refcounts()), a.free_blocks())


def test_alloc_gives_distinct_blocks_with_one_reference():
    a = BlockAllocator(8)
    got = a.alloc(5)
    assert len(set(got)) == 5 and all(0 <= b < 8 for b in got)
    assert all(a.refcount(b) == 1 for b in got)
    assert a.num_free == 3 and a.num_blocks == 8
    assert a.alloc(0) == []
    rest = a.alloc(3)
    assert sorted(got + rest) == list(range(8))
    assert a.num_free == 0


def test_exhausted_names_counts_and_changes_nothing():
    a = BlockAllocator(4)
    a.alloc(3)
    before = snapshot(a)
    with pytest.raises(PoolExhausted, match=r"asked for 2 blocks but only 1 of 4 are free"):
        a.alloc(2)
    assert snapshot(a) == before


def test_incref_decref_and_freeing():
    a = BlockAllocator(4)
    x, y = a.alloc(2)
    a.incref([x, x, y])
    assert a.refcount(x) == 3 and a.refcount(y) == 2
    a.share([y])  # unchecked, as for blocks an index hands out
    assert a.decref([x, y, y]) == []
    assert a.decref([x, x, y]) == [x, y]  # both reach zero; x listed once
    assert a.num_free == 4
    assert a.free_blocks()[-2:] == [x, y]  # freed blocks go to the back of the list


def test_double_free_is_rejected_atomically():
    a = BlockAllocator(4)
    x, y = a.alloc(2)
    a.decref([y])
    before = snapshot(a)
    with pytest.raises(ValueError, match="already free"):
        a.decref([x, y])
    with pytest.raises(ValueError, match="double free"):
        a.decref([x, x])
    assert snapshot(a) == before
    with pytest.raises(ValueError, match="is free"):
        a.incref([y])


@pytest.mark.parametrize("bad", [-1, 4, 100, True, 1.0, "1"])
def test_bad_block_ids(bad):
    a = BlockAllocator(4)
    a.alloc(4)
    before = snapshot(a)
    for call in (a.incref, a.decref):
        with pytest.raises(ValueError, match="out of range"):
            call([0, bad])
    with pytest.raises(ValueError, match="out of range"):
        a.refcount(bad)
    assert snapshot(a) == before


@pytest.mark.parametrize("bad", [-1, 2.0, None, True])
def test_bad_counts(bad):
    with pytest.raises(ValueError):
        BlockAllocator(bad)
    with pytest.raises(ValueError):
        BlockAllocator(2).alloc(bad)


def test_empty_allocator():
    a = BlockAllocator(0)
    assert a.num_free == 0 and a.alloc(0) == []
    with pytest.raises(PoolExhausted):
        a.alloc(1)


def scrambled(num_blocks: int, seed: int = 0) -> BlockAllocator:
    """An allocator whose free list is in random order: everything taken, freed shuffled."""
    a = BlockAllocator(num_blocks)
    held = a.alloc(num_blocks)
    random.Random(seed).shuffle(held)
    a.decref(held)
    return a


def test_contiguous_alloc_takes_the_lowest_run_and_skips_it_later():
    a = scrambled(16)
    assert not is_run(a.free_blocks()[:4])  # plain alloc would scatter
    run = a.alloc(4, contiguous=True)
    assert run == [0, 1, 2, 3]
    assert a.num_free == 12 and len(a.free_blocks()) == 12
    assert not set(run) & set(a.free_blocks())
    rest = a.alloc(12)  # the run's stale queue entries are skipped, never handed out again
    assert sorted(run + rest) == list(range(16)) and a.num_free == 0
    a.decref([5, 6, 9])
    assert a.alloc(2, contiguous=True) == [5, 6]
    assert a.alloc(1, contiguous=True) == [9]


def test_contiguous_alloc_without_a_run_falls_back_to_the_free_list():
    a = BlockAllocator(8)
    held = a.alloc(8)
    a.decref(held[::2])  # free: 0, 2, 4, 6
    got = a.alloc(3, contiguous=True)
    assert got == [0, 2, 4] and a.num_free == 1


def test_freeing_a_run_block_twice_is_still_a_double_free():
    a = scrambled(8)
    x = a.alloc(3, contiguous=True)
    a.decref(x)
    with pytest.raises(ValueError, match="already free"):
        a.decref(x[:1])
    assert sorted(a.free_blocks()) == list(range(8)) and a.num_free == 8


@settings(max_examples=60, deadline=None)
@given(
    num_blocks=st.integers(1, 24),
    ops=st.lists(
        st.tuples(st.sampled_from(["alloc", "run", "free"]), st.integers(0, 30)), max_size=80
    ),
)
def test_allocator_matches_a_set_model(num_blocks, ops):
    """Against a plain set of free ids: nothing is handed out twice, counts agree, and a
    contiguous request gets a run whenever the free ids hold one."""
    a = BlockAllocator(num_blocks)
    free, held = set(range(num_blocks)), []
    for op, k in ops:
        if op == "free":
            if held:
                b = held.pop(k % len(held))
                assert a.decref([b]) == [b]
                free.add(b)
            continue
        n = k % (num_blocks + 2)
        if n > len(free):
            with pytest.raises(PoolExhausted):
                a.alloc(n, contiguous=op == "run")
            continue
        got = a.alloc(n, contiguous=op == "run")
        assert len(got) == n and set(got) <= free
        if op == "run" and any(set(range(s, s + n)) <= free for s in range(num_blocks)):
            assert n == 0 or got == list(range(got[0], got[0] + n))
        free -= set(got)
        held += got
        listed = a.free_blocks()
        assert a.num_free == len(free) == len(listed) and set(listed) == free
    assert len(a._free) <= 2 * num_blocks + 64 + num_blocks  # stale entries are dropped


def test_stale_entries_are_compacted():
    a = BlockAllocator(4)
    for _ in range(200):  # every round leaves four stale entries behind
        a.decref(a.alloc(4, contiguous=True))
    assert len(a._free) <= 2 * 4 + 64 + 4
    assert sorted(a.free_blocks()) == [0, 1, 2, 3]
