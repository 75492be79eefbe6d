"""The MemPool of a tensor-parallel instance (:class:`ShardedPool`): one set of block ids for
every rank, each rank's KV heads in its own shard."""

from __future__ import annotations

import dataclasses
from collections import Counter
from collections.abc import Sequence
from typing import Any

import torch

from ..blocks.copy import check_pool_tensor
from ..blocks.layout import AGGREGATED, KVLayout
from ..errors import ConfigError
from ..mempool import KVReceiver, MemPool
from ..mempool.tiers import HBM


class ShardedPool(MemPool):
    """The MemPool of a tensor-parallel instance, on rank 0: it keeps the books for every rank
    (one set of block ids), its tensor holds rank 0's heads and the workers hold the others.
    A transfer moves each head slice between the rank holding it and the rank needing it,
    one message per rank pair with every block of the transfer; ``moved`` counts the pieces
    (one block's slice) and bytes per ``("sent" | "received", rank)``."""

    def __init__(self, layout: KVLayout, num_blocks: int, *, group: Any, **kwargs):
        # ``group``: the TPGroup that builds this pool (tp_group imports this module)
        if layout.kind != AGGREGATED:
            raise ConfigError("a tensor-parallel pool uses the aggregated block layout")
        super().__init__(layout, num_blocks, **kwargs)
        self.group = group
        self._model_layout = dataclasses.replace(
            layout, num_kv_heads=group.shard.cfg.num_key_value_heads
        )
        self.block_bytes = self._model_layout.block_bytes(self.dtype.itemsize)
        self.moved: Counter = Counter()
        # each KV head is sent from the first rank holding it; every rank holding it receives it
        heads = [(s.kv_start, s.kv_start + s.kv_heads) for s in group.shards]
        first = {h: r for r, (a, b) in reversed(list(enumerate(heads))) for h in range(a, b)}
        self._holds = heads
        self._owns = [
            sorted(h for h, r in first.items() if r == rank) for rank in range(group.size)
        ]

    @property
    def model_layout(self) -> KVLayout:
        """The layout of the whole model's KV (every head)."""
        return self._model_layout

    def _count(self, what: str, rank: int, piece: torch.Tensor) -> None:
        self.moved[(what, rank, "pieces")] += piece.shape[0]
        self.moved[(what, rank, "bytes")] += piece.numel() * piece.element_size()

    def copy_tier(self, dst: str, dst_ids: list[int], src: str, src_ids: list[int]) -> None:
        """Offload or onload: rank 0 copies its shard, and every worker the same blocks of its."""
        super().copy_tier(dst, dst_ids, src, src_ids)
        self.group.move_kv(dst, dst_ids, src, src_ids)

    def send_blocks(
        self, dst: KVReceiver, blocks: list[int], src: list[int], tier: str = HBM
    ) -> None:
        """Gather every head of ``src`` (in ``tier``) from the ranks owning them, write it
        into ``dst``: from dram straight, each rank reading its own shard."""
        whole = torch.empty(
            self._model_layout.pool_shape(len(src)), dtype=self.dtype, device=self.device
        )
        ids = torch.tensor(src, device=self.device)
        for rank, owned in enumerate(self._owns):
            if not owned:
                continue
            (lo, hi), start = (owned[0], owned[-1] + 1), self._holds[rank][0]
            held = (
                self.kv(tier).index_select(0, ids)
                if rank == 0
                else self.group.pull_kv(rank, src, tier)
            )
            piece = held[..., lo - start : hi - start, :]
            whole[..., lo:hi, :] = piece
            self._count("sent", rank, piece)
        dst.recv_copy(blocks, whole, range(len(src)))

    def recv_copy(self, blocks: Sequence[int], src: torch.Tensor, src_ids: Sequence[int]) -> None:
        """Blocks ``src_ids`` of a whole-model pool tensor ``src`` into ``blocks``: each
        rank's heads go to that rank."""
        check_pool_tensor(self._model_layout, self.dtype, src, "recv_copy")
        blocks = self.held_blocks(blocks, "recv_copy into")
        whole = src.index_select(0, torch.tensor(list(src_ids), device=src.device))
        whole = whole.to(self.device)
        for rank, (lo, hi) in enumerate(self._holds):
            piece = whole[..., lo:hi, :]
            if rank == 0:
                self.kv().index_copy_(0, torch.tensor(blocks, device=self.device), piece)
            else:
                self.group.push_kv(rank, blocks, piece)
            self._count("received", rank, piece)
        self.counters["recv_blocks"] += len(blocks)
        self.counters["recv_bytes"] += len(blocks) * self.block_bytes
