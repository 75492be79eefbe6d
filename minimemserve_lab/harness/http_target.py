"""A running ``minimemserve serve`` as a ``Serving``: the benchmark drives the real HTTP API.

Each request is one streaming ``/v1/completions`` call (prompt as token ids) in its own
thread; TTFT is the arrival of the first chunk, the token ids come back in the last chunk
(``return_token_ids``), ``cached_tokens`` from the usage chunk; :attr:`HttpServing.itl`
collects the gaps between token chunks. Pool state is read from the
server's ``/metrics``: the audit over HTTP is that no block stays referenced when idle."""

from __future__ import annotations

import http.client
import json
import queue
import re
import threading
import time
import urllib.parse
from collections.abc import Sequence
from typing import Any

from minimemserve.engine import Checked
from minimemserve.mempool import PoolAccountingError
from minimemserve.model.tokenizer import Tokenizer
from minimemserve.request import RequestMetrics, RequestOutput, TokenDelta
from minimemserve.sampling import SamplingParams

# Seconds a request may take before its connection gives up.
REQUEST_TIMEOUT_S = 600.0
# How long step() waits for a finished request before returning an empty list.
STEP_WAIT_S = 0.005
_METRIC = re.compile(r"^minimemserve:(\w+)(?:\{([^}]*)\})? ([-\d.e+]+)$")


def parse_metrics(text: str) -> list[tuple[str, dict[str, str], float]]:
    """``(name without prefix, labels, value)`` of each sample in a Prometheus exposition."""
    out = []
    for line in text.splitlines():
        if m := _METRIC.match(line):
            labels = dict(re.findall(r'(\w+)="([^"]*)"', m.group(2) or ""))
            out.append((m.group(1), labels, float(m.group(3))))
    return out


def _pool_blocks(samples) -> dict[str, dict]:
    """``{instance: {tier: {state: blocks}}}`` of parsed metrics."""
    stats: dict[str, dict] = {}
    for name, labels, value in samples:
        if name == "kv_cache_blocks":
            tier = stats.setdefault(labels["instance"], {}).setdefault(labels["tier"], {})
            tier[labels["state"]] = int(value)
    return stats


