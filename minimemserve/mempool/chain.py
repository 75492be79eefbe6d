"""The tiers of a MemPool, one ordered chain: ``hbm`` (the compute device), then each tier
below it. A tier is a name, a capacity in blocks and the store its blocks live in; moving
a block down or up the chain is the pool's business (``tiers.TierStore``), never the
tier's. A new tier is one class here (its store) and one entry in the list a pool is given:
``MemPool(layout, n, tiers=[Dram(64), Disk(256, directory=...)])``. The simulator prices the
moves with the bandwidths its hardware profile names for each tier (``sim/profiles.py``)."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import ClassVar

import torch

from ..blocks.layout import KVLayout
from ..errors import ConfigError
from .disk import DiskStore
from .stores import BlockStore, TensorStore
from .tiers import TierStore

HBM = "hbm"
DRAM = "dram"
DISK = "disk"


@dataclass(frozen=True)
class StoreContext:
    """What a tier needs to build its store: the pool's layout, dtype and compute device,
    whether host memory is pinned, the tensor factory (the simulator's ``meta`` tensors) and
    the model the KV belongs to (a persistent store keeps it to refuse another model's)."""

    layout: KVLayout
    dtype: torch.dtype
    device: torch.device
    pin: bool
    tensor_factory: Callable[..., torch.Tensor] | None
    model: str

    def tensor(self, num_blocks: int, device: torch.device, pin: bool) -> TensorStore:
        """A tensor store of ``num_blocks`` zero-filled blocks on ``device``."""
        shape, dim = self.layout.pool_shape(num_blocks), self.layout.block_dim
        if self.tensor_factory is not None:
            return TensorStore(self.tensor_factory(shape, self.dtype, device), dim)
        return TensorStore(torch.zeros(shape, dtype=self.dtype, device=device, pin_memory=pin), dim)


class TierSpec:
    """One tier of a chain: its ``name`` and ``blocks`` (capacity); ``store`` builds the place
    its blocks live. The base class keeps them in host memory."""

    name: ClassVar[str]

    def __init__(self, blocks: int) -> None:
        if not isinstance(blocks, int) or isinstance(blocks, bool) or blocks < 1:
            raise ConfigError(f"{self.name}_blocks must be an int >= 1, got {blocks!r}")
        self.blocks = blocks

    def store(self, ctx: StoreContext) -> BlockStore:
        """Where this tier's blocks live: host memory, pinned when the pool pins."""
        return ctx.tensor(self.blocks, torch.device("cpu"), ctx.pin)

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self.blocks})"


class Hbm(TierSpec):
    """The top of every chain: the pool tensor the model computes from."""

    name = HBM

    def store(self, ctx: StoreContext) -> BlockStore:
        return ctx.tensor(self.blocks, ctx.device, False)


class Dram(TierSpec):
    """Host memory below the compute device (pinned when CUDA is present)."""

    name = DRAM


class Disk(TierSpec):
    """A local disk: one file per block under ``directory``, written off the step path,
    checked on every read, kept across restarts (:class:`~minimemserve.mempool.disk.DiskStore`).
    Without a directory (the simulator) it is a capacity on the pool's tensor factory."""

    name = DISK

    def __init__(
        self, blocks: int, directory: str | Path | None = None, queue_blocks: int | None = None
    ) -> None:
        super().__init__(blocks)
        self.directory = None if directory is None else Path(directory)
        self.queue_blocks = queue_blocks

    def store(self, ctx: StoreContext) -> BlockStore:
        if self.directory is None:
            if ctx.tensor_factory is None:
                raise ConfigError("disk_blocks needs disk_dir: the directory its files go in")
            return ctx.tensor(self.blocks, torch.device("cpu"), False)
        return DiskStore(
            self.directory, self.blocks, ctx.layout, ctx.dtype, ctx.model, self.queue_blocks
        )


TIERS = (HBM, DRAM, DISK)  # the names of the chain the keyword shorthands build


def default_chain(
    dram_blocks: int = 0, disk_blocks: int = 0, disk_dir: str | Path | None = None
) -> list[TierSpec]:
    """The tiers below ``hbm`` that ``dram_blocks`` / ``disk_blocks`` / ``disk_dir`` ask for."""
    for name, value in (("dram_blocks", dram_blocks), ("disk_blocks", disk_blocks)):
        if not isinstance(value, int) or isinstance(value, bool) or value < 0:
            raise ConfigError(f"{name} must be an int >= 0, got {value!r}")
    if disk_dir is not None and not disk_blocks:
        raise ConfigError("disk_dir needs disk_blocks: the disk tier's capacity in blocks")
    tiers: list[TierSpec] = [Dram(dram_blocks)] if dram_blocks else []
    return tiers + ([Disk(disk_blocks, disk_dir)] if disk_blocks else [])


def full_chain(num_blocks: int, dram_blocks: int, below: Sequence[TierSpec] | None) -> list:
    """A pool's whole chain: hbm of ``num_blocks``, then ``below`` or a dram tier of
    ``dram_blocks`` (not both); each tier named once."""
    if below is not None and dram_blocks:
        raise ConfigError("give the tiers below hbm as tiers=[...] or by size, not both")
    chain = [Hbm(num_blocks), *(default_chain(dram_blocks) if below is None else below)]
    names = [t.name for t in chain]
    if len(set(names)) != len(names):
        raise ConfigError(f"a chain names each tier once, got {names}")
    return chain


def open_stores(
    chain: Sequence[TierSpec], ctx: StoreContext, books: TierStore, instance_id: str
) -> dict[str, BlockStore]:
    """Each tier's store, opened in chain order: its hooks given to its tier in ``books``
    and what it held at start indexed there; on a failure the ones opened are closed."""
    stores: dict[str, BlockStore] = {}
    try:
        for spec in chain:
            stores[spec.name] = store = spec.store(ctx)
            tier = books.tiers[spec.name]
            if store.intake is not None:
                tier.intake = store.intake
            tier.readable = store.readable
            for toks, blocks in store.restored():
                books.restore(spec.name, toks, blocks, instance_id)
    except BaseException:
        for store in stores.values():
            store.close()
        raise
    return stores
