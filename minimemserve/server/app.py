"""The OpenAI-compatible HTTP server: ``minimemserve serve``.

Endpoints: ``POST /v1/completions``, ``POST /v1/chat/completions``, ``GET /v1/models``,
``GET /health`` (liveness: the engine thread runs; never waits for a step), ``GET /ready``
(readiness: every role has a live instance and there is room for work) and ``GET /metrics``
(Prometheus). The probes read what the engine thread publishes once a second and never wait
on it (a scrape waits at most ``METRICS_WAIT_S`` for fresh pool gauges). If the engine thread
dies, the process logs it and exits (status 1) instead of serving 503s.
Any deployment serves: in this process (``--runtime inprocess``) or one process per instance
behind the global scheduler (``--runtime process``, the default). Tokens stream as the
decoding instance samples them (SSE, ending with ``data: [DONE]``). A client that goes away
aborts its requests, which frees their blocks wherever they are. Errors come in OpenAI's shape,
400 for every value the library refuses."""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import hmac
import itertools
import json
import logging
import math
import os
import re
import resource
import signal
import threading
import time
import uuid
from collections.abc import AsyncIterator, Iterator
from contextlib import asynccontextmanager, contextmanager
from dataclasses import dataclass, field

import uvicorn
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest
from starlette.requests import ClientDisconnect

from ..config import EngineConfig
from ..disagg.rpc import LOOPBACK_HOSTS
from ..errors import (
    InstanceDied,
    InvalidRequest,
    MiniMemServeError,
    PoolExhausted,
    TransferError,
)
from ..model.loader import read_checkpoint
from ..model.tokenizer import Tokenizer
from ..options import deployment_options, engine_options
from ..request import RequestOutput, TokenDelta
from ..sampling import INT64_LIMIT, SamplingParams
from ..serving import Serving
from . import DEFAULT_MAX_PENDING, SERVE_ENGINE_FLAGS, SERVE_FIELDS, protocol
from .connections import KEEP_ALIVE_S, GuardedHttp
from .engine_loop import TICK_S, EngineLoop
from .metrics import ServerMetrics, Snapshot

logger = logging.getLogger(__name__)

# How often a non-streaming request checks whether its client is still connected.
DISCONNECT_POLL_S = 0.25
# A loop iteration (one step and its calls) running longer than this is a hang: /health fails.
STALL_S = 600.0
# /ready needs a view of the instances at most this old, or three refresh periods (the engine
# thread refreshes it between steps; an older one means the thread is held up).
READY_STALE_S = 30.0
# The pool snapshot may take at most 1/SNAPSHOT_SHARE of the engine thread's time under load.
SNAPSHOT_SHARE = 20
# How long /metrics waits for fresh pool gauges before showing the last snapshot.
METRICS_WAIT_S = 2.0
# How long uvicorn waits for open connections when the process shuts down.
SHUTDOWN_GRACE_S = 5.0
# Start-up of the instances (processes load the checkpoint) before the port opens.
STARTUP_TIMEOUT_S = 300.0
# What an overloaded server tells a client to wait before it tries again (Retry-After, s).
RETRY_AFTER_S = 1
# Open files the server takes when the host allows no more than unlimited (connections cost
# one each; the server limits requests in flight, not connections).
OPEN_FILES_CAP = 2**20
# A body at least this large is parsed and tokenized in a worker thread, off the event loop
# (smaller ones cost less there than the hand-over).
OFFLOAD_BYTES = 64 * 2**10
# The environment variable an API key may come from (keeps it off the command line).
API_KEY_ENV = "MINIMEMSERVE_API_KEY"
# Largest request body read (a long prompt as token ids is a few MB).
MAX_BODY_BYTES = 16 * 2**20
# How much of a client's own text (a model name) an error message quotes.
QUOTE_CHARS = 80
# Media types a request body may declare (none declared is taken as JSON).
JSON_TYPES = ("application/json",)
_PARAM = re.compile(r"SamplingParams\.(\w+)")


