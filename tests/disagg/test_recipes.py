"""Every configuration gives the same greedy tokens; each caching milestone does what it says."""

from __future__ import annotations

import pytest
from helpers import assert_pool_clean, sharegpt_user_turns

from minimemserve import LLM, SamplingParams

CONFIGS = ["PD", "PD-CC", "1P1D", "1P1D-CC1", "1P1D-CC2", "1P1D-CC3", "1P2D-CC", "2P1D"]
BS = 16


def run_sessions(llm: LLM, sessions: list[list[list[int]]], max_tokens: int = 9):
    """Turn k+1's prompt = previous prompt + own answer + next user tokens."""
    params = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
    outs = [[] for _ in sessions]
    history = [[] for _ in sessions]
    for k in range(len(sessions[0])):
        prompts = [history[s] + sessions[s][k] for s in range(len(sessions))]
        for s, out in enumerate(llm.generate(prompts, params)):
            outs[s].append(out)
            history[s] = prompts[s] + out.token_ids
    return outs


@pytest.fixture(scope="module")
def results(tiny_llama_dir):
    sessions = sharegpt_user_turns(tiny_llama_dir, num_sessions=3, num_turns=4, max_user_tokens=40)
    res = {}
    for config in CONFIGS:
        llm = LLM(tiny_llama_dir, config=config, num_blocks=128)
        res[config] = (llm, run_sessions(llm, sessions))
        for pool in llm.pools:
            assert_pool_clean(pool)
    return res


def tokens(outs):
    return [[o.token_ids for o in session] for session in outs]


def test_same_answer_everywhere(results):
    ref = tokens(results["PD"][1])
    for config in CONFIGS[1:]:
        assert tokens(results[config][1]) == ref, config


def test_basic_disagg_caches_nothing_and_transfers_every_turn(results):
    llm, outs = results["1P1D"]
    assert all(o.metrics.cached_tokens == 0 for s in outs for o in s)
    assert all(o.metrics.transferred_bytes > 0 for s in outs for o in s)
    for pool in llm.pools:
        assert pool.stats()["index"]["blocks"] == 0


def test_cc1_caches_on_prefill_only(results):
    llm, outs = results["1P1D-CC1"]
    p, d = llm.engine.role("prefill")[0].pool, llm.engine.role("decode")[0].pool
    assert p.stats()["index"]["blocks"] > 0
    assert d.stats()["index"]["blocks"] == 0
    assert all(o.metrics.cached_tokens > 0 for s in outs for o in s[1:])
    # D keeps nothing, so every turn sends every block of its prompt again, exactly
    block_bytes = p.layout.block_bytes(p.kv().element_size())
    for s in outs:
        for o in s:
            n = p.layout.num_blocks_for(len(o.prompt_token_ids))
            assert o.metrics.transferred_bytes == n * block_bytes


def test_cc2_sends_only_missing_blocks_and_caches_on_decode(results):
    llm, outs = results["1P1D-CC2"]
    _, outs1 = results["1P1D-CC1"]
    d = llm.engine.role("decode")[0].pool
    assert d.stats()["index"]["blocks"] > 0
    for s2, s1 in zip(outs, outs1):
        for o2, o1 in zip(s2[1:], s1[1:]):
            assert o2.metrics.transferred_bytes < o1.metrics.transferred_bytes


def test_cc3_prefill_hit_covers_previous_answer(results):
    _, outs3 = results["1P1D-CC3"]
    _, outs2 = results["1P1D-CC2"]
    for s3, s2 in zip(outs3, outs2):
        for k in range(1, len(s3)):
            prev_prompt = len(s3[k - 1].prompt_token_ids)
            prev_total = prev_prompt + len(s3[k - 1].token_ids)
            # KV of everything but the last sampled token exists; whole blocks are cached
            assert s3[k].metrics.cached_tokens == (prev_total - 1) // BS * BS
            assert s3[k].metrics.cached_tokens > prev_prompt // BS * BS - 1
            assert s3[k].metrics.cached_tokens >= s2[k].metrics.cached_tokens
    assert any(
        s3[k].metrics.cached_tokens > s2[k].metrics.cached_tokens
        for s3, s2 in zip(outs3, outs2)
        for k in range(1, len(s3))
    )


def test_in_process_routing_is_the_global_schedulers(tiny_llama_dir):
    """Two caching prefill instances in one process: every request is routed by the
    ``GlobalScheduler`` (as in the process runtime and the simulator), and a turn goes where
    its prompt tree says the previous turn left its prefix cached."""
    sessions = sharegpt_user_turns(tiny_llama_dir, num_sessions=3, num_turns=3, max_user_tokens=40)
    with LLM(tiny_llama_dir, config="2P1D-CC1", num_blocks=128) as llm:
        outs = run_sessions(llm, sessions)
        sched = llm.engine.scheduler
        assert sum(sched.dispatches.values()) == 9 and set(sched.dispatches) <= {"P0", "P1"}
        followed = 0
        for session in outs:  # a turn after one that left a whole block cached follows it
            for prev, o in zip(session, session[1:]):
                if len(prev.prompt_token_ids) >= BS:
                    assert o.metrics.prefill_instance == prev.metrics.prefill_instance
                    assert o.metrics.cached_tokens >= BS
                    followed += 1
        assert followed >= 4
        for pool in llm.pools:
            assert_pool_clean(pool)
