"""The HTTP/1.1 connections the server runs (uvicorn's httptools protocol), with limits a
client cannot stretch.

uvicorn closes a keep-alive connection left idle after a response, but not one that never
completes a request: sockets that send nothing, or dribble header bytes, would stay open for
ever and fill the server's concurrency limit, so that every request, the probes included, got
503. Here a connection must complete a request's headers within ``HEADER_TIMEOUT_S`` of opening
(or of its previous response) or it is closed; a request head over ``MAX_HEADER_BYTES`` gets
431 and the connection closes; and the probes (``GET /health``, ``/ready``, ``/metrics``) are
answered beyond the concurrency limit, so a liveness check sees a server that can still serve."""

from __future__ import annotations

import asyncio
import http

import httptools
from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol

# A request's headers must be complete this long after the connection opened or its previous
# response went out (a client on a slow link sends a few hundred bytes in well under this).
HEADER_TIMEOUT_S = 10.0
# How long a connection may stay idle between a response and the next request (uvicorn's).
KEEP_ALIVE_S = 5
# The largest request head (request line and headers) read; larger gets 431.
MAX_HEADER_BYTES = 64 * 2**10
# Paths answered beyond the concurrency limit (GET only): what a supervisor polls.
PROBES = frozenset({b"/health", b"/ready", b"/metrics"})


class GuardedHttp(HttpToolsProtocol):
    """uvicorn's httptools protocol with a deadline on each request head, a cap on its size,
    and the probes exempt from the concurrency limit (see the module's docstring)."""

    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        super().connection_made(transport)
        self._head_bytes = 0
        self._deadline: asyncio.TimerHandle | None = None
        self._await_head()

    def _await_head(self) -> None:
        """A request head may begin now: it has ``HEADER_TIMEOUT_S`` to complete."""
        self._head_bytes = 0
        self._stop_clock()
        self._deadline = self.loop.call_later(HEADER_TIMEOUT_S, self._head_late)

    def _stop_clock(self) -> None:
        if self._deadline is not None:
            self._deadline.cancel()
            self._deadline = None

    def _head_late(self) -> None:
        self._deadline = None
        if not self.transport.is_closing():
            self.logger.info("closing a connection that sent no complete request in time")
            self.transport.close()

    def data_received(self, data: bytes) -> None:
        awaiting = self._deadline is not None  # no complete head yet before these bytes
        super().data_received(data)
        if not (awaiting and self._deadline is not None):
            return  # the head completed within these bytes (what follows is a body)
        self._head_bytes += len(data)
        if self._head_bytes > MAX_HEADER_BYTES and not self.transport.is_closing():
            self._refuse(http.HTTPStatus.REQUEST_HEADER_FIELDS_TOO_LARGE)

    def _refuse(self, status: http.HTTPStatus) -> None:
        """Answer ``status`` in plain text and close the connection."""
        self._stop_clock()
        msg = f"{status.value} {status.phrase}".encode()
        self.transport.write(
            b"HTTP/1.1 %s\r\ncontent-type: text/plain; charset=utf-8\r\n"
            b"content-length: %d\r\nconnection: close\r\n\r\n%s" % (msg, len(msg), msg)
        )
        self.transport.close()

    def on_headers_complete(self) -> None:
        self._stop_clock()
        path = httptools.parse_url(self.url).path
        probe = self.parser.get_method() == b"GET" and path in PROBES
        limit = self.limit_concurrency
        if probe:
            self.limit_concurrency = None
        try:
            super().on_headers_complete()
        finally:
            self.limit_concurrency = limit

    def on_response_complete(self) -> None:
        pipelined = bool(self.pipeline)  # a request whose head is in: it starts now
        super().on_response_complete()
        if not (pipelined or self.transport.is_closing()):
            self._await_head()

    def connection_lost(self, exc: Exception | None) -> None:
        self._stop_clock()
        super().connection_lost(exc)
