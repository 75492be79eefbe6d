"""GlobalScheduler: each policy's choice, prompt trees with a TTL, membership, bad input."""

from __future__ import annotations

from collections import Counter

import pytest

from minimemserve.errors import ConfigError, InstanceDied, InvalidRequest
from minimemserve.scheduler.global_scheduler import (
    MAX_SESSION_ID,
    UNIT_TRANSFER_COST,
    GlobalScheduler,
    PromptTrees,
    Route,
    TokenCost,
)

BS = 4


def toks(*blocks: int, tail: int = 1) -> list[int]:
    """Whole blocks of the given token ids, plus ``tail`` extra tokens."""
    return [t for b in blocks for t in [b] * BS] + [99] * tail


class Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def sched(policy: str = "prompt_tree", names=("A", "B"), **kw) -> GlobalScheduler:
    return GlobalScheduler(list(names), policy=policy, block_size=BS, **kw)


def submit(s: GlobalScheduler, rid: str, prompt: list[int]) -> Route:
    route = s.route(prompt)
    s.dispatched(rid, route, len(prompt))
    return route


def test_round_robin_and_least_load():
    s = sched("round_robin", names=("A", "B", "C"))
    assert [s.route(toks(1)).instance for _ in range(4)] == ["A", "B", "C", "A"]
    s = sched("least_load")
    assert submit(s, "r1", toks(1)).instance == "A"
    assert submit(s, "r2", toks(2)).instance == "B"
    s.finished("r1")
    assert s.route(toks(3)).instance == "A"  # A has nothing queued now, B one request


def test_session_affinity_follows_the_first_block():
    s = sched("session", names=("A", "B", "C"))
    first = {s.route(toks(b, 7, 8)).instance for b in range(12)}
    assert len(first) > 1  # different conversations spread out
    for b in range(12):
        assert s.route(toks(b, 5)).instance == s.route(toks(b, 6, 6, 6)).instance


def test_session_affinity_hashes_the_session_id_when_there_is_one():
    s = sched("session", names=("A", "B", "C", "D"))
    shared = toks(9, 9)  # every prompt opens with the same block, as ReAct's few-shot one
    by_id = Counter(s.route(shared + toks(k), session_id=f"q-{k}").instance for k in range(400))
    assert set(by_id) == {"A", "B", "C", "D"} and max(by_id.values()) < 2 * 100
    assert len({s.route(shared + toks(k)).instance for k in range(40)}) == 1  # head only
    for k in range(20):  # a session stays where its first request went, whatever it sends
        assert (
            s.route(toks(k), session_id="s").instance
            == s.route(toks(k + 1, 3), session_id="s").instance
        )
    for bad in ("", "x" * (MAX_SESSION_ID + 1), 7):
        with pytest.raises(InvalidRequest, match="session_id"):
            s.route(shared, session_id=bad)


def test_prompt_tree_goes_where_the_prefix_is_cached():
    s = sched()
    r = submit(s, "r1", toks(1, 2, 3))
    s.finished("r1", toks(1, 2, 3, 4, tail=0))  # prompt + answer are cached there now
    other = "B" if r.instance == "A" else "A"
    again = s.route(toks(1, 2, 3, 4, 5))
    assert again.instance == r.instance and again.cached_tokens == 4 * BS
    assert s.route(toks(7, 8)).cached_tokens == 0
    assert s.trees.cached(other, toks(1, 2)) == 0


def test_prompt_tree_local_weighs_the_queue_against_the_cache():
    s = sched("prompt_tree_local")  # no prefix moves: the cache stays where it is
    submit(s, "warm", toks(1, 2))
    s.finished("warm", toks(1, 2, tail=0))
    assert s.route(toks(1, 2, 3)).instance == "A"
    # A is now busy with a long prompt: recomputing 2 blocks on B is cheaper than waiting
    s.dispatched("long", Route("A", 0, 0.0), 200)
    route = s.route(toks(1, 2, 3))
    assert route.instance == "B" and route.cached_tokens == 0
    assert route.cost == pytest.approx(TokenCost().exec(3 * BS + 1, 0.0))
    s.prefilled("long")  # handed to a decode instance: A is free again
    assert s.queued_cost("A") == 0 and s.queued_requests("A") == 0
    assert s.route(toks(1, 2, 3)).instance == "A"


def test_marginal_cost_waiting_prefills_stalls_and_shared_decode_steps():
    s = sched()
    cost = TokenCost()
    s.dispatched("r1", Route("A", 0, 0.0), 10, max_tokens=4)
    s.dispatched("r2", Route("A", 0, 0.0), 30, max_tokens=8)
    assert s.queued_cost("A") == pytest.approx(cost.exec(10, 0.0) + cost.exec(30, 0.0))
    assert s.decoding("A") == 0
    s.started("r1")  # its first token is out: it no longer waits, it decodes
    assert s.queued_cost("A") == pytest.approx(cost.exec(30, 0.0)) and s.decoding("A") == 1
    # no answer finished yet: the answer length is the request's cap
    expect = cost.exec(30, 0.0) + 2 * cost.exec(20, 0.0) + 1 * 16 * cost.decode(20)
    assert s.marginal_cost("A", 20, 0, max_tokens=16) == pytest.approx(expect)
    s.finished("r1", output_tokens=6)  # answers so far average 6 tokens
    s.started("r2")
    assert s.answer_tokens(16) == 6 and s.answer_tokens(4) == 4
    expect = 2 * cost.exec(20, 0.0) + 1 * 6 * cost.decode(20)
    assert s.marginal_cost("A", 20, 0, max_tokens=16) == pytest.approx(expect)
    assert s.marginal_cost("B", 20, 0) == pytest.approx(cost.exec(20, 0.0))


