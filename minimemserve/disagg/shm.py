"""The ``shm`` KV link (:mod:`~.links`): a peer on this host, whose hbm pool tensor is mapped
here from shared memory (CPU) or CUDA IPC (one GPU) and written one-sided."""

from __future__ import annotations

from typing import Any, ClassVar

import torch

from ..blocks.copy import move_blocks
from ..errors import TransferError
from ..links import Counts
from ..mempool import MemPool
from ..mempool.shared import SharedPoolTensor, attach, segment_path
from . import rpc


class ShmLink:
    """A peer on this host: its hbm pool tensor ``kv``, mapped here, written one-sided (one
    pass when the blocks are one run); the peer only commits what arrived."""

    name: ClassVar[str] = "shm"
    shares_pool: ClassVar[bool] = True
    whole_model: ClassVar[bool] = False
    devices: ClassVar[tuple[str, ...]] = ("cpu", "cuda")
    meets_in_store: ClassVar[bool] = False

    def __init__(self, peer: str, kv: torch.Tensor, pool: MemPool) -> None:
        """Write into ``kv`` (laid out as ``pool``'s hbm tier)."""
        self.peer = peer
        self.kv: torch.Tensor | None = kv
        self.block_dim = pool.layout.block_dim
        self.block_bytes = pool.model_layout.block_bytes(pool.dtype.itemsize)
        self.counts = Counts()

    @classmethod
    def unfit(cls, a: Any, b: Any) -> str | None:
        """Shared memory needs one host."""
        return (
            None
            if a.host == b.host
            else f"{a.name} and {b.name} are on different hosts: no shared memory"
        )

    @classmethod
    def endpoint(cls, spec: Any, pool: MemPool) -> None:
        """Nothing of its own: a peer maps the instance's pool from its handle."""

    @classmethod
    def reach(cls, peers: Any, p: rpc.PeerInfo) -> None:
        """Map ``p``'s pool (only the project's own segments are mapped)."""
        if p.handle is None:
            peers.on_down(p.name, f"no shared-memory link: {p.name} shares no pool")
            return
        segment_path(p.handle)
        peers.add(p, cls(p.name, attach(p.handle), peers.pool))

    def write(self, node: rpc.RpcNode, xfer: str, blocks: list[int], src, src_ids) -> None:
        """Copy blocks ``src_ids`` of ``src`` into the peer's ``blocks`` (``node`` unused)."""
        if self.kv is None:
            raise TransferError(f"the shared-memory link with {self.peer} is closed")
        move_blocks(self.kv, blocks, src, list(src_ids), self.block_dim)
        if self.kv.is_cuda:
            torch.cuda.current_stream(self.kv.device).synchronize()  # land before Commit
        self.counts.sent_bytes += len(blocks) * self.block_bytes
        self.counts.sent_messages += 1

    def receive(self, pool: MemPool, m: rpc.KVData) -> None:
        """KV from this peer never comes as KVData."""
        raise ValueError(f"{self.peer}'s KV arrives in shared memory, not in KVData")

    def await_landing(self, xfer: str, new: list[int]) -> None:
        """The peer wrote before it commits: count what arrived."""
        if new:
            self.counts.recv_bytes += len(new) * self.block_bytes
            self.counts.recv_messages += 1

    def forget(self, xfer: str) -> None:
        """Nothing is kept per transfer here."""

    def close(self) -> None:
        """Drop the mapping (its counters stay)."""
        self.kv = None

    def stats(self) -> dict[str, int | str]:
        """Bytes and writes each way."""
        return self.counts.stats(self.name)


class SharedMemPool(MemPool):
    """A MemPool whose hbm tier tensor lives in shared memory (CPU) or is IPC-exported (CUDA;
    dram stays private). :attr:`shared` is the segment; publish ``shared.handle.to_dict()``."""

    def __init__(self, layout, num_blocks: int, **kw) -> None:
        self.shared: SharedPoolTensor | None = None

        def factory(shape, dtype, device) -> torch.Tensor:
            if self.shared is not None:  # the dram tier: private host memory, pinned with CUDA
                return torch.zeros(shape, dtype=dtype, pin_memory=torch.cuda.is_available())
            self.shared = SharedPoolTensor.create(tuple(shape), dtype, device)
            return self.shared.tensor  # [num_blocks, L, 2, block_size, n_kv_heads, head_dim]

        super().__init__(layout, num_blocks, tensor_factory=factory, **kw)
