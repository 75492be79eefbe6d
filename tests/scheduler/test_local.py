"""The local scheduler on its own: budgets, admission, preemption, and its failure path."""

from __future__ import annotations

from minimemserve.blocks.layout import KVLayout
from minimemserve.config import parse_config_name
from minimemserve.mempool import MemPool
from minimemserve.request import Request, Status
from minimemserve.sampling import SamplingParams
from minimemserve.scheduler.local import LocalScheduler

BS = 4
PD, PD_CC = (parse_config_name(n).milestone.recipes["colocated"] for n in ("PD", "PD-CC"))


def make(num_blocks: int, recipe=PD, max_seqs: int = 8, budget: int = 16):
    pool = MemPool(KVLayout(1, BS, 1, 2), num_blocks)
    return pool, LocalScheduler(pool, recipe, max_seqs, budget)


def req(rid: str, n: int, max_tokens: int = 4) -> Request:
    r = Request(rid, list(range(1, n + 1)), SamplingParams(max_tokens=max_tokens))
    r.max_total_tokens = n + max_tokens
    return r


def run(batch) -> None:
    """What the engine does after a forward pass: count the computed tokens."""
    for r, n in batch:
        r.num_computed += n


def test_prefill_is_chunked_by_the_token_budget_and_decodes_go_first():
    pool, s = make(16, budget=8)
    a, b = req("a", 10), req("b", 3)
    s.add(a)
    s.add(b)
    batch, failed = s.schedule()
    assert batch == [(a, 8)] and failed == []  # the budget cuts a's prompt
    run(batch)
    batch, _ = s.schedule()
    assert batch == [(a, 2), (b, 3)]  # a finishes its prompt, b joins in the same step
    run(batch)
    a.tokens.append(7)
    b.tokens.append(7)
    batch, _ = s.schedule()
    assert batch == [(a, 1), (b, 1)]  # two decodes
    assert len(a.blocks) == pool.layout.num_blocks_for(11)


def test_max_num_seqs_bounds_admission():
    _, s = make(16, max_seqs=1)
    a, b = req("a", 3), req("b", 3)
    s.add(a)
    s.add(b)
    batch, _ = s.schedule()
    assert batch == [(a, 3)] and list(s.waiting) == [b]


def test_a_full_pool_preempts_the_newest_request_and_it_recomputes_later():
    pool, s = make(4, budget=64)
    a, b = req("a", 8), req("b", 7)  # 2 blocks each: the pool is full
    s.add(a)
    s.add(b)
    run(s.schedule()[0])
    a.tokens.append(9)  # a needs a third block for its next token
    b.tokens.append(9)
    batch, failed = s.schedule()
    assert batch == [(a, 1)] and failed == []
    assert b.status is Status.WAITING and b.blocks == [] and b.num_computed == 0
    assert b.metrics.preemptions == 1 and s.waiting[0] is b
    assert pool.num_free() == 1


def test_preemption_with_caching_indexes_the_victims_kv():
    pool, s = make(4, recipe=PD_CC, budget=64)
    a, b = req("a", 8), req("b", 8)
    s.add(a)
    s.add(b)
    run(s.schedule()[0])
    a.tokens.append(9)
    b.tokens.append(9)
    s.schedule()
    stats = pool.stats()
    # b's two whole blocks were indexed, then the tail one was evicted to give a its block
    assert stats["counters"]["inserted_blocks"] == 2 and stats["counters"]["evicted_blocks"] == 1
    assert stats["index"]["blocks"] == 1 and stats["hbm"]["cached_only"] == 1
    pool.check()


def test_a_request_that_can_never_fit_fails_alone_and_the_next_one_runs():
    pool, s = make(2, budget=64)
    big, small = req("big", 12), req("small", 3)  # 3 blocks > the pool's 2
    s.add(big)
    s.add(small)
    batch, failed = s.schedule()
    assert failed == [big] and "PoolExhausted" in big.error and big.blocks == []
    assert batch == [(small, 3)]
    assert not s.waiting and s.running == [small]
    assert pool.num_free() == 1


def test_remove_forgets_a_request_in_either_queue():
    _, s = make(8, max_seqs=1)
    a, b = req("a", 3), req("b", 3)
    s.add(a)
    s.add(b)
    s.schedule()
    s.remove(a)
    s.remove(b)
    assert not s.has_unfinished()
