"""Hostile clients against `minimemserve serve` (tiny preset, loopback), one scenario per run,
while a well-behaved client asks for a completion and `/health` every second:

- ``idle``: 2,000 idle connections, each opened again as soon as the server closes it;
- ``slow``: 1,200 clients that send a request head, then one byte of body per second;
- ``large``: 4 clients looping 10.5 MB prompts (each answered 400), `/health` polled each
  second with a 1 s timeout;
- ``pause`` / ``pause-load``: under 1P1D-CC, the prefill instance stopped (SIGSTOP) for 40 s
  (45 s, with 4 clients looping completions meanwhile), then woken: when `/ready` fails, and
  how long after SIGCONT it and a completion succeed again.

    python bench/serve_hostile.py idle|slow|large|pause|pause-load

Prints one JSON line and writes it to ``serve_hostile_SCENARIO.json`` under ``--out``."""

from __future__ import annotations

import argparse
import json
import os
import selectors
import signal
import socket
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request
from pathlib import Path

MODEL = "tiny"
START_TIMEOUT_S = 180.0
NUM_BLOCKS = 256
IDLE_CONNECTIONS = 2000
SLOW_CLIENTS = 1200
LARGE_CLIENTS = 4
LARGE_BYTES = 10_500_000
PAUSE_S = {"pause": 40.0, "pause-load": 45.0}
PAUSE_CLIENTS = 4
# How long a scenario runs (the slow bodies past the server's 30 s body deadline).
SECONDS = {"idle": 25.0, "slow": 40.0, "large": 22.0}
# How long the pause scenarios wait after SIGCONT for the server to be ready again.
RECOVERY_S = 60.0


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def get(url: str, timeout_s: float = 1.0) -> tuple[int | None, float]:
    """``(status or None on a timeout, seconds)`` of a GET."""
    t0 = time.monotonic()
    try:
        with urllib.request.urlopen(url, timeout=timeout_s) as r:
            return r.status, time.monotonic() - t0
    except urllib.error.HTTPError as e:
        return e.code, time.monotonic() - t0
    except OSError:
        return None, time.monotonic() - t0


def post(url: str, body: dict, timeout_s: float = 30.0) -> tuple[int | None, float]:
    """``(status or None, seconds)`` of a POST."""
    req = urllib.request.Request(
        url, json.dumps(body).encode(), {"content-type": "application/json"}
    )
    t0 = time.monotonic()
    try:
        with urllib.request.urlopen(req, timeout=timeout_s) as r:
            r.read()
            return r.status, time.monotonic() - t0
    except urllib.error.HTTPError as e:
        e.read()
        return e.code, time.monotonic() - t0
    except OSError:
        return None, time.monotonic() - t0


def start(config: str) -> tuple[subprocess.Popen, str, int]:
    """A `serve` process of ``config`` (one process per instance), ready."""
    port = free_port()
    cmd = [
        *(sys.executable, "-m", "minimemserve.cli", "serve", "--served-model-name", MODEL),
        *("--config", config, "--port", str(port), "--num-blocks", str(NUM_BLOCKS)),
        *("--num-colocated", "1"),
    ]
    proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + START_TIMEOUT_S
    while get(url + "/ready")[0] != 200:
        if proc.poll() is not None or time.monotonic() > deadline:
            raise RuntimeError(f"the {config} server did not start")
        time.sleep(0.3)
    return proc, url, port


def complete(url: str) -> tuple[int | None, float]:
    body = {"model": MODEL, "prompt": "Hello there, how are", "max_tokens": 4, "temperature": 0}
    return post(url + "/v1/completions", body)


def well_behaved(url: str, seconds: float) -> dict:
    """A completion and `/health` each second: how many of each answered 200."""
    pairs = []
    end = time.monotonic() + seconds
    while time.monotonic() < end:
        t0 = time.monotonic()
        pairs.append((get(url + "/health")[0], complete(url)[0]))
        time.sleep(max(0.0, 1.0 - (time.monotonic() - t0)))
    ok = sum(p == (200, 200) for p in pairs)
    return {
        "probes": len(pairs),
        "both_200": ok,
        "other": [p for p in pairs if p != (200, 200)][:5],
    }


def connect(port: int) -> socket.socket:
    return socket.create_connection(("127.0.0.1", port), timeout=10)


def idle(url: str, port: int) -> dict:
    sel = selectors.DefaultSelector()
    stop = threading.Event()
    reopened = 0

    def open_one() -> None:
        s = connect(port)
        s.setblocking(False)
        sel.register(s, selectors.EVENT_READ)

    def keep() -> None:
        nonlocal reopened
        while not stop.is_set():
            for key, _ in sel.select(0.05):
                try:
                    alive = key.fileobj.recv(1) != b""
                except (BlockingIOError, ConnectionResetError):
                    alive = False
                if not alive:
                    sel.unregister(key.fileobj)
                    key.fileobj.close()
                    open_one()
                    reopened += 1

    for _ in range(IDLE_CONNECTIONS):
        open_one()
    keeper = threading.Thread(target=keep, daemon=True)
    keeper.start()
    row = well_behaved(url, SECONDS["idle"])
    stop.set()
    keeper.join()
    row |= {"held": len(sel.get_map()), "reopened": reopened}
    for key in list(sel.get_map().values()):
        key.fileobj.close()
    return row


