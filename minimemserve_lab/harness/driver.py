"""The end-to-end benchmark: replay a workload against several configurations, side by side.

``run_workload`` replays sessions against one :class:`~minimemserve.serving.Serving` in real
time: sessions arrive by a Poisson process, a session's next turn is submitted as soon as its
previous turn finished, with a prompt built from the history and the engine's own output.
``run_bench`` runs every configuration on the same sessions, audits every instance's KV pool
after each, prints a table, and writes JSON and plots. :func:`main` runs ``minimemserve
bench`` (its options: ``minimemserve.options.add_bench_arguments``).

Every configuration is a :class:`~minimemserve.deployment.DeploymentSpec` (``run_bench``'s
``options`` with the configuration's name), built by default as the spec says
(``DeploymentSpec.build``: in this process, or one process per instance); a factory given
in ``run_bench(factories={"1P1D": factory})`` builds it instead (:func:`process_factories`:
the bench's process runtime; any other runtime plugs in the same way).
"""

from __future__ import annotations

import argparse
import contextlib
import functools
import hashlib
import json
import math
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import replace
from pathlib import Path
from typing import Any

from tqdm.auto import tqdm

from minimemserve.config import EngineConfig, parse_config_name
from minimemserve.deployment import DeploymentSpec
from minimemserve.disagg.ray_runtime import ray_attached
from minimemserve.disagg.runtime import ProcessCluster
from minimemserve.model.tokenizer import Tokenizer
from minimemserve.options import (
    BENCH_ENGINE_FLAGS,
    BENCH_FIELDS,
    deployment_options,
    engine_options,
    trace_path,
)
from minimemserve.presets import preset_dir
from minimemserve.request import RequestOutput
from minimemserve.sampling import SamplingParams
from minimemserve.serving import Serving
from minimemserve.workloads.results import (
    DEFAULT_CONFIGS,
    DEFAULT_RATE,
    DEFAULT_SESSIONS,
    DEFAULT_WORKLOAD,
    greedy_params,
    record,
    summarize,
)
from minimemserve.workloads.sessions import (
    Session,
    TokenizerLike,
    Turn,
    build_prompt,
    make_workload,
    poisson_arrivals,
    total_turns,
    workload_args,
)
from minimemserve.workloads.trace import Trace, load_trace, trace_sessions
from minimemserve_lab.harness.hosts import HostsCluster
from minimemserve_lab.harness.http_target import endpoint_factory
from minimemserve_lab.report import CACHING_SUFFIX, caching_ratios, format_table, write_plots

# Equal resources under the process runtime: one core per instance, and two colocated
# instances, as many as 1P1D has.
CORES_PER_INSTANCE = 1
COLOCATED_INSTANCES = 2
# The bench's runtimes that start a ProcessCluster (or a subclass) per configuration.
CLUSTERS = {"process": ProcessCluster, "hosts": HostsCluster}
# Warm-up requests run before the measured workload (compilation, allocator, caches).
WARMUP_REQUESTS = 2
WARMUP_PROMPT_TOKENS = 64
WARMUP_OUTPUT_TOKENS = 8
# Longest idle sleep while waiting for the next arrival, so progress stays responsive.
MAX_IDLE_SLEEP_S = 0.05
# Without a rate, the bench first probes what the machine sustains: the first PROBE_SESSIONS
# sessions of the workload arrive at once under each probed configuration; while at least half
# of them are still running, the turns finished per second over the workload's turns per
# session is that configuration's capacity in sessions/s (the burst's tail, a few long
# sessions' turns one after another, measures their latency, not the machine). The measured
# runs then load the slowest configuration at PROBE_LOAD of its capacity: headroom for
# Poisson bursts, for a busy machine, and for the later turns' longer prompts.
PROBE_SESSIONS = 8
PROBE_LOAD = 0.6


TargetFactory = Callable[[DeploymentSpec], Serving]


def process_factories(
    configs: Sequence[str], cluster: type[ProcessCluster] = ProcessCluster, **kw: Any
) -> dict[str, TargetFactory]:
    """``{config: factory}`` for ``run_bench(factories=...)``: each config in its own
    processes, a ``cluster`` (``ProcessCluster`` or a subclass, such as ``HostsCluster``);
    ``kw`` are spec fields (cores, policy, cost model, transport, start method, timeouts...).
    Unknown names raise ``ConfigError`` here."""
    for c in configs:
        parse_config_name(c)
    process = functools.partial(replace, runtime="process", **kw)
    return {c: lambda spec: process(spec).build(cluster) for c in configs}


