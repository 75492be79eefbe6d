"""Frontend: the request's life across instances (route, push, dispatch, start, hand-off,
finish, drop, re-run rule) as every runtime and the simulator drive it; the routing-policy
table."""

from __future__ import annotations

import pytest

from minimemserve import config, scheduler
from minimemserve.request import RequestMetrics, RequestOutput, TokenDelta
from minimemserve.scheduler import ROUTING, ROUTING_POLICIES, STEP_POLICIES, global_scheduler, local
from minimemserve.scheduler.frontend import MAX_RERUNS, Frontend
from minimemserve.scheduler.global_scheduler import Route

BS = 4


class Pushes:
    """A ``push`` that records each call and moves ``moved`` tokens."""

    def __init__(self, moved: int) -> None:
        self.moved = moved
        self.calls: list[tuple[str, str, int]] = []

    def __call__(self, src: str, dst: str, prompt) -> int:
        self.calls.append((src, dst, len(prompt)))
        return self.moved


def output(rid: str, reason: str, n: int) -> RequestOutput:
    return RequestOutput(rid, [1, 2, 3], list(range(1, n + 1)), None, reason, RequestMetrics(0.0))


def busy_holder(front: Frontend, prompt: list[int]) -> str:
    """Cache ``prompt`` on A and queue a long prefill there, so B is cheaper with a push."""
    front.scheduler.record("A", prompt)
    front.dispatched("long", Route("A", 0, 0.0), 10_000, 1)
    return "A"


def test_a_route_that_asks_for_a_push_moves_the_prefix_and_says_what_landed():
    prompt = list(range(1, 8 * BS + 2))
    push = Pushes(moved=8 * BS)
    front = Frontend(["A", "B"], push, block_size=BS)
    busy_holder(front, prompt)
    route = front.route(prompt, 4)
    assert push.calls == [("A", "B", len(prompt))]
    assert (route.instance, route.transfer_from, route.transfer_tokens) == ("B", "A", 8 * BS)
    assert route.cached_tokens == 8 * BS  # what the trees now believe B holds
    assert front.scheduler.trees.cached("B", prompt) == 8 * BS
    assert front.prefix_tokens_moved == 8 * BS and front.route_calls == 1


def test_a_failed_push_routes_without_the_prefix():
    prompt = list(range(1, 8 * BS + 2))
    push = Pushes(moved=0)
    front = Frontend(["A", "B"], push, block_size=BS)
    busy_holder(front, prompt)
    route = front.route(prompt, 4)
    assert len(push.calls) == 1
    assert (route.instance, route.transfer_from, route.transfer_tokens) == ("B", None, 0)
    assert route.cached_tokens == 0 and front.prefix_tokens_moved == 0


def test_no_push_under_a_policy_that_does_not_move_prefixes():
    for policy in ROUTING_POLICIES:
        push = Pushes(moved=BS)
        front = Frontend(["A", "B"], push, policy=policy, block_size=BS)
        prompt = list(range(1, 8 * BS + 2))
        busy_holder(front, prompt)
        front.route(prompt, 4, session_id="s")
        assert bool(push.calls) == ROUTING[policy].moves_prefixes, policy


@pytest.mark.parametrize(
    ("reason", "counted"), [("stop", True), ("length", True), ("abort", False), ("error", False)]
)
def test_only_an_answered_request_counts_toward_the_mean_answer(reason, counted):
    front = Frontend(["A"], Pushes(0), block_size=BS)
    front.dispatched("r", Route("A", 0, 0.0), 8, 50)
    front.streamed(TokenDelta("r", 1, [5]))  # not the first token: no news
    assert front.scheduler.decoding("A") == 0
    front.streamed(TokenDelta("r", 0, [4]))
    assert front.scheduler.decoding("A") == 1
    front.finished(output("r", reason, 7))
    assert front.scheduler.decoding("A") == 0
    assert front.scheduler.answer_tokens(50) == (7 if counted else 50)


def test_a_handed_off_request_stops_weighing_on_its_prefill_instance():
    front = Frontend(["P"], Pushes(0), block_size=BS)
    front.dispatched("r", Route("P", 0, 0.0), 8, 5)
    assert front.scheduler.queued_requests("P") == 1
    front.prefilled("r")
    assert front.scheduler.queued_requests("P") == 0
    front.dropped("r")  # aborted on D: nothing left of it
    front.dropped("r")  # twice is harmless
    assert front.scheduler.answer_tokens() == 0


def test_the_rerun_rule():
    assert not Frontend(["A"], Pushes(0)).may_rerun(0)  # the deployment does not allow it
    front = Frontend(["A"], Pushes(0), rerun_on_failure=True)
    assert [front.may_rerun(n) for n in range(MAX_RERUNS + 1)] == [True] * MAX_RERUNS + [False]


def test_policy_names_are_one_table_and_the_old_names_are_gone():
    assert ROUTING_POLICIES == tuple(ROUTING) and "prompt_tree" in ROUTING
    assert set(ROUTING_POLICIES).isdisjoint(STEP_POLICIES)
    for module in (global_scheduler, scheduler, local):
        assert not hasattr(module, "POLICIES")
    assert not hasattr(config, "SCHEDULERS")
    assert not hasattr(global_scheduler.GlobalScheduler, "landed")  # after_push is its name


def test_submit_routes_dispatches_and_sends_once_and_a_failed_send_is_dropped():
    front = Frontend(["A", "B"], Pushes(0), block_size=BS)
    sent: list[str] = []
    route = front.submit("r", [1, 2, 3], 5, None, lambda rt: sent.append(rt.instance))
    assert sent == [route.instance] and front.scheduler.queued_requests(route.instance) == 1

    def refuse(rt: Route) -> None:
        raise RuntimeError("no room")

    with pytest.raises(RuntimeError, match="no room"):
        front.submit("q", [1, 2, 3], 5, None, refuse)
    assert sum(front.scheduler.queued_requests(n) for n in "AB") == 1  # only r weighs


def test_report_takes_first_tokens_hand_offs_outputs_and_drops():
    front = Frontend(["P"], Pushes(0), block_size=BS)
    for rid in ("a", "b", "c"):
        front.submit(rid, [1, 2, 3], 5, None, lambda rt: None)
    front.report(started=["a"], deltas=[TokenDelta("b", 0, [4])])
    assert front.scheduler.decoding("P") == 2
    front.report(handoffs=["a"], outputs=[output("b", "stop", 3)], dropped=["c"])
    assert front.scheduler.queued_requests("P") == 0 and front.scheduler.decoding("P") == 0
    assert front.scheduler.answer_tokens(50) == 3
