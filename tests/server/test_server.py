"""The OpenAI HTTP server, started as a real subprocess and driven with the ``openai`` client."""

from __future__ import annotations

import http.client
import json
import os
import re
import signal
import socket
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request

import pytest

openai = pytest.importorskip("openai")
pytest.importorskip("fastapi")

from minimemserve import LLM, SamplingParams  # noqa: E402
from minimemserve.model.tokenizer import Tokenizer  # noqa: E402
from minimemserve.server import DEFAULT_MAX_PENDING, app  # noqa: E402
from minimemserve.server.protocol import ChatFormat  # noqa: E402
from minimemserve_lab.harness.driver import endpoint_targets, run_bench  # noqa: E402
from minimemserve_lab.harness.hosts import LocalInstances  # noqa: E402

MODEL = "tiny"
NUM_BLOCKS = 64
START_TIMEOUT_S = 180.0
# (config, runtime): a colocated deployment in one process, a disaggregated one across processes
DEPLOYMENTS = [("PD-CC", "inprocess"), ("1P1D-CC", "process")]
SYSTEM = "You are a helpful assistant. You answer in short, clear sentences and stay on topic."
JSON_HEADERS = {"content-type": "application/json"}
QUESTION = "What should I pack for a week of hiking in the mountains in early spring?"


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _get(url: str) -> tuple[int, str]:
    try:
        with urllib.request.urlopen(url, timeout=30) as r:
            return r.status, r.read().decode()
    except urllib.error.HTTPError as e:
        return e.code, e.read().decode()


class Server:
    """A ``minimemserve serve`` subprocess on a free loopback port."""

    def __init__(self, model_dir, config: str, runtime: str, *extra: str) -> None:
        self.port, self.config = _free_port(), config
        self.url = f"http://127.0.0.1:{self.port}"
        cmd = [
            sys.executable,
            "-m",
            "minimemserve.cli",
            "serve",
            "--model",
            str(model_dir),
            "--served-model-name",
            MODEL,
            "--config",
            config,
            "--runtime",
            runtime,
            "--port",
            str(self.port),
            "--num-blocks",
            str(NUM_BLOCKS),
            "--num-colocated",
            "1",
            *extra,
        ]
        self.log_file = tempfile.NamedTemporaryFile(prefix="serve-", suffix=".log")
        self.proc = subprocess.Popen(cmd, stdout=self.log_file, stderr=subprocess.STDOUT)
        deadline = time.monotonic() + START_TIMEOUT_S
        while True:
            assert self.proc.poll() is None, self.log()[-3000:]
            try:
                if _get(self.url + "/health")[0] == 200:
                    break
            except OSError:
                pass
            assert time.monotonic() < deadline, "the server did not start"
            time.sleep(0.3)
        self.client = openai.OpenAI(base_url=self.url + "/v1", api_key="none", max_retries=0)

    def log(self) -> str:
        """What the server printed and logged so far."""
        return open(self.log_file.name, encoding="utf-8", errors="replace").read()

    def metrics(self) -> dict[tuple[str, str], float]:
        """``{(name, labels): value}`` of /metrics."""
        status, text = _get(self.url + "/metrics")
        assert status == 200
        out = {}
        for line in text.splitlines():
            if m := re.match(r"^([\w:]+)(\{[^}]*\})? ([-\d.e+]+|NaN)$", line):
                out[(m.group(1), m.group(2) or "")] = float(m.group(3))
        return out

    def total(self, name: str, where: str = "") -> float:
        return sum(v for (n, labels), v in self.metrics().items() if n == name and where in labels)

    def wait_released(self, timeout_s: float = 20.0) -> None:
        """Until no block is referenced on any instance (requests ended or aborted); every
        pool's audit passes."""
        deadline = time.monotonic() + timeout_s
        while self.total("minimemserve:kv_cache_blocks", 'state="referenced"') > 0:
            held = {k: v for k, v in self.metrics().items() if "referenced" in k[1] and v}
            assert time.monotonic() < deadline, f"blocks still referenced: {held}"
            time.sleep(0.2)
        assert self.total("minimemserve:kv_pool_audit_ok") == 1.0

    def post(self, path: str, body: bytes, ctype: str = "application/json") -> tuple[int, dict]:
        req = urllib.request.Request(self.url + path, body, {"content-type": ctype})
        try:
            with urllib.request.urlopen(req, timeout=60) as r:
                return r.status, json.loads(r.read())
        except urllib.error.HTTPError as e:
            return e.code, json.loads(e.read())

    def close(self) -> None:
        self.proc.terminate()
        try:
            self.proc.wait(30)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()


