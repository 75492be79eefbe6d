"""The HTTP/1.1 connections the server runs (uvicorn's httptools protocol), with limits a
client cannot stretch.

A connection costs a file descriptor and nothing else: the server limits requests in flight
(see ``Server.admit``), not connections, so idle sockets cannot keep anyone out. Still, none
is held for ever by a client that does nothing: a connection must complete a request's head
within ``HEADER_TIMEOUT_S`` of opening (or, kept alive after a response, of the first byte of
the next request; idle, it is closed after ``KEEP_ALIVE_S``), and the request's body within
``BODY_TIMEOUT_S`` of its head, or it is closed (a late body gets 408 first). A request
head over ``MAX_HEADER_BYTES`` gets 431 and the connection closes: every byte up to the blank
line that ends the head counts, also those in the chunk that completes it."""

from __future__ import annotations

import asyncio
import http

from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol

# A request's headers must be complete this long after the connection opened or the next
# request's first byte came (a client on a slow link sends a few hundred bytes well within it).
HEADER_TIMEOUT_S = 10.0
# How long a connection may stay idle between a response and the next request: longer than
# clients keep idle connections in their pools (aiohttp 15 s), so the client closes first and
# never sends a request into a connection the server is closing.
KEEP_ALIVE_S = 20
# A request's body must be complete this long after its head (the largest body the server
# reads, 16 MiB, at about 0.5 MB/s); a client that dribbles it is closed.
BODY_TIMEOUT_S = 30.0
# The largest request head (request line and headers) read; larger gets 431.
MAX_HEADER_BYTES = 64 * 2**10
# What ends a request head (httptools also takes bare newlines).
HEAD_ENDS = (b"\r\n\r\n", b"\n\n")
# Bytes of the previous chunk kept, where the end of a head may begin.
HEAD_END_TAIL = max(map(len, HEAD_ENDS)) - 1


def head_length(tail: bytes, data: bytes) -> int | None:
    """How many bytes of ``data`` belong to a request head that ``tail`` (the end of the head
    read so far) began: up to and including the first blank line, or None if none is in it."""
    joined = tail + data
    ends = [i + len(m) for m in HEAD_ENDS if (i := joined.find(m)) >= 0]
    return min(ends) - len(tail) if ends else None


class GuardedHttp(HttpToolsProtocol):
    """uvicorn's httptools protocol with deadlines on each request's head and body, and a cap
    on the head's size (see the module's docstring)."""

    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        super().connection_made(transport)
        self._head_bytes = 0
        self._tail = b""  # the last bytes of the head read so far
        self._deadline: asyncio.TimerHandle | None = None  # of the head
        self._body_deadline: asyncio.TimerHandle | None = None
        self._between = False  # kept alive after a response, no byte of the next request yet
        self._await_head()

    def _await_head(self) -> None:
        """A request head may begin now: it has ``HEADER_TIMEOUT_S`` to complete."""
        self._head_bytes = 0
        self._tail = b""
        self._stop_clock()
        self._deadline = self.loop.call_later(HEADER_TIMEOUT_S, self._head_late)

    def _stop_clock(self) -> None:
        if self._deadline is not None:
            self._deadline.cancel()
            self._deadline = None

    def _stop_body_clock(self) -> None:
        if self._body_deadline is not None:
            self._body_deadline.cancel()
            self._body_deadline = None

    def _head_late(self) -> None:
        self._deadline = None
        if not self.transport.is_closing():
            self.logger.info("closing a connection that sent no complete request in time")
            self.transport.close()

    def _body_late(self) -> None:
        self._body_deadline = None
        if self.transport.is_closing():
            return
        self.logger.info("closing a connection whose request body did not arrive in time")
        if self.cycle is not None and not self.cycle.response_started:
            self._refuse(http.HTTPStatus.REQUEST_TIMEOUT)
        else:
            self.transport.close()

    def data_received(self, data: bytes) -> None:
        if self._between:  # the next request begins: its head has the header timeout
            self._between = False
            self._await_head()
        if self._deadline is not None:  # no complete head yet before these bytes
            size = head_length(self._tail, data)
            self._head_bytes += len(data) if size is None else size
            self._tail = (self._tail + data)[-HEAD_END_TAIL:]
            if self._head_bytes > MAX_HEADER_BYTES:
                if not self.transport.is_closing():
                    self._refuse(http.HTTPStatus.REQUEST_HEADER_FIELDS_TOO_LARGE)
                return
        super().data_received(data)

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
        self._body_deadline = self.loop.call_later(BODY_TIMEOUT_S, self._body_late)
        super().on_headers_complete()

    def on_message_complete(self) -> None:
        self._stop_body_clock()
        super().on_message_complete()

    def on_response_complete(self) -> None:
        pipelined = bool(self.pipeline)  # a request whose head is in: it starts now
        super().on_response_complete()
        if not (pipelined or self.transport.is_closing()):
            self._between = True  # idle until KEEP_ALIVE_S (uvicorn's timer) or the next bytes

    def connection_lost(self, exc: Exception | None) -> None:
        self._stop_clock()
        self._stop_body_clock()
        super().connection_lost(exc)
