"""A production trace replayed by its timestamps on a simulated cluster at Mooncake's scale.

:func:`trace_setup` builds the cluster Mooncake measured on (FAST'25): a Llama-3-70B-shaped
model on 8 x A800 per instance (TP 8), each instance's MemPool with a DRAM tier below its HBM.
:func:`replay_trace` sends every request of the trace at its arrival time (each an
independent prompt: a turn's prompt already holds its history) and reports what a reader of
Mooncake's Fig. 10 compares: the share of prompt tokens served from cache, each instance's
prefill load (its GPU seconds in steps with prefill work), the mean prefill time per request,
and TTFT and TBT percentiles. :func:`fig10` is Mooncake's local-cache experiment under each
routing policy: 10 prefill instances with 3M-token DRAM tiers and outputs capped at one token
(so only prefill runs); :func:`slo_capacity` the highest load, by the trace's time scale,
that meets a TTFT and a TBT objective.
"""

from __future__ import annotations

import json
import math
import time
from collections import Counter
from collections.abc import Sequence
from dataclasses import replace
from pathlib import Path

import numpy as np

from minimemserve.sampling import SamplingParams
from minimemserve.sim.profiles import HardwareProfile
from minimemserve.sim.runner import SimSetup, gpu_setup
from minimemserve.workloads.sessions import Turn
from minimemserve.workloads.trace import Trace, load_trace, trace_sessions

# Mooncake's trace-replay cluster: a LLaMA3-70B-like model, one 8 x A800 node per instance.
TRACE_MODEL, TRACE_HARDWARE, TRACE_TP = "llama3-70b", "a800", 8
# Fig. 10: ten prefill nodes, a 3M-token cache each, outputs of one token (prefill alone).
FIG10_INSTANCES = 10
FIG10_DRAM_TOKENS = 3_000_000
FIG10_OUTPUT_CAP = 1
FIG10_POLICIES = ("round_robin", "least_load", "session", "prompt_tree")
# ... and the prompt tree that never moves a prefix between instances (Mooncake's local cache).
FIG10_ALL = (*FIG10_POLICIES, "prompt_tree_local")
# Mooncake's published Fig. 10 hit rates: routing to the best local cache, and one pooled cache.
MOONCAKE_LOCAL_HIT, MOONCAKE_GLOBAL_HIT = 0.17, 0.38
# The tier study: each instance's pool with HBM only, with Mooncake's 3M tokens of DRAM below,
# and with ten times that on disk below the DRAM (tokens per instance: dram, disk).
TIER_STUDY = {
    "hbm": (0, 0),
    "hbm+dram": (FIG10_DRAM_TOKENS, 0),
    "hbm+dram+disk": (FIG10_DRAM_TOKENS, 10 * FIG10_DRAM_TOKENS),
}
# The service objectives of the capacity search (ours, of the size Mooncake's replay used):
# P90 time to first token and P90 time between tokens (a request's mean inter-token time).
SLO = {"ttft_p90_s": 30.0, "tbt_p90_s": 0.1}
PERCENTILES = (50, 90, 99)


