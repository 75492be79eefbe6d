"""The server's engine thread with a scripted Serving: delivery order, failures, shutdown,
callers that give up; and the HTTP probes that read it (liveness and metrics answer while a
step is stuck, readiness follows the instances and the room for work). Its connections are
in ``test_connections.py``."""

from __future__ import annotations

import asyncio
import threading
import time

import pytest

pytest.importorskip("fastapi")
pytest.importorskip("uvicorn")

from scripted_server import TOKENS, Scripted, get, serve_scripted

from minimemserve.request import RequestOutput, TokenDelta
from minimemserve.server.engine_loop import EngineLoop


async def _collect(loop: EngineLoop, rid: str) -> list:
    events: asyncio.Queue = asyncio.Queue()
    aio = asyncio.get_running_loop()

    def add(s):
        s.add_request([1], None, rid)
        loop.register(rid, aio, events)

    await asyncio.wait_for(loop.call(add), 5)
    got = []
    while not got or not isinstance(got[-1], RequestOutput):
        got.append(await asyncio.wait_for(events.get(), 5))
    return got


def test_deltas_then_the_output_reach_the_caller_in_order():
    serving = Scripted()
    loop = EngineLoop(lambda: serving)
    loop.start(5)
    try:
        got = asyncio.run(_collect(loop, "a"))
        assert [type(e) for e in got] == [TokenDelta, TokenDelta, RequestOutput]
        assert [e.token_ids for e in got[:2]] == [[1], [2]] and got[-1].token_ids == [1, 2, 3]
        assert loop.num_streams == 0  # the finished request is no longer delivered to
        assert asyncio.run(loop.call(lambda s: s.abort("nope"))) is None
    finally:
        loop.stop()
    assert serving.closed and not loop.alive


def test_a_failing_start_is_reported():
    def boom():
        raise OSError("no checkpoint")

    loop = EngineLoop(boom)
    with pytest.raises(RuntimeError, match="failed to start: no checkpoint"):
        loop.start(5)
    assert not loop.alive


def test_a_failing_step_ends_open_streams_with_an_error_and_refuses_calls():
    serving = Scripted(fail_at_step=2)
    loop = EngineLoop(lambda: serving)
    loop.start(5)
    got = asyncio.run(_collect(loop, "a"))
    assert got[-1].finish_reason == "error" and "scripted failure" in got[-1].error
    loop._thread.join(5)
    assert not loop.alive and serving.closed
    with pytest.raises(RuntimeError, match="not running"):
        asyncio.run(loop.call(lambda s: None))


def test_callers_that_give_up_leave_the_engine_serving():
    """A probe with a short timeout during slow steps: one still queued is skipped, one already
    running keeps its result; the engine thread lives on and serves the next request."""
    serving = Scripted(step_s=0.2)
    loop = EngineLoop(lambda: serving)
    loop.start(5)
    ran: list[str] = []

    def slow_probe(s):
        ran.append("slow")
        time.sleep(0.3)
        return "late"

    async def scenario() -> list:
        busy = asyncio.create_task(_collect(loop, "busy"))  # steps of 0.2 s from now on
        await asyncio.sleep(0.05)
        with pytest.raises(asyncio.TimeoutError):  # queued behind a step, then given up
            await asyncio.wait_for(loop.call(lambda s: ran.append("queued")), 0.01)
        await busy
        with pytest.raises(asyncio.TimeoutError):  # running when its caller gives up
            await asyncio.wait_for(loop.call(slow_probe), 0.05)
        return await _collect(loop, "after")

    try:
        got = asyncio.run(scenario())
        assert got[-1].finish_reason == "length" and got[-1].token_ids == [1, 2, 3]
        assert ran == ["slow"]  # the abandoned queued call never ran
        assert loop.alive and loop.error is None
        assert asyncio.run(loop.call(lambda s: s.steps)) >= 2 * TOKENS
    finally:
        loop.stop()


