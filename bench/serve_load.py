"""Load on the OpenAI server: many concurrent streaming clients, against the same deployment
driven in this process.

For each config, starts ``minimemserve serve`` (tiny preset, loopback, ``--runtime`` as given:
by default ``process``, what ``serve`` runs, each instance in its own process behind the
frontend; ``inprocess`` puts every instance in the server's engine thread), keeps
``--clients`` streaming completions in flight for ``--duration`` seconds with real ShareGPT
prompts, and checks that every request completed or failed clearly and that no KV block stays
referenced. The same deployment (same runtime) is built in this process and driven the same
way (the same prompts in the same order, as many in flight, as long). The two alternate,
``--rounds`` server rounds between ``--rounds + 1`` in-process ones (in, server, in, server,
in), so a drift of the machine shows in both and averages out; the overhead is the server's
mean output tokens/s against the in-process mean. ``LLM.generate`` on the prompts that
completed (all at once, so it keeps more in flight) is shown beside. While the server runs,
``/health`` and ``/metrics`` are polled every ``--poll-s`` seconds (as a Kubernetes probe and
a Prometheus scrape would); every answer must be a 200.

    python bench/serve_load.py [--clients 64] [--duration 60] [--configs PD-CC,1P1D-CC]
    python bench/serve_load.py --runtime inprocess    # the engine in the server's thread
    python bench/serve_load.py --burst 300 --configs PD-CC   # 300 streams at once, polled

Prints one table; writes ``serve_load.json`` and ``serve_load.png`` under ``--out``."""

from __future__ import annotations

import argparse
import json
import socket
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request
from pathlib import Path

import numpy as np
from tqdm.auto import tqdm

from minimemserve import LLM, SamplingParams
from minimemserve.config import EngineConfig
from minimemserve.deployment import RUNTIMES, DeploymentSpec
from minimemserve.model.tokenizer import Tokenizer
from minimemserve.presets import preset_dir
from minimemserve.sharegpt import iter_sharegpt
from minimemserve_lab.harness.http_target import HttpServing

# Prompts are cut to this many tokens so requests stay comparable (tiny model, CPU).
MAX_PROMPT_TOKENS = 256
START_TIMEOUT_S = 180.0
# After the duration, requests still in flight get this long to finish.
DRAIN_TIMEOUT_S = 120.0
NUM_BLOCKS = 1024  # KV blocks per instance: 64 requests of up to 288 tokens fit


def prompts(tok: Tokenizer, n: int, max_len: int = MAX_PROMPT_TOKENS) -> list[list[int]]:
    """The first human message of ``n`` real ShareGPT conversations, as at most ``max_len``
    token ids."""
    out = []
    for conv in iter_sharegpt():
        turns = [m["value"] for m in conv["conversations"] if m.get("from") == "human"]
        if turns and turns[0].strip():
            out.append(tok.encode(turns[0])[:max_len])
            if len(out) == n:
                return out
    raise RuntimeError("not enough ShareGPT conversations")


class Poller:
    """GETs ``paths`` of ``url`` every ``period_s`` in a thread; counts answers by status."""

    def __init__(self, url: str, paths: tuple[str, ...], period_s: float) -> None:
        self.url, self.paths, self.period_s = url, paths, period_s
        self.status: dict[str, dict[str, int]] = {p: {} for p in paths}
        self.slowest_s = 0.0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _get(self, path: str) -> str:
        t0 = time.perf_counter()
        try:
            with urllib.request.urlopen(self.url + path, timeout=30) as r:
                r.read()
                code = str(r.status)
        except urllib.error.HTTPError as e:
            code = str(e.code)
        except OSError as e:
            code = type(e).__name__
        self.slowest_s = max(self.slowest_s, time.perf_counter() - t0)
        return code

    def _run(self) -> None:
        while not self._stop.wait(self.period_s):
            for p in self.paths:
                code = self._get(p)
                self.status[p][code] = self.status[p].get(code, 0) + 1

    def __enter__(self) -> Poller:
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        self._thread.join()

    @property
    def all_ok(self) -> bool:
        """Every answer was a 200 (and there was at least one per path)."""
        return all(st and set(st) == {"200"} for st in self.status.values())


