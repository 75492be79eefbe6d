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
