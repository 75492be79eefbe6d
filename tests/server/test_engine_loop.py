"""The server's engine thread with a scripted Serving: delivery order, failures, shutdown."""

from __future__ import annotations

import asyncio

import pytest

pytest.importorskip("fastapi")

from minimemserve.request import RequestMetrics, RequestOutput, TokenDelta
from minimemserve.server.engine_loop import EngineLoop

TOKENS = 3  # tokens each scripted request generates


class Scripted:
    """A Serving whose requests each yield one token per step, TOKENS in all."""

    def __init__(self, fail_at_step: int | None = None) -> None:
        self.left: dict[str, int] = {}
        self.deltas: list[TokenDelta] = []
        self.steps, self.fail_at_step, self.closed = 0, fail_at_step, False

    def add_request(self, prompt, params, request_id, arrival_time=None, session_id=None) -> str:
        self.left[request_id] = TOKENS
        return request_id

    def step(self) -> list[RequestOutput]:
        self.steps += 1
        if self.steps == self.fail_at_step:
            raise RuntimeError("scripted failure")
        done = []
        for rid in list(self.left):
            self.left[rid] -= 1
            n = TOKENS - self.left[rid]
            if self.left[rid]:
                self.deltas.append(TokenDelta(rid, n - 1, [n]))
            else:
                del self.left[rid]
                metrics = RequestMetrics(0.0)
                done.append(
                    RequestOutput(rid, [1], list(range(1, TOKENS + 1)), None, "length", metrics)
                )
        return done

    def take_deltas(self) -> list[TokenDelta]:
        out, self.deltas = self.deltas, []
        return out

    def has_unfinished(self) -> bool:
        return bool(self.left)

    def abort(self, rid):
        return None if self.left.pop(rid, None) is None else "aborted"

    def close(self) -> None:
        self.closed = True


async def _collect(loop: EngineLoop, rid: str) -> list:
    events: asyncio.Queue = asyncio.Queue()
    aio = asyncio.get_running_loop()

    def add(s):
        s.add_request([1], None, rid)
        loop.register(rid, aio, events)

    await loop.call(add)
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
