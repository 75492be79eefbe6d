"""The attention-backend interface and the per-step batch metadata every backend reads.

A step is a list of sequence slices, prefill chunks (more than one new token) first, then
single-token decodes; the new tokens of all slices are flattened into one ``[T, ...]`` batch."""

from __future__ import annotations

import itertools
from dataclasses import dataclass, field
from typing import Any, Protocol

import torch


@dataclass(frozen=True)
class SeqSlice:
    """What one sequence contributes to a step."""

    block_table: list[int]  # the sequence's MemPool block ids, in order
    num_computed: int  # tokens already in the KV pool (cached prefix + earlier chunks)
    num_new: int  # tokens whose KV is written and whose queries are computed now


@dataclass
class AttentionMetadata:
    """Per-step tensors shared by every layer, indices on the compute device. Slices
    ``[0, num_prefills)`` own tokens ``[0, num_prefill_tokens)``; each later slice one token."""

    positions: torch.Tensor  # int64 [T] absolute position of each new token
    slot_mapping: torch.Tensor  # int64 [T] block_id * block_size + offset of each new token
    query_start_loc: torch.Tensor  # int32 [B+1] cumulative new-token counts
    context_lens: torch.Tensor  # int32 [B] tokens already cached before this step
    seq_lens: torch.Tensor  # int32 [B] context_lens + new tokens
    block_tables: torch.Tensor  # int32 [B, max_blocks] padded with 0
    num_prefills: int
    num_prefill_tokens: int
    num_decodes: int
    max_query_len: int
    max_seq_len: int
    query_lens_host: list[int]  # host copies: backends looping on the CPU need no sync
    context_lens_host: list[int]
    seq_lens_host: list[int]
    block_size: int
    backend_data: dict[str, Any] = field(default_factory=dict)  # per-step, backend-private


def build_metadata(slices: list[SeqSlice], block_size: int, device) -> AttentionMetadata:
    """Build ``AttentionMetadata`` for ``slices`` (prefills first, then single-token decodes)."""
    if not slices:
        raise ValueError("a step needs at least one sequence")
    num_prefills = 0
    for i, s in enumerate(slices):
        if s.num_new <= 0:
            raise ValueError(f"slice {i} has no new tokens")
        if s.num_new > 1:
            if i != num_prefills:
                raise ValueError("prefill slices must come before decode slices")
            num_prefills += 1
        if len(s.block_table) * block_size < (n := s.num_computed + s.num_new):
            raise ValueError(f"slice {i}: {len(s.block_table)} blocks cannot hold {n} tokens")
    q_lens = [s.num_new for s in slices]
    ctx = [s.num_computed for s in slices]
    seq = [c + q for c, q in zip(ctx, q_lens)]
    starts = [0, *itertools.accumulate(q_lens)]
    table = padded_tables([s.block_table for s in slices])  # int32 [B, max_blocks]
    # positions and slots of every new token, vectorised (no loop over tokens or blocks)
    row = torch.repeat_interleave(torch.arange(len(slices)), torch.tensor(q_lens))  # [T]
    first = torch.tensor(ctx) - torch.tensor(starts[:-1])  # a row's position minus its start
    positions = torch.arange(starts[-1]) + first[row]  # [T]
    blocks = table[row, positions // block_size].long()
    slots = blocks * block_size + positions % block_size
    t = lambda x, dtype: torch.as_tensor(x, dtype=dtype).to(device)
    return AttentionMetadata(
        positions=t(positions, torch.int64),
        slot_mapping=t(slots, torch.int64),
        query_start_loc=t(starts, torch.int32),
        context_lens=t(ctx, torch.int32),
        seq_lens=t(seq, torch.int32),
        block_tables=table.to(device),
        num_prefills=num_prefills,
        num_prefill_tokens=starts[num_prefills],
        num_decodes=len(slices) - num_prefills,
        max_query_len=max(q_lens),
        max_seq_len=max(seq),
        query_lens_host=q_lens,
        context_lens_host=ctx,
        seq_lens_host=seq,
        block_size=block_size,
    )


def padded_tables(tables: list[list[int]]) -> torch.Tensor:
    """The block tables as one int32 ``[B, max_blocks]`` CPU tensor padded with 0, filled by
    one masked copy of all their ids."""
    widths = torch.tensor([len(t) for t in tables])
    out = torch.zeros(len(tables), int(widths.max()), dtype=torch.int32)
    flat = torch.tensor(list(itertools.chain.from_iterable(tables)), dtype=torch.int32)
    out[torch.arange(out.shape[1]) < widths[:, None]] = flat
    return out


class AttentionBackend(Protocol):
    """How the model computes attention over the paged KV pool. A backend is built over one pool
    tensor (``KVLayout.pool_shape``; it allocates no KV). ``forward`` stores layer ``layer_id``'s K
    and V of the new tokens, then returns causal attention of the new queries over prefix and new
    tokens, maybe in a per-step buffer the next layer overwrites (Triton): consume it first."""

    name: str
    elementwise: Any  # the layer's elementwise ops (``elementwise.TorchElementwise``'s calls)

    def prepare(self, slices: list[SeqSlice]) -> AttentionMetadata:
        """Build the per-step metadata once; every layer reuses it."""
        ...

    def forward(
        self,
        q: torch.Tensor,  # [T, n_heads, head_dim]
        k: torch.Tensor,  # [T, n_kv_heads, head_dim]
        v: torch.Tensor,  # [T, n_kv_heads, head_dim]
        layer_id: int,
        md: AttentionMetadata,
    ) -> torch.Tensor:  # [T, n_heads, head_dim]
        """Store K/V of the new tokens for ``layer_id`` and attend."""
        ...