def resolve_factory(
    config: str, factories: Mapping[str, TargetFactory] | None = None
) -> TargetFactory:
    """The factory of ``config``: from ``factories`` if listed there, else the spec's own
    ``build``. Names ``factories`` does not list must be configurations: one that is not
    raises ``ConfigError`` here, before any work."""
    if factories and config in factories:
        return factories[config]
    parse_config_name(config)
    return DeploymentSpec.build


# --------------------------------------------------------------------------- driver


class _Replay:
    """One replay of sessions against a ``Serving``: what is in flight and what is recorded."""

    def __init__(self, serving, sessions, config, params_for, bar) -> None:
        self.serving = serving
        self.sessions = sessions
        self.config = config
        self.params_for = params_for
        self.bar = bar
        self.records: list[dict] = []
        self.inflight: dict[str, tuple[int, int, float]] = {}  # id -> (session, turn, arrival)
        self.t0 = time.perf_counter()

    def submit(self, si: int, k: int, history: Sequence[int], arrival: float) -> None:
        """Turn ``k`` of session ``si``, after ``history``; a rejected turn ends its session."""
        session = self.sessions[si]
        prompt = build_prompt(session, k, history)
        rid = f"{session.id}/{k}"
        try:
            self.serving.add_request(
                prompt,
                self.params_for(session.turns[k]),
                request_id=rid,
                arrival_time=arrival,
                session_id=session.id,
            )
        except ValueError as exc:
            rejected = f"rejected: {exc}"
            rec = record(self.config, session, k, arrival - self.t0, None, len(prompt), rejected)
            self.records.append(rec)
            self.bar.update(len(session.turns) - k)
            return
        self.inflight[rid] = (si, k, arrival)

    def collect(self, out: RequestOutput) -> None:
        """Record a finished turn and submit its session's next one."""
        si, k, arrival = self.inflight.pop(out.request_id)
        session = self.sessions[si]
        rec = record(self.config, session, k, arrival - self.t0, out)
        rec["output_sha1"] = hashlib.sha1(repr(out.token_ids).encode()).hexdigest()[:12]
        self.records.append(rec)
        self.bar.update(1)
        if rec["error"] is not None:
            self.bar.update(len(session.turns) - k - 1)
        elif k + 1 < len(session.turns):
            history = [*out.prompt_token_ids, *out.token_ids]
            self.submit(si, k + 1, history, time.perf_counter())

    def step(self, next_arrival: float | None) -> None:
        """Step the serving and collect our outputs, or wait for the next arrival."""
        if self.serving.has_unfinished():
            for out in self.serving.step():
                if out.request_id in self.inflight:  # else not ours (added by someone else)
                    self.collect(out)
        elif self.inflight:
            raise RuntimeError(
                f"the engine reports no unfinished requests but "
                f"{len(self.inflight)} submitted turns never finished"
            )
        elif next_arrival is not None:  # nothing in flight: wait for the next arrival
            wait = next_arrival - time.perf_counter()
            time.sleep(min(max(wait, 0.0), MAX_IDLE_SLEEP_S))


def run_workload(
    serving: Serving,
    sessions: Sequence[Session],
    rate: float,
    seed: int,
    progress: bool = True,
    config: str = "",
    params_for: Callable[[Turn], SamplingParams] = greedy_params,
) -> list[dict]:
    """Replay ``sessions`` against ``serving`` in real time and return one record per turn.

    Sessions start at Poisson arrival offsets (``rate`` sessions/s, ``seed``); the first
    turn's ``arrival_time`` is its scheduled arrival, so queueing counts in its TTFT. A
    turn is submitted when the previous turn of its session finished; for chained sessions
    its prompt is that turn's prompt + output + the new user tokens. A turn the engine
    rejects or fails is recorded with its ``error`` and ends its session.
    Record keys: config, session, turn, arrival, prompt_tokens, output_tokens,
    cached_tokens, ttft, jct, tpot, transferred_bytes, preemptions, finish_reason, error.
    """
    arrivals = poisson_arrivals(rate, len(sessions), seed)
    desc = f"{config or 'bench'} turns"
    total = total_turns(sessions)
    with tqdm(total=total, disable=not progress, unit="req", desc=desc) as bar:
        replay = _Replay(serving, sessions, config, params_for, bar)
        due = [replay.t0 + a for a in arrivals]
        started = 0
        while started < len(sessions) or replay.inflight:
            now = time.perf_counter()
            while started < len(sessions) and due[started] <= now:
                replay.submit(started, 0, (), due[started])
                started += 1
            replay.step(due[started] if started < len(sessions) else None)
    return replay.records