class ClientGone(Exception):
    """The client of a non-streaming request disconnected (its requests were aborted)."""


class ApiError(Exception):
    """An error answered in OpenAI's shape with ``status``."""

    def __init__(
        self,
        status: int,
        message: str,
        kind: str,
        param: str | None = None,
        code: str | None = None,
        headers: dict[str, str] | None = None,
    ) -> None:
        super().__init__(message)
        self.status = status
        self.kind = kind
        self.param = param
        self.code = code
        self.headers = headers

    def body(self) -> dict:
        """``{"error": {"message", "type", "param", "code"}}``."""
        err = {"message": str(self), "type": self.kind, "param": self.param, "code": self.code}
        return {"error": err}

    def response(self) -> JSONResponse:
        """The JSON response of this error."""
        return JSONResponse(self.body(), status_code=self.status, headers=self.headers)


def quote(text: str) -> str:
    """``text`` as an error message quotes it: ``repr``, cut to ``QUOTE_CHARS`` characters."""
    if len(text) <= QUOTE_CHARS:
        return repr(text)
    return f"{text[:QUOTE_CHARS]!r}... ({len(text)} characters)"


def api_error(e: Exception) -> ApiError:
    """The HTTP error of an exception the library raised for a request."""
    if isinstance(e, ApiError):
        return e
    if isinstance(e, protocol.BadField):
        return ApiError(400, str(e), "invalid_request_error", e.param)
    if isinstance(e, PoolExhausted):
        return ApiError(400, str(e), "invalid_request_error", "max_tokens", "pool_exhausted")
    if isinstance(e, (InstanceDied, TransferError)):
        return ApiError(503, str(e), "service_unavailable", code="no_instance")
    if isinstance(e, ValueError):  # InvalidRequest and every other refused value
        param = m.group(1) if (m := _PARAM.search(str(e))) else None
        return ApiError(400, str(e), "invalid_request_error", param)
    if isinstance(e, RuntimeError) and not isinstance(e, NotImplementedError):
        return ApiError(503, str(e), "service_unavailable", code="engine_unavailable")
    return ApiError(500, f"{type(e).__name__}: {e}", "internal_error")


@dataclass
class Choice:
    """One generated sequence of a request: its engine request and what was sent of it."""

    index: int
    prompt: int  # which prompt of the request
    sibling: int  # j of n for that prompt; sibling 0 goes first, the others share its prefix
    rid: str
    detok: protocol.Detokenizer
    logprobs: list = field(default_factory=list)
    started: bool = False
    finish_reason: str | None = None
    out: RequestOutput | None = None
    first_at: float | None = None
    last_at: float = 0.0
    gaps: list[float] = field(default_factory=list)

    @property
    def tokens(self) -> list[int]:
        """The generated token ids received so far."""
        return self.detok.tokens


@dataclass
class Admission:
    """Choices of a request counted as in flight before their requests are in the engine."""

    choices: int


@dataclass
class Generation:
    """One HTTP request in flight: its choices and the queue their events arrive on."""

    parsed: protocol.Parsed
    choices: list[Choice]
    events: asyncio.Queue
    t0: float  # when the request arrived
    checked_at: float = 0.0  # when its client's connection was last checked (monotonic)


def usage(parsed: protocol.Parsed, choices: list[Choice]) -> dict:
    """OpenAI's usage object; ``cached_tokens`` is the prefix-cache hit of each prompt."""
    prompt = sum(map(len, parsed.prompts))
    done = sum(len(c.tokens) for c in choices)
    cached = sum(c.out.metrics.cached_tokens for c in choices if c.sibling == 0 and c.out)
    return {
        "prompt_tokens": prompt,
        "completion_tokens": done,
        "total_tokens": prompt + done,
        "prompt_tokens_details": {"cached_tokens": cached},
    }


