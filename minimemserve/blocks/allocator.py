"""A refcounted block allocator: a free list and one reference count per block id.

Plain Python. Free blocks come from a first-in, first-out queue or, on request, as one
ascending run of ids found in a byte map of the free blocks (``bytes.find``, a C-speed
scan); a block taken in a run stays queued as a stale entry, skipped when it comes up.
Every call validates its whole argument first: a call that raises changes nothing."""

from __future__ import annotations

from collections import deque
from collections.abc import Iterable, Sequence

from minimemserve.errors import PoolExhausted


class BlockAllocator:
    """Block ids ``0 .. num_blocks - 1``, each with a reference count (0: free). ``alloc`` hands out
    free blocks at count 1 (recently freed last); ``incref`` adds holders, ``decref`` drops them."""

    def __init__(self, num_blocks: int) -> None:
        if not isinstance(num_blocks, int) or isinstance(num_blocks, bool) or num_blocks < 0:
            raise ValueError(f"num_blocks must be a non-negative int, got {num_blocks!r}")
        self._num_blocks = self._num_free = num_blocks
        self._free: deque[int] = deque(range(num_blocks))  # may hold stale ids, skipped
        self._free_map = bytearray(b"\x01") * num_blocks  # 1 where the block is free
        self._refcount: list[int] = [0] * num_blocks
        self._no_floor = bytes(num_blocks)  # decref's floor when none is given

    @property
    def num_blocks(self) -> int:
        """Total blocks managed."""
        return self._num_blocks

    @property
    def num_free(self) -> int:
        """Blocks with no reference."""
        return self._num_free

    def alloc(self, n: int, contiguous: bool = False) -> list[int]:
        """Take ``n`` free blocks with count 1: with ``contiguous``, the lowest free run
        ``[b, b + n)`` when there is one (a transfer then lands in one piece)."""
        if not isinstance(n, int) or isinstance(n, bool) or n < 0:
            raise ValueError(f"block count must be a non-negative int, got {n!r}")
        if n > self._num_free:
            raise PoolExhausted(
                f"asked for {n} blocks but only {self._num_free} of {self._num_blocks} are free"
            )
        rc, free_map, free = self._refcount, self._free_map, self._free
        start = free_map.find(b"\x01" * n) if contiguous and n > 1 else -1
        if start >= 0:
            out = list(range(start, start + n))
        elif len(free) == self._num_free:  # no stale entry: each free block queued once
            out = [free.popleft() for _ in range(n)]
        else:
            out = []
            while len(out) < n:
                b = free.popleft()
                if free_map[b]:  # else stale: taken by a run since it was queued
                    free_map[b] = 0
                    out.append(b)
        for b in out:
            rc[b] = 1
            free_map[b] = 0  # a run's queue entries are now stale
        self._num_free -= n
        return out

    def take(self, blocks: Sequence[int]) -> None:
        """Take the given free blocks with count 1 (a store restoring the ids it holds)."""
        blocks = list(blocks)
        for b in blocks:
            self.check_id(b)
            if not self._free_map[b]:
                raise ValueError(f"block {b} is not free")
        if len(set(blocks)) != len(blocks):
            raise ValueError("take got the same block id twice")
        for b in blocks:
            self._free_map[b] = 0  # its queue entry is now stale
            self._refcount[b] = 1
        self._num_free -= len(blocks)

    def incref(self, blocks: Iterable[int]) -> None:
        """Add one reference to each block (a block listed twice gains two)."""
        blocks = list(blocks)
        rc, n = self._refcount, self._num_blocks
        for b in blocks:
            if type(b) is not int or not 0 <= b < n or not rc[b]:
                self.check_id(b)
                raise ValueError(f"block {b} is free: take it with alloc, not incref")
        self.share(blocks)

    def share(self, blocks: Iterable[int]) -> None:
        """``incref`` without checks, for ids known to be held already (an index's blocks)."""
        rc = self._refcount
        for b in blocks:
            rc[b] += 1

    def decref(self, blocks: Iterable[int], floor: Sequence[int] | None = None) -> list[int]:
        """Drop one reference from each block; return the blocks that became free.
        ``floor[b]`` references of block ``b``, when given, are someone else's to drop."""
        blocks = list(blocks)
        rc, n = self._refcount, self._num_blocks
        reserved = self._no_floor if floor is None else floor
        freed = []
        for i, b in enumerate(blocks):
            if type(b) is not int or not 0 <= b < n or rc[b] <= reserved[b]:
                self.share(blocks[:i])  # undo, then say why
                self.check_id(b)
                if reserved[b]:
                    raise ValueError(
                        f"block {b} has {rc[b]} reference(s), {reserved[b]} of them "
                        "reserved: none is left to drop"
                    )
                raise ValueError(f"block {b} is already free (double free)")
            r = rc[b] - 1
            rc[b] = r
            if not r:
                freed.append(b)
        for b in freed:
            self._free_map[b] = 1
        self._free.extend(freed)
        self._num_free += len(freed)
        if len(self._free) > 2 * self._num_blocks + 64:
            self._free = deque(self.free_blocks())  # drop the stale entries
        return freed

    def refcount(self, block: int) -> int:
        """Current reference count of ``block``."""
        self.check_id(block)
        return self._refcount[block]

    def refcounts(self) -> Sequence[int]:
        """Every block's count, indexed by block id: a live view, never to be modified."""
        return self._refcount

    def free_blocks(self) -> list[int]:
        """The free blocks in the order ``alloc`` would hand them out (for audits)."""
        return list(dict.fromkeys(b for b in self._free if self._free_map[b]))  # each once

    def check_id(self, b: int) -> None:
        """Raise ValueError unless ``b`` is a block id of this allocator."""
        if type(b) is not int or not 0 <= b < self._num_blocks:
            raise ValueError(f"block id {b!r} out of range [0, {self._num_blocks}) or not an int")

    def __repr__(self) -> str:
        return f"BlockAllocator(num_blocks={self._num_blocks}, free={self._num_free})"
