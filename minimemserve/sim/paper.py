"""``minimemserve sim --paper``: MemServe's evaluation (arXiv 2406.17565, Section 6) simulated.

The paper serves Llama-2-13B on 8 GPUs at tensor parallelism 2 and reports 19 relative
gains over three workloads (:data:`PAPER`): disaggregation against colocated PD, caching on
top of disaggregation, and prompt-tree against session routing. :func:`reproduce` simulates
each at one load per workload chosen by one rule (:func:`knee_rate`), for every
disaggregated ratio the 8 GPUs allow (1P3D, 2P2D) and for the paper's 1P2D on 6 GPUs,
prints the 19 numbers beside the paper's, and writes them with two plots."""

from __future__ import annotations

import dataclasses
import json
import multiprocessing
import os
import time
from collections.abc import Sequence
from concurrent.futures import Executor, Future, ProcessPoolExecutor
from dataclasses import dataclass
from pathlib import Path

from minimemserve.mempool.radix import RadixTree
from minimemserve.workloads.results import PAPER_SESSIONS, summarize
from minimemserve.workloads.sessions import build_prompt

from .runner import SimSetup, gpu_setup, simulate, workload_sessions

# (workload, comparison, metric) -> the paper's relative change (Figures 8-10, Section 6).
PAPER = {
    ("sharegpt", "disagg vs PD", "jct_mean"): -0.30,
    ("sharegpt", "disagg vs PD", "jct_p99"): -0.42,
    ("sharegpt", "disagg-CC vs disagg", "jct_mean"): -0.17,
    ("sharegpt", "disagg-CC vs disagg", "jct_p99"): -0.29,
    ("sharegpt", "disagg-CC vs disagg", "ttft_mean"): -0.58,
    ("sharegpt", "disagg-CC vs disagg", "ttft_p99"): -0.45,
    ("loogle", "disagg vs PD", "jct_mean"): -0.103,
    ("loogle", "disagg vs PD", "jct_p99"): -0.108,
    ("loogle", "disagg-CC vs disagg", "jct_mean"): -0.269,
    ("loogle", "disagg-CC vs disagg", "jct_p99"): -0.225,
    ("loogle", "disagg-CC vs disagg", "ttft_mean"): -0.562,
    ("loogle", "disagg-CC vs disagg", "ttft_p99"): -0.452,
    ("react", "disagg vs PD", "jct_mean"): -0.408,
    ("react", "disagg vs PD", "jct_p99"): -0.531,
    ("react", "disagg-CC vs disagg", "jct_mean"): -0.267,
    ("react", "disagg-CC vs disagg", "jct_p99"): -0.214,
    ("react", "disagg-CC vs disagg", "ttft_mean"): -0.785,
    ("react", "disagg-CC vs disagg", "ttft_p99"): -0.849,
    # The paper does not name this one's workload. Prompt trees exist for prefixes that
    # sessions share, which ReAct's few-shot block is; a router that knows a session only by
    # its first block (ours) sends every ReAct question to one instance. In ShareGPT sessions
    # share nothing but their own history, so session affinity already finds every hit: the
    # other workloads' values are printed beside it.
    ("react", "prompt_tree vs session", "ttft_p99"): -0.59,
}
WORKLOADS = ("sharegpt", "loogle", "react")
# Disaggregated layouts: name -> (GPUs, its colocated baseline on as many GPUs).
RATIOS = {"1P3D": 8, "2P2D": 8, "1P2D": 6}
# ShareGPT's real answers, capped where the paper's 4k-token model leaves room anyway; the
# synthetic workloads keep their own answer lengths (LooGLE 8-32, ReAct 20-100 tokens).
MAX_OUTPUT_TOKENS = {"sharegpt": 1024}
# The load rule: from LIGHT_RATE sessions/s, doubling, the first rate at which colocated PD's
# mean JCT is KNEE times its light-load value (queueing has doubled it), at most MAX_DOUBLINGS.
LIGHT_RATE = 0.25
KNEE = 2.0
MAX_DOUBLINGS = 9