def burst(
    url: str, tok: Tokenizer, pool: list[list[int]], n: int, params, poll_s: float, limit_s: float
) -> dict:
    """``n`` streams started at once, /health and /metrics polled meanwhile, for at most
    ``limit_s`` (each stream may wait that long for its next bytes: queued ones wait long on
    a busy machine); their outcome."""
    target = HttpServing(url, tok, timeout_s=limit_s)
    start = time.perf_counter()
    with Poller(url, ("/health", "/metrics"), poll_s) as poller:
        rids = [target.add_request(pool[i % len(pool)], params, f"b{i}") for i in range(n)]
        outs = []
        with tqdm(total=n, desc=f"burst of {n}", unit="req") as bar:
            while target.has_unfinished() and time.perf_counter() - start < limit_s:
                got = target.step()
                outs += got
                bar.update(len(got))
    target.check_pools(require_idle=True)
    ok = [o for o in outs if o.error is None and len(o.token_ids) == params.max_tokens]
    return {
        "streams": len(rids),
        "ok": len(ok),
        "failed": len(outs) - len(ok),
        "lost": n - len(outs),
        "errors": sorted({str(o.error) for o in outs if o.error})[:5],
        "wall_s": time.perf_counter() - start,
        "polls": poller.status,
        "slowest_poll_s": poller.slowest_s,
        "polls_ok": poller.all_ok,
    }


def start_server(
    config: str, port: int, num_blocks: int = NUM_BLOCKS, runtime: str = "process"
) -> subprocess.Popen:
    """``minimemserve serve`` of ``config`` on ``port``, once ``/ready`` answers 200."""
    cmd = [
        sys.executable,
        "-m",
        "minimemserve.cli",
        "serve",
        "--config",
        config,
        "--port",
        str(port),
        "--runtime",
        runtime,
        "--num-blocks",
        str(num_blocks),
    ]
    proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    deadline = time.monotonic() + START_TIMEOUT_S
    while time.monotonic() < deadline:
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{port}/ready", timeout=5) as r:
                if r.status == 200:
                    return proc
        except OSError:
            time.sleep(0.3)
    proc.kill()
    raise TimeoutError(f"the {config} server did not start")


def drive(
    url: str,
    tok: Tokenizer,
    pool: list[list[int]],
    clients: int,
    duration: float,
    params: SamplingParams,
    poll_s: float,
) -> dict:
    """Keep ``clients`` streams in flight for ``duration`` s, /health and /metrics polled
    every ``poll_s``; every request's outcome."""
    target = HttpServing(url, tok)
    submitted, outs, i = {}, [], 0
    start = time.perf_counter()
    poller = Poller(url, ("/health", "/metrics"), poll_s)
    with poller, tqdm(desc=f"{clients} clients", unit="req", total=None) as bar:
        while time.perf_counter() - start < duration or target.has_unfinished():
            while time.perf_counter() - start < duration and len(submitted) - len(outs) < clients:
                rid = target.add_request(pool[i % len(pool)], params, request_id=f"r{i}")
                submitted[rid] = pool[i % len(pool)]
                i += 1
            for out in target.step():
                outs.append(out)
                bar.update(1)
            if time.perf_counter() - start > duration + DRAIN_TIMEOUT_S:
                break
    wall = time.perf_counter() - start
    target.check_pools(require_idle=True)  # raises if a block stayed referenced
    ok = [o for o in outs if o.error is None]
    return {
        "submitted": len(submitted),
        "completed": len(ok),
        "failed": len(outs) - len(ok),
        "lost": len(submitted) - len(outs),
        "errors": sorted({o.error for o in outs if o.error})[:5],
        "wall_s": wall,
        "output_tokens": sum(len(o.token_ids) for o in ok),
        "ttft": [o.metrics.ttft for o in ok],
        "tpot": [o.metrics.tpot for o in ok if o.metrics.tpot is not None],
        "itl": list(target.itl),
        "prompts": [submitted[o.request_id] for o in ok],
        "polls": poller.status,
        "polls_ok": poller.all_ok,
    }