def test_the_tick_runs_between_steps_and_a_death_is_reported_once():
    serving = Scripted(fail_at_step=2)
    ticks, deaths = [], []
    loop = EngineLoop(
        lambda: serving, tick=lambda s: ticks.append(s.steps), on_failure=deaths.append
    )
    loop.start(5)
    got = asyncio.run(_collect(loop, "a"))
    loop._thread.join(5)
    assert got[-1].finish_reason == "error"
    assert ticks and ticks[0] == 0  # the first tick comes before any step
    assert len(deaths) == 1 and "scripted failure" in str(deaths[0])


def test_a_failing_tick_does_not_stop_the_engine():
    def tick(s):
        raise OSError("stats unavailable")

    loop = EngineLoop(Scripted, tick=tick)
    loop.start(5)
    try:
        got = asyncio.run(_collect(loop, "a"))
        assert got[-1].finish_reason == "length" and loop.alive
    finally:
        loop.stop()


def test_a_failing_output_callback_does_not_stop_the_engine():
    def on_output(out):
        if out.request_id == "a":
            raise KeyError("no such label")

    loop = EngineLoop(Scripted, on_output=on_output)
    loop.start(5)
    try:
        assert asyncio.run(_collect(loop, "a"))[-1].finish_reason == "length"
        assert asyncio.run(_collect(loop, "b"))[-1].finish_reason == "length" and loop.alive
    finally:
        loop.stop()


@pytest.fixture
def served():
    """(url, serving, loop, server) of an app on a free loopback port."""
    with serve_scripted() as srv:
        yield srv.url, srv.serving, srv.loop, srv.server


def test_health_and_metrics_answer_while_a_step_is_stuck(served):
    url, serving, loop, _ = served
    assert get(url + "/ready")[0] == 200
    serving.gate.clear()
    add = threading.Thread(target=lambda: asyncio.run(_collect(loop, "a")), daemon=True)
    add.start()
    assert serving.stepping.wait(5)
    assert get(url + "/health") == (200, '{"status":"ok"}')  # the step is still waiting
    status, text = get(url + "/metrics")
    assert status == 200 and 'model_name="scripted"' in text
    assert not serving.gate.is_set() and add.is_alive()
    serving.gate.set()
    add.join(5)
    assert not add.is_alive() and loop.alive


def test_ready_needs_a_live_instance_per_role_and_room(served):
    url, serving, loop, server = served
    assert get(url + "/ready")[0] == 200
    serving.dead = True
    loop._ticked = -1e9  # refresh the view at the next loop iteration
    deadline = time.monotonic() + 5
    while (got := get(url + "/ready"))[0] == 200:
        assert time.monotonic() < deadline, "/ready missed the dead instance"
        time.sleep(0.05)
    assert got[0] == 503 and "no live instance for role(s) colocated" in got[1], got
    assert get(url + "/health")[0] == 200  # alive, just not ready
    serving.dead = False
    loop._ticked = -1e9
    while get(url + "/ready")[0] != 200:
        assert time.monotonic() < deadline + 5
        time.sleep(0.05)
    server.max_pending = 0  # no room: not ready, still alive
    assert get(url + "/ready")[0] == 503 and get(url + "/health")[0] == 200


def test_a_deployment_beyond_repair_fails_liveness(served):
    """A role none of whose instances will come back (restarts used up): /health fails, so a
    supervisor restarts the server instead of leaving it unready for good."""
    url, serving, loop, _ = served
    assert get(url + "/health")[0] == 200
    serving.broken = "no decode instance will come back (D0: it exited after 5 restarts)"
    loop._ticked = -1e9  # refresh the view at the next loop iteration
    deadline = time.monotonic() + 5
    while (got := get(url + "/health"))[0] == 200:
        assert time.monotonic() < deadline, "/health missed it"
        time.sleep(0.05)
    assert got[0] == 503 and "will not recover" in got[1] and "D0" in got[1], got
    assert get(url + "/ready")[0] == 503


def test_a_dead_engine_fails_both_probes(served):
    url, serving, loop, _ = served
    serving.fail_at_step = serving.steps + 1
    asyncio.run(_collect(loop, "a"))
    loop._thread.join(5)
    status, text = get(url + "/health")
    assert status == 503 and "scripted failure" in text
    assert get(url + "/ready")[0] == 503