@dataclass
class Workload:
    """One workload's sessions and the load chosen for it, with the ladder that chose it."""

    name: str
    sessions: list
    rate: float
    ladder: list[tuple[float, float]]  # (rate, PD mean JCT)


def workload_stats(sessions, block_size: int = 16) -> dict:
    """What the paper's Figure 7 shows of a workload: prompt and answer lengths (mean, median,
    P99), turns per session, and the shared-prefix fraction: of all prompt tokens, those (in
    whole blocks) that begin an earlier request's prompt plus answer, the most any cache could
    hit. Answers are stand-in tokens of their planned length, distinct per request."""
    tree = RadixTree(block_size, clock=lambda: 0.0)
    prompts, answers, turns, shared = [], [], [], 0
    fresh = 1 << 40  # stand-in answer ids, beyond any vocabulary
    for session in sessions:
        turns.append(len(session.turns))
        history: list[int] = []
        for k, turn in enumerate(session.turns):
            prompt = build_prompt(session, k, history)
            shared += tree.match_prefix(prompt).num_tokens
            answer = list(range(fresh, fresh + turn.max_tokens))
            fresh += turn.max_tokens
            history = [*prompt, *answer]
            whole = len(history) - len(history) % block_size
            tree.insert(history[:whole], [0] * (whole // block_size))
            prompts.append(len(prompt))
            answers.append(turn.max_tokens)

    def spread(xs: list[int]) -> dict:
        xs = sorted(xs)
        return {
            "mean": sum(xs) / len(xs),
            "p50": xs[len(xs) // 2],
            "p99": xs[int(0.99 * (len(xs) - 1))],
        }

    return {
        "sessions": len(sessions),
        "requests": len(prompts),
        "prompt": spread(prompts),
        "answer": spread(answers),
        "turns": spread(turns),
        "shared_prefix": shared / sum(prompts),
    }


def simulate_one(setup: SimSetup, config: str, sessions, rate: float, seed: int):
    """One configuration's summary and simulator stats (a worker process runs it)."""
    records, stats = simulate(setup, [config], sessions, rate, seed, progress=False)
    return summarize(records[config]), stats[config]


def knee_rate(
    pool: Executor, setup: SimSetup, sessions, seed: int, width: int = 2
) -> tuple[float, list[tuple[float, float]]]:
    """The load rule, the same for every workload: colocated PD's mean JCT at
    :data:`LIGHT_RATE` and at doubling rates; the first rate where it reaches :data:`KNEE`
    times the light-load value (else the last tried). Returns it and the ladder walked.
    ``width`` rates are simulated at once on ``pool``."""
    rates = [LIGHT_RATE * 2**k for k in range(MAX_DOUBLINGS)]
    ladder: list[tuple[float, float]] = []
    for k in range(0, len(rates), width):
        batch = rates[k : k + width]
        futures = [pool.submit(simulate_one, setup, "PD", sessions, r, seed) for r in batch]
        for rate, f in zip(batch, futures):
            ladder.append((rate, f.result()[0]["jct_mean"]))
            if ladder[-1][1] >= KNEE * ladder[0][1]:
                return rate, ladder
    return ladder[-1][0], ladder


def _gains(summ: dict[str, dict], new: str, base: str, metrics: Sequence[str]) -> dict:
    return {m: summ[new][m] / summ[base][m] - 1 for m in metrics}


def run_workload(
    pool: Executor, setups: dict[int, SimSetup], w: Workload, seed: int, progress: bool
) -> tuple[dict, dict]:
    """Every configuration the comparisons need at ``w.rate``, run on ``pool``: ``(summaries
    by run name, simulator stats by run name)``."""
    runs: dict[str, tuple[int, str, str]] = {}  # run name -> (gpus, config, routing)
    for ratio, gpus in RATIOS.items():
        runs[f"PD@{gpus}"] = (gpus, "PD", "prompt_tree")
        runs[ratio] = (gpus, ratio, "prompt_tree")
        runs[f"{ratio}-CC"] = (gpus, f"{ratio}-CC", "prompt_tree")
    runs["PD-CC@8"] = (8, "PD-CC", "prompt_tree")
    runs["PD-CC@8 session"] = (8, "PD-CC", "session")
    t0 = time.perf_counter()
    futures = {}
    for name, (gpus, config, routing) in runs.items():
        setup = setups[gpus].with_deployment(policy=routing)
        futures[name] = pool.submit(simulate_one, setup, config, w.sessions, w.rate, seed)
    summaries, stats = {}, {}
    for name, future in futures.items():
        summaries[name], st = future.result()
        stats[name] = {
            k: st[k] for k in ("simulated_s", "wall_s", "prefill_share", "decode_stall_s")
        }
        if progress:
            s = summaries[name]
            print(
                f"  {w.name} {name:16} JCT {s['jct_mean']:7.2f} s (P99 {s['jct_p99']:6.1f}), "
                f"TTFT {1e3 * s['ttft_mean']:8.1f} ms (P99 {1e3 * s['ttft_p99']:8.1f}), "
                f"TPOT {1e3 * s['tpot_mean']:5.1f} ms, cached {s['cached_ratio']:.0%}, prefill "
                f"{st['prefill_share']:.0%} of busy time, decodes held up "
                f"{st['decode_stall_s']:.2f} s [{st['wall_s']:.1f} s; "
                f"{time.perf_counter() - t0:.0f} s]",
                flush=True,
            )
    return summaries, stats


def comparisons(workload: str, summ: dict[str, dict]) -> list[dict]:
    """The paper's rows of ``workload``, each with the simulated change per ratio."""
    rows = []
    for (w, comparison, metric), paper in PAPER.items():
        if w != workload:
            continue
        sim = {}
        for ratio, gpus in RATIOS.items():
            if comparison == "disagg vs PD":
                new, base = ratio, f"PD@{gpus}"
            elif comparison == "disagg-CC vs disagg":
                new, base = f"{ratio}-CC", ratio
            else:  # routing is a colocated comparison: one value, on the 8 GPUs
                new, base = "PD-CC@8", "PD-CC@8 session"
            sim[ratio] = _gains(summ, new, base, [metric])[metric]
        rows.append(
            {"workload": w, "comparison": comparison, "metric": metric, "paper": paper, **sim}
        )
    return rows


def best_ratio(rows: list[dict]) -> str:
    """The ratio whose changes are closest to the paper's (mean absolute difference)."""
    errs = {r: sum(abs(row[r] - row["paper"]) for row in rows) for r in RATIOS}
    return min(errs, key=errs.get)


def reproduce(
    model: str = "llama2-13b",
    hardware: str = "h800",
    tp: int = 2,
    scheduler: str = "prefill_first",
    num_sessions: int = PAPER_SESSIONS,
    seed: int = 0,
    rates: dict[str, float] | None = None,
    out_dir: str | Path | None = None,
    progress: bool = True,
    jobs: int | None = None,
) -> dict:
    """Simulate the paper's evaluation under the local ``scheduler`` policy (the paper's base,
    vLLM 0.4.0, is ``prefill_first``) at ``rates`` per workload (default: the load rule);
    prints the table; with ``out_dir``, writes ``sim_paper.json``, ``sim_paper.png`` and
    ``sim_paper_fig8.png`` there; returns the result. Configurations run ``jobs`` at a time
    (default: one per core), each in its own process."""
    t0 = time.perf_counter()
    setups = {}
    for gpus in sorted(set(RATIOS.values())):
        s = gpu_setup(model, hardware, gpus, tp)
        cfg = dataclasses.replace(s.engine_config, scheduler=scheduler)
        setups[gpus] = s.with_deployment(engine=cfg)
    result: dict = {
        "setup": {**setups[8].describe, "scheduler": scheduler, "sessions": num_sessions},
        "load_rule": f"from {LIGHT_RATE}/s doubling, the first rate where colocated PD's mean "
        f"JCT reaches {KNEE}x its value at {LIGHT_RATE}/s (at most {MAX_DOUBLINGS} rates)",
        "workloads": {},
        "rows": [],
        "routing": {},  # prompt_tree vs session, P99 TTFT, on each workload
    }
    jobs = jobs or os.cpu_count() or 1
    spawn = multiprocessing.get_context("spawn")
    with ProcessPoolExecutor(jobs, mp_context=spawn) if jobs > 1 else _Inline() as pool:
        for name in WORKLOADS:
            _one_workload(pool, setups, name, num_sessions, seed, rates, progress, result)
    disagg = [r for r in result["rows"] if r["comparison"] != "prompt_tree vs session"]
    result["best_ratio"] = best_ratio(disagg)
    result["wall_s"] = time.perf_counter() - t0
    print_table(result)
    result["files"] = []
    if out_dir is None:
        return result
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    files = [out / "sim_paper.json", out / "sim_paper.png", out / "sim_paper_fig8.png"]
    result["files"] = list(map(str, files))
    files[0].write_text(json.dumps(result, indent=1))
    plot_gains(result, files[1])
    plot_fig8(result, files[2])
    print(f"wrote {', '.join(result['files'])} ({result['wall_s']:.0f} s)")
    return result


def _one_workload(pool, setups, name, num_sessions, seed, rates, progress, result) -> None:
    cap = MAX_OUTPUT_TOKENS.get(name)
    sessions = workload_sessions(setups[8], name, num_sessions, seed, None, cap, None)
    if rates and name in rates:
        w = Workload(name, sessions, rates[name], [])
    else:
        w = Workload(name, sessions, *knee_rate(pool, setups[8], sessions, seed))
    if progress:
        ladder = ", ".join(f"{r:g}/s: {j:.2f} s" for r, j in w.ladder)
        print(f"{name}: {len(sessions)} sessions at {w.rate:g}/s (PD mean JCT {ladder})")
    wstats = workload_stats(sessions, setups[8].engine_config.block_size)
    if progress:
        p, a = wstats["prompt"], wstats["answer"]
        print(
            f"  {wstats['requests']} requests; prompt mean {p['mean']:.0f} (P99 {p['p99']}), "
            f"answer mean {a['mean']:.0f} (P99 {a['p99']}), turns {wstats['turns']['mean']:.1f}, "
            f"shared prefix {wstats['shared_prefix']:.0%}"
        )
    summ, stats = run_workload(pool, setups, w, seed, progress)
    result["rows"] += comparisons(name, summ)
    result["routing"][name] = summ["PD-CC@8"]["ttft_p99"] / summ["PD-CC@8 session"]["ttft_p99"] - 1
    result["workloads"][name] = {
        "rate": w.rate,
        "ladder": w.ladder,
        "workload_stats": wstats,
        "summaries": summ,
        "stats": stats,
    }


class _Inline(Executor):
    """Runs each task at once in this process (``jobs=1``: no worker to start)."""

    def submit(self, fn, /, *args, **kwargs) -> Future:
        """``fn(*args, **kwargs)`` now; its result (or exception) in a finished future."""
        future: Future = Future()
        try:
            future.set_result(fn(*args, **kwargs))
        except BaseException as e:
            future.set_exception(e)
        return future


def print_table(result: dict) -> None:
    """The 19 numbers: the paper's beside the simulated one per ratio, with each load."""
    ratios = list(RATIOS)
    head = "".join(f"{r + ('' if RATIOS[r] == 8 else f' ({RATIOS[r]} GPUs)'):>16}" for r in ratios)
    print(f"\n{'workload':9}{'load':>8}  {'comparison':24}{'metric':10}{'paper':>8}{head}")
    for r in result["rows"]:
        rate = result["workloads"][r["workload"]]["rate"]
        sims = "".join(f"{r[x]:>+16.1%}" for x in ratios)
        if r["comparison"] == "prompt_tree vs session":
            sims = f"{r[ratios[0]]:>+16.1%}{'(8 GPUs, PD-CC)':>32}"
        print(
            f"{r['workload']:9}{rate:>6g}/s  {r['comparison']:24}{r['metric']:10}"
            f"{r['paper']:>+8.1%}{sims}"
        )
    routing = ", ".join(f"{w} {g:+.1%}" for w, g in result["routing"].items())
    print(f"prompt_tree vs session, P99 TTFT, PD-CC on 8 GPUs: {routing}")
    print(f"closest to the paper: {result['best_ratio']}; load rule: {result['load_rule']}")


def plot_gains(result: dict, png: Path) -> None:
    """Bars: each of the 19 changes, the paper's beside the simulated ones. Bars beyond
    +-100 % are cut there and carry their value."""
    from matplotlib.figure import Figure  # slow to import: only plots need it

    rows = result["rows"]
    fig = Figure(figsize=(14, 6), layout="tight")
    ax = fig.subplots()
    series = [("paper", "paper")] + [(r, f"{r} ({RATIOS[r]} GPUs)") for r in RATIOS]
    width = 0.8 / len(series)
    for k, (key, label) in enumerate(series):
        xs = [i + (k - (len(series) - 1) / 2) * width for i in range(len(rows))]
        values = [100 * r[key] for r in rows]
        ax.bar(xs, [max(-100.0, min(v, 100.0)) for v in values], width, label=label)
        for x, v in zip(xs, values):
            if v > 100:
                ax.text(x, 101, f"+{v:.0f}", rotation=90, fontsize=6, ha="center", va="bottom")
    labels = [f"{r['workload']} {r['metric']}\n{r['comparison']}" for r in rows]
    ax.set_xticks(range(len(rows)), labels, fontsize=7, rotation=40, ha="right")
    ax.set_ylim(-105, 140)
    ax.set_ylabel("change (%, cut at +100)")
    ax.axhline(0, color="black", linewidth=0.5)
    ax.legend(fontsize=7, loc="upper left")
    ax.set_title(f"MemServe's gains, paper vs simulated ({result['setup']['scheduler']})")
    fig.savefig(png, dpi=110)


def plot_fig8(result: dict, png: Path) -> None:
    """Like the paper's Figure 8: per workload, JCT and TTFT (mean, P99) of colocated PD,
    disaggregated and disaggregated with caching, normalized to PD, for the closest ratio."""
    from matplotlib.figure import Figure  # slow to import: only plots need it

    ratio = result["best_ratio"]
    gpus = RATIOS[ratio]
    metrics = ("jct_mean", "jct_p99", "ttft_mean", "ttft_p99")
    fig = Figure(figsize=(12, 3.6), layout="tight")
    axes = fig.subplots(1, len(WORKLOADS))
    for ax, (name, w) in zip(axes, result["workloads"].items()):
        summ = w["summaries"]
        runs = (f"PD@{gpus}", ratio, f"{ratio}-CC")
        for k, run in enumerate(runs):
            vals = [summ[run][m] / summ[runs[0]][m] for m in metrics]
            ax.bar([i + (k - 1) * 0.27 for i in range(len(metrics))], vals, 0.27, label=run)
        ax.set_xticks(range(len(metrics)), [m.replace("_", " ") for m in metrics], fontsize=7)
        ax.set_title(f"{name} at {w['rate']:g}/s", fontsize=9)
        ax.set_ylabel("relative to PD")
        ax.legend(fontsize=7)
    fig.suptitle(f"simulated, {result['setup']['scheduler']}, {ratio} on {gpus} GPUs", fontsize=9)
    fig.savefig(png, dpi=110)