def merge(rounds: list[dict]) -> dict:
    """The server rounds of one config as one row: counts summed, output tokens/s per round
    and their mean, latency percentiles over every round's requests."""
    cat = lambda key: [v for r in rounds for v in r[key]]
    pct = lambda key, q: 1e3 * float(np.percentile(cat(key), q))
    rates = [r["output_tokens"] / r["wall_s"] for r in rounds]
    wall = sum(r["wall_s"] for r in rounds)
    return {
        **{k: sum(r[k] for r in rounds) for k in ("submitted", "completed", "failed", "lost")},
        "errors": sorted({e for r in rounds for e in r["errors"]})[:5],
        "wall_s": wall,
        "requests_per_s": sum(r["completed"] for r in rounds) / wall,
        "runs_tokens_per_s": rates,
        "output_tokens_per_s": float(np.mean(rates)),
        **{f"{k}_p{q}_ms": pct(k, q) for k in ("ttft", "itl", "tpot") for q in (50, 99)},
        "prompts": cat("prompts"),
        "pool_balanced": True,  # drive raised otherwise
        "polls": [r["polls"] for r in rounds],
        "polls_ok": all(r["polls_ok"] for r in rounds),
    }


def in_process_closed(
    llm: LLM, pool: list[list[int]], clients: int, duration: float, params: SamplingParams
) -> float:
    """Output tokens/s of the LLM's own engine driven as the clients drive the server: the
    same prompts in the same order, ``clients`` in flight for ``duration`` s, then drained."""
    eng, i, inflight, tokens = llm.engine, 0, 0, 0
    start = time.perf_counter()
    while time.perf_counter() - start < duration or inflight:
        while time.perf_counter() - start < duration and inflight < clients:
            eng.add_request(pool[i % len(pool)], params)
            i, inflight = i + 1, inflight + 1
        for out in eng.step():
            inflight, tokens = inflight - 1, tokens + len(out.token_ids)
    return tokens / (time.perf_counter() - start)


def generate_rate(llm: LLM, prompts_: list[list[int]], params: SamplingParams) -> float:
    """Output tokens/s of ``LLM.generate`` on ``prompts_``, every prompt at once."""
    start = time.perf_counter()
    outs = llm.generate(prompts_, params, use_tqdm=True)
    return sum(len(o.token_ids) for o in outs) / (time.perf_counter() - start)


def plot(rows: dict[str, dict], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6, 3.5))
    names, x = list(rows), np.arange(len(rows))
    ax.bar(x - 0.2, [rows[c]["output_tokens_per_s"] for c in names], 0.4, label="server (HTTP)")
    ax.bar(
        x + 0.2,
        [rows[c]["in_process_tokens_per_s"] for c in names],
        0.4,
        label="in process, as many in flight",
    )
    ax.set_xticks(x, names)
    ax.set_ylabel("output tokens/s")
    ax.set_title("streaming clients over HTTP vs the same deployment in process")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def _list(values: list[float]) -> str:
    return ", ".join(f"{v:.0f}" for v in values)


def print_table(rows: dict[str, dict]) -> None:
    """The Markdown table of every configuration's row."""
    head = (
        "config",
        "done",
        "failed",
        "lost",
        "req/s",
        "server tok/s (rounds)",
        "in-proc tok/s (rounds)",
        "LLM.generate tok/s",
        "overhead",
        "TTFT p50/p99 ms",
        "ITL p50/p99 ms",
        "TPOT p50/p99 ms",
        "probes all 200",
    )
    print("| " + " | ".join(head) + " |\n|" + "---|" * len(head))
    for c, r in rows.items():
        print(
            f"| {c} | {r['completed']} | {r['failed']} | {r['lost']} | {r['requests_per_s']:.2f} "
            f"| {r['output_tokens_per_s']:.0f} ({_list(r['runs_tokens_per_s'])}) "
            f"| {r['in_process_tokens_per_s']:.0f} ({_list(r['in_process_runs_tokens_per_s'])}) "
            f"| {r['generate_tokens_per_s']:.0f} "
            f"| {100 * r['overhead']:.1f}% | {r['ttft_p50_ms']:.0f} / {r['ttft_p99_ms']:.0f} "
            f"| {r['itl_p50_ms']:.1f} / {r['itl_p99_ms']:.1f} "
            f"| {r['tpot_p50_ms']:.1f} / {r['tpot_p99_ms']:.1f} | {r['polls_ok']} |"
        )
        print(f"{c}: server / in-process output tokens/s = {1 - r['overhead']:.3f}")