def slow(url: str, port: int) -> dict:
    head = (
        b"POST /v1/completions HTTP/1.1\r\nhost: x\r\ncontent-type: application/json\r\n"
        b"content-length: 100000\r\n\r\n"
    )
    socks = []
    for _ in range(SLOW_CLIENTS):
        s = connect(port)
        s.sendall(head)
        s.setblocking(False)
        socks.append(s)
    stop = threading.Event()

    def dribble() -> None:
        while not stop.is_set():
            for s in socks:
                try:
                    s.send(b" ")
                except OSError:
                    pass
            time.sleep(1.0)

    t = threading.Thread(target=dribble, daemon=True)
    t.start()
    row = well_behaved(url, SECONDS["slow"])
    stop.set()
    t.join()
    answers: dict[str, int] = {}
    for s in socks:
        try:
            first = s.recv(12).decode(errors="replace") or "closed"
        except BlockingIOError:
            first = "still open"
        except OSError:
            first = "closed"
        answers[first] = answers.get(first, 0) + 1
        s.close()
    return row | {"clients": SLOW_CLIENTS, "slow_clients_got": answers}


def large(url: str, port: int) -> dict:
    prompt = "hello world " * (LARGE_BYTES // 12)
    stop = threading.Event()
    codes: list[int | None] = []

    def loop() -> None:
        while not stop.is_set():
            body = {"model": MODEL, "prompt": prompt, "max_tokens": 1}
            codes.append(post(url + "/v1/completions", body, timeout_s=120)[0])

    clients = [threading.Thread(target=loop, daemon=True) for _ in range(LARGE_CLIENTS)]
    for t in clients:
        t.start()
    polls = []
    end = time.monotonic() + SECONDS["large"]
    while time.monotonic() < end:
        polls.append(get(url + "/health", timeout_s=1.0))
        time.sleep(max(0.0, 1.0 - polls[-1][1]))
    stop.set()
    for t in clients:
        t.join(150)
    return {
        "health_polls": len(polls),
        "timed_out": sum(p[0] is None for p in polls),
        "slowest_s": round(max(p[1] for p in polls), 3),
        "large_requests": len(codes),
        "large_answers": sorted({str(c) for c in codes}),
    }


def instances(pid: int) -> list[int]:
    """The instance processes `serve` spawned, in start order (P0 first under 1P1D)."""
    children = []
    for task in os.listdir(f"/proc/{pid}/task"):
        with open(f"/proc/{pid}/task/{task}/children") as f:
            children += [int(c) for c in f.read().split()]
    out = []
    for c in children:
        with open(f"/proc/{c}/cmdline", "rb") as f:
            if b"spawn_main" in f.read():
                out.append(c)
    return sorted(out)


def recovery(url: str, p0: int, seconds: float) -> dict:
    """Stop ``p0`` for ``seconds``, then wake it; poll `/ready` and `/health` each second until
    `/ready` and a completion succeed after the wake (or ``RECOVERY_S`` passed)."""
    os.kill(p0, signal.SIGSTOP)
    t0, resumed, unready_at, health = time.monotonic(), None, None, set()
    back = None
    while resumed is None or time.monotonic() - resumed <= RECOVERY_S:
        now = time.monotonic()
        if resumed is None and now - t0 >= seconds:
            os.kill(p0, signal.SIGCONT)
            resumed = now
        ready = get(url + "/ready", timeout_s=2)[0]
        health.add(str(get(url + "/health", timeout_s=2)[0]))
        if ready != 200 and unready_at is None:
            unready_at = round(now - t0, 1)
        if resumed is not None and ready == 200 and complete(url)[0] == 200:
            back = round(time.monotonic() - resumed, 1)
            break
        time.sleep(max(0.0, 1.0 - (time.monotonic() - now)))
    return {
        "paused_s": seconds,
        "ready_fails_after_s": unready_at,
        "ready_and_serving_s_after_sigcont": back,
        "health": sorted(health),
    }


def pause(url: str, proc: subprocess.Popen, seconds: float, load: bool) -> dict:
    """The prefill instance paused (see :func:`recovery`), with ``PAUSE_CLIENTS`` clients
    looping completions meanwhile if ``load``: what they were answered."""
    stop = threading.Event()
    outcomes: list[tuple[int | None, float]] = []

    def loop() -> None:
        while not stop.is_set():
            outcomes.append(complete(url))

    clients = [threading.Thread(target=loop, daemon=True) for _ in range(PAUSE_CLIENTS * load)]
    for t in clients:
        t.start()
    row = recovery(url, instances(proc.pid)[0], seconds)
    stop.set()
    for t in clients:
        t.join(60)
    codes: dict[str, int] = {}
    for code, _ in outcomes:
        codes[str(code)] = codes.get(str(code), 0) + 1
    slowest = max((s for _, s in outcomes), default=0.0)
    return row | {"load_answers": codes, "slowest_load_request_s": round(slowest, 1)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("scenario", choices=["idle", "slow", "large", "pause", "pause-load"])
    ap.add_argument("--config", default=None, help="default: PD-CC, or 1P1D-CC for a pause")
    ap.add_argument("--out", default="bench/results")
    args = ap.parse_args()
    paused = args.scenario.startswith("pause")
    config = args.config or ("1P1D-CC" if paused else "PD-CC")
    proc, url, port = start(config)
    try:
        if paused:
            row = pause(url, proc, PAUSE_S[args.scenario], args.scenario == "pause-load")
        else:
            row = {"idle": idle, "slow": slow, "large": large}[args.scenario](url, port)
    finally:
        proc.send_signal(signal.SIGTERM)
        proc.wait(30)
    row = {"scenario": args.scenario, "config": config} | row
    print(json.dumps(row))
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / f"serve_hostile_{args.scenario}.json").write_text(json.dumps(row, indent=1) + "\n")


if __name__ == "__main__":
    main()
