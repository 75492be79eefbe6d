"""The server's engine thread with a scripted Serving: delivery order, failures, shutdown,
callers that give up; and the HTTP probes that read it (liveness and metrics answer while a
step is stuck, readiness follows the instances and the room for work)."""

from __future__ import annotations

import asyncio
import json
import socket
import threading
import time
import urllib.error
import urllib.request

import pytest

pytest.importorskip("fastapi")
uvicorn = pytest.importorskip("uvicorn")

from minimemserve.recipes import Role  # noqa: E402
from minimemserve.request import RequestMetrics, RequestOutput, TokenDelta  # noqa: E402
from minimemserve.server import app, connections  # noqa: E402
from minimemserve.server.engine_loop import EngineLoop  # noqa: E402
from minimemserve.server.metrics import ServerMetrics  # noqa: E402

TOKENS = 3  # tokens each scripted request generates


class Scripted:
    """A Serving whose requests each yield one token per step, TOKENS in all."""

    def __init__(self, fail_at_step: int | None = None, step_s: float = 0.0) -> None:
        self.left: dict[str, int] = {}
        self.deltas: list[TokenDelta] = []
        self.steps, self.fail_at_step, self.closed = 0, fail_at_step, False
        self.step_s = step_s  # how long each step takes

    def add_request(self, prompt, params, request_id, arrival_time=None, session_id=None) -> str:
        self.left[request_id] = TOKENS
        return request_id

    def step(self) -> list[RequestOutput]:
        time.sleep(self.step_s)
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

    def load(self) -> dict[str, dict]:
        return {"c0": {"role": "colocated", "waiting": 0, "running": len(self.left)}}

    def check_pools(self, require_idle: bool = True) -> dict[str, dict]:
        return {"c0": {"pool": {"hbm": {"total": 4, "free": 4, "referenced": 0, "cached_only": 0}}}}


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


class Gated(Scripted):
    """A scripted serving whose steps wait for ``gate`` (a step stuck for as long as a test
    wants), and whose instance can be declared dead."""

    def __init__(self) -> None:
        super().__init__()
        self.gate = threading.Event()
        self.stepping = threading.Event()
        self.dead = False

    def step(self):
        self.stepping.set()
        self.gate.wait(30)
        return super().step()

    def load(self) -> dict[str, dict]:
        return {} if self.dead else super().load()


def _get(url: str) -> tuple[int, str]:
    try:
        with urllib.request.urlopen(url, timeout=5) as r:
            return r.status, r.read().decode()
    except urllib.error.HTTPError as e:
        return e.code, e.read().decode()


@pytest.fixture
def served():
    """(url, serving, loop, server) of an app on a free loopback port."""
    serving = Gated()
    metrics = ServerMetrics("scripted")
    loop = EngineLoop(lambda: serving, metrics.observe_output, app.Watcher(metrics))
    loop.start(5)
    roles = (Role.COLOCATED,)
    server = app.Server(loop, None, None, "scripted", 64, roles, metrics, max_pending=2)
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    web = uvicorn.Server(app.web_config(server, "127.0.0.1", port, "error"))
    thread = threading.Thread(target=web.run, daemon=True)
    thread.start()
    deadline = time.monotonic() + 10
    while not web.started:
        assert time.monotonic() < deadline, "the app did not start"
        time.sleep(0.05)
    serving.gate.set()
    yield f"http://127.0.0.1:{port}", serving, loop, server
    serving.gate.set()
    web.should_exit = True
    thread.join(10)


def test_health_and_metrics_answer_while_a_step_is_stuck(served):
    url, serving, loop, _ = served
    assert _get(url + "/ready")[0] == 200
    serving.gate.clear()
    add = threading.Thread(target=lambda: asyncio.run(_collect(loop, "a")), daemon=True)
    add.start()
    assert serving.stepping.wait(5)
    assert _get(url + "/health") == (200, '{"status":"ok"}')  # the step is still waiting
    status, text = _get(url + "/metrics")
    assert status == 200 and 'model_name="scripted"' in text
    assert not serving.gate.is_set() and add.is_alive()
    serving.gate.set()
    add.join(5)
    assert not add.is_alive() and loop.alive


