"""Both sides of a MemPool's transfers. Sending: read the blocks (from the tier that holds
each), have the destination allocate what it lacks, write them there, and commit, or have it
release everything when a step fails (``MemPool.transfer``, ``transfer_with_insert`` and
``send_cached``). Receiving: allocate, matching a cached prefix first
(``MemPool.recv_alloc``)."""

from __future__ import annotations

import itertools
from collections.abc import Sequence
from typing import Protocol, runtime_checkable

import torch

from ..blocks.layout import KVLayout
from ..errors import PoolExhausted
from .radix import as_tokens
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


def send_cached_path(pool, dst: KVReceiver, tokens: Sequence[int]) -> list[int]:
    """``pool.send_cached(dst, tokens)``: the spans of the cached path, one tier each, are
    pinned while they are sent."""
    toks, bs = as_tokens(tokens), pool.block_size
    pool._clock += 1
    match = pool._tree.match_prefix(toks, now=pool._clock)
    spans: list[tuple[str, list, list[int]]] = []  # runs of nodes in one tier, in order
    pos = 0
    for node in match.nodes:
        c = min(len(node.values), len(match.values) - pos)
        if not spans or spans[-1][0] != node.tier:
            spans.append((node.tier, [], []))
        spans[-1][1].append(node)
        spans[-1][2].extend(match.values[pos : pos + c])
        pos += c
    if not spans:
        return []
    for tier, nodes, blocks in spans:  # pinned: a peer's call may evict while we send
        pool._store.hold(pool._tiers[tier], nodes, blocks)
    try:
        return _send_spans(pool, dst, toks[: len(match.values) * bs], spans)
    finally:
        for tier, _, blocks in spans:
            pool._store.unhold(pool._tiers[tier], blocks)


def _send_spans(pool, dst: KVReceiver, toks, spans) -> list[int]:
    if dst.model_layout != pool.model_layout or dst.dtype != pool.dtype:
        raise ValueError("cannot send between pools of different layout or dtype")
    pairs = [(tier, b) for tier, _, blocks in spans for b in blocks]
    matched, new = dst.recv_alloc(toks, len(pairs))
    todo, at = pairs[len(matched) :], 0
    try:
        for tier, run in itertools.groupby(todo, key=lambda p: p[0]):
            src = [b for _, b in run]
            pool.send_blocks(dst, new[at : at + len(src)], src, tier)
            at += len(src)
            if tier != HBM:
                pool.counters["dram_sent_blocks"] += len(src)
        dst.recv_commit(toks, matched + new)
    except BaseException:
        dst.recv_abort(matched + new)
        raise
    c = pool.counters
    c["sent_blocks"] += len(todo)
    c["sent_bytes"] += len(todo) * pool.block_bytes
    c["transfers_sent"] += 1
    return matched + new


def send(pool, dst: KVReceiver, toks, src_blocks: Sequence[int]) -> list[int]:
    """dst allocates what it lacks, this pool's tensor is read straight into dst's blocks
    (here, or one-sided into a peer's mapping), dst commits; or dst releases it all."""
    if dst.model_layout != pool.model_layout or dst.dtype != pool.dtype:
        raise ValueError(
            f"cannot transfer between pools of different layout or dtype: "
            f"{pool.model_layout}/{pool.dtype} -> {dst.model_layout}/{dst.dtype}"
        )
    src = pool.held_blocks(src_blocks, "cannot send")
    matched, new = dst.recv_alloc(toks, len(src))
    src = src[len(matched) :]
    try:
        if src:
            pool.send_blocks(dst, new, src)
            pool.counters["sent_blocks"] += len(src)
            pool.counters["sent_bytes"] += len(src) * pool.block_bytes
        dst.recv_commit(toks, matched + new)
    except BaseException:
        dst.recv_abort(matched + new)
        raise
    pool.counters["transfers_sent"] += 1
    return matched + new


def receive_alloc(pool, tokens, num_blocks: int) -> tuple[list[int], list[int]]:
    """``MemPool.recv_alloc``: fails before matching when hbm cannot hold what is missing,
    so a refused transfer leaves the pool as it was."""
    if not isinstance(num_blocks, int) or num_blocks < 0:
        raise ValueError(f"num_blocks must be a non-negative int, got {num_blocks!r}")
    if tokens is None:
        return [], pool.alloc_mem(num_blocks, contiguous=True)
    toks = as_tokens(tokens)
    # every block missing from hbm costs one hbm block, onloaded or allocated: fail
    # before matching, so a refused transfer leaves the pool as it was
    in_hbm, _, room = pool._store.match_room(toks)
    if num_blocks - in_hbm > room:
        raise PoolExhausted(
            f"instance {pool.instance_id}: receiving {num_blocks} blocks needs "
            f"{num_blocks - in_hbm} hbm blocks beyond the {in_hbm} cached there, "
            f"but only {room} are free or evictable"
        )
    matched = pool.match(toks)
    if len(matched) > num_blocks:
        pool.free_mem(matched[num_blocks:])
        matched = matched[:num_blocks]
    try:
        new = pool.alloc_mem(num_blocks - len(matched), contiguous=True)
    except BaseException:
        pool.free_mem(matched)
        raise
    return matched, new
