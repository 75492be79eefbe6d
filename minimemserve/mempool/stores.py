"""Where a tier's blocks live. A store reads and writes whole blocks by id; what it holds is
decided by the pool's books (``tiers.TierStore``), never by the store."""

from __future__ import annotations

from array import array
from collections.abc import Sequence

import torch

from ..blocks.copy import move_blocks


class BlockStore:
    """The interface: ``read`` and ``write`` whole blocks. ``kv`` is the pool tensor when the
    blocks are one (the engine computes from it, transfers read it); ``intake`` and ``readable``
    are the books' hooks (:class:`~minimemserve.mempool.tiers.Tier`), ``None`` when every
    block is taken and every block reads back intact."""

    kv: torch.Tensor | None = None
    intake = None
    readable = None

    def read(self, ids: Sequence[int]) -> torch.Tensor:
        """The blocks ``ids``, stacked along the block dimension."""
        raise NotImplementedError

    def write(self, ids: Sequence[int], data: torch.Tensor, path: array) -> None:
        """Store ``data`` (blocks stacked along the block dimension) as ``ids``; ``path`` is the
        token path from the root through the last of them."""
        raise NotImplementedError

    def restored(self) -> list[tuple[array, list[int]]]:
        """What the store held at start, as ``(token path, block ids along it)``."""
        return []

    def stats(self) -> dict[str, int]:
        """The store's own counters (a write queue's, a checksum's)."""
        return {}

    def done(self) -> None:
        """The end of a pool call: forget what was staged for it."""

    def close(self) -> None:
        """Release what the store holds open (files, threads)."""


class TensorStore(BlockStore):
    """Blocks in one pool tensor (the compute device's or host memory), ``dim`` its block
    dimension."""

    def __init__(self, kv: torch.Tensor, dim: int) -> None:
        self.kv = kv
        self.dim = dim

    def read(self, ids: Sequence[int]) -> torch.Tensor:
        return self.kv.index_select(self.dim, torch.tensor(list(ids), device=self.kv.device))

    def write(self, ids: Sequence[int], data: torch.Tensor, path: array) -> None:
        move_blocks(self.kv, ids, data, range(len(ids)), self.dim)
