"""The receiving side of a MemPool transfer, the contract a sending pool writes against. A
send (``MemPool.transfer``, ``transfer_with_insert``, ``send_cached``) has the destination
allocate what it lacks (``recv_alloc``), writes the blocks there (``recv_copy``), and commits
(``recv_commit``), or has it release everything when a step fails (``recv_abort``)."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Protocol, runtime_checkable

import torch

from ..blocks.layout import KVLayout
from .tiers import HBM


@runtime_checkable
class KVReceiver(Protocol):
    """The receiving side of a transfer, the one contract a sending pool writes against: a
    ``MemPool`` here (the tensor-parallel and the simulator's pools are MemPools), or a peer's
    behind a proxy (the process runtime's ``RemotePool``). ``recv_alloc`` matches ``tokens``
    (when given) and allocates the rest, ``recv_copy`` writes the sender's blocks ``src_ids``
    of ``src`` into ``blocks``, ``recv_commit`` keeps them (indexing ``tokens``),
    ``recv_abort`` releases them; ``free_mem`` drops one reference. ``model_layout`` and
    ``dtype`` are what both sides must agree on."""

    layout: KVLayout
    model_layout: KVLayout
    dtype: torch.dtype
    block_size: int

    def recv_alloc(
        self, tokens: Sequence[int] | None, num_blocks: int
    ) -> tuple[list[int], list[int]]: ...

    def recv_copy(
        self, blocks: Sequence[int], src: torch.Tensor, src_ids: Sequence[int]
    ) -> None: ...

    def recv_commit(self, tokens: Sequence[int] | None, blocks: Sequence[int]) -> None: ...

    def recv_abort(self, blocks: Sequence[int]) -> None: ...

    def free_mem(self, blocks: Sequence[int], tier: str = HBM) -> None: ...
