"""The end-to-end benchmark: replay a workload against several configurations, side by side.

``run_workload`` replays sessions against one :class:`~minimemserve.serving.Serving` in real
time: sessions arrive by a Poisson process, a session's next turn is submitted as soon as its
previous turn finished, with a prompt built from the history and the engine's own output.
``run_bench`` runs every configuration on the same sessions, audits every instance's KV pool
after each, prints a table, and writes JSON and plots. :func:`add_arguments` and
:func:`main` are ``minimemserve bench``.

A configuration is built by a factory that maps a :class:`TargetSpec` to a fresh
``Serving``. Every name ``LLM`` accepts ("PD", "PD-CC", "1P1D", "1P1D-CC", ...) runs in this
process through :func:`in_process_target`; :func:`process_factories` runs them with one
process per instance (``ProcessCluster``), and ``run_bench(factories={"1P1D": factory})``
plugs in any other runtime.
"""

from __future__ import annotations

import argparse
import functools
import json
import math
import time
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
from tqdm.auto import tqdm

from minimemserve.bench.hosts import HostsCluster
from minimemserve.bench.http_target import endpoint_factory
from minimemserve.bench.presets import preset_dir
from minimemserve.bench.workloads import (
    WORKLOADS,
    Session,
    TokenizerLike,
    Turn,
    build_prompt,
    make_workload,
    poisson_arrivals,
    total_turns,
)
from minimemserve.config import SCHEDULERS, EngineConfig, parse_config_name
from minimemserve.disagg.runtime import ProcessCluster
from minimemserve.llm import LLM
from minimemserve.model.tokenizer import Tokenizer
from minimemserve.request import RequestMetrics, RequestOutput
from minimemserve.sampling import SamplingParams
from minimemserve.scheduler.cost_model import CostModel
from minimemserve.scheduler.global_scheduler import POLICIES
from minimemserve.serving import Serving

# Defaults of `minimemserve bench`, sized so both in-process configs finish in a few
# minutes on a 2-core CPU with the tiny preset model.
DEFAULT_CONFIGS = ("PD", "PD-CC", "1P1D", "1P1D-CC")
DEFAULT_WORKLOAD = "sharegpt"
DEFAULT_SESSIONS = 16
PAPER_SESSIONS = 600  # sim --paper: enough sessions to load 4 Llama-2-13B instances past their knee
DEFAULT_RATE = 1.0  # sessions per second
DEFAULT_OUT_DIR = "bench/results"
# Equal resources under the process runtime: one core per instance, and two colocated
# instances, as many as 1P1D has.
CORES_PER_INSTANCE = 1
COLOCATED_INSTANCES = 2
# Warm-up requests run before the measured workload (compilation, allocator, caches).
WARMUP_REQUESTS = 2
WARMUP_PROMPT_TOKENS = 64
WARMUP_OUTPUT_TOKENS = 8
# Percentile reported beside the mean.
TAIL_PERCENTILE = 99.0
# Longest idle sleep while waiting for the next arrival, so progress stays responsive.
MAX_IDLE_SLEEP_S = 0.05
# A config is compared with its context-caching variant named "<config>-CC".
CACHING_SUFFIX = "-CC"
_METRICS = ("ttft", "jct", "tpot")


@dataclass(frozen=True)
class EngineOptions:
    """Engine settings shared by every configuration of a run (equal resources)."""

    device: str = "cpu"
    dtype: str = "float32"
    block_size: int = 16
    num_blocks: int | None = None
    max_num_seqs: int = 64
    max_num_batched_tokens: int = 512
    seed: int = 0
    tensor_parallel_size: int = 1
    decode_tensor_parallel_size: int | None = None
    scheduler: str = "chunked"

    def engine_config(self) -> EngineConfig:
        """These options as the ``EngineConfig`` of every instance (device and dtype aside)."""
        return EngineConfig(
            block_size=self.block_size,
            num_blocks=self.num_blocks,
            max_num_seqs=self.max_num_seqs,
            max_num_batched_tokens=self.max_num_batched_tokens,
            seed=self.seed,
            tensor_parallel_size=self.tensor_parallel_size,
            decode_tensor_parallel_size=self.decode_tensor_parallel_size,
            scheduler=self.scheduler,
        )


