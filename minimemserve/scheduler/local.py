"""Local scheduler: continuous batching with a per-step token budget, preemption by recompute
when the pool is full, and one of two step policies (:data:`STEP_POLICIES`). Plain Python: no
tensors here."""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Callable

from ..errors import ConfigError, PoolExhausted
from ..recipes import Hook, Recipe
from ..request import Request, Status

# ``chunked``: decodes first, prompts fill the rest of the budget in chunks (vLLM and SGLang
# today). ``prefill_first``: waiting prompts run whole in a step of their own before any
# decode (vLLM 0.4.0's default, MemServe's base).
STEP_POLICIES = ("chunked", "prefill_first")


class LocalScheduler:
    """Decides, every step, which requests compute how many tokens within
    ``max_num_batched_tokens`` tokens and ``max_num_seqs`` running requests.

    ``chunked`` (the default): running requests first get their pending tokens (one for a
    decode, a chunk of a prefill); then waiting ones are admitted while budget, sequence slots
    and blocks remain. Chunking keeps a long prompt from stalling decodes for more than a step.

    ``prefill_first`` follows vLLM 0.4.0's default scheduler: while prompts wait and fit whole
    (token budget, sequence slots counting the running ones, blocks), the step is those
    prefills alone, first come first served, and every running decode waits; otherwise the
    step is the running decodes. It differs from vLLM 0.4.0 in three ways: a prompt longer than
    the budget is prefilled alone in budget-sized chunks (vLLM rejects it), a request that
    arrives with its KV (a hand-off) joins the decodes (vLLM has no hand-off), and there is no
    swap space or free-block watermark.

    Under both, a running request that cannot get a block preempts the newest: its recipe
    releases (with caching, indexes) its KV, to be recomputed (vLLM's default, recompute)."""

    def __init__(
        self,
        pool,
        recipe: Recipe,
        max_num_seqs: int,
        max_num_batched_tokens: int,
        policy: str = "chunked",
        clock: Callable[[], float] = time.perf_counter,
    ):
        if policy not in STEP_POLICIES:
            raise ConfigError(f"unknown local scheduler {policy!r}; choose from {STEP_POLICIES}")
        self.pool = pool
        self.block_size = pool.layout.block_size
        self.recipe = recipe
        self.policy = policy
        self.clock = clock
        self.max_num_seqs = max_num_seqs
        self.max_num_batched_tokens = max_num_batched_tokens
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
        batch = _Batch()
        failed: list[Request] = []
        if self.policy == "chunked":
            self._run(batch, decodes_only=False)
            self._admit(batch, failed, prompts=True, handoffs=True)
            return list(batch.items()), failed
        self._prefills_alone(batch, failed)
        if not batch:  # no prompt runs: the decode step, which hand-offs may join
            self._run(batch, decodes_only=True)
            self._admit(batch, failed, prompts=False, handoffs=True)
        return list(batch.items()), failed

    def _run(self, batch: _Batch, decodes_only: bool) -> None:
        """Give running requests their pending tokens (a decode's one, a prompt's next chunk)
        within the budget; with ``decodes_only``, only those with one token pending."""
        limit, block_size, running = self.max_num_batched_tokens, self.block_size, Status.RUNNING
        for req in list(self.running):  # (attributes read once: this runs per row per step)
            budget = limit - batch.tokens  # a preempted victim gives back
            if req.status is not running or budget == 0:
                continue
            pending = len(req.tokens) - req.num_computed  # num_pending: this runs per token
            if decodes_only and pending != 1:
                continue
            n = pending if pending < budget else budget
            end = req.num_computed + n  # most decodes fit in the blocks they hold: no _grow
            if -(-end // block_size) <= len(req.blocks) or self._grow(req, end, batch):
                batch[req] = n

    def _prefills_alone(self, batch: _Batch, failed: list[Request]) -> None:
        """``prefill_first``'s prefill step: the next chunk of a prompt too long for the
        budget, else the waiting prompts that fit whole (hand-offs wait for the decodes)."""
        running = Status.RUNNING
        for req in self.running:  # (num_pending inlined: this runs per row per step)
            if req.status is running and len(req.tokens) - req.num_computed > 1:
                n = min(req.num_pending, self.max_num_batched_tokens)
                if self._grow(req, req.num_computed + n, batch):
                    batch[req] = n
                return
        self._admit(batch, failed, prompts=True, handoffs=False, whole=True)

    def _admit(
        self,
        batch: _Batch,
        failed: list[Request],
        prompts: bool,
        handoffs: bool,
        whole: bool = False,
    ) -> None:
        """Admit waiting requests in order while budget, slots and blocks remain: ``prompts``
        (requests without KV here) and ``handoffs`` (arrived with their KV) say which kinds
        may run; with ``whole``, a prompt runs whole or waits (unless alone in the step, where
        one longer than the budget takes its first chunk). The first that waits stops it."""
        while self.waiting and len(self.running) < self.max_num_seqs:
            if (budget := self.max_num_batched_tokens - batch.tokens) <= 0:
                return
            req = self.waiting[0]
            arrived = not req.blocks  # requests handed over with KV keep their blocks
            if not (prompts if arrived else handoffs):
                return
            if arrived:
                self.recipe.run(Hook.ARRIVAL, self.pool, req)
            n = min(req.num_pending, budget)
            try:
                if whole and n < req.num_pending and batch:
                    raise _Wait
                self._alloc_to(req, req.num_computed + n)
            except (PoolExhausted, _Wait) as e:
                if arrived:
                    self.recipe.run(Hook.PREEMPT, self.pool, req)
                if isinstance(e, PoolExhausted) and not (self.running or self.parked):
                    self.waiting.popleft()  # nothing will free blocks: fail it
                    req.error = f"PoolExhausted: {e}"
                    failed.append(req)
                    continue
                return
            self.waiting.popleft()
            req.metrics.first_scheduled_time = req.metrics.first_scheduled_time or self.clock()
            req.status = Status.RUNNING
            self.running.append(req)
            batch[req] = n

    def _alloc_to(self, req: Request, num_tokens: int) -> None:
        need = -(-num_tokens // self.block_size) - len(req.blocks)  # layout.num_blocks_for
        if need > 0:
            req.blocks.extend(self.pool.alloc_mem(need))

    def _grow(self, req: Request, num_tokens: int, batch: _Batch) -> bool:
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


class _Batch(dict):
    """A step's ``{request: tokens}``, keeping their sum as ``tokens``."""

    tokens = 0

    def __setitem__(self, req: Request, n: int) -> None:
        self.tokens += n - self.get(req, 0)
        dict.__setitem__(self, req, n)

    def pop(self, req: Request, default=None):
        """Remove ``req`` (a preempted victim); its tokens return to the budget."""
        n = super().pop(req, default)
        if n is not default:
            self.tokens -= n
        return n


class _Wait(Exception):
    """The head of the waiting queue does not run this step."""
