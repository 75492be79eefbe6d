"""MemPool's tier moves in virtual time. The engine moves blocks between tiers inside its step
(a hit is promoted to hbm when ``match`` admits a request, a block demoted when an allocation
evicts), so the step waits for them; a disk tier's writes alone are queued off the step path.
:class:`TierPrices` prices each move at the hardware profile's per-GPU bandwidths
(:class:`~minimemserve.sim.profiles.TierLink`) times the GPUs of an instance: a promotion
passes every link between its tier and hbm (disk -> dram -> hbm), a demotion the one link
down. :class:`QueuedDisk` is a disk tier whose write queue drains at the disk's write
bandwidth in virtual time: a block that finds the queue full is dropped, as the engine's is."""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch

from minimemserve.mempool.chain import DISK, Disk, Dram, StoreContext, TierSpec
from minimemserve.mempool.disk import queue_blocks_for
from minimemserve.mempool.stores import BlockStore, TensorStore

from .profiles import GB, TierLink


class TierPrices:
    """Seconds a move between tiers of ``chain`` costs the step, an instance of ``gpus`` GPUs
    moving its shards in parallel over ``links`` (by the lower tier's name)."""

    def __init__(self, links: dict[str, TierLink], chain: Sequence[str], gpus: int) -> None:
        missing = [t for t in chain[1:] if t not in links]
        if missing:
            raise ValueError(f"the hardware profile prices no link to the tier(s) {missing}")
        self.links = links
        self.rank = {name: i for i, name in enumerate(chain)}
        self.chain = tuple(chain)
        self.gpus = gpus

    def seconds(self, src: str, dst: str, nbytes: int) -> float:
        """What the step waits for ``nbytes`` moved from tier ``src`` to ``dst``."""
        a, b = self.rank[src], self.rank[dst]
        if b < a:  # up: through every link from src to dst
            passed = self.chain[b + 1 : a + 1]
            return sum(nbytes / (self.links[t].up_gb_per_s * GB * self.gpus) for t in passed)
        link = self.links[dst]
        return nbytes / (link.down_gb_per_s * GB * self.gpus) if link.down_waits else 0.0


class QueuedDiskStore(TensorStore):
    """A simulated disk's blocks (a ``meta`` tensor) behind a write queue of ``queue_blocks``
    that drains ``block_s`` seconds a block on the cluster's ``clock``."""

    def __init__(
        self, kv: torch.Tensor, dim: int, block_s: float, queue_blocks: int, clock: Callable
    ) -> None:
        super().__init__(kv, dim)
        self.block_s = block_s
        self.queue_blocks = queue_blocks
        self.clock = clock
        self.busy_until = 0.0  # when the writer has written every block queued so far
        self.refused = 0

    def intake(self, n: int) -> int:
        """As many of ``n`` blocks as the queue has room for now; they join its end."""
        now = self.clock()
        busy = max(self.busy_until, now)
        waiting = (busy - now) / self.block_s
        got = max(0, min(n, int(self.queue_blocks - waiting + 1e-9)))
        self.busy_until = busy + got * self.block_s
        self.refused += n - got
        return got

    def stats(self) -> dict[str, int]:
        return {"write_refused": self.refused}


class QueuedDisk(Disk):
    """The disk tier of a simulated pool: a capacity, and a write queue priced by ``link``."""

    def __init__(self, blocks: int, link: TierLink, gpus: int, clock: Callable) -> None:
        super().__init__(blocks)
        self.rate = link.down_gb_per_s * GB * gpus  # bytes/s the instance's share writes
        self.clock = clock

    def store(self, ctx: StoreContext) -> BlockStore:
        plain = super().store(ctx)
        block_bytes = ctx.layout.block_bytes(ctx.dtype.itemsize)
        queue = queue_blocks_for(block_bytes)
        return QueuedDiskStore(plain.kv, plain.dim, block_bytes / self.rate, queue, self.clock)


def sim_chain(
    dram_blocks: int, disk_blocks: int, links: dict[str, TierLink] | None, gpus: int, clock
) -> list[TierSpec]:
    """The tiers below hbm of a simulated pool: capacities, the disk's queue priced when the
    hardware gives ``links``."""
    tiers: list[TierSpec] = [Dram(dram_blocks)] if dram_blocks else []
    if disk_blocks and links is not None and DISK in links:
        tiers.append(QueuedDisk(disk_blocks, links[DISK], gpus, clock))
    elif disk_blocks:
        tiers.append(Disk(disk_blocks))
    return tiers