@dataclass(frozen=True)
class TargetSpec:
    """What a factory is given to build the ``Serving`` of one configuration."""

    config: str
    model_dir: Path
    options: EngineOptions = field(default_factory=EngineOptions)


TargetFactory = Callable[[TargetSpec], Serving]


def in_process_target(spec: TargetSpec) -> Serving:
    """``LLM(...).engine`` of config ``spec.config``: every instance in this process."""
    o = spec.options
    llm = LLM(
        spec.model_dir,
        config=spec.config,
        device=o.device,
        dtype=o.dtype,
        **asdict(o.engine_config()),  # LLM takes EngineConfig's fields by name
    )
    return llm.engine


def process_target(
    spec: TargetSpec, cluster: type[ProcessCluster] = ProcessCluster, **cluster_kw: Any
) -> Serving:
    """A ``ProcessCluster`` (one process per instance; ``cluster`` may be a subclass, such as
    ``HostsCluster``) of config ``spec.config``; ``cluster_kw`` go to its constructor (cores,
    policy, cost model, transport, ...)."""
    o = spec.options
    return cluster(
        spec.model_dir,
        spec.config,
        engine_config=o.engine_config(),
        device=o.device,
        dtype=o.dtype,
        **cluster_kw,
    )


def process_factories(configs: Sequence[str], **cluster_kw: Any) -> dict[str, TargetFactory]:
    """``{config: factory}`` for ``run_bench(factories=...)``: each config in its own
    processes (:func:`process_target`). Unknown names raise ``ConfigError`` here."""
    for c in configs:
        parse_config_name(c)
    return {c: functools.partial(process_target, **cluster_kw) for c in configs}


def resolve_factory(
    config: str, factories: Mapping[str, TargetFactory] | None = None
) -> TargetFactory:
    """The factory of ``config``: from ``factories`` if listed there, else the in-process ``LLM``.

    Names ``factories`` does not list fall back to :func:`in_process_target`; one ``LLM``
    does not know raises ``ConfigError`` here, before any work.
    """
    if factories and config in factories:
        return factories[config]
    parse_config_name(config)
    return in_process_target


# --------------------------------------------------------------------------- driver


def greedy_params(turn: Turn) -> SamplingParams:
    """Sampling parameters of a benchmark turn: greedy, exactly ``turn.max_tokens`` tokens."""
    return SamplingParams(max_tokens=turn.max_tokens, temperature=0.0, ignore_eos=True)


