"""Recipes: which MemPool calls run at a request's hooks on one instance.

A request has three hooks per role: on arrival (admission), after prefill (its first
token was sampled) and on finish; preemption is a finish that will be re-run. Context
caching and disaggregation differ only in these calls: the engine, scheduler, model and
attention code are the same for every configuration.

| recipe | on arrival | after prefill | on finish / preempt |
|---|---|---|---|
| PD     | —                         | keep decoding | free_mem            |
| PD-CC  | match (prefix → blocks)   | keep decoding | insert, free_mem    |

The disaggregated recipes (1P1D, PD-Caching-1/2/3) add ``transfer`` /
``transfer_with_insert`` at the prefill side's after-prefill hook.
"""

from __future__ import annotations

from ..request import Request


class Recipe:
    """Base recipe (PD): allocate, compute, free. Subclasses override hooks."""

    name = "PD"
    caching = False

    def on_arrival(self, pool, req: Request) -> None:
        """Runs when the request is admitted with no KV yet (``req.blocks`` empty)."""

    def after_prefill(self, pool, req: Request) -> bool:
        """Runs once the first token is sampled; False hands the request off this instance."""
        return True

    def on_finish(self, pool, req: Request) -> None:
        """Runs when the request ends here (done, aborted or failed): release its blocks."""
        release(pool, req, cache=self.caching)

    def on_preempt(self, pool, req: Request) -> None:
        """Runs when the request is preempted to be recomputed later."""
        release(pool, req, cache=self.caching)


class CachingRecipe(Recipe):
    """PD-CC: reuse the longest cached prefix, and cache the whole sequence at the end."""

    name = "PD-CC"
    caching = True

    def on_arrival(self, pool, req: Request) -> None:
        """``match`` the longest cached prefix into ``req.blocks`` (see ``match_prefix``)."""
        match_prefix(pool, req)


def match_prefix(pool, req: Request) -> int:
    """``match`` all but the last token (one token is always computed to get logits).

    Sets ``req.blocks`` and ``req.num_computed``; returns the cached token count.
    """
    blocks = pool.match(req.all_token_ids[: req.num_tokens - 1])
    req.blocks = blocks
    req.num_computed = len(blocks) * pool.block_size
    if req.metrics.preemptions == 0:
        req.metrics.cached_tokens = req.num_computed
    return req.num_computed


def release(pool, req: Request, cache: bool) -> None:
    """Optionally ``insert`` the computed tokens, then drop the request's block references."""
    if req.blocks:
        if cache and req.num_computed:
            pool.insert(req.all_token_ids[: req.num_computed], req.blocks)
        pool.free_mem(req.blocks)
    req.blocks = []
    req.num_computed = 0


COLOCATED_RECIPES = {0: Recipe, 1: CachingRecipe}


class PrefillRecipe(Recipe):
    """Prefill side of xPyD: compute the prompt, move its KV to a decode instance, hand off.

    ``cache_level`` 0 is PD-Basic (``transfer``), 1 caches on P (``insert`` then
    ``transfer``), 2 and 3 also let D keep what it has (``transfer_with_insert``: D matches
    its own index and receives only the blocks it lacks).
    """

    def __init__(self, cache_level: int, pick_decode):
        self.cache_level = cache_level
        self.caching = cache_level >= 1
        self.name = f"prefill-cc{cache_level}" if cache_level else "prefill"
        self.pick_decode = pick_decode  # req -> decode instance (with .pool and .accept)

    def on_arrival(self, pool, req: Request) -> None:
        """With caching (level >= 1), ``match`` the cached prefix into ``req.blocks``."""
        if self.caching:
            match_prefix(pool, req)

    def after_prefill(self, pool, req: Request) -> bool:
        """``insert`` (level >= 1), ``transfer`` (``transfer_with_insert`` at level >= 2) to the
        picked decode pool, ``free_mem`` here; hands the request over and returns False."""
        dst = self.pick_decode(req)
        tokens = req.all_token_ids[: req.num_computed]
        src = req.blocks[: -(-req.num_computed // pool.block_size)]
        before = pool.stats()["counters"]["sent_bytes"]
        if self.caching:
            pool.insert(tokens, req.blocks)
        if self.cache_level >= 2:
            dst_blocks = pool.transfer_with_insert(dst.pool, tokens, src)
        else:
            dst_blocks = pool.transfer(dst.pool, src)
        req.metrics.transferred_bytes += pool.stats()["counters"]["sent_bytes"] - before
        pool.free_mem(req.blocks)
        req.blocks = dst_blocks
        dst.accept(req)
        return False


class DecodeRecipe(Recipe):
    """Decode side of xPyD. Level 2 caches on D; level 3 also sends the decode-phase KV back
    to the prefill instance (``transfer_with_insert``) so its next-turn hit covers the answer."""

    def __init__(self, cache_level: int, prefill_pool_of):
        self.cache_level = cache_level
        self.caching = cache_level >= 2
        self.name = f"decode-cc{cache_level}" if cache_level else "decode"
        self.prefill_pool_of = prefill_pool_of  # req -> MemPool of the instance that prefilled it

    def on_arrival(self, pool, req: Request) -> None:  # only after a preemption on D
        """With caching (level >= 2), ``match`` the cached prefix into ``req.blocks``."""
        if self.caching:
            match_prefix(pool, req)

    def on_finish(self, pool, req: Request) -> None:
        """Level 3: ``transfer_with_insert`` the whole blocks back to P, ``free_mem`` there; then
        ``insert`` here (level >= 2) and ``free_mem`` the request's blocks."""
        if self.cache_level >= 3 and req.blocks and req.num_computed:
            tokens = req.all_token_ids[: req.num_computed]
            whole = len(tokens) // pool.block_size
            if whole:
                p_pool = self.prefill_pool_of(req)
                before = pool.stats()["counters"]["sent_bytes"]
                got = pool.transfer_with_insert(
                    p_pool, tokens[: whole * pool.block_size], req.blocks[:whole]
                )
                p_pool.free_mem(got)  # P's index keeps its own references
                req.metrics.transferred_bytes += pool.stats()["counters"]["sent_bytes"] - before
        release(pool, req, cache=self.caching)