def logprobs(chat: bool, c: Choice, lps: list, offset: int = 0) -> dict | None:
    """The logprobs object of some tokens of a choice, as OpenAI shapes it."""
    if c.out is None and not lps and not c.logprobs:
        return None
    toks = c.tokens[offset : offset + len(lps)]
    piece = c.detok.piece
    if chat:

        def entry(t: int, lp: float) -> dict:
            s = piece(t)
            return {"token": s, "logprob": lp, "bytes": list(s.encode())}

        return {
            "content": [
                entry(t, lp) | {"top_logprobs": [entry(a, b) for a, b in alts]}
                for t, (lp, alts) in zip(toks, lps)
            ]
        }
    return {
        "tokens": [piece(t) for t in toks],
        "token_logprobs": [lp for lp, _ in lps],
        "top_logprobs": [{piece(a): b for a, b in alts} for _, alts in lps],
        "text_offset": list(itertools.accumulate((len(piece(t)) for t in toks), initial=0))[:-1],
    }


def choice_body(c: Choice, body: dict, lp: dict | None, token_ids: bool) -> dict:
    """One entry of a response's ``choices``."""
    extra = {"token_ids": c.tokens} if token_ids and c.finish_reason else {}
    return {
        "index": c.index,
        **body,
        "logprobs": lp,
        "finish_reason": c.finish_reason,
        **extra,
    }


