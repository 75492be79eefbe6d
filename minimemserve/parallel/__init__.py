"""Tensor parallelism: one instance's model split Megatron-style over ranks on torch.distributed.

Rank 0 is the engine: its scheduler and its MemPool decide everything (which requests run,
every block id, match, insert, eviction). Ranks 1..N-1 are worker processes (spawned, daemonic)
that hold one model shard and one KV shard tensor indexed by the same block ids; they own no
pool and decide nothing. Each step rank 0 announces the step over a gloo control group: the
token ids, each sequence's ``(num_computed, num_new, block table)`` and the rows to sample.
Every rank then runs its shard of the forward pass on the compute group (gloo on CPU, NCCL on
CUDA). The pool moves KV between blocks only in transfers and between tiers (offload to
dram, onload back): ``ShardedPool`` tells the workers of both (each KV head goes between the
rank holding it and the rank needing it; a tier move is mirrored by every rank on its own
shard); otherwise the step announcement is all a worker needs to keep its shard in step with
rank 0's pool.

What is split where (``r`` = rank, ``n`` = tensor-parallel size):

- ``q/k/v`` and ``gate/up`` projections: column-parallel, rank r computes its heads / its
  slice of the intermediate features; ``o`` and ``down``: row-parallel over the same slices,
  then one all-reduce each (two per layer);
- KV heads: split when ``num_kv_heads >= n``, else each head replicated on
  ``n / num_kv_heads`` ranks (the ranks whose query heads share it);
- embedding: vocabulary-parallel (rank r looks up its rows, zeros elsewhere, one all-reduce);
- LM head: vocabulary-parallel, the logits all-gathered (rank 0 samples).

Every wait of rank 0 has a deadline (``EngineConfig.collective_timeout_s`` per collective or
message): a worker that misses it, stopped, slow or cut off, is killed and its instance fails
with ``InstanceDied``, as when it dies. A worker exits when rank 0 closes the group, when rank
0's process ends (its connections close, and a watchdog thread waits on the parent), or when a
step's collectives time out. Every socket of the group (the store, gloo's pairs) listens on
loopback only.

Where each part lives: :mod:`.shard` (what a rank holds), :mod:`.layers` (the parallel layers,
put in the model after construction), :mod:`.groups` (process groups, the step announcement),
:mod:`.store` (the store ranks meet in), :mod:`.tp_group` (rank 0), :mod:`.pool`
(``ShardedPool``), :mod:`.worker` (ranks 1..N-1)."""

from __future__ import annotations

from .groups import decode_step, encode_step
from .layers import build_model
from .pool import ShardedPool
from .shard import TPShard, shard_weights
from .store import LOOPBACK, HostStore
from .tp_group import SingleRank, TPGroup

__all__ = [
    "LOOPBACK",
    "HostStore",
    "ShardedPool",
    "SingleRank",
    "TPGroup",
    "TPShard",
    "build_model",
    "decode_step",
    "encode_step",
    "shard_weights",
]