def _record(
    config: str,
    session: Session,
    turn: int,
    arrival: float,
    out: RequestOutput | None,
    prompt_tokens: int = 0,
    error: str | None = None,
) -> dict:
    """One row of the results: a finished turn, or (``out`` None) one the engine rejected."""
    m = out.metrics if out else RequestMetrics(arrival_time=arrival)  # rejected: nothing measured
    if out is not None:
        prompt_tokens = len(out.prompt_token_ids)
        if out.finish_reason == "error":
            error = out.error or "failed"
    return {
        "config": config,
        "session": session.id,
        "turn": turn,
        "arrival": arrival,
        "prompt_tokens": prompt_tokens,
        "output_tokens": len(out.token_ids) if out else 0,
        "cached_tokens": m.cached_tokens,
        "ttft": m.ttft,
        "jct": m.latency,
        "tpot": m.tpot,
        "transferred_bytes": m.transferred_bytes,
        "preemptions": m.preemptions,
        "finish_reason": out.finish_reason if out else "error",
        "error": error,
    }


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
    records: list[dict] = []
    inflight: dict[str, tuple[int, int, float]] = {}  # request id -> (session, turn, arrival)
    bar = tqdm(
        total=total_turns(sessions),
        disable=not progress,
        unit="req",
        desc=f"{config or 'bench'} turns",
    )
    t0 = time.perf_counter()

    def submit(si: int, k: int, history: Sequence[int], arrival: float) -> None:
        session = sessions[si]
        prompt = build_prompt(session, k, history)
        rid = f"{session.id}/{k}"
        try:
            serving.add_request(
                prompt, params_for(session.turns[k]), request_id=rid, arrival_time=arrival
            )
        except ValueError as exc:
            rec = _record(config, session, k, arrival - t0, None, len(prompt), f"rejected: {exc}")
            records.append(rec)
            bar.update(len(session.turns) - k)
            return
        inflight[rid] = (si, k, arrival)

    def collect(out: RequestOutput) -> None:
        si, k, arrival = inflight.pop(out.request_id)
        session = sessions[si]
        rec = _record(config, session, k, arrival - t0, out)
        records.append(rec)
        bar.update(1)
        if rec["error"] is not None:
            bar.update(len(session.turns) - k - 1)
        elif k + 1 < len(session.turns):
            submit(si, k + 1, [*out.prompt_token_ids, *out.token_ids], time.perf_counter())

    next_session = 0
    with bar:
        while next_session < len(sessions) or inflight:
            now = time.perf_counter()
            while next_session < len(sessions) and t0 + arrivals[next_session] <= now:
                submit(next_session, 0, (), t0 + arrivals[next_session])
                next_session += 1
            if serving.has_unfinished():
                for out in serving.step():
                    if out.request_id in inflight:  # else not ours (added by someone else)
                        collect(out)
            elif inflight:
                raise RuntimeError(
                    f"the engine reports no unfinished requests but "
                    f"{len(inflight)} submitted turns never finished"
                )
            else:  # nothing in flight: wait for the next arrival
                wait = t0 + arrivals[next_session] - time.perf_counter()
                time.sleep(min(max(wait, 0.0), MAX_IDLE_SLEEP_S))
    return records


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


# --------------------------------------------------------------------------- statistics


def _mean(values: Sequence[float]) -> float | None:
    return float(np.mean(values)) if values else None


def _tail(values: Sequence[float]) -> float | None:
    return float(np.percentile(values, TAIL_PERCENTILE)) if values else None


def summarize(records: Iterable[dict]) -> dict[str, Any]:
    """Mean and P99 of TTFT, JCT and TPOT, overall and for turns after the first.

    Keys: ``requests``, ``errors``, ``{ttft,jct,tpot}_{mean,p99}`` and the same with a
    ``_later`` suffix (turn > 0), ``cached_ratio`` (cached / prompt tokens, also
    ``cached_ratio_later``), ``prompt_tokens``, ``output_tokens``, ``cached_tokens``,
    ``transferred_bytes``. Failed requests count only in ``errors``; a statistic over no
    values is None.
    """
    records = list(records)
    ok = [r for r in records if r.get("error") is None]
    later = [r for r in ok if r["turn"] > 0]
    out: dict[str, Any] = {"requests": len(records), "errors": len(records) - len(ok)}
    for suffix, group in (("", ok), ("_later", later)):
        for metric in _METRICS:
            values = [r[metric] for r in group if r.get(metric) is not None]
            out[f"{metric}_mean{suffix}"] = _mean(values)
            out[f"{metric}_p99{suffix}"] = _tail(values)
        prompt = sum(r["prompt_tokens"] for r in group)
        cached = sum(r["cached_tokens"] for r in group)
        out[f"cached_ratio{suffix}"] = cached / prompt if prompt else None
    out["prompt_tokens"] = sum(r["prompt_tokens"] for r in ok)
    out["output_tokens"] = sum(r["output_tokens"] for r in ok)
    out["cached_tokens"] = sum(r["cached_tokens"] for r in ok)
    out["transferred_bytes"] = sum(r["transferred_bytes"] for r in ok)
    return out