class Server:
    """The request handling behind the routes, over one :class:`EngineLoop`."""

    def __init__(
        self,
        loop: EngineLoop,
        tokenizer: Tokenizer,
        chat: protocol.ChatFormat,
        model_name: str,
        max_model_len: int,
        roles: tuple[str, ...],
        metrics: ServerMetrics,
        max_pending: int = DEFAULT_MAX_PENDING,
        api_key: str | None = None,
    ) -> None:
        self.loop = loop
        self.tok = tokenizer
        self.chat = chat
        self.model_name = model_name
        self.max_model_len = max_model_len
        self.roles = roles
        self.metrics = metrics
        self.max_pending = max_pending
        self.api_key = api_key
        self._ids = itertools.count()
        self._admitting = 0  # choices admitted whose requests are not in the engine yet
        # held to count: the engine thread registers requests and settles their admission
        # under it, so that no request is counted twice, or not at all, in between
        self._counting = threading.RLock()

    @property
    def in_flight(self) -> int:
        """Choices in flight: running in the engine, or admitted and being added to it."""
        return self.loop.num_streams + self._admitting

    @contextmanager
    def admit(self, choices: int) -> Iterator[Admission]:
        """Count ``choices`` as in flight until their requests are in the engine (or failed);
        past ``max_pending`` the request gets 503 with ``Retry-After`` instead. Requests in
        flight are what the server limits, not connections (an idle one costs a descriptor)."""
        with self._counting:
            if self.in_flight + choices > self.max_pending:
                raise ApiError(
                    503,
                    f"server overloaded: {self.in_flight} choices in flight (--max-pending "
                    f"{self.max_pending}); retry after {RETRY_AFTER_S} s",
                    "service_unavailable",
                    code="overloaded",
                    headers={"Retry-After": str(RETRY_AFTER_S)},
                )
            self._admitting += choices
        admission = Admission(choices)
        try:
            yield admission
        finally:
            self._settle(admission)

    def _settle(self, admission: Admission) -> None:
        """Stop counting ``admission``'s choices as admitted (they run, or never will)."""
        with self._counting:
            self._admitting -= admission.choices
            admission.choices = 0

    # ---- a request's choices ------------------------------------------------------------------
    def _params(self, gen: Generation, c: Choice) -> SamplingParams:
        p = gen.parsed.params
        if c.sibling and p.seed is not None:  # seeded siblings differ from each other
            p = dataclasses.replace(p, seed=(p.seed + c.sibling) % INT64_LIMIT)
        return p

    async def _add(
        self,
        gen: Generation,
        choices: list[Choice],
        validate: bool = False,
        admission: Admission | None = None,
    ) -> None:
        """Add ``choices`` to the engine in one call (after validating every prompt first, so
        a bad one adds nothing); their events go to ``gen.events``. The requests are counted
        in flight from then on, and ``admission`` no longer."""
        aio, prompts = asyncio.get_running_loop(), gen.parsed.prompts

        def add(s: Serving) -> None:
            checked = [s.validate(p, gen.parsed.params) for p in prompts] if validate else prompts
            try:
                for c in choices:
                    s.add_request(
                        checked[c.prompt],
                        self._params(gen, c),
                        c.rid,
                        gen.t0,
                        gen.parsed.session_id,
                    )
                    c.started = True
                    if c.sibling:
                        self.metrics.share_prompt(c.rid)
            finally:  # registered before the next step, so nothing comes before it
                with self._counting:
                    for c in choices:
                        if c.started:
                            self.loop.register(c.rid, aio, gen.events)
                    if admission is not None:
                        self._settle(admission)

        try:
            await self.loop.call(add)
        except BaseException:  # one failed, or the caller left while the call ran: undo it all
            self._abort(choices)
            raise

    def _abort(self, choices: list[Choice]) -> None:
        """Stop delivering to ``choices`` and abort their requests (unknown ids are no-ops);
        each aborted one is counted as ended with ``finished_reason="abort"``."""
        for c in choices:
            self.loop.unregister(c.rid)
            self.loop.post(lambda s, rid=c.rid: self._count(s.abort(rid)))

    def _count(self, out: RequestOutput | None) -> None:
        if out is not None:
            self.metrics.observe_output(out)

    async def submit(
        self, parsed: protocol.Parsed, t0: float, chat: bool, admission: Admission | None = None
    ) -> Generation:
        """Validate and start a request's choices (the first of each prompt; the others follow
        once it computed the prompt, to share it), counted in flight instead of ``admission``.
        Bad prompts raise ``BadField`` here."""
        base, n, stop = f"srv-{next(self._ids)}", parsed.n, parsed.stop
        least = parsed.params.min_tokens
        choices = [
            Choice(i * n + j, i, j, f"{base}-{i}-{j}", protocol.Detokenizer(self.tok, stop, least))
            for i in range(len(parsed.prompts))
            for j in range(n)
        ]
        gen = Generation(parsed, choices, asyncio.Queue(), t0)
        try:
            await self._add(gen, [c for c in choices if c.sibling == 0], True, admission)
        except PoolExhausted:
            raise
        except InvalidRequest as e:  # too long, outside the vocabulary: the prompt's fault
            named = m.group(1) if (m := _PARAM.search(str(e))) else None  # or a param's
            raise protocol.BadField(named or ("messages" if chat else "prompt"), str(e)) from None
        return gen

    async def _next_event(self, gen: Generation, request: Request | None):
        """The next event of ``gen``; a non-streaming request's client is checked every
        ``DISCONNECT_POLL_S`` meanwhile, also while events keep coming (a streaming response
        is cancelled by the server when its client goes)."""
        if request is None:
            return await gen.events.get()
        while True:
            if time.monotonic() - gen.checked_at > DISCONNECT_POLL_S:
                gen.checked_at = time.monotonic()
                if await request.is_disconnected():
                    raise ClientGone("client disconnected")
            try:
                return await asyncio.wait_for(gen.events.get(), DISCONNECT_POLL_S)
            except asyncio.TimeoutError:
                continue

    async def run(
        self, gen: Generation, request: Request | None
    ) -> AsyncIterator[tuple[Choice, str, list]]:
        """Yield ``(choice, text delta, new logprobs)`` until every choice finished; the
        choices' requests are aborted if the caller stops early (client gone)."""
        choices, n = gen.choices, gen.parsed.n
        by_rid = {c.rid: c for c in choices}
        try:
            left = len(choices)
            while left:
                ev = await self._next_event(gen, request)
                c = by_rid[ev.request_id]
                if c.finish_reason is not None:
                    continue  # ended by a stop string; what was still queued for it
                text, lps = self._take(c, ev)
                if c.sibling == 0 and (c.tokens or c.finish_reason):  # its prompt is computed
                    if rest := [s for s in choices[c.index + 1 : c.index + n] if not s.started]:
                        await self._add(gen, rest)
                if c.detok.stopped and c.finish_reason is None:
                    await self._end_early(c)
                if c.finish_reason is not None:
                    left -= 1
                    self._observe(c, gen.t0)
                yield c, text, lps
        finally:
            self._abort([c for c in choices if c.started and c.finish_reason is None])

    def _take(self, c: Choice, ev: TokenDelta | RequestOutput) -> tuple[str, list]:
        """Feed a delta or the final output into the choice; its text delta and new logprobs."""
        now, have = time.perf_counter(), len(c.tokens)
        final = isinstance(ev, RequestOutput)
        skip = have if final else have - ev.start
        new, lps = ev.token_ids[skip:], (ev.logprobs or [])[skip:]
        if new:
            if c.first_at is None:
                c.first_at = now
            elif c.last_at:
                c.gaps += [(now - c.last_at) / len(new)] * len(new)
            c.last_at = now
        c.logprobs += lps
        text = c.detok.feed(new, final=final)
        if final:
            c.out, c.finish_reason = ev, "stop" if c.detok.stopped else ev.finish_reason
            if ev.finish_reason == "error":
                raise api_error(RuntimeError(f"request failed: {ev.error}"))
        return text, lps

    async def _end_early(self, c: Choice) -> None:
        """A stop string ended the choice: abort its request (its blocks go back now)."""
        self.loop.unregister(c.rid)
        out = await self.loop.call(lambda s: s.abort(c.rid))
        if out is not None:
            out.finish_reason = "stop"  # what the client is told, and what is counted
            self.metrics.observe_output(out)
            c.out = out
        c.finish_reason = "stop"

    def _observe(self, c: Choice, t0: float) -> None:
        if c.out is not None:
            ttft = None if c.first_at is None else c.first_at - t0
            self.metrics.observe_timing(c.out, ttft, time.perf_counter() - t0, c.gaps)

    # ---- HTTP ---------------------------------------------------------------------------------
    def authorize(self, request: Request) -> None:
        """With an API key, every ``/v1`` call must carry ``Authorization: Bearer <key>``."""
        if self.api_key is None:
            return
        given = request.headers.get("authorization", "").removeprefix("Bearer ").encode()
        if not hmac.compare_digest(given, self.api_key.encode()):
            raise ApiError(
                401, "missing or wrong API key", "authentication_error", code="invalid_api_key"
            )

    async def parse(self, request: Request, chat: bool) -> protocol.Parsed:
        """Read and check a request body (the engine validates the prompts in :meth:`submit`)."""
        media = request.headers.get("content-type", JSON_TYPES[0]).split(";")[0].strip().lower()
        if media not in JSON_TYPES:
            raise ApiError(
                415,
                f"the body must be JSON (content-type: application/json), not {quote(media)}",
                "invalid_request_error",
                "content-type",
                "unsupported_media_type",
            )
        raw = bytearray()
        try:
            async for part in request.stream():
                raw += part
                if len(raw) > MAX_BODY_BYTES:
                    raise ApiError(
                        413,
                        f"request body over {MAX_BODY_BYTES} bytes",
                        "invalid_request_error",
                        "body",
                        "body_too_large",
                    )
        except ClientDisconnect:  # or closed for sending its body too slowly
            raise ClientGone("client disconnected while sending its request") from None
        if len(raw) < OFFLOAD_BYTES:
            parsed = self._decode(raw, chat)
        else:  # a long prompt takes long to parse and tokenize: the event loop serves on
            parsed = await asyncio.to_thread(self._decode, raw, chat)
        if header := request.headers.get("x-session-id"):
            parsed.session_id = protocol.session_id(header, "X-Session-Id")
        if parsed.model != self.model_name:
            raise ApiError(
                404,
                f"model {quote(parsed.model)} does not exist; this server has {self.model_name!r}",
                "invalid_request_error",
                "model",
                "model_not_found",
            )
        if (choices := len(parsed.prompts) * parsed.n) > self.max_pending:  # never admitted
            raise protocol.BadField(
                "n" if chat else "prompt",
                f"the request asks for {choices} choices (prompts x n); this server runs at "
                f"most {self.max_pending} at once (--max-pending)",
            )
        return parsed

    def _decode(self, raw: bytes, chat: bool) -> protocol.Parsed:
        """The request a body asks for: JSON parsed, fields checked, prompts tokenized."""
        try:
            body = json.loads(raw)
        except (ValueError, RecursionError) as e:  # UnicodeDecodeError is a ValueError
            raise protocol.BadField("body", f"malformed JSON: {e}") from None
        return protocol.parse(body, self.tok, self.chat if chat else None, self.max_model_len)

    async def complete(self, request: Request, chat: bool) -> Response:
        """``/v1/completions`` and ``/v1/chat/completions``."""
        t0 = time.perf_counter()
        parsed = await self.parse(request, chat)
        with self.admit(len(parsed.prompts) * parsed.n) as admission:
            gen = await self.submit(parsed, t0, chat, admission)
        head = {
            "id": f"{'chatcmpl' if chat else 'cmpl'}-{uuid.uuid4().hex}",
            "object": "chat.completion" if chat else "text_completion",
            "created": int(time.time()),
            "model": self.model_name,
        }
        if parsed.stream:
            return StreamingResponse(self._sse(gen, chat, head), media_type="text/event-stream")
        texts: dict[int, list[str]] = {c.index: [] for c in gen.choices}
        async for c, text, _ in self.run(gen, request):
            texts[c.index].append(text)
        out = []
        for c in gen.choices:
            text = "".join(texts[c.index])
            body = {"message": {"role": "assistant", "content": text}} if chat else {"text": text}
            lp = logprobs(chat, c, c.logprobs) if parsed.params.logprobs is not None else None
            out.append(choice_body(c, body, lp, parsed.return_token_ids))
        return JSONResponse(head | {"choices": out, "usage": usage(parsed, gen.choices)})

    async def _sse(self, gen: Generation, chat: bool, head: dict) -> AsyncIterator[str]:
        parsed = gen.parsed
        head = head | {"object": "chat.completion.chunk" if chat else "text_completion"}
        send = lambda chunk: f"data: {json.dumps(head | chunk)}\n\n"
        try:
            if chat:
                role = {"role": "assistant", "content": ""}
                yield send(
                    {"choices": [choice_body(c, {"delta": role}, None, False) for c in gen.choices]}
                )
            async for c, text, lps in self.run(gen, None):
                if not (text or lps or c.finish_reason):
                    continue
                lp = logprobs(chat, c, lps, len(c.logprobs) - len(lps)) if lps else None
                body = {"delta": {"content": text} if text else {}} if chat else {"text": text}
                yield send({"choices": [choice_body(c, body, lp, parsed.return_token_ids)]})
            if parsed.include_usage:
                yield send({"choices": [], "usage": usage(parsed, gen.choices)})
        except Exception as e:  # after the 200 went out: the error is the last event
            yield f"data: {json.dumps(api_error(e).body())}\n\n"
        yield "data: [DONE]\n\n"

    def health(self) -> Response:
        """Liveness: 200 while the engine thread runs, is not stuck in one iteration for
        ``STALL_S``, and the deployment can still recover (a role whose every instance used
        its restarts cannot); answered from this thread, never waiting for a step."""
        if not self.loop.alive:
            why = f"the engine is not running: {self.loop.error or 'stopped'}"
            return ApiError(503, why, "service_unavailable").response()
        if (busy := self.loop.busy_for()) > STALL_S:
            why = f"the engine loop has been in one step for {busy:.0f} s"
            return ApiError(503, why, "service_unavailable").response()
        if (broken := self.metrics.snapshot.beyond_repair) is not None:
            why = f"the deployment will not recover: {broken}"  # a restart of the server may
            return ApiError(503, why, "service_unavailable").response()
        return JSONResponse({"status": "ok"})

    def ready(self) -> Response:
        """Readiness: 200 when the engine runs, its view of the instances is fresh, every role
        has a live instance and fewer than ``max_pending`` choices are in flight."""
        if (live := self.health()).status_code != 200:
            return live
        snap = self.metrics.snapshot
        if (age := time.monotonic() - snap.taken_at) > max(READY_STALE_S, 3 * snap.period_s):
            why = f"no view of the instances for {age:.0f} s (the engine thread is held up)"
            return ApiError(503, why, "service_unavailable").response()
        if missing := set(self.roles) - {v["role"] for v in snap.load.values()}:
            why = f"no live instance for role(s) {', '.join(sorted(map(str, missing)))}"
            return ApiError(503, why, "service_unavailable").response()
        if self.in_flight >= self.max_pending:
            why = f"at capacity: {self.in_flight} choices in flight (--max-pending)"
            return ApiError(503, why, "service_unavailable", code="overloaded").response()
        return JSONResponse({"status": "ready"})

    async def metrics_text(self) -> Response:
        """The Prometheus exposition of every metric. The pool gauges are read between two
        steps if the engine thread gets to it within ``METRICS_WAIT_S``, else they are the
        engine thread's last refresh (a scrape that gives up is skipped by the engine)."""
        try:
            snap = await asyncio.wait_for(self.loop.call(Snapshot.of), METRICS_WAIT_S)
            snap.period_s = self.metrics.snapshot.period_s
            self.metrics.snapshot = snap
        except (TimeoutError, RuntimeError) as e:  # RuntimeError: the engine stopped
            logger.info("metrics: showing the last pool snapshot (%s)", type(e).__name__)
        return Response(generate_latest(self.metrics.registry), media_type=CONTENT_TYPE_LATEST)