def warm_up(
    serving: Serving,
    tokenizer: TokenizerLike,
    params_for: Callable[[Turn], SamplingParams] = greedy_params,
) -> None:
    """Run a few short requests to completion so one-time costs stay out of the measurement."""
    ids = tokenizer.encode("warm up the engine before measuring " * 32, add_bos=True)
    prompt = ids[:WARMUP_PROMPT_TOKENS]
    for i in range(WARMUP_REQUESTS):
        turn = Turn("warmup", 0, tuple(prompt[: len(prompt) - i]), WARMUP_OUTPUT_TOKENS)
        serving.add_request(list(turn.user_tokens), params_for(turn), request_id=f"warmup-{i}")
    while serving.has_unfinished():
        serving.step()


# --------------------------------------------------------------------------- run_bench


def _model_context(model_dir: Path) -> int:
    config = json.loads((model_dir / "config.json").read_text())
    return int(config["max_position_embeddings"])


def _sessions(
    setup: dict[str, Any],
    model_dir: Path,
    num_sessions: int,
    max_context: int | None,
    verbose: bool,
) -> tuple[Tokenizer, list[Session]]:
    """The tokenizer and the sessions of ``setup``'s workload; adds their counts and the
    context to ``setup``."""
    context = int(min(max_context or math.inf, _model_context(model_dir)))
    tokenizer = Tokenizer.from_dir(model_dir)
    workload, turns, out = setup["workload"], setup["max_turns"], setup["max_output_tokens"]
    sessions = make_workload(
        workload,
        tokenizer,
        num_sessions,
        context,
        setup["seed"],
        max_turns=turns,
        max_output_tokens=out,
    )
    setup.update(sessions=len(sessions), turns=total_turns(sessions), max_context=context)
    if verbose:
        print(
            f"workload {workload}: {len(sessions)} sessions, {setup['turns']} turns, "
            f"context {context}, model {model_dir}"
        )
    return tokenizer, sessions


def _trace_sessions(
    setup: dict[str, Any], trace: Trace, model_dir: Path, max_context: int | None, verbose: bool
) -> tuple[Tokenizer, list[Session]]:
    """The tokenizer and the sessions (conversations) of a trace, its requests that fit the
    model's context, outputs capped at ``setup["max_output_tokens"]``; adds the counts."""
    context = int(min(max_context or math.inf, _model_context(model_dir)))
    fitted = trace.limited(context, setup["max_output_tokens"])
    tokenizer = Tokenizer.from_dir(model_dir)
    sessions, _ = trace_sessions(fitted, tokenizer.vocab_size)
    setup.update(sessions=len(sessions), turns=total_turns(sessions), max_context=context)
    setup["trace"] = {
        "path": str(trace.path),
        "requests": len(trace.requests),
        "dropped_too_long": len(trace.requests) - len(fitted.requests),
        "length_scale": trace.length_scale,
        "prompt_tokens": fitted.prompt_tokens(),
    }
    if verbose:
        print(
            f"trace {trace.path.name}: {len(fitted.requests)} requests in {len(sessions)} "
            f"conversations (length scale {trace.length_scale}; "
            f"{setup['trace']['dropped_too_long']} beyond the context {context}), "
            f"model {model_dir}"
        )
    return tokenizer, sessions


def probed_configs(configs: Sequence[str]) -> list[str]:
    """The configurations a rate probe runs: all but those whose base (``X`` of ``X-CC``) is
    among them too, as caching only removes work from its base on the same sessions."""
    suffix = CACHING_SUFFIX
    return [c for c in configs if not (c.endswith(suffix) and c[: -len(suffix)] in configs)]


