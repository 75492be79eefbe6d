"""Local scheduler: continuous batching with a per-step token budget, chunked prefill,
and preemption by recompute when the pool is full. Plain Python: no tensors here."""

from __future__ import annotations

import time
from collections import deque

from ..disagg.recipes import Hook, Recipe
from ..errors import PoolExhausted
from ..request import Request, Status


class LocalScheduler:
    """Decides, every step, which requests compute how many tokens. Running requests first get their
    pending tokens (one for a decode, a chunk of a prefill) within ``max_num_batched_tokens``; then
    waiting ones are admitted while budget, sequence slots and blocks remain. Chunking keeps a long
    prompt from stalling decodes for more than a step. A running request that cannot get a block
    preempts the newest: its recipe releases (with caching, indexes) its KV, to be recomputed."""

    def __init__(self, pool, recipe: Recipe, max_num_seqs: int, max_num_batched_tokens: int):
        self.pool, self.recipe = pool, recipe
        self.max_num_seqs, self.max_num_batched_tokens = max_num_seqs, max_num_batched_tokens
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []
        self.parked: deque[Request] = deque()  # prefilled, holding KV, waiting for room on D

    def add(self, req: Request) -> None:
        """Queue a request (it keeps any blocks it arrives with, e.g. after a transfer)."""
        req.status = Status.WAITING
        self.waiting.append(req)

    def remove(self, req: Request) -> None:
        """Forget a request (finished, aborted or handed off); its blocks are the caller's."""
        for queue in (self.running, self.waiting, self.parked):
            if req in queue:
                queue.remove(req)
                return

    def park(self, req: Request) -> None:
        """Set a running request aside with its KV until it can be handed off."""
        self.running.remove(req)
        req.status = Status.PARKED
        self.parked.append(req)

    def has_unfinished(self) -> bool:
        """True while any request waits, runs or is parked."""
        return bool(self.waiting or self.running or self.parked)

    def schedule(self) -> tuple[list[tuple[Request, int]], list[Request]]:
        """The step's ``(request, tokens to compute)`` pairs, and the requests that failed
        because they can never get blocks (their error says why; the caller ends them)."""
        budget = self.max_num_batched_tokens
        batch: dict[Request, int] = {}
        failed: list[Request] = []
        for req in list(self.running):
            if req.status is not Status.RUNNING or budget == 0:
                continue
            n = min(req.num_pending, budget)
            if self._grow(req, req.num_computed + n, batch):
                batch[req] = n
            budget = self.max_num_batched_tokens - sum(batch.values())  # victims give theirs back
        while self.waiting and budget > 0 and len(self.running) < self.max_num_seqs:
            req = self.waiting[0]
            arrived = not req.blocks  # requests handed over with KV keep their blocks
            if arrived:
                self.recipe.run(Hook.ARRIVAL, self.pool, req)
            n = min(req.num_pending, budget)
            try:
                self._alloc_to(req, req.num_computed + n)
            except PoolExhausted as e:
                if arrived:
                    self.recipe.run(Hook.PREEMPT, self.pool, req)
                if not (self.running or self.parked):  # nothing will free blocks: fail it
                    self.waiting.popleft()
                    req.error = f"PoolExhausted: {e}"
                    failed.append(req)
                    continue
                break
            self.waiting.popleft()
            req.metrics.first_scheduled_time = (
                req.metrics.first_scheduled_time or time.perf_counter()
            )
            req.status = Status.RUNNING
            self.running.append(req)
            batch[req] = n
            budget -= n
        return list(batch.items()), failed

    def _alloc_to(self, req: Request, num_tokens: int) -> None:
        need = self.pool.layout.num_blocks_for(num_tokens) - len(req.blocks)
        if need > 0:
            req.blocks.extend(self.pool.alloc_mem(need))

    def _grow(self, req: Request, num_tokens: int, batch: dict[Request, int]) -> bool:
        """Give ``req`` blocks for ``num_tokens``, preempting newer requests if needed."""
        while True:
            try:
                self._alloc_to(req, num_tokens)
                return True
            except PoolExhausted:
                victim = self.running[-1]
                self.preempt(victim)
                batch.pop(victim, None)
                if victim is req:
                    return False

    def preempt(self, req: Request) -> None:
        """Release a running request's KV and put it first in line to be recomputed."""
        self.recipe.run(Hook.PREEMPT, self.pool, req)
        self.running.remove(req)
        req.status = Status.WAITING
        req.metrics.preemptions += 1
        self.waiting.appendleft(req)