def trace_setup(
    policy: str = "prompt_tree",
    instances: int = FIG10_INSTANCES,
    dram_tokens: int = FIG10_DRAM_TOKENS,
    model: str = TRACE_MODEL,
    hardware: str = TRACE_HARDWARE,
    tp: int = TRACE_TP,
    scheduler: str = "chunked",
    disk_tokens: int = 0,
) -> SimSetup:
    """``instances`` instances of ``model`` on ``tp`` x ``hardware`` each, every MemPool with
    a ``dram_tokens``-token DRAM tier below its HBM and a ``disk_tokens``-token disk tier below
    that, routed by ``policy``; tier moves priced at the hardware profile's links."""
    setup = gpu_setup(model, hardware, instances * tp, tp, policy, scheduler=scheduler)
    block = setup.engine_config.block_size
    sizes = {"dram_blocks": dram_tokens // block, "disk_blocks": disk_tokens // block}
    setup = setup.with_deployment(engine=replace(setup.engine_config, **sizes))
    setup.topology = replace(setup.topology, tiers=HardwareProfile.load(hardware).tiers)
    setup.describe = setup.describe | {
        "dram_tokens_per_instance": dram_tokens,
        "disk_tokens_per_instance": disk_tokens,
        "policy": policy,
    }
    return setup


def _pcts(values: Sequence[float], name: str) -> dict[str, float | None]:
    arr = np.asarray([v for v in values if v is not None], dtype=float)
    out: dict[str, float | None] = {f"{name}_mean": float(arr.mean()) if arr.size else None}
    for p in PERCENTILES:
        out[f"{name}_p{p}"] = float(np.percentile(arr, p)) if arr.size else None
    return out


def replay_trace(
    setup: SimSetup,
    config: str,
    trace: Trace,
    output_cap: int | None = None,
    progress: bool = True,
) -> dict:
    """Replay ``trace`` by its timestamps under ``config`` (outputs capped at ``output_cap``
    tokens when given); the summary (see the module docstring), the pools audited."""
    sessions, schedule = trace_sessions(trace, setup.model_config.vocab_size)
    cap = output_cap or math.inf

    def params_for(turn: Turn) -> SamplingParams:
        n = int(min(turn.max_tokens, cap))
        return SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True)

    cluster = setup.cluster(config)
    t0 = time.perf_counter()
    records = cluster.replay(
        sessions, 1.0, 0, config, progress, params_for, arrivals="open", schedule=schedule
    )
    wall = time.perf_counter() - t0
    cluster.check_pools()
    ok = [r for r in records if r["error"] is None]
    prompt = sum(r["prompt_tokens"] for r in ok)
    hit_rate = sum(r["cached_tokens"] for r in ok) / prompt if prompt else 0.0
    loads = [i.prefill_busy_s for i in cluster.instances if i.role == cluster.entry[0].role]
    mean_load = sum(loads) / len(loads)
    return {
        "config": config,
        "policy": setup.deployment.policy,
        "requests": len(records),
        "errors": len(records) - len(ok),
        "hit_rate": hit_rate,
        **_by_tier(cluster, hit_rate),
        "prefill_s_per_request": cluster.prefill_busy_s / max(len(ok), 1),
        "prefill_load_s": loads,
        "max_over_mean_load": max(loads) / mean_load if mean_load else None,
        "prefix_pushes": cluster.scheduler.num_transfers,
        **_pcts([r["ttft"] for r in ok], "ttft"),
        **_pcts([r["tpot"] for r in ok], "tbt"),
        "simulated_s": max((r["arrival"] + (r["jct"] or 0.0) for r in records), default=0.0),
        "wall_s": wall,
    }


def _by_tier(cluster, hit_rate: float) -> dict:
    """The hit rate split by the tier each hit came from (its share of the pools' hit tokens),
    and per tier the blocks demoted, promoted and dropped, summed over the instances."""
    counts: dict[str, Counter] = {}
    for inst in cluster.instances:
        for tier, c in inst.pool.tier_counters().items():
            counts.setdefault(tier, Counter()).update(c)
    hits = sum(c["hit_tokens"] for c in counts.values())
    moves = ("demoted_blocks", "promoted_blocks", "dropped_blocks", "write_refused")
    return {
        "hit_rate_by_tier": {
            t: hit_rate * c["hit_tokens"] / hits if hits else 0.0 for t, c in counts.items()
        },
        "tier_blocks": {t: {k: c[k] for k in moves if k in c} for t, c in counts.items()},
    }


def fig10(
    trace: Trace, policies: Sequence[str] = FIG10_POLICIES, progress: bool = True, **setup_kw
) -> list[dict]:
    """Mooncake's Fig. 10 setup (10 caching instances, 3M-token DRAM tiers, one-token outputs:
    prefill alone) under each routing policy; one summary per policy."""
    rows = []
    for policy in policies:
        row = replay_trace(trace_setup(policy, **setup_kw), "PD-CC", trace, FIG10_OUTPUT_CAP, False)
        rows.append(row)
        if progress:
            print(
                f"fig10 {policy}: hit {row['hit_rate']:.3f}, max/mean prefill load "
                f"{row['max_over_mean_load']:.2f}, TTFT p90 {row['ttft_p90']:.2f} s "
                f"({row['wall_s']:.0f} s)",
                flush=True,
            )
    return rows


def meets_slo(row: dict, slo: dict = SLO) -> bool:
    """Whether a replay's P90 TTFT and P90 TBT are within ``slo`` (a one-token run has no TBT)."""
    tbt = row["tbt_p90"]
    return (
        row["errors"] == 0
        and row["ttft_p90"] is not None
        and row["ttft_p90"] <= slo["ttft_p90_s"]
        and (tbt is None or tbt <= slo["tbt_p90_s"])
    )