def test_ready_needs_a_live_instance_per_role_and_room(served):
    url, serving, loop, server = served
    assert _get(url + "/ready")[0] == 200
    serving.dead = True
    loop._ticked = -1e9  # refresh the view at the next loop iteration
    deadline = time.monotonic() + 5
    while (got := _get(url + "/ready"))[0] == 200:
        assert time.monotonic() < deadline, "/ready missed the dead instance"
        time.sleep(0.05)
    assert got[0] == 503 and "no live instance for role(s) colocated" in got[1], got
    assert _get(url + "/health")[0] == 200  # alive, just not ready
    serving.dead = False
    loop._ticked = -1e9
    while _get(url + "/ready")[0] != 200:
        assert time.monotonic() < deadline + 5
        time.sleep(0.05)
    server.max_pending = 0  # no room: not ready, still alive
    assert _get(url + "/ready")[0] == 503 and _get(url + "/health")[0] == 200


def test_a_dead_engine_fails_both_probes(served):
    url, serving, loop, _ = served
    serving.fail_at_step = serving.steps + 1
    asyncio.run(_collect(loop, "a"))
    loop._thread.join(5)
    status, text = _get(url + "/health")
    assert status == 503 and "scripted failure" in text
    assert _get(url + "/ready")[0] == 503


def _connect(url: str) -> socket.socket:
    host, port = url.removeprefix("http://").split(":")
    return socket.create_connection((host, int(port)), timeout=10)


def _closed_by_server(sock: socket.socket) -> bool:
    """Whether the server closed ``sock`` (within the socket's timeout)."""
    try:
        return sock.recv(1) == b""
    except ConnectionResetError:
        return True
    except TimeoutError:
        return False


def test_idle_and_dribbling_connections_are_closed_and_the_probes_answer(served, monkeypatch):
    """More connections than the server takes, sending nothing or a byte of headers now and
    then: the probes answer meanwhile, the server closes them all within the header timeout
    (here 1 s), and then serves everyone again."""
    url, _, _, server = served
    monkeypatch.setattr(connections, "HEADER_TIMEOUT_S", 1.0)
    limit = server.max_pending + app.SPARE_CONNECTIONS
    idle = [_connect(url) for _ in range(limit + 10)]
    dribbling = [_connect(url) for _ in range(5)]
    try:
        time.sleep(0.2)  # every connection accepted
        assert _get(url + "/health") == (200, '{"status":"ok"}')  # beyond the limit
        assert _get(url + "/v1/models")[0] == 503  # the limit holds for the rest
        for i in range(4):
            for sock in dribbling:
                sock.sendall(b"GET /v1/models HTTP/1.1\r\n"[i : i + 1])
            time.sleep(0.3)
        start = time.monotonic()
        assert all(map(_closed_by_server, idle + dribbling))
        assert time.monotonic() - start < 5
        assert _get(url + "/v1/models")[0] == 200
    finally:
        for sock in idle + dribbling:
            sock.close()


def _raw(url: str, head: bytes) -> bytes:
    with _connect(url) as sock:
        sock.sendall(head)
        return sock.recv(4096)


def test_oversized_headers_a_wrong_content_type_and_a_huge_model_name(served):
    url = served[0]
    big = b"GET /health HTTP/1.1\r\nhost: x\r\nx-big: " + b"a" * 2**20 + b"\r\n\r\n"
    assert _raw(url, big).startswith(b"HTTP/1.1 431 ")
    body = json.dumps({"model": "m", "prompt": [1, 2]}).encode()
    req = urllib.request.Request(url + "/v1/completions", body, {"content-type": "text/plain"})
    with pytest.raises(urllib.error.HTTPError) as e:
        urllib.request.urlopen(req, timeout=10)
    err = json.loads(e.value.read())["error"]
    assert e.value.code == 415 and err["code"] == "unsupported_media_type", err
    body = json.dumps({"model": "m" * 2**20, "prompt": [1, 2]}).encode()  # a 1 MB body
    headers = {"content-type": "application/json; charset=utf-8"}
    req = urllib.request.Request(url + "/v1/completions", body, headers)
    with pytest.raises(urllib.error.HTTPError) as e:
        urllib.request.urlopen(req, timeout=10)
    answer = e.value.read()
    assert e.value.code == 404 and len(answer) < 1000, answer[:300]
    assert b"1048576 characters" in answer
    assert _get(url + "/health")[0] == 200
