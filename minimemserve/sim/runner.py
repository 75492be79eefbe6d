"""The four-configuration benchmark on a simulated cluster (``minimemserve sim``).

:func:`cpu_setup` reproduces the default ``minimemserve bench`` layout on this CPU (tiny
preset, two instances, a fitted step model); :func:`gpu_setup` builds ``gpus / tp``
instances of a model on a hardware profile with the roofline step model. :func:`run_sim`
replays a workload under each configuration and prints, writes and plots what
``minimemserve bench`` does; :func:`sweep` repeats it over request rates;
:func:`calibrate` compares the roofline with ``bench/gpu_steps.py`` measurements and
:func:`anchors` with published ones."""

from __future__ import annotations

import json
import math
import re
import time
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import Any

import torch

from minimemserve.config import EngineConfig, parse_config_name
from minimemserve.deployment import DeploymentSpec
from minimemserve.errors import ConfigError
from minimemserve.memory import DEFAULT_CPU_KV_BYTES
from minimemserve.model.config import ModelConfig
from minimemserve.model.tokenizer import Tokenizer
from minimemserve.presets import preset_dir
from minimemserve.scheduler.global_scheduler import Cost
from minimemserve.workloads.results import (
    DEFAULT_CONFIGS,
    caching_ratios,
    format_table,
    summarize,
    write_plots,
)
from minimemserve.workloads.sessions import make_workload, total_turns, workload_args

from .cluster import Contention, SimCluster, Topology
from .profiles import (
    DATA_DIR,
    FittedStepModel,
    HardwareProfile,
    Link,
    RooflineStepModel,
    StepCost,
    StepShape,
    load_model_shape,
    with_overhead,
)

# The paper's setup: Llama-2-13B, 8 x H800, tensor parallelism 2.
DEFAULT_MODEL, DEFAULT_HARDWARE, DEFAULT_GPUS, DEFAULT_TP = "llama2-13b", "h800", 8, 2
# The bench's equal-resources layout on the CPU: two instances of one core each.
CPU_INSTANCES = 2
# CPU KV link: the receiver's pool in shared memory, written by the sender (blocking). 16 GB/s
# and the control round trips (probe, alloc, commit, hand-over: ~0.3 ms each on loopback)
# from bench/transfer.py's shared-memory by-request-aggregated row and the RPC tests here.
CPU_LINK = Link(gb_per_s=16.0, latency_us=0.0, sender_blocks=True, setup_us=600.0)
# A GPU instance's batch limits: vLLM's default sequence cap, and a token budget that holds
# a whole Llama-2 prompt in one step (no chunking, as MemServe's vLLM base).
GPU_MAX_NUM_SEQS, GPU_MAX_BATCHED_TOKENS = 256, 4096
GPU_DTYPE = torch.bfloat16
# What tables, JSON and plots call a closed replay and a finite run (``--arrivals open``).
STEADY_LABEL, FINITE_LABEL = "closed loop", "finite run (not steady state)"
_PREFILL_NAME = re.compile(r"prefill (\d+)x(\d+)(?: after (\d+) cached)?")
_MIXED_NAME = re.compile(r"mixed (\d+)x(\d+)")


@dataclass
class SimSetup:
    """Everything but the config name that a :class:`SimCluster` is built from: the
    ``deployment`` simulated (its engines' config, its routing policy and cost model; its
    configuration name is each cluster's), the hardware (step model, topology, blocks, dtype,
    instances) and how KV moves."""

    model_config: ModelConfig
    step_model: Any  # FittedStepModel or RooflineStepModel
    topology: Topology
    deployment: DeploymentSpec
    num_blocks: int
    dtype: torch.dtype
    instances: int
    transfer_mode: str = "by_request_aggregated"
    tokenizer_dir: Path = field(default_factory=lambda: Path(preset_dir("tiny")))
    describe: dict = field(default_factory=dict)

    @property
    def engine_config(self) -> EngineConfig:
        """Every simulated instance's engine config."""
        return self.deployment.engine

    @property
    def cost(self) -> Cost | None:
        """The routing cost model (None: prompt tokens)."""
        return self.deployment.cost_model

    def with_deployment(self, **changes: Any) -> SimSetup:
        """This setup with the deployment's fields ``changes`` (``policy``, ``engine``...)."""
        return replace(self, deployment=replace(self.deployment, **changes))

    def cluster(self, config: str) -> SimCluster:
        """A fresh simulated cluster of ``config``."""
        d = self.deployment
        return SimCluster(
            config,
            model_config=self.model_config,
            step_time=self.step_model.step_time,
            decode_times=self.step_model.decode_times,
            topology=self.topology,
            spec=d,
            num_blocks=self.num_blocks,
            dtype=self.dtype,
            instances=self.instances,
            transfer_mode=self.transfer_mode,
        )