def main() -> None:
    """Load-test each configuration over HTTP beside the in-process engine; print and write."""
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--clients", type=int, default=64)
    ap.add_argument("--duration", type=float, default=60.0)
    ap.add_argument("--configs", default="PD-CC,1P1D-CC")
    ap.add_argument("--max-tokens", type=int, default=32)
    ap.add_argument("--out", default="bench/results")
    ap.add_argument("--poll-s", type=float, default=1.0, help="probe and scrape period")
    ap.add_argument("--burst", type=int, default=0, help="only N streams at once, polled")
    ap.add_argument("--num-blocks", type=int, default=NUM_BLOCKS, help="KV blocks per instance")
    ap.add_argument("--prompt-tokens", type=int, default=MAX_PROMPT_TOKENS, help="prompt cut")
    ap.add_argument("--limit-s", type=float, default=1200.0, help="longest a burst may run")
    ap.add_argument("--runtime", default="process", choices=RUNTIMES, help="of server and baseline")
    ap.add_argument("--rounds", type=int, default=2, help="server rounds, between in-process ones")
    args = ap.parse_args()
    tok = Tokenizer.from_dir(preset_dir("tiny"))
    pool = prompts(tok, 512, args.prompt_tokens)
    params = SamplingParams(max_tokens=args.max_tokens, temperature=0.0, ignore_eos=True)
    if args.burst:
        return run_burst(args, tok, pool, params)
    rows = {}
    for config in args.configs.split(","):
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        spec = DeploymentSpec(
            config, runtime=args.runtime, engine=EngineConfig(num_blocks=args.num_blocks)
        )
        llm = LLM(spec)
        llm.generate(pool[:4], params)  # warm-up
        load = (pool, args.clients, args.duration, params)
        runs, served = [in_process_closed(llm, *load)], []
        proc = start_server(config, port, args.num_blocks, args.runtime)
        url = f"http://127.0.0.1:{port}"
        try:
            for _ in range(args.rounds):  # alternated: a drift of the machine shows in both
                served.append(drive(url, tok, *load, args.poll_s))
                runs.append(in_process_closed(llm, *load))
        finally:
            proc.terminate()
            proc.wait(30)
        row = merge(served)
        row["in_process_runs_tokens_per_s"] = runs
        row["in_process_tokens_per_s"] = float(np.mean(runs))
        row["generate_tokens_per_s"] = generate_rate(llm, row.pop("prompts")[:512], params)
        llm.close()
        row["overhead"] = 1 - row["output_tokens_per_s"] / row["in_process_tokens_per_s"]
        rows[config] = row
    print_table(rows)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    setup = {
        "clients": args.clients,
        "duration_s": args.duration,
        "max_tokens": args.max_tokens,
        "runtime": args.runtime,
        "rounds": args.rounds,
    }
    (out / "serve_load.json").write_text(json.dumps({"setup": setup, "results": rows}, indent=1))
    plot(rows, out / "serve_load.png")
    print(f"wrote {out / 'serve_load.json'}, {out / 'serve_load.png'}")


def run_burst(args, tok: Tokenizer, pool: list[list[int]], params: SamplingParams) -> None:
    """``--burst``: for each config, ``args.burst`` streams at once against a fresh server."""
    rows = {}
    for config in args.configs.split(","):
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        proc = start_server(config, port, args.num_blocks, args.runtime)
        try:
            rows[config] = burst(
                f"http://127.0.0.1:{port}", tok, pool, args.burst, params, args.poll_s, args.limit_s
            )
        finally:
            proc.terminate()
            proc.wait(30)
    print(
        "| config | streams | ok | failed | lost | wall s | /health | /metrics | slowest poll s |"
    )
    print("|---|---|---|---|---|---|---|---|---|")
    for c, r in rows.items():
        h, m = r["polls"]["/health"], r["polls"]["/metrics"]
        print(
            f"| {c} | {r['streams']} | {r['ok']} | {r['failed']} | {r['lost']} | "
            f"{r['wall_s']:.0f} | {h} | {m} | {r['slowest_poll_s']:.2f} |"
        )
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "serve_burst.json").write_text(json.dumps(rows, indent=1))
    print(f"wrote {out / 'serve_burst.json'}")


if __name__ == "__main__":
    main()