def slo_capacity(
    path: str | Path | None,
    configs: Sequence[str],
    loads: Sequence[float],
    window: tuple[int, int | None] = (0, None),
    policy: str = "prompt_tree",
    progress: bool = True,
) -> dict:
    """Each config replayed at each load (the trace's request rate times it: its time scale
    is ``1 / load``) on the Fig. 10 cluster with full outputs; per config the highest load
    meeting :data:`SLO` (Mooncake's effective request capacity; None when none does)."""
    rows = []
    for load in sorted(loads):
        trace = load_trace(path, window=window, time_scale=1.0 / load)
        for config in configs:
            row = replay_trace(trace_setup(policy), config, trace, None, False)
            row |= {"load": load, "requests_per_s": len(trace.requests) / trace.duration}
            row["meets_slo"] = meets_slo(row)
            rows.append(row)
            if progress:
                print(
                    f"load x{load:g} {config}: hit {row['hit_rate']:.3f}, TTFT p90 "
                    f"{row['ttft_p90']:.2f} s, TBT p90 {1e3 * (row['tbt_p90'] or 0):.1f} ms, "
                    f"SLO {'met' if row['meets_slo'] else 'missed'} ({row['wall_s']:.0f} s)",
                    flush=True,
                )
    capacity = {}
    for config in configs:
        met = [r["load"] for r in rows if r["config"] == config and r["meets_slo"]]
        capacity[config] = max(met) if met else None
    return {"slo": SLO, "policy": policy, "rows": rows, "capacity": capacity}


def _write(result: dict, out_dir: str | Path, name: str, plot, progress: bool) -> dict:
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    path, png = out / f"{name}.json", out / f"{name}.png"
    plot(result, png)
    result["files"] = [str(path), str(png)]
    path.write_text(json.dumps(result, indent=1))
    if progress:
        print(f"wrote {path}, {png}")
    return result


def fig10_study(
    path: str | Path | None,
    out_dir: str | Path,
    window: tuple[int, int | None] = (0, None),
    progress: bool = True,
    policies: Sequence[str] = FIG10_ALL,
) -> dict:
    """:func:`fig10` under ``policies`` (by default every one, and ``prompt_tree_local``,
    which never moves a prefix: Mooncake's local cache) on the trace's ``window``; writes
    ``trace_fig10.json`` and its plot to ``out_dir``."""
    trace = load_trace(path, window=window)
    result = {
        "trace": str(trace.path),
        "window": list(window),
        "requests": len(trace.requests),
        "setup": trace_setup().describe | {"output_cap": FIG10_OUTPUT_CAP},
        "mooncake": {"local_hit": MOONCAKE_LOCAL_HIT, "global_hit": MOONCAKE_GLOBAL_HIT},
        "fig10": fig10(trace, policies, progress),
    }
    return _write(result, out_dir, "trace_fig10", plot_fig10, progress)


def tiers_row(trace: Trace, name: str, scale: float = 1.0, progress: bool = False) -> dict:
    """One :data:`TIER_STUDY` configuration on Fig. 10's cluster (``prompt_tree``, PD-CC,
    one-token outputs), tier moves priced; every tier's capacity, HBM's included, times
    ``scale`` (a window of the trace with caches as full as the whole hour's)."""
    dram, disk = (int(t * scale) for t in TIER_STUDY[name])
    setup = trace_setup("prompt_tree", dram_tokens=dram, disk_tokens=disk)
    setup.num_blocks = int(setup.num_blocks * scale)
    row = replay_trace(setup, "PD-CC", trace, FIG10_OUTPUT_CAP, progress)
    hbm = setup.num_blocks * setup.engine_config.block_size
    return {"tiers": name, "hbm_tokens": hbm, "dram_tokens": dram, "disk_tokens": disk} | row


def tiers_study(
    path: str | Path | None,
    out_dir: str | Path,
    window: tuple[int, int | None] = (0, None),
    progress: bool = True,
    names: Sequence[str] = tuple(TIER_STUDY),
    scale: float = 1.0,
) -> dict:
    """:func:`tiers_row` of each of ``names`` on the trace's ``window`` (capacities times
    ``scale``); writes ``trace_tiers.json`` and its plot (the hit rate by tier) to ``out_dir``."""
    trace = load_trace(path, window=window)
    rows = []
    for name in names:
        rows.append(tiers_row(trace, name, scale))
        if progress:
            r = rows[-1]
            print(
                f"tiers {name}: hit {r['hit_rate']:.3f}, prefill "
                f"{r['prefill_s_per_request']:.2f} GPU s/request, TTFT p50 {r['ttft_p50']:.2f} s, "
                f"p90 {r['ttft_p90']:.2f} s ({r['wall_s']:.0f} s)",
                flush=True,
            )
    result = {
        "trace": str(trace.path),
        "window": list(window),
        "requests": len(trace.requests),
        "setup": trace_setup().describe | {"output_cap": FIG10_OUTPUT_CAP},
        "capacity_scale": scale,
        "mooncake": {"global_hit": MOONCAKE_GLOBAL_HIT},
        "tiers": rows,
    }
    return _write(result, out_dir, "trace_tiers", plot_tiers, progress)


