"""MemPool: the elastic KV memory pool, its tiers and its block-granular radix index."""

from minimemserve.mempool.pool import DRAM, HBM, TIERS, MemPool, PoolAccountingError
from minimemserve.mempool.radix import Match, RadixNode, RadixTree, as_tokens

__all__ = [
    "DRAM",
    "HBM",
    "TIERS",
    "Match",
    "MemPool",
    "PoolAccountingError",
    "RadixNode",
    "RadixTree",
    "as_tokens",
]