def caching_ratios(summaries: Mapping[str, Mapping[str, Any]]) -> dict[str, float | None]:
    """``{"X/X-CC": mean TTFT of later turns under X / under X-CC}`` for every such pair."""
    ratios: dict[str, float | None] = {}
    for name, base in summaries.items():
        cc = summaries.get(name + CACHING_SUFFIX)
        if cc is None:
            continue
        a, b = base.get("ttft_mean_later"), cc.get("ttft_mean_later")
        ratios[f"{name}/{name}{CACHING_SUFFIX}"] = a / b if a and b else None
    return ratios


def _ms(value: float | None) -> str:
    return "-" if value is None else f"{value * 1e3:.1f}"


def format_table(summaries: Mapping[str, Mapping[str, Any]]) -> str:
    """A plain-text table of the per-config summaries (times in milliseconds)."""
    header = (
        "config",
        "TTFT mean",
        "TTFT P99",
        "TTFT mean t>1",
        "JCT mean",
        "JCT P99",
        "TPOT mean",
        "cached",
        "bytes",
        "errors",
    )
    rows = [header]
    for name, s in summaries.items():
        ratio = s.get("cached_ratio")
        rows.append(
            (
                name,
                _ms(s["ttft_mean"]),
                _ms(s["ttft_p99"]),
                _ms(s["ttft_mean_later"]),
                _ms(s["jct_mean"]),
                _ms(s["jct_p99"]),
                _ms(s["tpot_mean"]),
                "-" if ratio is None else f"{ratio:.1%}",
                f"{s['transferred_bytes']:,}",
                str(s["errors"]),
            )
        )
    widths = [max(len(r[i]) for r in rows) for i in range(len(header))]
    lines = [
        " | ".join(c.ljust(w) if i == 0 else c.rjust(w) for i, (c, w) in enumerate(zip(r, widths)))
        for r in rows
    ]
    lines.insert(1, "-+-".join("-" * w for w in widths))
    return "(times in ms)\n" + "\n".join(lines)


# --------------------------------------------------------------------------- plots


def write_plots(
    records_by_config: Mapping[str, list[dict]],
    summaries: Mapping[str, Mapping[str, Any]],
    prefix: Path,
    title: str = "",
) -> list[Path]:
    """Bars of mean/P99 TTFT and JCT per config, and CDFs of TTFT and JCT; returns the paths."""
    from matplotlib.figure import Figure  # optional and slow to import: only plots need it

    names = list(summaries)
    bars = Figure(figsize=(10, 4), layout="tight")
    x = np.arange(len(names))  # [configs]
    width = 0.38
    for ax, metric, name in zip(bars.subplots(1, 2), ("ttft", "jct"), ("TTFT", "JCT")):
        for j, (stat, label) in enumerate((("mean", "mean"), ("p99", "P99"))):
            vals = [(summaries[n][f"{metric}_{stat}"] or 0.0) for n in names]
            ax.bar(x + (j - 0.5) * width, vals, width, label=label)
        ax.set_xticks(x, names)
        ax.set_ylabel("seconds")
        ax.set_title(name)
        ax.legend()
    cdfs = Figure(figsize=(10, 4), layout="tight")
    for ax, metric, name in zip(cdfs.subplots(1, 2), ("ttft", "jct"), ("TTFT", "JCT")):
        for n in names:
            vals = np.sort(
                [
                    r[metric]
                    for r in records_by_config[n]
                    if r.get("error") is None and r.get(metric) is not None
                ]
            )
            if len(vals):
                ax.step(vals, np.arange(1, len(vals) + 1) / len(vals), where="post", label=n)
        ax.set_xlabel(f"{name} (s)")
        ax.set_ylabel("fraction of requests")
        ax.set_title(f"CDF of {name}")
        ax.legend()
    if title:
        bars.suptitle(title)
        cdfs.suptitle(title)
    paths = [prefix.with_name(f"{prefix.name}_{kind}.png") for kind in ("bars", "cdf")]
    bars.savefig(paths[0], dpi=100)
    cdfs.savefig(paths[1], dpi=100)
    return paths


# --------------------------------------------------------------------------- run_bench