class HttpServing:
    """``Serving`` over the OpenAI API of the server at ``url`` (``http://host:port``)."""

    def __init__(self, url: str, tokenizer: Tokenizer, timeout_s: float = REQUEST_TIMEOUT_S):
        parts = urllib.parse.urlsplit(url)
        if parts.scheme != "http" or not parts.hostname:
            raise ValueError(f"endpoint must be an http://host:port URL, got {url!r}")
        self.host = parts.hostname
        self.port = parts.port or 80
        self.tokenizer = tokenizer
        self.timeout_s = timeout_s
        self.model = json.loads(self._get("/v1/models"))["data"][0]["id"]
        self._done: queue.SimpleQueue = queue.SimpleQueue()
        self._open: dict[str, http.client.HTTPConnection | None] = {}
        self._lock = threading.Lock()
        self.itl: list[float] = []  # seconds between successive token chunks, every request

    def _conn(self) -> http.client.HTTPConnection:
        return http.client.HTTPConnection(self.host, self.port, timeout=self.timeout_s)

    def _get(self, path: str) -> str:
        conn = self._conn()
        try:
            conn.request("GET", path)
            resp = conn.getresponse()
            body = resp.read().decode()
            if resp.status != 200:
                raise RuntimeError(f"GET {path}: HTTP {resp.status}: {body[:200]}")
            return body
        finally:
            conn.close()

    def validate(self, prompt: str | Sequence[int], params: SamplingParams) -> list[int]:
        """Token ids of ``prompt`` (the server checks the rest when the request arrives)."""
        return self.tokenizer.prompt_ids(prompt)

    def add_request(
        self,
        prompt,
        params: SamplingParams,
        request_id: str | None = None,
        arrival_time: float | None = None,
        session_id: str | None = None,
    ) -> str:
        """Start streaming the request in a thread; returns its id."""
        ids = prompt.ids if isinstance(prompt, Checked) else self.validate(prompt, params)
        rid = request_id or f"http-{len(self._open)}-{time.monotonic_ns()}"
        with self._lock:
            if rid in self._open:
                raise ValueError(f"request id {rid!r} is already in use")
            self._open[rid] = None
        body = {
            "model": self.model,
            "prompt": ids,
            "max_tokens": params.max_tokens,
            "temperature": params.temperature,
            "top_p": params.top_p,
            "top_k": params.top_k,
            "seed": params.seed,
            "stop_token_ids": list(params.stop_token_ids),
            "ignore_eos": params.ignore_eos,
            "stream": True,
            "return_token_ids": True,
            "stream_options": {"include_usage": True},
            **({"user": session_id} if session_id else {}),
        }
        arrival = time.perf_counter() if arrival_time is None else arrival_time
        args = (rid, ids, body, RequestMetrics(arrival, prompt_tokens=len(ids)))
        threading.Thread(target=self._stream, args=args, daemon=True).start()
        return rid

    def _stream(self, rid: str, ids: list[int], body: dict, m: RequestMetrics) -> None:
        tokens, reason, error = [], "error", None
        conn = self._conn()
        with self._lock:
            self._open[rid] = conn
        try:
            conn.request(
                "POST", "/v1/completions", json.dumps(body), {"content-type": "application/json"}
            )
            resp = conn.getresponse()
            if resp.status != 200:
                error = f"rejected: HTTP {resp.status}: {resp.read().decode()[:300]}"
            else:
                tokens, reason, error = self._read_events(resp, m)
        except (OSError, http.client.HTTPException, ValueError) as e:
            error = f"{type(e).__name__}: {e}"
        finally:
            conn.close()
        m.finish_time, m.output_tokens = time.perf_counter(), len(tokens)
        with self._lock:
            self._open.pop(rid, None)
        self._done.put(RequestOutput(rid, ids, tokens, None, reason, m, error))

    def _read_events(self, resp, m: RequestMetrics) -> tuple[list[int], str, str | None]:
        tokens, reason, error, last = [], "error", None, None
        gaps = []  # between chunks that carry text: the inter-token latency a client sees
        for raw in resp:
            now, line = time.perf_counter(), raw.decode().strip()
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            if last is not None and '"finish_reason": null' in line:
                gaps.append(now - last)  # a token chunk after the first: nothing else in it
                last = now
                continue
            chunk = json.loads(line[6:])
            if "error" in chunk:
                error = chunk["error"]["message"]
                continue
            if usage := chunk.get("usage"):
                m.cached_tokens = usage["prompt_tokens_details"]["cached_tokens"]
            for c in chunk.get("choices", ()):
                if last is not None:
                    gaps.append(now - last)
                m.first_token_time, last = m.first_token_time or now, now
                if c.get("finish_reason"):
                    reason, tokens = c["finish_reason"], c.get("token_ids", [])
        with self._lock:
            self.itl += gaps
        return tokens, reason, error

    def step(self) -> list[RequestOutput]:
        """Requests finished since the last call (waits a few ms for one)."""
        out = []
        try:
            out.append(self._done.get(timeout=STEP_WAIT_S))
            while True:
                out.append(self._done.get_nowait())
        except queue.Empty:
            return out

    def take_deltas(self) -> list[TokenDelta]:
        """Not streamed to the caller: the benchmark reads whole outputs."""
        return []

    def abort(self, request_id: str) -> RequestOutput | None:
        """Close the request's connection (the server aborts it); its output comes from step."""
        with self._lock:
            conn = self._open.get(request_id)
        if conn is not None and conn.sock is not None:
            conn.sock.shutdown(2)
        return None

    def has_unfinished(self) -> bool:
        """Whether a request is still streaming or its output not yet returned."""
        return bool(self._open) or not self._done.empty()

    def _samples(self) -> list[tuple[str, dict[str, str], float]]:
        return parse_metrics(self._get("/metrics"))

    def pool_stats(self) -> dict[str, dict]:
        """Blocks per instance, tier and state, from the server's metrics."""
        return _pool_blocks(self._samples())

    def load(self) -> dict[str, dict]:
        """Requests waiting and running per instance, from the server's metrics."""
        out: dict[str, dict] = {}
        for name, labels, value in self._samples():
            if name in ("num_requests_running", "num_requests_waiting"):
                d = out.setdefault(labels["instance"], {"role": labels["role"]})
                d[name.rsplit("_", 1)[1]] = int(value)
        return out

    def check_pools(self, require_idle: bool = True) -> dict[str, dict]:
        """Every pool's audit passed at the server's last scrape, and (with ``require_idle``)
        no block is referenced on any instance; the stats by instance."""
        samples = self._samples()
        if any(name == "kv_pool_audit_ok" and value != 1 for name, _, value in samples):
            raise PoolAccountingError("a pool's block accounting does not balance on the server")
        stats = _pool_blocks(samples)
        held = {
            i: t["referenced"] for i, s in stats.items() for t in s.values() if t.get("referenced")
        }
        if require_idle and held:
            raise PoolAccountingError(f"blocks still referenced on the server: {held}")
        return {i: {"pool": s} for i, s in stats.items()}

    def close(self) -> None:
        """Abort what still streams (the server keeps running)."""
        for rid in list(self._open):
            self.abort(rid)


def endpoint_factory(url: str):
    """A benchmark target factory for the server at ``url`` (the spec's model gives the
    tokenizer, which must be the server's)."""

    def make(spec: Any) -> HttpServing:
        return HttpServing(url, Tokenizer.from_dir(spec.model_dir))

    return make