def plot_tiers(result: dict, png: Path) -> None:
    """The hit rate of each configuration, stacked by the tier the hits came from."""
    from matplotlib.figure import Figure  # lazy: slow to import, only plots need it

    fig = Figure(figsize=(6, 4), layout="tight")
    ax = fig.subplots()
    rows = result["tiers"]
    names = [r["tiers"] for r in rows]
    bottom = [0.0] * len(rows)
    for i, tier in enumerate(("hbm", "dram", "disk")):
        part = [r["hit_rate_by_tier"].get(tier, 0.0) for r in rows]
        ax.bar(names, part, bottom=bottom, color=f"C{i}", label=f"hit in {tier}")
        bottom = [b + p for b, p in zip(bottom, part)]
    ax.axhline(result["mooncake"]["global_hit"], ls="--", color="C3", label="Mooncake global")
    ax.set_ylabel("prompt tokens served from cache")
    ax.legend(fontsize=8)
    fig.suptitle(f"{Path(result['trace']).name}: {result['requests']} requests, 10 instances")
    fig.savefig(png, dpi=100)


def layouts_study(
    path: str | Path | None,
    out_dir: str | Path,
    configs: Sequence[str],
    loads: Sequence[float] = (1.0,),
    window: tuple[int, int | None] = (0, None),
    policy: str = "prompt_tree",
    progress: bool = True,
) -> dict:
    """:func:`slo_capacity` of ``configs`` on the trace's ``window``; writes
    ``trace_layouts.json`` and its plot (P90 TTFT and TBT against load) to ``out_dir``."""
    result = slo_capacity(path, configs, loads, window, policy, progress)
    result |= {"window": list(window), "setup": trace_setup(policy).describe}
    return _write(result, out_dir, "trace_layouts", plot_layouts, progress)


def plot_layouts(result: dict, png: Path) -> None:
    """P90 TTFT and P90 TBT of each config against load, with the objectives."""
    from matplotlib.figure import Figure  # lazy: slow to import, only plots need it

    fig = Figure(figsize=(10, 4), layout="tight")
    axes = fig.subplots(1, 2)
    configs = list(result["capacity"])
    for ax, key, slo in zip(axes, ("ttft_p90", "tbt_p90"), ("ttft_p90_s", "tbt_p90_s")):
        for c in configs:
            pts = [(r["load"], r[key]) for r in result["rows"] if r["config"] == c and r[key]]
            if pts:
                ax.plot(*zip(*pts), marker="o", label=c)
        ax.axhline(result["slo"][slo], ls=":", color="k", label="objective")
        ax.set_xlabel("load (x the trace's request rate)")
        ax.set_ylabel(f"{key.replace('_', ' ')} (s)")
        ax.set_yscale("log")
        ax.legend(fontsize=8)
    fig.suptitle(f"trace replay, window {result['window']}, policy {result['policy']}")
    fig.savefig(png, dpi=100)


def plot_fig10(result: dict, png: Path) -> None:
    """Hit rate and max/mean prefill load per policy, beside Mooncake's local and global."""
    from matplotlib.figure import Figure  # lazy: slow to import, only plots need it

    fig = Figure(figsize=(10, 4), layout="tight")
    hit_ax, load_ax = fig.subplots(1, 2)
    rows = result["fig10"]
    names = [r["policy"] for r in rows]
    hit_ax.bar(names, [r["hit_rate"] for r in rows], color="C0")
    m = result["mooncake"]
    hit_ax.axhline(m["local_hit"], ls=":", color="C3", label="Mooncake local cache")
    hit_ax.axhline(m["global_hit"], ls="--", color="C2", label="Mooncake global cache")
    hit_ax.set_ylabel("prompt tokens served from cache")
    hit_ax.legend(fontsize=8)
    load_ax.bar(names, [r["max_over_mean_load"] for r in rows], color="C1")
    load_ax.axhline(1.3, ls=":", color="k", label="1.3 x mean")
    load_ax.set_ylabel("max / mean prefill GPU time per instance")
    load_ax.legend(fontsize=8)
    for ax in (hit_ax, load_ax):
        ax.tick_params(axis="x", labelrotation=20, labelsize=8)
    fig.suptitle(f"{Path(result['trace']).name}: {result['requests']} requests, 10 instances")
    fig.savefig(png, dpi=100)