def _model_context(model_dir: Path) -> int:
    config = json.loads((model_dir / "config.json").read_text())
    return int(config["max_position_embeddings"])


def _measure(
    config: str,
    serving: Serving,
    tokenizer: Tokenizer,
    sessions: Sequence[Session],
    rate: float,
    seed: int,
    progress: bool,
) -> tuple[list[dict], dict[str, Any]]:
    """Warm up, replay the workload, audit the pools; returns the records and
    ``{"wall_s", "pool"}``."""
    warm_up(serving, tokenizer)
    start = time.perf_counter()
    records = run_workload(serving, sessions, rate, seed, progress=progress, config=config)
    wall = time.perf_counter() - start
    try:
        serving.check_pools(require_idle=True)
    except Exception as exc:
        raise RuntimeError(f"KV pool balance check failed after the {config} run") from exc
    return records, {"wall_s": wall, "pool": serving.pool_stats()}


def run_bench(
    configs: Sequence[str] = DEFAULT_CONFIGS,
    workload: str = DEFAULT_WORKLOAD,
    num_sessions: int = DEFAULT_SESSIONS,
    rate: float = DEFAULT_RATE,
    max_turns: int | None = None,
    model_dir: str | Path | None = None,
    out_dir: str | Path | None = DEFAULT_OUT_DIR,
    seed: int = 0,
    max_output_tokens: int | None = None,
    max_context: int | None = None,
    options: EngineOptions | None = None,
    factories: Mapping[str, TargetFactory] | None = None,
    progress: bool = True,
    verbose: bool = True,
    runtime: Mapping[str, Any] | None = None,
) -> dict[str, Any]:
    """Run ``workload`` under every config in ``configs`` on the same sessions; compare.

    ``model_dir`` None uses the tiny preset. ``max_context`` None is the model's context.
    ``max_turns`` and ``max_output_tokens`` None take the workload's defaults (see
    :func:`minimemserve.bench.workloads.make_workload`).
    ``factories`` maps config names to :data:`TargetFactory`; other names run as an
    in-process ``LLM`` (see :func:`resolve_factory`). ``runtime`` describes how the
    factories run the configs (process runtime, routing policy) for the JSON. Each config
    gets a fresh ``Serving``, a warm-up (excluded), the workload, a pool audit and
    ``close()``. Prints a table when ``verbose``; with ``out_dir`` writes
    ``e2e_<workload>.json`` and ``e2e_<workload>_{bars,cdf}.png`` there. Returns
    ``{"summaries", "ttft_later_ratio", "records", "pool_stats", "setup", "files"}``.
    """
    if not configs:
        raise ValueError("no configs to benchmark")
    known = {c: resolve_factory(c, factories) for c in configs}
    model_dir = Path(preset_dir("tiny") if model_dir is None else model_dir)
    options = options or EngineOptions(seed=seed)
    context = min(max_context or math.inf, _model_context(model_dir))
    tokenizer = Tokenizer.from_dir(model_dir)
    sessions = make_workload(
        workload,
        tokenizer,
        num_sessions,
        int(context),
        seed,
        max_turns=max_turns,
        max_output_tokens=max_output_tokens,
    )
    setup = {
        "workload": workload,
        "sessions": len(sessions),
        "turns": total_turns(sessions),
        "rate": rate,
        "seed": seed,
        "max_turns": max_turns,
        "max_context": int(context),
        "max_output_tokens": max_output_tokens,
        "model_dir": str(model_dir),
        "configs": list(configs),
        "options": asdict(options),
        "runtime": dict(runtime or {"kind": "inline"}),
    }
    if verbose:
        print(
            f"workload {workload}: {len(sessions)} sessions, {setup['turns']} turns, "
            f"rate {rate}/s, context {int(context)}, model {model_dir}"
        )

    records: dict[str, list[dict]] = {}
    pool_stats: dict[str, Any] = {}
    for config in configs:
        serving = known[config](TargetSpec(config, model_dir, options))
        try:
            records[config], pool_stats[config] = _measure(
                config, serving, tokenizer, sessions, rate, seed, progress
            )
        finally:
            serving.close()
        if verbose:
            print(
                f"{config}: {len(records[config])} requests in "
                f"{pool_stats[config]['wall_s']:.1f} s, pool balanced"
            )

    summaries = {c: summarize(records[c]) for c in configs}
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
            shown = "-" if ratio is None else f"{ratio:.2f}x"
            print(f"mean TTFT of turns after the first, {pair}: {shown}")
    if out_dir is not None:
        out = Path(out_dir)
        out.mkdir(parents=True, exist_ok=True)
        json_path = out / f"e2e_{workload}.json"
        title = (
            f"{workload}: {len(sessions)} sessions, {setup['turns']} requests, "
            f"{rate} sessions/s, {model_dir.name}"
        )
        pngs = write_plots(records, summaries, out / f"e2e_{workload}", title=title)
        result["files"] = [str(json_path), *map(str, pngs)]
        json_path.write_text(json.dumps(result, indent=1))
        if verbose:
            print("wrote " + ", ".join(result["files"]))
    return result


