"""A scripted ``Serving`` and the HTTP server over it, in this process: the server's engine
thread, probes and connections tested without a model (tests/server)."""

from __future__ import annotations

import socket
import threading
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass

import uvicorn

from minimemserve.recipes import Role
from minimemserve.request import RequestMetrics, RequestOutput, TokenDelta
from minimemserve.server import app
from minimemserve.server.engine_loop import EngineLoop
from minimemserve.server.metrics import ServerMetrics

TOKENS = 3  # tokens each scripted request generates
LETTERS = 26  # the scripted tokenizer's vocabulary: one id per lower-case letter


class Scripted:
    """A Serving whose requests each yield one token per step, TOKENS in all."""

    def __init__(self, fail_at_step: int | None = None, step_s: float = 0.0) -> None:
        self.left: dict[str, int] = {}
        self.deltas: list[TokenDelta] = []
        self.steps, self.fail_at_step, self.closed = 0, fail_at_step, False
        self.step_s = step_s  # how long each step takes

    def validate(self, prompt, params) -> list[int]:
        return list(prompt)

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


class Gated(Scripted):
    """A scripted serving whose steps wait for ``gate`` (a step stuck for as long as a test
    wants), whose instance can be declared dead, and the deployment beyond repair."""

    def __init__(self) -> None:
        super().__init__()
        self.gate = threading.Event()
        self.stepping = threading.Event()
        self.dead = False
        self.broken: str | None = None

    def beyond_repair(self) -> str | None:
        return self.broken

    def step(self):
        self.stepping.set()
        self.gate.wait(30)
        return super().step()

    def load(self) -> dict[str, dict]:
        return {} if self.dead else super().load()


class Letters:
    """A tokenizer of lower-case letters (one id each); tokenizing a prompt of ``slow_from``
    characters or more takes ``slow_s`` (a long prompt's cost, without the GIL, as
    sentencepiece's)."""

    vocab_size = LETTERS
    bos_id = eos_id = None

    def __init__(self) -> None:
        self.slow_from = 2**62
        self.slow_s = 0.0

    def prompt_ids(self, prompt) -> list[int]:
        if isinstance(prompt, str):
            if len(prompt) >= self.slow_from:
                time.sleep(self.slow_s)
            return [(ord(c) - ord("a")) % LETTERS for c in prompt]
        return list(prompt)

    def decode(self, ids, skip_special: bool = True) -> str:
        return "".join(chr(ord("a") + i % LETTERS) for i in ids)

    def id_to_piece(self, token_id: int) -> str:
        return self.decode([token_id])


@dataclass
class Served:
    """An app over a gated scripted serving, on a free loopback port."""

    url: str
    serving: Gated
    loop: EngineLoop
    server: app.Server
    tokenizer: Letters


def get(url: str, timeout_s: float = 5.0) -> tuple[int, str]:
    """``(status, body)`` of a GET."""
    try:
        with urllib.request.urlopen(url, timeout=timeout_s) as r:
            return r.status, r.read().decode()
    except urllib.error.HTTPError as e:
        return e.code, e.read().decode()


@contextmanager
def serve_scripted(max_pending: int = 2) -> Iterator[Served]:
    """Start the app (uvicorn in a thread of this process) over a :class:`Gated` serving."""
    serving = Gated()
    metrics = ServerMetrics("scripted")
    loop = EngineLoop(lambda: serving, metrics.observe_output, app.Watcher(metrics))
    loop.start(5)
    roles = (Role.COLOCATED,)
    tok = Letters()
    server = app.Server(loop, tok, None, "scripted", 64, roles, metrics, max_pending=max_pending)
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
    try:
        yield Served(f"http://127.0.0.1:{port}", serving, loop, server, tok)
    finally:
        serving.gate.set()
        web.should_exit = True
        thread.join(10)
        loop.stop()