def burst_capacity(records: Sequence[dict], turns_per_session: float) -> float:
    """Sessions/s a configuration sustains, from the records of a burst (sessions arriving
    at once): turns finished per second until half the sessions have finished, over
    ``turns_per_session``."""
    ends: dict[str, float] = {}
    for r in records:
        end = r["arrival"] + (r["jct"] or 0.0)
        ends[r["session"]] = max(ends.get(r["session"], 0.0), end)
    half = sorted(ends.values())[max(len(ends) // 2 - 1, 0)]
    done = sum(1 for r in records if r["arrival"] + (r["jct"] or 0.0) <= half)
    start = min(r["arrival"] for r in records)
    return done / max(half - start, 1e-9) / turns_per_session


def probe_rate(
    measure: Callable[[str, Sequence[Session], float], tuple[list[dict], dict[str, Any]]],
    configs: Sequence[str],
    sessions: Sequence[Session],
    verbose: bool,
) -> dict[str, Any]:
    """The load the machine sustains: ``measure(config, sessions, rate)`` (a real run) of the
    first :data:`PROBE_SESSIONS` sessions, all arriving at once, under each of
    :func:`probed_configs`, and their :func:`burst_capacity`; returns ``{"capacity": {config:
    sessions/s}, "load": PROBE_LOAD, "rate": PROBE_LOAD x the least capacity, to two
    significant digits}``."""
    burst = list(sessions[:PROBE_SESSIONS])
    if verbose:
        print(f"probing the load: {len(burst)} sessions at once under each of ", end="")
        print(", ".join(probed_configs(configs)))
    capacity = {}
    for config in probed_configs(configs):
        records, _ = measure(config, burst, math.inf)
        capacity[config] = burst_capacity(records, total_turns(sessions) / len(sessions))
    slowest = min(capacity, key=capacity.__getitem__)
    rate = float(f"{PROBE_LOAD * capacity[slowest]:.2g}")
    if verbose:
        print(
            f"rate {rate} sessions/s: {PROBE_LOAD:.0%} of {slowest}'s "
            f"{capacity[slowest]:.2f} sessions/s, the least any probed configuration sustained "
            f"({len(burst)} sessions at once; --rate sets a rate instead)"
        )
    return {"capacity": capacity, "load": PROBE_LOAD, "rate": rate}


def _measure(
    factory: TargetFactory,
    spec: DeploymentSpec,
    tokenizer: Tokenizer,
    sessions: Sequence[Session],
    arrivals: tuple[float, int],
    progress: bool,
    verbose: bool,
) -> tuple[list[dict], dict[str, Any]]:
    """Build the config's ``Serving``, warm up, replay the workload at ``arrivals`` (rate,
    seed), audit the pools, close; returns the records and ``{"wall_s", "startup_s", "pool",
    "tokens"}`` (tokens: a digest of every turn's output tokens, equal across runtimes)."""
    config = spec.config
    begin = time.perf_counter()
    serving = factory(spec)
    startup = time.perf_counter() - begin
    try:
        warm_up(serving, tokenizer)
        start = time.perf_counter()
        records = run_workload(serving, sessions, *arrivals, progress=progress, config=config)
        wall = time.perf_counter() - start
        try:
            serving.check_pools(require_idle=True)
        except Exception as exc:
            raise RuntimeError(f"KV pool balance check failed after the {config} run") from exc
        stats = {"wall_s": wall, "startup_s": startup, "pool": serving.pool_stats()}
    finally:
        serving.close()
    outputs = sorted((r["session"], r["turn"], r.get("output_sha1", "-")) for r in records)
    stats["tokens"] = hashlib.sha1(repr(outputs).encode()).hexdigest()[:12]
    if verbose:
        print(
            f"{config}: {len(records)} requests in {wall:.1f} s, pool balanced (started in "
            f"{startup:.1f} s; output tokens {stats['tokens']})"
        )
    return records, stats


# What a benchmark's workload is made of, with the defaults ``run_bench`` takes for them.
WORKLOAD_ARGS = {
    "workload": DEFAULT_WORKLOAD,
    "num_sessions": DEFAULT_SESSIONS,
    "rate": DEFAULT_RATE,
    "max_turns": None,
    "seed": 0,
    "max_output_tokens": None,
    "max_context": None,
}


def run_bench(
    configs: Sequence[str] = DEFAULT_CONFIGS,
    *,
    model_dir: str | Path | None = None,
    out_dir: str | Path | None = None,
    options: DeploymentSpec | None = None,
    factories: Mapping[str, TargetFactory] | None = None,
    progress: bool = True,
    verbose: bool = True,
    runtime: Mapping[str, Any] | None = None,
    **run: Any,
) -> dict[str, Any]:
    """Run a workload under every config in ``configs`` on the same sessions; compare.

    ``run`` are the workload's arguments (:data:`WORKLOAD_ARGS`): ``workload``, ``num_sessions``,
    ``rate``, ``max_turns``, ``seed``, ``max_output_tokens`` and ``max_context``. ``workload``
    is a name or a :class:`~minimemserve.workloads.trace.Trace`, whose
    conversations are the sessions (``num_sessions`` unused; requests that do not fit the
    context are left out). ``rate`` (sessions/s) None probes the machine first
    (:func:`probe_rate`; the setup's ``rate_probe``). ``model_dir`` None uses the tiny preset.
    ``max_context`` None is the model's context. ``max_turns`` and ``max_output_tokens`` None
    take the workload's defaults (see
    :func:`minimemserve.workloads.sessions.make_workload`).
    ``options`` is every config's deployment but its name (default: in this process, seeded
    with ``seed``); ``factories`` maps config names to :data:`TargetFactory`, others are
    built as their spec says (see :func:`resolve_factory`). ``runtime`` (for the JSON)
    describes how the factories run the configs. Each config gets a fresh ``Serving``, a warm-up
    (excluded), the workload, a pool audit and ``close()``. Prints a table when ``verbose``;
    with ``out_dir`` writes ``e2e_<workload>.json`` and ``e2e_<workload>_{bars,cdf}.png``
    there. Returns ``{"summaries", "ttft_later_ratio", "records", "pool_stats", "setup",
    "files"}``.
    """
    if not configs:
        raise ValueError("no configs to benchmark")
    w = workload_args(run, WORKLOAD_ARGS)
    workload, rate, seed = w["workload"], w["rate"], w["seed"]
    num_sessions, max_context = w["num_sessions"], w["max_context"]
    known = {c: resolve_factory(c, factories) for c in configs}
    model_dir = Path(model_dir or preset_dir("tiny"))
    options = replace(options or DeploymentSpec(engine=EngineConfig(seed=seed)), model=model_dir)
    setup = {
        "workload": workload,
        "rate": rate,
        "seed": seed,
        "max_turns": w["max_turns"],
        "max_output_tokens": w["max_output_tokens"],
        "model_dir": str(model_dir),
        "configs": list(configs),
        "options": options.describe(),
        "runtime": dict(runtime or {"kind": "inline"}),
    }
    if isinstance(workload, Trace):
        setup["workload"] = "trace"
        tokenizer, sessions = _trace_sessions(setup, workload, model_dir, max_context, verbose)
    else:
        tokenizer, sessions = _sessions(setup, model_dir, num_sessions, max_context, verbose)

    def measure(config: str, sessions: Sequence[Session], rate: float):
        spec = replace(options, config=config)
        return _measure(known[config], spec, tokenizer, sessions, (rate, seed), progress, verbose)

    if rate is None:
        setup["rate_probe"] = probe_rate(measure, configs, sessions, verbose)
        rate = setup["rate"] = setup["rate_probe"]["rate"]
    elif verbose:
        print(f"rate {rate} sessions/s")
    records: dict[str, list[dict]] = {}
    pool_stats: dict[str, Any] = {}
    for config in configs:
        records[config], pool_stats[config] = measure(config, sessions, rate)
    result = _compare(setup, records, pool_stats, verbose)
    if out_dir is not None:
        _write(result, Path(out_dir), model_dir.name, verbose)
    return result


def _compare(
    setup: dict[str, Any], records: dict[str, list[dict]], pool_stats: dict, verbose: bool
) -> dict[str, Any]:
    """The summaries of each config's records side by side (printed when ``verbose``)."""
    summaries = {c: summarize(records[c]) for c in records}
    ratios = caching_ratios(summaries)
    result: dict[str, Any] = {
        "setup": setup,
        "summaries": summaries,
        "ttft_later_ratio": ratios,
        "pool_stats": pool_stats,
        "records": records,
        "files": [],
    }
    if verbose:
        print(format_table(summaries))
        for pair, ratio in ratios.items():
            shown = ratio if isinstance(ratio, str) else "-" if ratio is None else f"{ratio:.2f}x"
            print(f"mean TTFT of turns after the first, {pair}: {shown}")
    return result


def _write(result: dict[str, Any], out: Path, model_name: str, verbose: bool) -> None:
    """Write a run's JSON and plots under ``out``; lists them in ``result["files"]``."""
    setup = result["setup"]
    workload = setup["workload"]
    out.mkdir(parents=True, exist_ok=True)
    json_path = out / f"e2e_{workload}.json"
    title = (
        f"{workload}: {setup['sessions']} sessions, {setup['turns']} requests, "
        f"{setup['rate']} sessions/s, {model_name}"
    )
    records, summaries = result["records"], result["summaries"]
    pngs = write_plots(records, summaries, out / f"e2e_{workload}", title=title)
    result["files"] = [str(json_path), *map(str, pngs)]
    json_path.write_text(json.dumps(result, indent=1))
    if verbose:
        print("wrote " + ", ".join(result["files"]))


# --------------------------------------------------------------------------- CLI


def endpoint_targets(specs: Sequence[str]) -> dict[str, TargetFactory]:
    """``{name: factory}`` of ``--endpoint [NAME=]URL`` options."""
    out = {}
    for spec in specs:
        name, _, url = spec.partition("=") if "=" in spec.split("://")[0] else ("", "", spec)
        out[name or url] = endpoint_factory(url)
    return out


def _engine_config(args: argparse.Namespace) -> EngineConfig:
    """Every instance's ``EngineConfig`` from ``bench``'s options (``--scheduler`` defaults
    to ``chunked`` here)."""
    engine = engine_options(args, BENCH_ENGINE_FLAGS)
    return EngineConfig(**engine, seed=args.seed, scheduler=args.scheduler or "chunked")


def main(args: argparse.Namespace) -> int:
    """Run ``minimemserve bench`` with parsed ``args`` (see
    ``minimemserve.options.add_bench_arguments``); returns the exit status."""
    configs = [c.strip() for c in args.configs.split(",") if c.strip()]
    options = deployment_options(args, BENCH_FIELDS, _engine_config(args))
    factories = None
    runtime: dict[str, Any] = {"kind": args.runtime}
    if args.endpoint:
        factories = endpoint_targets(args.endpoint)
        configs, runtime = list(factories), {"kind": "http", "endpoints": args.endpoint}
    elif args.runtime in CLUSTERS:
        equal = {"cores_per_instance": CORES_PER_INSTANCE, "num_colocated": COLOCATED_INSTANCES}
        factories = process_factories(configs, CLUSTERS[args.runtime], **equal)
        runtime.update(equal, policy=args.policy, cost_model=args.cost_model or "prompt tokens")
        runtime.update(transport=args.transport)
    elif args.runtime == "ray":
        equal = {"cores_per_instance": CORES_PER_INSTANCE, "num_colocated": COLOCATED_INSTANCES}
        ray = {"ray_address": args.ray_address, "placement": args.placement}
        options = replace(options, runtime="ray", **equal | ray)
        runtime.update(equal | ray, policy=args.policy, transport=args.transport)
    start = time.perf_counter()
    ray = options.runtime == "ray"
    with ray_attached(args.ray_address) if ray else contextlib.nullcontext():  # one Ray session
        _run(args, configs, options, factories, runtime)
    print(f"benchmark took {time.perf_counter() - start:.1f} s")
    return 0


def _run(args, configs, options, factories, runtime) -> None:
    """``run_bench`` with ``bench``'s parsed ``args``."""
    workload = args.workload
    if args.trace:
        window, scales = args.trace_window, (args.time_scale, args.length_scale)
        workload = load_trace(trace_path(args), window, *scales)
    run_bench(
        configs=configs,
        workload=workload,
        num_sessions=args.sessions or DEFAULT_SESSIONS,
        rate=args.rate,
        max_turns=args.max_turns,
        max_output_tokens=args.max_output_tokens,
        max_context=args.max_context,
        model_dir=options.model,
        out_dir=args.out,
        seed=args.seed,
        options=options,
        progress=not args.no_progress,
        factories=factories,
        runtime=runtime,
    )