class Watcher:
    """The engine thread's periodic check (its ``tick``): let a process runtime notice dead
    instances, then refresh the snapshot the gauges and ``/ready`` read, and the instances'
    roles. Reading the pools costs a round trip to each instance, answered between its steps,
    so while requests run the snapshot is refreshed at most every ``period_s``, which grows
    with what the last one cost: it takes at most ``1 / SNAPSHOT_SHARE`` of the thread."""

    def __init__(self, metrics: ServerMetrics) -> None:
        self.metrics = metrics
        self.period_s = TICK_S
        self._due = -math.inf

    def __call__(self, s: Serving) -> None:
        getattr(s, "monitor", lambda: None)()
        now = time.monotonic()
        if now < self._due and s.has_unfinished():
            return
        snap = Snapshot.of(s)
        self.period_s = max(TICK_S, SNAPSHOT_SHARE * (time.monotonic() - now))
        self._due = now + self.period_s
        snap.period_s = self.period_s
        self.metrics.roles.update((inst, v["role"]) for inst, v in snap.load.items())
        self.metrics.snapshot = snap


def exit_loudly(error: BaseException) -> None:
    """The engine thread died: log it and stop the process (``main`` then exits with 1), so a
    supervisor restarts it instead of a server that answers only ``/v1/models``."""
    logger.critical(
        "the engine thread died (%s: %s); shutting the server down", type(error).__name__, error
    )
    os.kill(os.getpid(), signal.SIGTERM)