def test_a_cached_prompt_stays_on_its_instance_whatever_the_caps_of_the_requests_there():
    """Two instances, equally busy. A holds 2,144 of a 2,204-token prompt; its requests may
    generate up to 1,024 tokens, B's up to 64; answers have averaged 200 tokens. A queue term
    that counted each request's cap times a whole decode step read ~6 s on A against ~0.4 s on
    B and sent the prompt to B, recomputing its 2,144 cached tokens (13B, TP 2, H800)."""
    from minimemserve.sim.runner import gpu_setup

    setup = gpu_setup("llama2-13b", "h800", 8, 2)
    s = GlobalScheduler(["A", "B"], block_size=16, cost_model=setup.cost)
    prompt = list(range(2204))
    s.record("A", prompt[:2144])
    for i in range(4):
        for name, cap in (("A", 1024), ("B", 64)):
            rid = f"{name}{i}"
            s.dispatched(rid, Route(name, 0, 0.0), 1000, max_tokens=cap)
            s.started(rid)
    s.dispatched("done", Route("B", 0, 0.0), 100, max_tokens=1024)
    s.finished("done", output_tokens=200)
    route = s.route(prompt, max_tokens=1024)
    assert route.instance == "A" and route.cached_tokens == 2144
    # the load still counts: with A's decodes twice B's, an uncached prompt goes to B
    for i in range(4, 8):
        s.dispatched(f"A{i}", Route("A", 0, 0.0), 1000, max_tokens=1024)
        s.started(f"A{i}")
    assert s.route(list(range(5000, 7204)), max_tokens=1024).instance == "B"
    # and the cached prompt goes there too, its prefix sent over rather than recomputed
    route = s.route(prompt, max_tokens=1024)
    assert (route.instance, route.transfer_from, route.cached_tokens) == ("B", "A", 2144)


def test_prompt_tree_moves_the_prefix_to_the_idle_instance():
    s = sched("prompt_tree")
    prefix = toks(*range(1, 21), tail=0)  # 20 blocks cached on A
    s.dispatched("warm", Route("A", 0, 0.0), len(prefix))
    s.finished("warm", prefix)
    s.dispatched("long", Route("A", 0, 0.0), 500)
    route = s.route(prefix + [7])
    assert (route.instance, route.transfer_from, route.transfer_tokens) == ("B", "A", 80)
    assert route.cached_tokens == 80
    expect = TokenCost().exec(81, 80 / 81) + UNIT_TRANSFER_COST * 80
    assert route.cost == pytest.approx(expect) and s.num_transfers == 1
    # without the queue on A, going to A directly is cheaper than any transfer
    s.finished("long")
    route = s.route(prefix + [7])
    assert route.instance == "A" and route.transfer_from is None
    # prompt_tree_local never moves a prefix: behind the same queue it recomputes it on B
    local = sched("prompt_tree_local")
    local.dispatched("warm", Route("A", 0, 0.0), len(prefix))
    local.finished("warm", prefix)
    local.dispatched("long", Route("A", 0, 0.0), 500)
    route = local.route(prefix + [7])
    assert (route.instance, route.transfer_from, route.cached_tokens) == ("B", None, 0)
    assert local.num_transfers == 0


def test_without_caching_the_trees_are_ignored():
    s = sched(caching=False)
    submit(s, "r1", toks(1, 2))
    s.finished("r1", toks(1, 2, 3, tail=0))
    assert s.route(toks(1, 2, 3)).cached_tokens == 0
    assert s.trees.num_blocks("A") == 0 == s.trees.num_blocks("B")


def test_tree_entries_expire_after_the_ttl():
    clock = Clock()
    trees = PromptTrees(BS, ttl_s=10.0, clock=clock)
    trees.add("A")
    trees.record("A", toks(1, 2, tail=3))  # the partial block is not recorded
    assert trees.cached("A", toks(1, 2, 3)) == 2 * BS
    clock.now = 9.0
    trees.record("A", toks(1, tail=0))  # touching a prefix renews it
    clock.now = 15.0
    assert trees.cached("A", toks(1, 2)) == BS
    clock.now = 30.0
    assert trees.expire() == 1 and trees.cached("A", toks(1, 2)) == 0
    assert trees.cached("nobody", toks(1)) == 0


def test_routing_sweeps_expired_entries_it_never_walks():
    clock = Clock()
    s = sched(ttl_s=20.0, clock=clock)
    s.dispatched("r1", Route("A", 0, 0.0), 9)
    s.finished("r1", toks(1, 2))
    assert s.trees.num_blocks("A") == 2
    clock.now = 15.0
    s.route(toks(5))  # another prefix: nothing expired yet
    assert s.trees.num_blocks("A") == 2
    clock.now = 40.0
    s.route(toks(5))  # the sweep drops A's entry although this lookup never reached it
    assert s.trees.num_blocks("A") == 0


def test_drop_forgets_an_instance_and_its_requests():
    s = sched("least_load")
    submit(s, "r1", toks(1))
    submit(s, "r2", toks(2))
    assert s.drop("A") == ["r1"]
    assert s.live == ["B"] and all(s.route(toks(b)).instance == "B" for b in range(3))
    s.drop("B")
    with pytest.raises(InstanceDied, match="no live instance"):
        s.route(toks(1))


def test_bad_input():
    with pytest.raises(ConfigError, match="unknown routing policy 'fastest'"):
        sched("fastest")
    with pytest.raises(ValueError, match="at least one instance"):
        sched(names=())
    with pytest.raises(ValueError, match="repeat"):
        sched(names=("A", "A"))
    with pytest.raises(ValueError, match="ttl_s must be positive"):
        PromptTrees(BS, ttl_s=0)
    with pytest.raises(InvalidRequest, match="empty prompt"):
        sched().route([])
