"""The server's connections under hostile clients (an app over a scripted serving, in this
process): idle, dribbling and slow-body sockets cost a descriptor, not service; request heads
are capped; long bodies are parsed off the event loop; requests in flight are what is limited."""

from __future__ import annotations

import json
import selectors
import socket
import threading
import time
import urllib.error
import urllib.request

import pytest

pytest.importorskip("fastapi")
pytest.importorskip("uvicorn")

from scripted_server import get, serve_scripted

from minimemserve.server import app, connections

# Connections the descriptor test holds open at once (the production load).
HELD = 2000
# How long it holds them while it asks for completions and health.
HOLD_S = 4.0


@pytest.fixture
def served():
    with serve_scripted() as srv:
        yield srv


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


def _post(url: str, body: dict, timeout_s: float = 10.0):
    """``(status, JSON body, headers)`` of a POST."""
    data = json.dumps(body).encode()
    req = urllib.request.Request(url, data, {"content-type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=timeout_s) as r:
            return r.status, json.loads(r.read()), r.headers
    except urllib.error.HTTPError as e:
        return e.code, json.loads(e.read()), e.headers


def _complete(url: str) -> int:
    body = {"model": "scripted", "prompt": "abc", "max_tokens": 3}
    status, answer, _ = _post(url + "/v1/completions", body)
    assert status != 200 or answer["choices"][0]["text"] == "bcd", answer
    return status


def test_idle_and_dribbling_connections_are_closed_and_cost_no_request_slot(served, monkeypatch):
    """Many more connections than requests in flight, sending nothing or a byte of headers now
    and then: everyone is served meanwhile, and the server closes them all within the header
    timeout (here 1 s)."""
    url = served.url
    monkeypatch.setattr(connections, "HEADER_TIMEOUT_S", 1.0)
    idle = [_connect(url) for _ in range(100)]
    dribbling = [_connect(url) for _ in range(5)]
    try:
        time.sleep(0.2)  # every connection accepted
        assert get(url + "/health") == (200, '{"status":"ok"}')
        assert get(url + "/v1/models")[0] == 200 and _complete(url) == 200
        for i in range(4):
            for sock in dribbling:
                sock.sendall(b"GET /v1/models HTTP/1.1\r\n"[i : i + 1])
            time.sleep(0.3)
        start = time.monotonic()
        assert all(map(_closed_by_server, idle + dribbling))
        assert time.monotonic() - start < 5
    finally:
        for sock in idle + dribbling:
            sock.close()


class Holder:
    """``n`` idle connections to ``url``, each opened again as soon as the server closes it."""

    def __init__(self, url: str, n: int) -> None:
        self.url = url
        self.sel = selectors.DefaultSelector()
        self.reopened = 0
        self.stop = threading.Event()
        for _ in range(n):
            self._open()
        self.thread = threading.Thread(target=self._run, daemon=True)
        self.thread.start()

    def _open(self) -> None:
        sock = _connect(self.url)
        sock.setblocking(False)
        self.sel.register(sock, selectors.EVENT_READ)

    def _run(self) -> None:
        while not self.stop.is_set():
            for key, _ in self.sel.select(0.05):
                sock = key.fileobj
                try:
                    alive = sock.recv(1) != b""
                except (BlockingIOError, ConnectionResetError):
                    alive = False
                if not alive:
                    self.sel.unregister(sock)
                    sock.close()
                    self._open()
                    self.reopened += 1

    def halt(self) -> int:
        """Stop re-opening; how many connections are open."""
        self.stop.set()
        self.thread.join(10)
        return len(self.sel.get_map())

    def close(self) -> None:
        self.halt()
        for key in list(self.sel.get_map().values()):
            key.fileobj.close()
        self.sel.close()


def test_two_thousand_idle_connections_reopened_as_closed_keep_no_one_out(served, monkeypatch):
    """2,000 idle sockets held open, each re-opened when the server closes it (header timeout
    here 2 s): completions and /health succeed throughout; the server limits requests in
    flight, not connections, and raised its descriptor limit to the host's."""
    if app.allow_open_files() < 3 * HELD:  # both ends of each connection live in this process
        pytest.skip(f"the host allows fewer than {3 * HELD} open files")
    monkeypatch.setattr(connections, "HEADER_TIMEOUT_S", 2.0)
    holder = Holder(served.url, HELD)
    try:
        statuses: list[tuple[int, int]] = []
        end = time.monotonic() + HOLD_S
        while time.monotonic() < end:
            health = get(served.url + "/health", timeout_s=2)[0]
            statuses.append((health, _complete(served.url)))
            time.sleep(0.1)
        assert holder.halt() == HELD
        assert holder.reopened >= HELD // 2, holder.reopened  # the server closed and we reopened
        assert len(statuses) >= 10 and set(statuses) == {(200, 200)}, statuses
    finally:
        holder.close()


def test_slow_bodies_are_closed_with_408_and_deny_no_one(served, monkeypatch):
    """Clients that send a head and then a byte of body now and then: others are served
    meanwhile, and each slow one gets 408 once the body timeout (here 2 s) passed. They dribble
    for half of it (the rounds a loaded machine allows), so none is closed while it writes."""
    url = served.url
    monkeypatch.setattr(connections, "BODY_TIMEOUT_S", 2.0)
    head = (
        b"POST /v1/completions HTTP/1.1\r\nhost: x\r\ncontent-type: application/json\r\n"
        b"content-length: 1000\r\n\r\n"
    )
    slow = [_connect(url) for _ in range(150)]
    try:
        for sock in slow:
            sock.sendall(head)
        start, rounds = time.monotonic(), 0
        while rounds < 3 and (rounds == 0 or time.monotonic() - start < 1.0):
            for sock in slow:
                sock.sendall(b" ")
            assert _complete(url) == 200 and get(url + "/health")[0] == 200
            rounds += 1
            time.sleep(0.2)
        answers = [sock.recv(4096) for sock in slow]
        assert time.monotonic() - start < 6
        assert all(a.startswith(b"HTTP/1.1 408 ") for a in answers), {a[:20] for a in answers}
        assert all(map(_closed_by_server, slow))
    finally:
        for sock in slow:
            sock.close()


def _raw(url: str, head: bytes) -> bytes:
    with _connect(url) as sock:
        sock.sendall(head)
        return sock.recv(4096)


def _head(size: int) -> bytes:
    """A ``GET /health`` request head of ``size`` bytes."""
    start, end = b"GET /health HTTP/1.1\r\nhost: x\r\nx-big: ", b"\r\n\r\n"
    return start + b"a" * (size - len(start) - len(end)) + end


def test_a_head_over_the_cap_gets_431_also_when_one_chunk_completes_it(served):
    url = served.url
    cap = connections.MAX_HEADER_BYTES
    assert _raw(url, _head(cap)).startswith(b"HTTP/1.1 200 ")
    for size in (cap + 1, 66 * 2**10, 100 * 2**10, 2**20):
        assert _raw(url, _head(size)).startswith(b"HTTP/1.1 431 "), size
    # a head that ends in the same chunk as its body starts is measured up to its end
    body = json.dumps({"model": "nope", "prompt": "a" * 2 * cap}).encode()
    post = (
        b"POST /v1/completions HTTP/1.1\r\nhost: x\r\ncontent-type: application/json\r\n"
        b"content-length: %d\r\n\r\n%s" % (len(body), body)
    )
    assert _raw(url, post).startswith(b"HTTP/1.1 400 ")  # the prompt is too long


def test_a_wrong_content_type_and_a_huge_model_name(served):
    url = served.url
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
    assert get(url + "/health")[0] == 200


def test_a_long_prompt_is_parsed_and_tokenized_off_the_event_loop(served):
    """While a long prompt takes 1.5 s to tokenize, /health answers within 0.5 s every time."""
    url = served.url
    served.tokenizer.slow_from, served.tokenizer.slow_s = app.OFFLOAD_BYTES, 1.5
    body = {"model": "scripted", "prompt": "a" * app.OFFLOAD_BYTES, "max_tokens": 1}
    long = threading.Thread(target=_post, args=(url + "/v1/completions", body))
    long.start()
    time.sleep(0.1)
    polls = []
    try:
        while long.is_alive() and len(polls) < 10:
            t0 = time.monotonic()
            try:
                status = get(url + "/health", timeout_s=0.5)[0]
            except OSError:  # timed out
                status = None
            polls.append((status, round(time.monotonic() - t0, 2)))
            time.sleep(0.1)
    finally:
        long.join(10)
    assert len(polls) >= 3 and all(s == 200 for s, _ in polls), polls


def test_past_the_limit_a_request_gets_503_with_retry_after(served):
    """With ``max_pending`` (2) choices in flight a third request is refused at once, with
    Retry-After; /health still answers; once they finish the server takes requests again."""
    url, serving = served.url, served.serving
    serving.gate.clear()  # steps wait: the requests stay in flight
    running = [threading.Thread(target=_complete, args=(url,)) for _ in range(2)]
    try:
        for t in running:
            t.start()
        deadline = time.monotonic() + 5
        while served.server.in_flight < 2:
            assert time.monotonic() < deadline, f"in flight: {served.server.in_flight}"
            time.sleep(0.02)
        body = {"model": "scripted", "prompt": "abc", "max_tokens": 3}
        status, answer, headers = _post(url + "/v1/completions", body)
        assert status == 503 and answer["error"]["code"] == "overloaded", answer
        assert headers.get("Retry-After") == str(app.RETRY_AFTER_S), headers
        assert get(url + "/health")[0] == 200
    finally:
        serving.gate.set()
        for t in running:
            t.join(10)
    assert _complete(url) == 200


def test_a_kept_alive_connection_waits_for_its_next_request_past_the_header_timeout(
    served, monkeypatch
):
    """After a response, the connection stays open while idle (up to the keep-alive time, longer
    than clients keep idle connections pooled, so they close first): a request sent after more
    than the header timeout (here 0.5 s) is served on it. Once the next request's first byte
    came, its head has the header timeout as before."""
    monkeypatch.setattr(connections, "HEADER_TIMEOUT_S", 0.5)
    assert connections.KEEP_ALIVE_S > 15  # aiohttp's pool keeps idle connections 15 s
    ask = b"GET /health HTTP/1.1\r\nhost: x\r\n\r\n"
    sock = _connect(served.url)
    try:
        for _ in range(2):
            sock.sendall(ask)
            answer = b""
            while b'{"status":"ok"}' not in answer:
                chunk = sock.recv(4096)
                assert chunk, answer  # the server closed the kept-alive connection
                answer += chunk
            assert answer.startswith(b"HTTP/1.1 200"), answer
            time.sleep(1.0)  # idle twice the header timeout
        sock.sendall(ask[:3])  # a head begun, then nothing: closed at the header timeout
        sock.settimeout(3)
        start = time.monotonic()
        assert _closed_by_server(sock) and time.monotonic() - start < 2.5
    finally:
        sock.close()