async def _client_gone(request: Request, e: Exception) -> Response:
    logger.warning(
        "client disconnected: %s %s (its requests were aborted)", request.method, request.url.path
    )
    return Response(status_code=499)


async def _on_error(request: Request, e: Exception) -> JSONResponse:
    err = api_error(e)
    if err.status == 500:
        logger.error("internal error: %r", e)
    return err.response()


def build_app(server: Server) -> FastAPI:
    """The FastAPI application of ``server`` (starts and stops its engine loop)."""

    @asynccontextmanager
    async def lifespan(app: FastAPI):
        yield
        await asyncio.to_thread(server.loop.stop)

    app = FastAPI(title="minimemserve", lifespan=lifespan)

    # every error in OpenAI's shape: 400, 404, 503 (500 only for a bug)
    for kind in (ApiError, ValueError, RuntimeError, MiniMemServeError, Exception):
        app.add_exception_handler(kind, _on_error)
    app.add_exception_handler(ClientGone, _client_gone)

    @app.post("/v1/completions")
    async def completions(request: Request) -> Response:
        server.authorize(request)
        return await server.complete(request, chat=False)

    @app.post("/v1/chat/completions")
    async def chat(request: Request) -> Response:
        server.authorize(request)
        return await server.complete(request, chat=True)

    @app.get("/v1/models")
    async def models(request: Request) -> dict:
        server.authorize(request)
        card = {
            "id": server.model_name,
            "object": "model",
            "created": 0,
            "owned_by": "minimemserve",
            "max_model_len": server.max_model_len,
        }
        return {"object": "list", "data": [card]}

    @app.get("/health")
    async def health() -> Response:
        return server.health()

    @app.get("/ready")
    async def ready() -> Response:
        return server.ready()

    @app.get("/metrics")
    async def metrics() -> Response:
        return await server.metrics_text()

    return app