def with_costs(
    setup: SimSetup,
    step_ms: float | None = None,
    prefill_speed: float = 1.0,
    decode_speed: float = 1.0,
) -> SimSetup:
    """``setup`` (a GPU one) with its roofline's fixed cost per step set to ``step_ms``
    milliseconds (None: the hardware profile's ``step_overhead_ms``) and its prefill and
    decode work ``prefill_speed`` and ``decode_speed`` times as fast
    (:class:`~minimemserve.sim.profiles.RooflineStepModel`); the routing cost model prices
    steps by the same roofline, as one fitted on that hardware would."""
    roof = setup.step_model
    hw = roof.hw if step_ms is None else replace(roof.hw, step_overhead_ms=float(step_ms))
    step_model = RooflineStepModel(
        hw, roof.shape, roof.tp, roof.dtype_bytes, prefill_speed, decode_speed
    )
    costs = {"step_ms": hw.step_overhead_ms, "prefill_speed": prefill_speed}
    costs["decode_speed"] = decode_speed
    cost = setup.cost
    if isinstance(cost, StepCost):
        cost = StepCost(step_model, cost.link, cost.kv_bytes_per_token, cost.block_size)
    setup = setup.with_deployment(cost_model=cost)
    return replace(setup, step_model=step_model, describe={**setup.describe, **costs})


def cpu_setup(
    step_model: FittedStepModel,
    model_dir: str | Path | None = None,
    policy: str = "prompt_tree",
    runtime_overhead_s: tuple[float, float] = (0.0, 0.0),
    contention: Contention | float = 1.0,
    scheduler: str = "chunked",
    prefill_scale: float = 1.0,
    handoff: str = "overlap",
) -> SimSetup:
    """The default ``minimemserve bench`` layout: tiny preset (or ``model_dir``), fp32, the
    bench's engine options, two one-core instances, the token-count routing cost; each step
    costs ``runtime_overhead_s`` = (per step, per sequence) more than ``step_model`` says (the
    process runtime's alone on the machine, measured by ``bench/sim_validate.py``), a step that
    starts while the other instance computes longer by ``contention`` (a :class:`Contention`
    by the kinds of the two steps, or one factor), and every step with prefill work
    ``prefill_scale`` times as long as the fit says (all measured there too)."""
    mdir = Path(model_dir or preset_dir("tiny"))
    step_model = with_overhead(step_model, *runtime_overhead_s)
    step_model = replace(step_model, prefill_scale=prefill_scale)
    mc = ModelConfig.from_hf(mdir)
    cfg = EngineConfig(scheduler=scheduler, handoff=handoff)
    block_bytes = 2 * mc.num_hidden_layers * cfg.block_size * mc.num_key_value_heads * mc.head_dim
    blocks = DEFAULT_CPU_KV_BYTES // (block_bytes * torch.float32.itemsize)
    topo = Topology(
        CPU_LINK,
        CPU_LINK,
        calls_wait_for_steps=True,
        contention=contention,
    )
    describe = {
        "kind": "cpu",
        "model_dir": str(mdir),
        "step_model": asdict(step_model),
        "runtime_overhead_s": runtime_overhead_s,
        "contention": asdict(topo.contention),
        "prefill_scale": prefill_scale,
        "instances": CPU_INSTANCES,
        "scheduler": scheduler,
        "handoff": handoff,
    }
    return SimSetup(
        mc,
        step_model,
        topo,
        DeploymentSpec(model=mdir, engine=cfg, policy=policy),
        blocks,
        torch.float32,
        CPU_INSTANCES,
        tokenizer_dir=mdir,
        describe=describe,
    )


