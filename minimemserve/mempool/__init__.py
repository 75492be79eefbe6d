"""MemPool: the elastic KV memory pool, its tiers and its block-granular radix index."""

from minimemserve.mempool.chain import DISK, DRAM, HBM, TIERS, Disk, Dram, TierSpec
from minimemserve.mempool.pool import MemPool, push_cached
from minimemserve.mempool.radix import RadixTree, as_tokens
from minimemserve.mempool.tiers import PoolAccountingError
from minimemserve.mempool.transfer import KVReceiver

__all__ = [
    "push_cached",
    "DISK",
    "DRAM",
    "Disk",
    "Dram",
    "TierSpec",
    "HBM",
    "TIERS",
    "KVReceiver",
    "MemPool",
    "PoolAccountingError",
    "RadixTree",
    "as_tokens",
]