@pytest.fixture(scope="module", params=DEPLOYMENTS, ids=[c for c, _ in DEPLOYMENTS])
def server(request, tiny_llama_dir):
    srv = Server(tiny_llama_dir, *request.param)
    yield srv
    srv.close()


@pytest.fixture(scope="module")
def reference(tiny_llama_dir):
    return LLM(tiny_llama_dir, config="PD", num_blocks=NUM_BLOCKS)


def test_models_and_health(server):
    assert [m.id for m in server.client.models.list().data] == [MODEL]
    assert _get(server.url + "/health")[0] == 200


def test_completion_is_the_library_greedy_text(server, reference):
    prompt = "The history of the printing press begins"
    r = server.client.completions.create(model=MODEL, prompt=prompt, max_tokens=12, temperature=0)
    ref = reference.generate(prompt, SamplingParams(max_tokens=12, temperature=0.0))[0]
    assert r.choices[0].text == ref.text and r.choices[0].finish_reason == ref.finish_reason
    assert r.usage.prompt_tokens == len(ref.prompt_token_ids)
    assert r.usage.completion_tokens == len(ref.token_ids)


def test_streaming_chat_with_usage_equals_the_whole_answer(server):
    messages = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": QUESTION}]
    # 64 tokens: long enough that some arrive while the request still runs, even on a busy machine
    kw = dict(
        model=MODEL,
        messages=messages,
        max_tokens=64,
        temperature=0,
        extra_body={"ignore_eos": True},
    )
    whole = server.client.chat.completions.create(**kw)
    chunks = list(
        server.client.chat.completions.create(
            **kw, stream=True, stream_options={"include_usage": True}
        )
    )
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == whole.choices[0].message.content
    assert sum(1 for c in chunks if c.choices and c.choices[0].delta.content) >= 2  # streamed
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == 64
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "length"
    server.wait_released()


CACHE_COUNTERS = ("prompt_tokens", "prefix_cache_queries", "prefix_cache_hits")


def _cache_counters(server) -> dict[str, float]:
    return {c: server.total(f"minimemserve:{c}_total") for c in CACHE_COUNTERS}


def test_n_choices_share_the_prompt_and_count_it_once(server):
    prompt = "A long shared prompt about gardens, rivers and old stone bridges, " * 3
    ask = dict(model=MODEL, prompt=prompt, max_tokens=6, temperature=1.0, seed=7)
    server.client.completions.create(**ask)  # the prompt is cached from now on
    before = _cache_counters(server)
    r = server.client.completions.create(**ask, n=2)
    assert sorted(c.index for c in r.choices) == [0, 1]
    assert r.usage.completion_tokens == 12
    # one prompt, one query: the counters agree with usage (vLLM's meaning)
    grew = {c: v - before[c] for c, v in _cache_counters(server).items()}
    cached = r.usage.prompt_tokens_details.cached_tokens
    assert cached >= 16, r.usage
    want = dict(zip(CACHE_COUNTERS, (r.usage.prompt_tokens, r.usage.prompt_tokens, cached)))
    assert grew == want
    server.wait_released()


