"""The local scheduler on its own: budgets, admission, preemption, and its failure path."""

from __future__ import annotations

import pytest

from minimemserve.blocks.layout import KVLayout
from minimemserve.config import parse_config_name
from minimemserve.errors import ConfigError
from minimemserve.mempool import MemPool
from minimemserve.request import Request, Status
from minimemserve.sampling import SamplingParams
from minimemserve.scheduler.local import LocalScheduler

BS = 4
PD, PD_CC = (parse_config_name(n).milestone.recipes["colocated"] for n in ("PD", "PD-CC"))


def make(num_blocks: int, recipe=PD, max_seqs: int = 8, budget: int = 16, policy="chunked"):
    pool = MemPool(KVLayout(1, BS, 1, 2), num_blocks)
    return pool, LocalScheduler(pool, recipe, max_seqs, budget, policy)


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


def decoding(s: LocalScheduler, rid: str, n: int) -> Request:
    """A request of ``n`` prompt tokens prefilled and given its first token: it decodes next."""
    r = req(rid, n)
    s.add(r)
    run(s.schedule()[0])
    r.tokens.append(7)
    return r


def test_chunked_runs_a_new_prompt_beside_the_running_decodes():
    _, s = make(32, budget=16)
    a = decoding(s, "a", 5)
    b = req("b", 12)
    s.add(b)
    batch, _ = s.schedule()
    assert batch == [(a, 1), (b, 12)]  # the decode goes on in the prompt's step


def test_prefill_first_stalls_every_decode_while_a_prompt_runs():
    _, s = make(32, budget=16, policy="prefill_first")
    a = decoding(s, "a", 5)
    b, c = req("b", 8), req("c", 8)
    s.add(b)
    s.add(c)
    batch, _ = s.schedule()
    assert batch == [(b, 8), (c, 8)]  # the prompts alone: a's decode waits
    run(batch)
    for r in (b, c):
        r.tokens.append(7)
    batch, _ = s.schedule()
    assert batch == [(a, 1), (b, 1), (c, 1)]  # then the decodes, together


def test_prefill_first_runs_prompts_whole_and_first_come_first_served():
    _, s = make(32, budget=16, policy="prefill_first")
    a = decoding(s, "a", 5)
    b, c = req("b", 10), req("c", 10)  # b fits whole, c does not fit beside it
    s.add(b)
    s.add(c)
    batch, _ = s.schedule()
    assert batch == [(b, 10)] and list(s.waiting) == [c]
    run(batch)
    b.tokens.append(7)
    batch, _ = s.schedule()
    assert batch == [(c, 10)]  # the next prompt before any decode
    run(batch)
    c.tokens.append(7)
    assert s.schedule()[0] == [(a, 1), (b, 1), (c, 1)]


def test_prefill_first_chunks_a_prompt_longer_than_the_budget_alone():
    _, s = make(32, budget=16, policy="prefill_first")
    decoding(s, "a", 5)  # waits through every chunk
    long, short = req("long", 40), req("short", 3)
    s.add(long)
    s.add(short)
    chunks = []
    for _ in range(3):
        batch, _ = s.schedule()
        chunks.append(batch)
        run(batch)
    assert chunks == [[(long, 16)], [(long, 16)], [(long, 8)]]
    long.tokens.append(7)
    assert s.schedule()[0] == [(short, 3)]


def test_prefill_first_runs_decodes_when_the_waiting_prompt_cannot_get_blocks():
    pool, s = make(4, budget=64, policy="prefill_first")
    a = decoding(s, "a", 5)  # 2 blocks of the 4
    b = req("b", 13)  # needs 4 blocks: waits for a
    s.add(b)
    batch, failed = s.schedule()
    assert batch == [(a, 1)] and failed == [] and list(s.waiting) == [b]
    assert b.blocks == [] and pool.num_free() == 2


def test_prefill_first_lets_a_handed_over_request_join_the_decodes():
    pool, s = make(32, budget=16, policy="prefill_first")
    a = decoding(s, "a", 5)
    handed = req("h", 9)  # arrives with its KV and first token, as after a transfer
    handed.blocks = pool.alloc_mem(3)
    handed.num_computed = 9
    handed.tokens.append(7)
    s.add(handed)
    batch, _ = s.schedule()
    assert batch == [(a, 1), (handed, 1)]


def test_an_unknown_policy_is_a_config_error():
    with pytest.raises(ConfigError, match="unknown local scheduler 'fifo'"):
        make(4, policy="fifo")