# --------------------------------------------------------------------------- CLI

DESCRIPTION = (
    "Replay a multi-turn workload under several configurations and compare TTFT, JCT and "
    "TPOT (mean and P99)."
)


def add_workload_arguments(p: argparse.ArgumentParser) -> argparse.ArgumentParser:
    """The options ``minimemserve bench`` and ``minimemserve sim`` share: configs, workload,
    sessions, rate, turns and lengths, seed, output folder, routing policy, progress."""
    p.add_argument(
        "--configs",
        default=",".join(DEFAULT_CONFIGS),
        help="comma-separated configurations (default: %(default)s)",
    )
    p.add_argument("--workload", choices=WORKLOADS, default=DEFAULT_WORKLOAD)
    p.add_argument(
        "--sessions",
        type=int,
        default=None,
        help="sessions (ShareGPT conversations, LooGLE documents, ReAct questions; default "
        f"{DEFAULT_SESSIONS}, sim --paper {PAPER_SESSIONS})",
    )
    p.add_argument("--rate", type=float, default=DEFAULT_RATE, help="session arrivals per second")
    p.add_argument(
        "--max-turns",
        type=int,
        default=None,
        help="turns per ShareGPT session (default 6), questions per LooGLE "
        "document (8) or steps per ReAct question (7)",
    )
    p.add_argument(
        "--max-output-tokens",
        type=int,
        default=None,
        help="cap on output tokens per turn (defaults: sharegpt 48, loogle 32, react 100)",
    )
    p.add_argument(
        "--max-context",
        type=int,
        default=None,
        help="cap on prompt + output per request (default: the model's context)",
    )
    p.add_argument("--out", default=DEFAULT_OUT_DIR, help="where JSON and plots go")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument(
        "--policy",
        choices=POLICIES,
        default="prompt_tree",
        help="global scheduler policy (default: %(default)s)",
    )
    p.add_argument(
        "--scheduler",
        choices=SCHEDULERS,
        default=None,
        help="local step policy: chunked prefill beside decodes (the default), or "
        "prefill_first (whole prompts in steps of their own, vLLM 0.4.0's; the default of "
        "sim --paper)",
    )
    p.add_argument("--no-progress", action="store_true", help="hide the progress bar")
    return p


def add_parallel_arguments(p: argparse.ArgumentParser) -> argparse.ArgumentParser:
    """``--tensor-parallel-size`` and ``--decode-tensor-parallel-size`` (instances in one
    process: ``bench --runtime inline``, ``serve --runtime inprocess``, ``generate``)."""
    p.add_argument("--tensor-parallel-size", type=int, default=1, help="ranks per instance")
    p.add_argument(
        "--decode-tensor-parallel-size",
        type=int,
        default=None,
        help="ranks per decode instance (default: --tensor-parallel-size)",
    )
    return p