# ---- the command ------------------------------------------------------------------------------
def make_server(args: argparse.Namespace) -> Server:
    """Start the engine (loading the model) and wrap it as a :class:`Server`."""
    engine = EngineConfig(**engine_options(args, SERVE_ENGINE_FLAGS))
    spec = deployment_options(args, SERVE_FIELDS, engine)
    model_dir = spec.model_dir
    deployment = spec.deployment
    model_config, tok = read_checkpoint(model_dir)  # the engines of this process share them
    chat = protocol.ChatFormat(model_dir, tok)  # a broken template fails before the engine starts
    name = args.served_model_name or ("tiny" if args.model is None else model_dir.name)
    metrics = ServerMetrics(name)
    loop = EngineLoop(spec.build, metrics.observe_output, Watcher(metrics), exit_loudly)
    loop.start(STARTUP_TIMEOUT_S)
    context = model_config.max_position_embeddings
    return Server(
        loop,
        tok,
        chat,
        name,
        min(args.max_model_len or context, context),
        deployment.milestone.roles,
        metrics,
        args.max_pending,
        args.api_key or os.environ.get(API_KEY_ENV) or None,
    )


def web_config(server: Server, host: str, port: int, log_level: str = "warning"):
    """uvicorn's configuration of ``server``'s app: its connections guarded (see
    :mod:`.connections`) and not limited in number (requests in flight are: ``Server.admit``)."""
    return uvicorn.Config(
        build_app(server),
        host=host,
        port=port,
        log_level=log_level,
        http=GuardedHttp,
        timeout_keep_alive=KEEP_ALIVE_S,
        timeout_graceful_shutdown=SHUTDOWN_GRACE_S,
    )