def test_stop_string_ends_the_text_before_it(server):
    prompt = "Rain fell over the quiet harbour town"
    kw = dict(model=MODEL, prompt=prompt, max_tokens=20, temperature=0)
    full = server.client.completions.create(**kw).choices[0].text
    stop = full[len(full) // 2 : len(full) // 2 + 3]
    assert stop.strip()
    r = server.client.completions.create(**kw, stop=[stop]).choices[0]
    assert r.text == full[: full.index(stop)] and r.finish_reason == "stop"
    server.wait_released()


def test_second_chat_turn_reports_the_cached_prefix(server, tiny_llama_dir):
    question = "Plan a three day visit to an old city with museums, parks and a river walk."
    first = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": question}]
    a = server.client.chat.completions.create(
        model=MODEL, messages=first, max_tokens=8, temperature=0
    )
    shared = a.usage.prompt_tokens_details.cached_tokens  # the system prompt, seen before
    second = [
        *first,
        {"role": "assistant", "content": a.choices[0].message.content},
        {"role": "user", "content": "And what should I leave at home?"},
    ]
    server.wait_released()
    before = _cache_counters(server)
    tier_hits = server.total("minimemserve:kv_tier_hit_tokens_total")
    b = server.client.chat.completions.create(
        model=MODEL, messages=second, max_tokens=8, temperature=0
    )
    cached = b.usage.prompt_tokens_details.cached_tokens
    # each pool's matches, by the tier they found their tokens in (every tier of its chain);
    # a decode instance's match of what P sends it counts there too
    assert server.total("minimemserve:kv_tier_hit_tokens_total", 'tier="hbm"') > 0
    assert server.total("minimemserve:kv_tier_hit_tokens_total") - tier_hits >= cached
    tok = Tokenizer.from_dir(tiny_llama_dir)
    prompt1 = ChatFormat(tiny_llama_dir, tok).render([(m["role"], m["content"]) for m in first])
    assert cached > shared and cached % 16 == 0 and cached >= len(prompt1) // 16 * 16
    # the hits are the prompt cache's, as usage says (KV P sent to D is no hit)
    grew = {c: v - before[c] for c, v in _cache_counters(server).items()}
    want = (b.usage.prompt_tokens, b.usage.prompt_tokens, cached)
    assert grew == dict(zip(CACHE_COUNTERS, want))
    # the same two turns through the library: its pool matches as many tokens
    chat = ChatFormat(tiny_llama_dir, tok)
    llm = LLM(tiny_llama_dir, config=server.config, num_blocks=NUM_BLOCKS)
    greedy = SamplingParams(max_tokens=8, temperature=0.0)
    for turn, want in ((first, shared * 0), (second, cached)):
        ids = chat.render([(m["role"], m["content"]) for m in turn])
        out = llm.generate([ids], greedy)[0]
        assert out.metrics.cached_tokens == want
    server.wait_released()


BAD_BODIES = [
    ({"max_tokens": 0}, "max_tokens"),
    ({"max_tokens": -3}, "max_tokens"),
    ({"max_tokens": "5"}, "max_tokens"),
    ({"temperature": -0.1}, "temperature"),
    ({"temperature": "hot"}, "temperature"),
    ({"top_p": 0.0}, "top_p"),
    ({"top_p": 1.5}, "top_p"),
    ({"top_k": -5}, "top_k"),
    ({"seed": -1}, "seed"),
    ({"n": 0}, "n"),
    ({"n": True}, "n"),
    ({"stop": [1, 2]}, "stop"),
    ({"stop_token_ids": "x"}, "stop_token_ids"),
    ({"ignore_eos": "yes"}, "ignore_eos"),
    ({"logprobs": 99}, "logprobs"),
    ({"prompt": ""}, "prompt"),
    ({"prompt": []}, "prompt"),
    ({"prompt": [5, 6, 512]}, "prompt"),
    ({"prompt": [5, -1]}, "prompt"),
    ({"prompt": [5, 6.5]}, "prompt"),
    ({"prompt": [7] * 600}, "prompt"),
    ({"prompt": None}, "prompt"),
    ({"prompt": {"a": 1}}, "prompt"),
    ({"prompt": 5}, "prompt"),
    ({"prompt": [[True, 5]]}, "prompt"),
    ({"prompt": [None]}, "prompt"),
    ({"prompt": [[5, 6.0]]}, "prompt"),
    ({"prompt": ["a good prompt", ""]}, "prompt"),  # a good and a bad one: nothing queued
    ({"prompt": [[5, 6, 7], []]}, "prompt"),
    ({"prompt": "a lone \ud800 surrogate"}, "not valid unicode"),
    ({"prompt": [[5, 6]] * (DEFAULT_MAX_PENDING + 1)}, f"at most {DEFAULT_MAX_PENDING}"),
    ({"max_tokens": 100_000}, "max_tokens"),
    ({"echo": True}, "echo"),
    ({"tools": [{"type": "function", "function": {"name": "f"}}]}, "tools"),
    ({"response_format": {"type": "json_object"}}, "response_format"),
    ({"logit_bias": {"512": 1}}, "logit_bias"),  # outside the vocabulary
    ({"frequency_penalty": -2.5}, "frequency_penalty"),
]


def test_bad_input_is_a_400_in_the_openai_shape_and_the_server_keeps_serving(server):
    good = {"model": MODEL, "prompt": "hello", "max_tokens": 2}
    for change, needle in BAD_BODIES:
        status, body = server.post("/v1/completions", json.dumps(good | change).encode())
        assert status == 400, (change, body)
        err = body["error"]
        assert set(err) == {"message", "type", "param", "code"}, err
        assert err["type"] == "invalid_request_error"
        msg = err["message"].lower()
        assert needle.replace("_", " ") in msg.replace("_", " ") or err["param"] == needle, err
    for raw in (b"{bad json", b"[1, 2]", b"\xff\xfe", b""):
        status, body = server.post("/v1/completions", raw)
        assert status == 400 and body["error"]["param"] == "body", (raw, body)
    status, body = server.post("/v1/chat/completions", json.dumps({"model": MODEL}).encode())
    assert status == 400 and body["error"]["param"] == "messages"
    surrogate = {"model": MODEL, "messages": [{"role": "user", "content": "\udfff"}]}
    status, body = server.post("/v1/chat/completions", json.dumps(surrogate).encode())
    assert status == 400 and body["error"]["param"] == "messages", body
    bad_role = {"model": MODEL, "messages": [{"role": "robot", "content": "hi"}]}
    status, body = server.post("/v1/chat/completions", json.dumps(bad_role).encode())
    assert status == 400 and "role" in body["error"]["param"]
    with pytest.raises(openai.NotFoundError) as e:
        server.client.completions.create(model="no-such-model", prompt="hi", max_tokens=2)
    assert e.value.body["code"] == "model_not_found"
    for value in (b"NaN", b"Infinity", b"1e999"):
        raw = b'{"model": "tiny", "prompt": "hi", "temperature": ' + value + b"}"
        status, body = server.post("/v1/completions", raw)
        assert status == 400 and body["error"]["param"] == "temperature", body
    with pytest.raises(openai.BadRequestError):
        server.client.completions.create(model=MODEL, prompt="hi", top_p=2.0)
    r = server.client.completions.create(model=MODEL, prompt="still serving", max_tokens=3)
    assert r.usage.completion_tokens == 3 or r.choices[0].finish_reason == "stop"
    server.wait_released()


def test_hostile_bodies_fail_alone(server):
    status, body = server.post("/v1/completions", b"[" * 100_000 + b"]" * 100_000)
    assert status == 400 and body["error"]["param"] == "body"
    status, body = server.post("/v1/completions", b'{"prompt": "' + b"a" * (17 * 2**20) + b'"}')
    assert status == 413 and body["error"]["code"] == "body_too_large"
    r = server.client.completions.create(model=MODEL, prompt="still here", max_tokens=2)
    assert len(r.choices) == 1


def test_closing_a_stream_midway_frees_its_blocks(server):
    aborts = 'finished_reason="abort"'
    before = server.total("minimemserve:request_success_total", aborts)
    stream = server.client.completions.create(
        model=MODEL,
        prompt="Once upon a time",
        max_tokens=400,
        temperature=0,
        stream=True,
        extra_body={"ignore_eos": True},
    )
    got = [next(iter(stream)) for _ in range(3)]
    assert all(c.choices[0].finish_reason is None for c in got)
    assert server.total("minimemserve:kv_cache_blocks", 'state="referenced"') > 0
    stream.close()
    server.wait_released()
    assert server.total("minimemserve:num_requests_running") == 0
    deadline = time.monotonic() + 10  # counted in the engine thread, once the abort ran
    while server.total("minimemserve:request_success_total", aborts) == before:
        assert time.monotonic() < deadline, "the aborted request was not counted"
        time.sleep(0.1)
    assert server.total("minimemserve:request_success_total", aborts) == before + 1
    r = server.client.completions.create(model=MODEL, prompt="after the abort", max_tokens=2)
    assert len(r.choices) == 1


def test_logprobs_come_back_for_each_token(server):
    r = server.client.completions.create(
        model=MODEL, prompt="Numbers and words", max_tokens=4, temperature=0, logprobs=3
    )
    lp = r.choices[0].logprobs
    assert len(lp.token_logprobs) == 4 and all(len(t) == 3 for t in lp.top_logprobs)
    assert all(v <= 0 for v in lp.token_logprobs)
    c = server.client.chat.completions.create(
        model=MODEL,
        messages=[{"role": "user", "content": "hi"}],
        max_tokens=3,
        temperature=0,
        logprobs=True,
        top_logprobs=2,
    )
    content = c.choices[0].logprobs.content
    assert len(content) == 3 and all(len(t.top_logprobs) == 2 for t in content)


def test_the_benchmark_replays_a_workload_over_http(server, tiny_llama_dir):
    factories = endpoint_targets([f"{server.config}={server.url}"])
    res = run_bench(
        configs=[server.config],
        workload="sharegpt",
        num_sessions=3,
        rate=50.0,
        max_turns=2,
        max_output_tokens=6,
        max_context=400,
        model_dir=tiny_llama_dir,
        out_dir=None,
        factories=factories,
        progress=False,
        verbose=False,
    )
    records = res["records"][server.config]
    assert len(records) == 6 and all(r["error"] is None for r in records), records
    assert all(r["ttft"] > 0 and r["jct"] >= r["ttft"] and r["output_tokens"] == 6 for r in records)
    assert sum(r["cached_tokens"] for r in records if r["turn"] == 1) > 0  # later turns hit


def test_an_api_key_is_required_when_set():
    srv = app.Server.__new__(app.Server)
    srv.api_key = "s3cret"
    ask = lambda header: type("R", (), {"headers": {"authorization": header} if header else {}})
    srv.authorize(ask("Bearer s3cret"))
    for header in (None, "Bearer wrong", "s3cret!", "Bearer "):
        with pytest.raises(app.ApiError) as e:
            srv.authorize(ask(header))
        assert e.value.status == 401 and e.value.body()["error"]["code"] == "invalid_api_key"


def _spawned_children(pid: int) -> list[int]:
    """The multiprocessing-spawned children of ``pid`` (tensor-parallel workers)."""
    children = []
    for task in os.listdir(f"/proc/{pid}/task"):  # the engine thread starts them, not main
        with open(f"/proc/{pid}/task/{task}/children") as f:
            children += [int(c) for c in f.read().split()]
    out = []
    for c in children:
        with open(f"/proc/{c}/cmdline", "rb") as f:
            if b"spawn_main" in f.read():
                out.append(c)
    return out


def test_a_tensor_parallel_server_answers_as_the_library_and_fails_a_stopped_rank(
    tiny_llama_dir, reference
):
    deadline_s = 4.0
    srv = Server(
        tiny_llama_dir,
        "1P1D-CC",
        "inprocess",
        "--tensor-parallel-size",
        "2",
        "--collective-timeout",
        str(deadline_s),
    )
    try:
        prompt = "Tensor parallel serving splits every layer"
        r = srv.client.completions.create(model=MODEL, prompt=prompt, max_tokens=8, temperature=0)
        ref = reference.generate(prompt, SamplingParams(max_tokens=8, temperature=0.0))[0]
        assert r.choices[0].text == ref.text
        srv.wait_released()
        workers = _spawned_children(srv.proc.pid)
        assert len(workers) == 2  # rank 1 of P0 and of D0
        os.kill(workers[0], signal.SIGSTOP)
        start = time.monotonic()
        with pytest.raises(openai.APIStatusError) as e:
            srv.client.completions.create(model=MODEL, prompt=prompt, max_tokens=8)
        assert time.monotonic() - start < 2 * deadline_s
        assert e.value.status_code == 503 and "collective_timeout_s=4" in str(e.value.body)
        assert not any(os.path.exists(f"/proc/{w}") for w in workers[:1])  # killed, reaped
    finally:
        srv.close()


def test_a_server_over_instances_started_on_their_own(tiny_llama_dir, reference, tmp_path):
    with LocalInstances(
        ["prefill", "decode"],
        tmp_path / "k",
        model_dir=tiny_llama_dir,
        transport="gloo",
        log_dir=tmp_path,
    ) as inst:
        srv = Server(
            tiny_llama_dir,
            "1P1D-CC",
            "process",
            "--instances",
            ",".join(inst.addresses),
            "--key",
            str(inst.key),
        )
        try:
            prompt = "Two hosts share the work of one request"
            r = srv.client.completions.create(
                model=MODEL, prompt=prompt, max_tokens=8, temperature=0
            )
            ref = reference.generate(prompt, SamplingParams(max_tokens=8, temperature=0.0))[0]
            assert r.choices[0].text == ref.text
            assert srv.total("minimemserve:kv_transfer_bytes_total") > 0
            srv.wait_released()
        finally:
            srv.close()


def test_a_client_that_leaves_a_request_is_one_log_line(server):
    prompt = "A client that leaves early asks for a long story about lighthouses"
    body = {"model": MODEL, "prompt": prompt, "max_tokens": 400, "ignore_eos": True}
    start = len(server.log())  # the server is shared: judge only what this test logs
    before = server.log().count("client disconnected")
    conn = http.client.HTTPConnection("127.0.0.1", server.port, timeout=0.05)
    conn.request("POST", "/v1/completions", json.dumps(body), {"content-type": "application/json"})
    with pytest.raises(OSError):  # the client gives up long before 400 tokens
        conn.getresponse()
    conn.close()
    server.wait_released()
    deadline = time.monotonic() + 30  # a loaded machine logs it late
    while server.log().count("client disconnected") == before:
        assert time.monotonic() < deadline, server.log()[-2000:]
        time.sleep(0.2)
    log = server.log()
    assert log.count("client disconnected") == before + 1
    new = log[start:]
    assert "Traceback" not in new and "Exception in ASGI" not in new, new[-3000:]


def _sse_events(srv: Server, path: str, body: dict) -> list[dict]:
    """The JSON events of a streamed response (``[DONE]`` dropped)."""
    req = urllib.request.Request(
        srv.url + path, json.dumps(body | {"stream": True}).encode(), JSON_HEADERS
    )
    with urllib.request.urlopen(req, timeout=60) as r:
        lines = r.read().decode().splitlines()
    data = [line.removeprefix("data: ") for line in lines if line.startswith("data: ")]
    assert data[-1] == "[DONE]", data[-3:]
    return [json.loads(d) for d in data[:-1]]


def test_ids_beyond_the_tokenizer_stream_as_no_text_and_kill_nothing(wide_embedding_dir):
    """A model whose embedding has more rows than its tokenizer has tokens may generate those
    ids: they come back in ``token_ids`` with no text, streamed or not, and every instance
    lives on."""
    srv = Server(wide_embedding_dir, "1P1D-CC", "process")
    tok = Tokenizer.from_dir(wide_embedding_dir)
    prompt = list(range(40, 60))
    common = {"model": MODEL, "prompt": prompt, "max_tokens": 10, "ignore_eos": True}
    beyond = {"logit_bias": {"520": 4.0, "600": 4.0, "639": 4.0}, "return_token_ids": True}
    try:
        status, body = srv.post(
            "/v1/completions", json.dumps(common | beyond | {"logit_bias": {"600": 100}}).encode()
        )
        assert status == 200, body
        assert body["choices"][0]["token_ids"] == [600] * 10 and body["choices"][0]["text"] == ""
        for temperature in (0.0, 1.0):
            ask = common | beyond | {"temperature": temperature, "seed": 3}
            status, whole = srv.post("/v1/completions", json.dumps(ask).encode())
            assert status == 200, whole
            ids = whole["choices"][0]["token_ids"]
            assert len(ids) == 10 and any(t >= tok.vocab_size for t in ids), ids
            text = tok.decode([t for t in ids if t < tok.vocab_size])
            assert whole["choices"][0]["text"] == text
            events = _sse_events(srv, "/v1/completions", ask)
            assert "error" not in events[-1], events[-1]
            assert "".join(e["choices"][0]["text"] for e in events) == text
            assert events[-1]["choices"][0]["finish_reason"] == "length"
        chat = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 8}
        chat |= beyond | {"temperature": 0, "ignore_eos": True}
        events = _sse_events(srv, "/v1/chat/completions", chat)
        assert events[-1]["choices"][0]["finish_reason"] == "length", events[-1]
        assert _get(srv.url + "/ready")[0] == 200
        srv.wait_released()
        assert "died" not in srv.log(), srv.log()[-3000:]
    finally:
        srv.close()


def test_a_killed_instance_is_restarted_and_the_server_is_ready_again(tiny_llama_dir):
    srv = Server(tiny_llama_dir, "1P1D-CC", "process")
    ask = dict(model=MODEL, prompt="After a crash", max_tokens=6, temperature=0)
    try:
        before = srv.client.completions.create(**ask).choices[0].text
        instances = _spawned_children(srv.proc.pid)
        assert len(instances) == 2  # P0 and D0
        os.kill(instances[0], signal.SIGKILL)
        deadline = time.monotonic() + 30
        while _get(srv.url + "/ready")[0] == 200:
            assert time.monotonic() < deadline, "/ready missed the death"
            time.sleep(0.1)
        while (ready := _get(srv.url + "/ready"))[0] != 200:
            assert time.monotonic() < deadline + 60, f"not ready again: {ready}"
            time.sleep(0.2)
        assert srv.client.completions.create(**ask).choices[0].text == before
        assert len(_spawned_children(srv.proc.pid)) == 2
        srv.wait_released()
    finally:
        srv.close()