def add_arguments(p: argparse.ArgumentParser) -> argparse.ArgumentParser:
    """Add the options of ``minimemserve bench`` to ``p``; returns ``p``."""
    add_workload_arguments(p)
    p.add_argument("--model", default=None, help="HF Llama checkpoint dir (default: tiny preset)")
    p.add_argument("--device", default="cpu")
    p.add_argument("--dtype", default="float32")
    p.add_argument("--num-blocks", type=int, default=None, help="KV blocks per instance")
    add_parallel_arguments(p)
    p.add_argument(
        "--runtime",
        choices=("process", "hosts", "inline"),
        default="process",
        help="process: every instance its own process on one core (colocated configs run "
        "two instances, xPyD ones x+y), the equal-resources comparison; hosts: the same, as "
        "`minimemserve instance` processes a frontend joins (the multi-host runtime on this "
        "machine); inline: one process, instances stepped in turn (default: %(default)s)",
    )
    p.add_argument(
        "--transport",
        choices=("auto", "shm", "gloo"),
        default="auto",
        help="KV transport between instances of the process and hosts runtimes (auto: "
        "shared memory within a host, gloo between hosts; default: %(default)s)",
    )
    p.add_argument(
        "--cost-model",
        default=None,
        help="JSON of a fitted cost model (bench/cost_model.py writes one) for the global "
        "scheduler; default: cost counted in new tokens",
    )
    p.add_argument(
        "--endpoint",
        action="append",
        default=[],
        metavar="[NAME=]URL",
        help="replay over the OpenAI API of a running `minimemserve serve` at URL (streaming; "
        "TTFT is the first chunk), shown as NAME (default: its URL); repeat to compare "
        "servers of different configs; replaces --configs",
    )
    return p


def endpoint_targets(specs: Sequence[str]) -> dict[str, TargetFactory]:
    """``{name: factory}`` of ``--endpoint [NAME=]URL`` options."""
    out = {}
    for spec in specs:
        name, _, url = spec.partition("=") if "=" in spec.split("://")[0] else ("", "", spec)
        out[name or url] = endpoint_factory(url)
    return out


def main(args: argparse.Namespace) -> int:
    """Run ``minimemserve bench`` with parsed ``args`` (see :func:`add_arguments`); returns
    the exit status."""
    configs = [c.strip() for c in args.configs.split(",") if c.strip()]
    factories = None
    runtime: dict[str, Any] = {"kind": args.runtime}
    if args.endpoint:
        factories = endpoint_targets(args.endpoint)
        configs, runtime = list(factories), {"kind": "http", "endpoints": args.endpoint}
    elif args.runtime in ("process", "hosts"):
        factories = process_factories(
            configs,
            cluster=HostsCluster if args.runtime == "hosts" else ProcessCluster,
            cores_per_instance=CORES_PER_INSTANCE,
            num_colocated=COLOCATED_INSTANCES,
            policy=args.policy,
            cost_model=CostModel.load(args.cost_model) if args.cost_model else None,
            transport=args.transport,
        )
        runtime.update(
            cores_per_instance=CORES_PER_INSTANCE,
            colocated_instances=COLOCATED_INSTANCES,
            policy=args.policy,
            cost_model=args.cost_model or "prompt tokens",
            transport=args.transport,
        )
    start = time.perf_counter()
    run_bench(
        configs=configs,
        workload=args.workload,
        num_sessions=args.sessions or DEFAULT_SESSIONS,
        rate=args.rate,
        max_turns=args.max_turns,
        max_output_tokens=args.max_output_tokens,
        max_context=args.max_context,
        model_dir=args.model,
        out_dir=args.out,
        seed=args.seed,
        options=EngineOptions(
            device=args.device,
            dtype=args.dtype,
            num_blocks=args.num_blocks,
            seed=args.seed,
            tensor_parallel_size=args.tensor_parallel_size,
            decode_tensor_parallel_size=args.decode_tensor_parallel_size,
            scheduler=args.scheduler or "chunked",
        ),
        progress=not args.no_progress,
        factories=factories,
        runtime=runtime,
    )
    print(f"benchmark took {time.perf_counter() - start:.1f} s")
    return 0