def allow_open_files() -> int:
    """Raise this process's soft limit on open files to the hard limit (``OPEN_FILES_CAP`` if
    that is unlimited), so connections do not run out at a default of 1,024; returns it."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    want = OPEN_FILES_CAP if hard == resource.RLIM_INFINITY else hard
    if soft != resource.RLIM_INFINITY and soft < want:
        try:
            resource.setrlimit(resource.RLIMIT_NOFILE, (want, hard))
        except (ValueError, OSError) as e:  # beyond what the kernel allows (fs.nr_open)
            logger.warning("could not raise the open-file limit to %d: %s", want, e)
            return soft
    return resource.getrlimit(resource.RLIMIT_NOFILE)[0]


def main(args: argparse.Namespace) -> int:
    """``minimemserve serve``: start the engine, then serve HTTP until interrupted."""
    logging.basicConfig(level=args.log_level.upper())
    server = make_server(args)
    if args.host not in LOOPBACK_HOSTS and not server.api_key:
        logger.warning(
            "serving on %s without --api-key: anyone who reaches it can use it", args.host
        )
    print(
        f"minimemserve: serving {server.model_name!r} ({args.config}, {args.runtime}) on "
        f"http://{args.host}:{args.port}",
        flush=True,
    )
    logger.info("open files allowed: %d", allow_open_files())
    uvicorn.Server(web_config(server, args.host, args.port, args.log_level)).run()
    return 1 if server.loop.error is not None else 0
