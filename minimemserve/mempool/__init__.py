"""MemPool: the elastic KV memory pool, its tiers and its block-granular radix index."""

from minimemserve.mempool.pool import MemPool
from minimemserve.mempool.radix import Match, RadixNode, RadixTree, as_tokens
from minimemserve.mempool.tiers import DRAM, HBM, TIERS, PoolAccountingError

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
