"""The aggregated KV block layout: one block holds all 2*L layer pieces of a token range."""

from __future__ import annotations

import math
from dataclasses import dataclass

AGGREGATED = "aggregated"  # [num_blocks, L, 2, block_size, n_kv_heads, head_dim]
PER_LAYER = "per_layer"  # [L, 2, num_blocks, block_size, n_kv_heads, head_dim], baseline only


@dataclass(frozen=True)
class KVLayout:
    """Shape of one KV block. In the aggregated layout a pool tensor is ``[num_blocks,
    num_layers, 2, block_size, num_kv_heads, head_dim]``: block ``b`` is one contiguous chunk
    holding K and V of every layer for ``block_size`` tokens."""

    num_layers: int
    block_size: int
    num_kv_heads: int
    head_dim: int
    kind: str = AGGREGATED

    def __post_init__(self) -> None:
        for name in ("num_layers", "block_size", "num_kv_heads", "head_dim"):
            if getattr(self, name) <= 0:
                raise ValueError(f"KVLayout.{name} must be positive, got {getattr(self, name)}")
        if self.kind not in (AGGREGATED, PER_LAYER):
            raise ValueError(f"unknown KV layout kind {self.kind!r}")

    def block_bytes(self, element_size: int) -> int:
        """Bytes in one block (all layers, K and V) for an element size in bytes."""
        return math.prod(self.pool_shape(1)) * element_size

    @property
    def block_dim(self) -> int:
        """The dimension of a pool tensor that indexes blocks."""
        return 0 if self.kind == AGGREGATED else 2

    def pool_shape(self, num_blocks: int) -> tuple[int, ...]:
        """Shape of a pool tensor holding ``num_blocks`` blocks in this layout."""
        tail = (self.block_size, self.num_kv_heads, self.head_dim)
        if self.kind == AGGREGATED:
            return (num_blocks, self.num_layers, 2, *tail)
        return (self.num_layers, 2, num_blocks, *tail)

    def num_blocks_for(self, num_tokens: int) -> int:
        """Blocks needed to hold ``num_tokens`` tokens."""
        return -(-num_tokens // self.block_size)


def layer_views(pool, layout: KVLayout, layer: int):
    """K and V views of one layer, each ``[num_blocks, block_size, n_kv_heads, head_dim]``,
    in either layout (kernels read them through strides)."""
    if layout.kind == AGGREGATED:
        return pool[:, layer, 0], pool[:, layer, 1]
    return pool[layer, 0], pool[layer, 1]
