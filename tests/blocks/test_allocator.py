"""BlockAllocator: free list, reference counts, and errors that leave the state unchanged."""

from __future__ import annotations

import pytest

from minimemserve.blocks.allocator import BlockAllocator
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
    assert a.decref([x, y]) == []
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