def gpu_setup(
    model: str,
    hardware: str,
    gpus: int,
    tp: int,
    policy: str = "prompt_tree",
    transfer_mode: str = "by_request_aggregated",
    max_num_seqs: int = GPU_MAX_NUM_SEQS,
    max_batched_tokens: int = GPU_MAX_BATCHED_TOKENS,
    scheduler: str = "chunked",
    handoff: str = "overlap",
) -> SimSetup:
    """``gpus // tp`` instances of ``model`` on ``hardware`` with the roofline step model."""
    if not isinstance(gpus, int) or gpus < 1 or gpus % tp:
        raise ConfigError(f"--gpus must be a positive multiple of --tp {tp}, got {gpus}")
    hw, mc = HardwareProfile.load(hardware), load_model_shape(model)
    roof = RooflineStepModel(hw, mc, tp, GPU_DTYPE.itemsize)
    cfg = EngineConfig(
        max_num_seqs=max_num_seqs,
        max_num_batched_tokens=max_batched_tokens,
        scheduler=scheduler,
        # layers streamed during the step that computes them need no later hand-off
        handoff="inline" if transfer_mode == "by_layer" else handoff,
    )
    blocks = roof.kv_blocks(cfg.block_size)
    nvlink = hw.links["nvlink"]
    topo = Topology(nvlink, hw.link(False), tp, int(hw.gpus_per_node))
    cost = StepCost(roof, nvlink, roof.kv_bytes_per_token // tp, cfg.block_size)
    describe = {
        "kind": "gpu",
        "model": model,
        "hardware": hw.name,
        "gpus": gpus,
        "tp": tp,
        "kv_blocks_per_instance": blocks,
        "weights_gb": roof.weight_bytes / 1e9,
        "scheduler": scheduler,
        "handoff": cfg.handoff,
    }
    return SimSetup(
        mc,
        roof,
        topo,
        DeploymentSpec(engine=cfg, policy=policy, cost_model=cost),
        blocks,
        GPU_DTYPE,
        gpus // tp,
        transfer_mode,
        describe=describe,
    )


def workload_sessions(
    setup: SimSetup, workload: str, n: int, seed: int, max_turns, max_out, max_context
) -> list:
    """``n`` sessions of ``workload`` in ``setup``'s tokens, within the model's context."""
    context = min(max_context or math.inf, setup.model_config.max_position_embeddings)
    tok = Tokenizer.from_dir(setup.tokenizer_dir)
    return make_workload(
        workload, tok, n, int(context), seed, max_turns=max_turns, max_output_tokens=max_out
    )


def regime_label(arrivals: str) -> str:
    """What a replay with ``arrivals`` measures, as tables, JSON and plots call it."""
    return STEADY_LABEL if arrivals == "closed" else FINITE_LABEL


def role_stats(cluster: SimCluster, counters: dict[str, tuple] | None = None) -> dict[str, dict]:
    """Per role of ``cluster``'s instances: how many, their seconds in steps, and their
    decode rows with the row-weighted mean decode batch and KV length (what a bound on a
    layout's gain is computed from, ``minimemserve_lab.bound``); from ``counters`` by instance name
    (``SimInstance.counters``; default: each instance's own so far)."""
    out: dict[str, dict] = {}
    for inst in cluster.instances:
        busy, _, rows, b, c = counters[inst.name] if counters else inst.counters()
        r = out.setdefault(
            inst.role.value, dict.fromkeys(("instances", "busy_s", "rows", "b", "c"), 0)
        )
        r["instances"] += 1
        r["busy_s"] += busy
        r["rows"] += rows
        r["b"] += b
        r["c"] += c
    return {
        role: {
            "instances": r["instances"],
            "busy_s": r["busy_s"],
            "decode_rows": r["rows"],
            "decode_batch": r["b"] / r["rows"] if r["rows"] else 0.0,
            "decode_context": r["c"] / r["rows"] if r["rows"] else 0.0,
        }
        for role, r in out.items()
    }


def window_stats(cluster: SimCluster) -> dict | None:
    """The work between the two marks of a replay's ``window`` (``SimCluster.marks``): its
    seconds, the share of busy time in steps with prefill work, and :func:`role_stats` over
    it; None without two marks."""
    if len(cluster.marks) != 2:
        return None
    (t0, a), (t1, b) = cluster.marks
    diff = {name: tuple(y - x for x, y in zip(a[name], b[name])) for name in a}
    busy = sum(d[0] for d in diff.values())
    return {
        "seconds": t1 - t0,
        "prefill_share": sum(d[1] for d in diff.values()) / busy if busy else 0.0,
        "roles": role_stats(cluster, diff),
    }


def simulate(
    setup: SimSetup,
    configs: Sequence[str],
    sessions,
    rate: float,
    seed: int,
    progress: bool = True,
    arrivals: str = "closed",
    stop_unstable: bool = False,
    window: tuple[int, int] | None = None,
) -> tuple[dict, dict]:
    """Replay ``sessions`` under each config (``arrivals``, ``stop_unstable`` and ``window``:
    ``SimCluster.replay``'s); ``(records by config, run stats by config)``, the stats saying
    whether the run ``stopped`` at its window's end and, with a ``window``, the work within it
    (:func:`window_stats`). Every instance's pool is audited after each run."""
    if not (isinstance(rate, (int, float)) and math.isfinite(rate) and rate > 0):
        raise ConfigError(f"rate must be a finite number > 0, got {rate!r}")
    records, stats = {}, {}
    for config in configs:
        cluster = setup.cluster(config)
        t0 = time.perf_counter()
        records[config] = cluster.replay(
            sessions,
            rate,
            seed,
            config,
            progress,
            arrivals=arrivals,
            stop_unstable=stop_unstable,
            window=window,
        )
        wall = time.perf_counter() - t0
        cluster.check_pools()
        ends = [r["arrival"] + (r["jct"] or 0.0) for r in records[config]]
        if cluster.stopped:
            ends.append(cluster.now)
        front = cluster.frontend
        stats[config] = {
            "wall_s": wall,
            "simulated_s": max(ends, default=0.0),
            "stopped": cluster.stopped,
            "steps": cluster.steps,
            "run_steps": cluster.run_steps,
            "steps_per_s": cluster.steps / wall if wall else None,
            "transfers": cluster.net.transfers,
            "prefix_pushes": cluster.scheduler.num_transfers,
            "prefill_share": cluster.prefill_busy_s / cluster.busy_s if cluster.busy_s else 0.0,
            "decode_stall_s": cluster.decode_stall_s / max(len(records[config]), 1),
            "instances": [f"{i.name}:{i.role}" for i in cluster.instances],
            "route_us_mean": 1e6 * front.route_wall_s / max(front.route_calls, 1),
            "dispatches": dict(cluster.scheduler.dispatches),
            "roles": role_stats(cluster),
            "window": window_stats(cluster),
        }
    return records, stats


# What a simulated workload is made of, with the defaults ``run_sim`` takes for them.
SIM_WORKLOAD_ARGS = {
    "workload": "sharegpt",
    "num_sessions": 16,
    "rate": 1.0,
    "seed": 0,
    "max_turns": None,
    "max_output_tokens": None,
    "max_context": None,
}


def run_sim(
    setup: SimSetup,
    configs: Sequence[str] = DEFAULT_CONFIGS,
    *,
    out_dir: str | Path | None = None,
    progress: bool = True,
    verbose: bool = True,
    tag: str = "sim",
    arrivals: str = "closed",
    **workload: Any,
) -> dict:
    """Simulate a workload (``workload``: :data:`SIM_WORKLOAD_ARGS`) under ``configs`` and compare
    them as ``minimemserve bench`` does: prints the table; with ``out_dir``, writes
    ``<tag>_<workload>.json`` and its bar and CDF plots there. ``arrivals="open"`` or
    ``"paced"``: a finite run (``SimCluster.replay``), labelled :data:`FINITE_LABEL` in the
    table, JSON and plots."""
    for c in configs:
        parse_config_name(c)
    w = workload_args(workload, SIM_WORKLOAD_ARGS)
    workload, rate, seed = w["workload"], w["rate"], w["seed"]
    sessions = workload_sessions(
        setup,
        workload,
        w["num_sessions"],
        seed,
        w["max_turns"],
        w["max_output_tokens"],
        w["max_context"],
    )
    records, stats = simulate(setup, configs, sessions, rate, seed, progress, arrivals)
    summaries = {c: summarize(records[c]) for c in configs}
    regime = regime_label(arrivals)
    result = {
        "setup": {
            "workload": workload,
            "arrivals": arrivals,
            "regime": regime,
            "sessions": len(sessions),
            "turns": total_turns(sessions),
            "rate": rate,
            "seed": seed,
            "configs": list(configs),
            **setup.describe,
        },
        "summaries": summaries,
        "ttft_later_ratio": caching_ratios(summaries),
        "sim_stats": stats,
        "records": records,
        "files": [],
    }
    if verbose:
        for c, s in stats.items():
            print(
                f"{c}: {s['simulated_s']:.1f} simulated s in {s['wall_s']:.2f} s "
                f"({s['steps']} steps, {s['steps_per_s']:.0f} steps/s), pools balanced"
            )
        print(f"{regime}:\n{format_table(summaries)}")
    if out_dir is not None:
        out = Path(out_dir)
        out.mkdir(parents=True, exist_ok=True)
        title = f"simulated {workload}: {len(sessions)} sessions, {rate} sessions/s, {regime}"
        pngs = write_plots(records, summaries, out / f"{tag}_{workload}", title=title)
        path = out / f"{tag}_{workload}.json"
        result["files"] = [str(path), *map(str, pngs)]
        path.write_text(json.dumps(result, indent=1))
        if verbose:
            print("wrote " + ", ".join(result["files"]))
    return result


def sweep(
    setup: SimSetup,
    configs: Sequence[str],
    workload: str,
    num_sessions: int,
    rates: Sequence[float],
    seed: int = 0,
    out_dir: str | Path | None = None,
    progress: bool = True,
    arrivals: str = "closed",
    **workload_kw,
) -> dict:
    """Mean and P99 JCT and TTFT of each config against the request rate (``arrivals``:
    ``SimCluster.replay``'s); with ``out_dir``, writes them (JSON) and one plot there."""
    sessions = workload_sessions(
        setup,
        workload,
        num_sessions,
        seed,
        workload_kw.get("max_turns"),
        workload_kw.get("max_output_tokens"),
        workload_kw.get("max_context"),
    )
    rows = []
    for rate in rates:
        records, _ = simulate(setup, configs, sessions, rate, seed, False, arrivals)
        for c in configs:
            s = summarize(records[c])
            rows.append(
                {
                    "rate": rate,
                    "config": c,
                    **{
                        k: s[k]
                        for k in (
                            "ttft_mean",
                            "ttft_p99",
                            "jct_mean",
                            "jct_p99",
                            "cached_ratio",
                            "errors",
                        )
                    },
                }
            )
            if progress:
                print(
                    f"rate {rate:g}/s {c}: JCT mean {s['jct_mean']:.3f} s, "
                    f"TTFT mean {s['ttft_mean']:.3f} s"
                )
    if out_dir is None:
        return {"rows": rows, "files": []}
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    png = out / f"sim_{workload}_sweep.png"
    regime = regime_label(arrivals)
    _plot_sweep(rows, configs, png, f"simulated {workload}, {regime}, {setup.describe}")
    path = out / f"sim_{workload}_sweep.json"
    meta = {**setup.describe, "arrivals": arrivals, "regime": regime}
    path.write_text(json.dumps({"setup": meta, "rows": rows}, indent=1))
    return {"rows": rows, "files": [str(path), str(png)]}


def _plot_sweep(rows: list[dict], configs: Sequence[str], png: Path, title: str) -> None:
    from matplotlib.figure import Figure  # slow to import: only plots need it

    fig = Figure(figsize=(12, 8), layout="tight")
    axes = fig.subplots(2, 2)
    for ax, key in zip(axes.flat, ("jct_mean", "jct_p99", "ttft_mean", "ttft_p99")):
        for c in configs:
            pts = [(r["rate"], r[key]) for r in rows if r["config"] == c and r[key] is not None]
            ax.plot(*zip(*pts), marker="o", label=c) if pts else None
        ax.set_xlabel("session arrival rate (1/s)")
        ax.set_ylabel(f"{key.replace('_', ' ')} (s)")
        ax.legend()
    fig.suptitle(title[:150], fontsize=9)
    fig.savefig(png, dpi=100)


# --------------------------------------------------------------------------- roofline checks


def steps_shape(step: dict) -> StepShape:
    """The :class:`StepShape` of one ``bench/gpu_steps.py`` result row."""
    name, prefills = step["shape"], ()
    if m := _PREFILL_NAME.fullmatch(name):
        prefills = ((int(m.group(3) or 0), int(m.group(2))),) * int(m.group(1))
    elif m := _MIXED_NAME.match(name):
        prefills = ((0, int(m.group(2))),) * int(m.group(1))
    decodes = (int(step["context"]),) * int(step.get("decodes", 0))
    if not prefills and not decodes:
        raise ConfigError(f"cannot read the step shape {name!r}")
    return StepShape(prefills, decodes, len(prefills) + len(decodes))


def calibrate(path: str | Path, hardware: str = "h200") -> list[dict]:
    """Measured (``bench/gpu_steps.py`` JSON, e.g. from ``scripts/gpu-check.sh``) against the
    roofline's predicted step times on ``hardware``; prints and returns the rows."""
    try:
        report = json.loads(Path(path).read_text())
        sizes, steps = report["model"], report["steps"]
    except (OSError, json.JSONDecodeError, KeyError, TypeError) as e:
        raise ConfigError(f"{path}: not a bench/gpu_steps.py result ({e})") from None
    dtype_bytes = {"bfloat16": 2, "float16": 2, "float32": 4}.get(report.get("dtype"), 2)
    roof = RooflineStepModel(HardwareProfile.load(hardware), ModelConfig(**sizes), 1, dtype_bytes)
    rows = []
    print(
        f"{report.get('device', '?')} ({'dry run' if report.get('dry_run') else 'GPU'}) "
        f"against the {roof.hw.name} roofline"
    )
    print(f"{'shape':36}{'measured ms':>13}{'predicted ms':>14}{'error':>8}")
    for step in steps:
        pred = roof.step_time(steps_shape(step)) * 1e3
        meas = float(step["step_ms_median"])
        rows.append(
            {
                "shape": step["shape"],
                "measured_ms": meas,
                "predicted_ms": pred,
                "error": pred / meas - 1,
            }
        )
        print(f"{step['shape']:36}{meas:>13.2f}{pred:>14.2f}{pred / meas - 1:>8.0%}")
    return rows


def _prefill(roof: RooflineStepModel, b: int, x: int, out: int) -> float:
    return roof.step_time(StepShape(((0, x),) * b, (), b))


def _latency(roof: RooflineStepModel, b: int, x: int, out: int) -> float:
    decodes = (roof.step_time(StepShape((), (x + i,) * b, b)) for i in range(1, out))
    return _prefill(roof, b, x, out) + sum(decodes)


def _dense(roof: RooflineStepModel, b: int, x: int, out: int) -> float:
    parts = roof.parts(StepShape(((0, x),) * b, (), 0))
    return parts["linear"] + parts["elementwise"]


# How each kind of published measurement is predicted (see ``data/anchors.json``'s note):
# the batch's prefill, that and ``output - 1`` decode steps, or a pass's dense operators.
ANCHOR_KINDS = {"prefill": _prefill, "latency": _latency, "dense": _dense}


def anchor_time(roof: RooflineStepModel, a: dict) -> float:
    """Predicted seconds of one published measurement ``a`` (see ``data/anchors.json``)."""
    if a["kind"] not in ANCHOR_KINDS:
        raise ConfigError(f"unknown anchor kind {a['kind']!r}; known: {sorted(ANCHOR_KINDS)}")
    return ANCHOR_KINDS[a["kind"]](roof, int(a["batch"]), int(a["input"]), int(a["output"]))


def anchors(path: str | Path = DATA_DIR / "anchors.json") -> list[dict]:
    """Every published measurement against the roofline's prediction; prints the table
    (for whole requests also per output token) and each source's range of errors."""
    data = json.loads(Path(path).read_text())
    rows = []
    print(
        f"{'hardware':9}{'model':11}{'TP':>3}{'kind':>8}{'batch':>6}{'in':>6}{'out':>6}"
        f"{'published':>11}{'predicted':>11}{'per token':>17}{'error':>7}  source"
    )
    for a in data["anchors"]:
        roof = RooflineStepModel(
            HardwareProfile.load(a["hardware"]), load_model_shape(a["model"]), int(a["tp"])
        )
        pred = anchor_time(roof, a) * 1e3
        rows.append({**a, "predicted_ms": pred, "error": pred / a["ms"] - 1})
        out = int(a["output"])
        per = f"{a['ms'] / out:6.2f} /{pred / out:6.2f}" if a["kind"] == "latency" else ""
        print(
            f"{a['hardware']:9}{a['model']:11}{a['tp']:>3}{a['kind']:>8}{a['batch']:>6}"
            f"{a['input']:>6}{out:>6}{a['ms']:>11.1f}{pred:>11.1f}{per:>17}"
            f"{pred / a['ms'] - 1:>7.0%}  {a['source']} {a['framework']}"
        )
    groups: dict[tuple, list[float]] = {}
    for r in rows:
        key = (r["hardware"], r["model"], r["source"], r["framework"], r["kind"])
        groups.setdefault(key, []).append(r["error"])
    print("\nerror range per source (hardware, model, source, framework, kind: rows, min..max)")
    for key, errs in groups.items():
        print(f"  {', '.join(key)}: {len(errs)}, {min(errs):+.0%}..{max(errs):+.0%}")
    return rows
