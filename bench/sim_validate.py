"""The simulator against a real run: the default `minimemserve bench` and its simulation.

    python bench/sim_validate.py [--out DIR] [--cpu-model FILE] [--repeats N] [--sessions N]

Fits the CPU step model (real steps of the tiny preset on one thread, ~15 s; retaken when
disturbed) unless ``--cpu-model`` is given, then runs each configuration of the default
benchmark for real (process runtime, one core per instance, two colocated instances,
``prompt_tree`` routing), all of them in turn ``--repeats`` times (default 3), with a
calibration of the process runtime (~10 s) before the first real run and after each: its
per-step cost beyond the forward pass (decode batches on one instance alone), a lone
prefill's time against the model's, and how much longer a step takes while the other
instance computes (a prefill and a decode step, each timed beside the other's decodes and
beside its prefills; the simulator slows a step that starts beside another's by the factor
of the two steps' kinds). The machine is shared and its speed drifts from minute to minute,
so each real run is simulated (same sessions, same seed, same instance layout) with the mean
runtime cost and prefill speed of the calibrations just before and just after it, and the
median contention factors of all. Prints measured against predicted mean TTFT and mean JCT
per configuration (means over the repeats), with the ranking of each and how far the real
runs separate neighbouring configurations. 12-13 minutes. Writes ``sim_validate.json`` and
``sim_validate.png`` under ``--out``.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from dataclasses import asdict
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from minimemserve.config import EngineConfig
from minimemserve.deployment import DeploymentSpec
from minimemserve.disagg.runtime import ProcessCluster
from minimemserve.presets import preset_dir
from minimemserve.sampling import SamplingParams
from minimemserve.scheduler.global_scheduler import GlobalScheduler
from minimemserve.scheduler.local import STEP_POLICIES
from minimemserve.sim.cluster import Contention
from minimemserve.sim.profiles import FittedStepModel, StepShape, fit_cpu_steps, with_overhead
from minimemserve.sim.runner import CPU_INSTANCES, cpu_setup
from minimemserve.workloads.results import DEFAULT_CONFIGS, DEFAULT_RATE, DEFAULT_SESSIONS
from minimemserve_lab.compare import run_sim
from minimemserve_lab.harness import driver

METRICS = (("ttft_mean", "TTFT mean"), ("jct_mean", "JCT mean"))
TARGET_ERROR = 0.20  # the accuracy the simulator aims for on each mean


# Prompt length of every calibration request: about the bench's mean prompt, so the steps
# timed work on the bench's sizes of context.
CALIBRATION_PROMPT_TOKENS = 384
# Output tokens of the requests that measure the process runtime's per-step cost beyond the
# forward pass, and how many decode together on each instance while it is measured.
OVERHEAD_OUTPUT_TOKENS, OVERHEAD_BATCHES = 64, (1, 16)
# Contention: prompts timed on one instance, alone and while the other decodes or prefills,
# and requests decoding together there.
CONTENTION_PREFILLS, CONTENTION_DECODES = 5, 4
# What keeps the other instance prefilling meanwhile: a few prompts of nearly the tiny
# preset's whole 2048-token context, four chunks of the 512-token step budget each. Long
# ones, because the frontend's submit to a busy instance waits for its step to end: many
# short prompts would be prefilled as fast as they could be submitted.
BACKGROUND_PREFILLS, BACKGROUND_PROMPT_TOKENS = 4, 2040
FIRST_PROMPT_TOKEN = 3  # ids 0-2 are <unk>, <s>, </s> in the presets
BLOCK_SIZE = EngineConfig().block_size  # the session policy hashes a prompt's first block
# A step-model fit whose mean error exceeds this was disturbed (the machine is shared): it is
# retaken, up to FIT_TRIES fits in all, and the best one kept.
FIT_RETAKE_ERROR, FIT_TRIES = 0.10, 3
BOOTSTRAP = 2000  # resamples of the paired interval between two configurations


def measure_runtime_overhead(
    step_model: FittedStepModel,
    model_dir: str | Path | None = None,
) -> tuple[float, float]:
    """Seconds the process runtime adds beyond ``step_model``'s forward pass (its loop,
    scheduling and postprocess, control plane, the frontend), per step and per sequence in the
    step, for an instance alone on the machine: decodes of ``b`` requests on one one-core
    instance, for each ``b`` in :data:`OVERHEAD_BATCHES`; measured TPOT less the modelled step,
    fitted as ``per_step + per_row * b``. Either is negative where the fit over-estimates those
    steps (it is timed two at a time, and drifts), down to the fit's own coefficient. A step
    beside the other instance's is slowed by :func:`measure_contention`'s factors."""
    mdir = Path(model_dir or preset_dir("tiny"))
    params = SamplingParams(max_tokens=OVERHEAD_OUTPUT_TOKENS, temperature=0.0, ignore_eos=True)
    n = CALIBRATION_PROMPT_TOKENS
    ctx = n + OVERHEAD_OUTPUT_TOKENS // 2  # the mean context while decoding
    extra = []
    with ProcessCluster.of(mdir, "PD", cores_per_instance=1, num_colocated=1) as c:
        for b in OVERHEAD_BATCHES:
            for i in range(b):
                prompt = [FIRST_PROMPT_TOKEN + (i * 7 + j) % 1000 for j in range(n)]
                c.add_request(prompt, params, request_id=f"overhead-{b}-{i}")
            tpots = sorted(o.metrics.tpot for o in c.run_until_done())
            modelled = step_model.step_time(StepShape((), (ctx,) * b, b))
            extra.append(tpots[len(tpots) // 2] - modelled)
    # negative where the fit over-estimates these steps, but never below what it charges
    step, *_, row = step_model.coefs
    (b1, b2), (o1, o2) = OVERHEAD_BATCHES, extra
    per_row = max(-row, (o2 - o1) / (b2 - b1))
    return max(-step, o1 - per_row * b1), per_row


def measure_contention(model_dir: str | Path | None = None) -> tuple[Contention, float]:
    """How many times longer a step takes on one of the bench's two one-core instances while
    the other is in a step than while it idles, for each kind of step beside each kind (a
    :class:`Contention`), and a prefill's seconds while it idles. Timed side by side in one
    process-runtime cluster (the cores, their memory and the frontend are shared; prompts are
    steered to an instance by the ``session`` policy's hash of their first block): on the
    first instance, the median time to first token of :data:`CONTENTION_PREFILLS` prompts of
    :data:`CALIBRATION_PROMPT_TOKENS` tokens and the median time per output token of
    :data:`CONTENTION_DECODES` requests with prompts that long decoding together, alone, then
    while the second decodes that many such requests, then while it prefills a queue of long
    prompts (a phase whose background ended before its measurements did is reported)."""
    mdir = Path(model_dir or preset_dir("tiny"))
    one = SamplingParams(max_tokens=1, temperature=0.0, ignore_eos=True)
    dec = SamplingParams(max_tokens=OVERHEAD_OUTPUT_TOKENS, temperature=0.0, ignore_eos=True)
    long = SamplingParams(max_tokens=OVERHEAD_OUTPUT_TOKENS * 8, temperature=0.0, ignore_eos=True)
    n = CALIBRATION_PROMPT_TOKENS
    with ProcessCluster.of(
        mdir, "PD", cores_per_instance=1, num_colocated=CPU_INSTANCES, policy="session"
    ) as c:
        steer = _Steer(list(c.instances))
        prompt = steer.to(0, [FIRST_PROMPT_TOKEN + j % 1000 for j in range(n)])
        mine = [steer.to(0, _distinct(i, n)) for i in range(CONTENTION_DECODES)]
        backgrounds = {
            "alone": [],
            "decode": [(steer.to(1, _distinct(i, n, 7)), long) for i in range(CONTENTION_DECODES)],
            "prefill": [
                (steer.to(1, _distinct(i, BACKGROUND_PROMPT_TOKENS, 11)), one)
                for i in range(BACKGROUND_PREFILLS)
            ],
        }
        _run(c, [(prompt, one), (steer.to(1, prompt), one)], "warm-up")
        ttft, tpot = {}, {}
        for phase, background in backgrounds.items():
            started = [
                c.add_request(ids, p, request_id=f"{phase}-bg-{i}")
                for i, (ids, p) in enumerate(background)
            ]
            ttft[phase] = float(
                np.median(
                    [
                        _run(c, [(prompt, one)], f"{phase}-{k}")[0].metrics.ttft
                        for k in range(CONTENTION_PREFILLS)
                    ]
                )
            )
            outs = _run(c, [(ids, dec) for ids in mine], f"{phase}-decodes")
            tpot[phase] = float(np.median([o.metrics.tpot for o in outs]))
            running = [o for rid in started if (o := c.abort(rid)) is not None]
            if background and len(running) < 1:
                print(f"contention beside {phase}: the background ended before the measurements")
            c.run_until_done()
    ratio = lambda times, beside: max(1.0, times[beside] / times["alone"])
    contention = Contention(
        decode_beside_decode=ratio(tpot, "decode"),
        prefill_beside_decode=ratio(ttft, "decode"),
        decode_beside_prefill=ratio(tpot, "prefill"),
        prefill_beside_prefill=ratio(ttft, "prefill"),
    )
    return contention, ttft["alone"]


def _distinct(i: int, n: int, stride: int = 1) -> list[int]:
    """The ``i``-th of a family of ``n``-token prompts that share no block."""
    return [FIRST_PROMPT_TOKEN + (i * stride + j * (i + 1)) % 1000 for j in range(n)]


class _Steer:
    """Prompts for a chosen instance of a ``session``-routed cluster of ``names``: the first
    token is changed until the policy's route (asked of a scheduler of the same names) says
    that instance."""

    def __init__(self, names: list[str]) -> None:
        self.names = names
        self.router = GlobalScheduler(names, policy="session", block_size=BLOCK_SIZE)

    def to(self, index: int, prompt: list[int]) -> list[int]:
        """``prompt`` with a first token that routes it to instance ``index``."""
        for first in range(FIRST_PROMPT_TOKEN, FIRST_PROMPT_TOKEN + 1000):
            steered = [first, *prompt[1:]]
            if self.router.route(steered).instance == self.names[index]:
                return steered
        raise RuntimeError(f"no first token routes a prompt to {self.names[index]}")


def _run(c: ProcessCluster, requests: list[tuple[list[int], SamplingParams]], tag: str) -> list:
    """Add ``requests`` (prompt, params) and run them to the end; their outputs, in order."""
    rids = [c.add_request(ids, p, request_id=f"{tag}-{i}") for i, (ids, p) in enumerate(requests)]
    outs: dict = {}
    while not all(r in outs for r in rids):
        outs.update((o.request_id, o) for o in c.step())
    return [outs[r] for r in rids]


def parse_args() -> argparse.Namespace:
    """Command-line options."""
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default="bench/results/sim_validate")
    ap.add_argument("--cpu-model", default=None, help="fitted step model JSON (default: fit now)")
    ap.add_argument("--sessions", type=int, default=DEFAULT_SESSIONS)
    ap.add_argument("--rate", type=float, default=DEFAULT_RATE)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--configs", default=",".join(DEFAULT_CONFIGS))
    ap.add_argument(
        "--scheduler",
        choices=STEP_POLICIES,
        default="chunked",
        help="the local step policy of the real runs and their simulation",
    )
    ap.add_argument(
        "--repeats",
        type=int,
        default=3,
        help="real runs of each configuration, interleaved; means are averaged over them",
    )
    args = ap.parse_args()
    if args.repeats < 1:
        ap.error(f"--repeats must be >= 1, got {args.repeats}")
    return args


def real_run(config: str, args: argparse.Namespace, out: Path) -> tuple[dict, list[dict]]:
    """``config`` of the default benchmark, as ``minimemserve bench`` runs it; its summary and
    per-request records."""
    factories = driver.process_factories(
        [config],
        cores_per_instance=driver.CORES_PER_INSTANCE,
        num_colocated=driver.COLOCATED_INSTANCES,
        policy="prompt_tree",
        cost_model=None,
    )
    res = driver.run_bench(
        configs=[config],
        num_sessions=args.sessions,
        rate=args.rate,
        seed=args.seed,
        out_dir=out,
        options=DeploymentSpec(engine=EngineConfig(seed=args.seed, scheduler=args.scheduler)),
        factories=factories,
        runtime={"kind": "process", "policy": "prompt_tree"},
    )
    return res["summaries"][config], res["records"][config]


def calibrate(step_model: FittedStepModel) -> dict:
    """The process runtime's cost beyond ``step_model``, its prefill speed against the model's
    (the fit is taken once, the machine drifts) and its contention, now."""
    overhead = measure_runtime_overhead(step_model)
    contention, alone = measure_contention()
    modelled = with_overhead(step_model, *overhead).prefill_time(CALIBRATION_PROMPT_TOKENS)
    scale = alone / modelled
    factors = ", ".join(f"{k.replace('_', ' ')} {v:.2f}x" for k, v in asdict(contention).items())
    print(
        f"process runtime beyond the forward pass: {overhead[0] * 1e3:.2f} ms per step + "
        f"{overhead[1] * 1e3:.2f} ms per sequence; a lone prefill takes {scale:.2f}x the "
        f"model's time; contention: {factors}"
    )
    return {
        "runtime_overhead_s": overhead,
        "prefill_scale": scale,
        "contention": asdict(contention),
    }


def bracket(before: dict, after: dict, contention: Contention) -> dict:
    """The runtime's cost and prefill speed between two calibrations (their means: they drift
    with the machine), and ``contention``, that of all calibrations (each factor's median: it
    is the cores', and one measurement of a few steps each way is sometimes far off)."""
    steps = zip(before["runtime_overhead_s"], after["runtime_overhead_s"])
    return {
        "runtime_overhead_s": tuple((a + b) / 2 for a, b in steps),
        "prefill_scale": (before["prefill_scale"] + after["prefill_scale"]) / 2,
        "contention": contention,
    }


def fit_steps() -> FittedStepModel:
    """The CPU step model, timed in as many processes at once as the bench runs instances
    (the cores are shared); retaken while its mean error says a neighbour disturbed it."""
    fits = []
    while len(fits) < FIT_TRIES and (not fits or fits[-1].relative_error > FIT_RETAKE_ERROR):
        f = fit_cpu_steps(preset_dir("tiny"), concurrent=CPU_INSTANCES)
        print(f"CPU step model: {f.samples} steps, mean fit error {f.relative_error:.1%}")
        fits.append(f)
    return min(fits, key=lambda f: f.relative_error)


def ranking(summaries: dict, key: str) -> list[str]:
    """Configs from best (lowest) to worst on ``key``."""
    return sorted(summaries, key=lambda c: summaries[c][key])


def compare(real: dict, sim: dict) -> list[dict]:
    """One row per config: measured, predicted and relative error of each metric."""
    rows = []
    for c in real:
        row = {"config": c}
        for key, _ in METRICS:
            m, p = real[c][key], sim[c][key]
            row |= {f"{key}_measured": m, f"{key}_predicted": p, f"{key}_error": p / m - 1}
        rows.append(row)
    return rows


def paired_interval(a: list[dict], b: list[dict], key: str) -> tuple[float, float]:
    """95 % bootstrap interval of the mean of ``key`` in ``b`` less in ``a``, paired by
    repeat, session and turn (both ran the same requests): an interval that holds 0 says
    the runs do not tell which of the two is lower."""
    turn = lambda r: (r["repeat"], r["session"], r["turn"])
    by_turn = {turn(r): r[key] for r in a if r[key] is not None}
    diffs = np.array([r[key] - by_turn[turn(r)] for r in b if turn(r) in by_turn])  # [requests]
    rng = np.random.default_rng(0)
    means = diffs[rng.integers(0, len(diffs), (BOOTSTRAP, len(diffs)))].mean(axis=1)
    return tuple(np.quantile(means, [0.025, 0.975]))


def report(rows: list[dict], real: dict, sim: dict, records: dict) -> dict:
    """Print the side-by-side table and rankings, and how far the real runs separate each
    pair of neighbours in their ranking; return the rankings."""
    print(
        f"{'config':10}" + "".join(f"{n + ' meas':>16}{'pred':>10}{'error':>8}" for _, n in METRICS)
    )
    for r in rows:
        cells = "".join(
            f"{r[k + '_measured'] * 1e3:>13.1f} ms{r[k + '_predicted'] * 1e3:>7.1f} ms"
            f"{r[k + '_error']:>8.1%}"
            for k, _ in METRICS
        )
        print(f"{r['config']:10}{cells}")
    ranks = {}
    for key, name in METRICS:
        ranks[key] = {"measured": ranking(real, key), "predicted": ranking(sim, key)}
        same = "same" if ranks[key]["measured"] == ranks[key]["predicted"] else "different"
        print(f"{name} ranking, measured:  {' < '.join(ranks[key]['measured'])}")
        print(f"{name} ranking, predicted: {' < '.join(ranks[key]['predicted'])} ({same})")
        order, gaps = ranks[key]["measured"], []
        for lo, hi in zip(order, order[1:]):
            low, high = paired_interval(records[lo], records[hi], key.removesuffix("_mean"))
            gaps.append(f"{lo} to {hi} {low * 1e3:+.1f}..{high * 1e3:+.1f} ms")
        print(f"  measured neighbours, paired 95 % interval of the difference: {'; '.join(gaps)}")
    worst = max(abs(r[f"{k}_error"]) for r in rows for k, _ in METRICS)
    print(f"largest error {worst:.1%} (target ±{TARGET_ERROR:.0%})")
    return ranks


def plot(rows: list[dict], path: Path) -> None:
    """Measured against predicted bars per config, one panel per metric."""
    from matplotlib.figure import Figure

    fig = Figure(figsize=(10, 4), layout="tight")
    x = np.arange(len(rows))  # [configs]
    for ax, (key, name) in zip(fig.subplots(1, 2), METRICS):
        ax.bar(x - 0.2, [r[f"{key}_measured"] for r in rows], 0.4, label="measured")
        ax.bar(x + 0.2, [r[f"{key}_predicted"] for r in rows], 0.4, label="simulated")
        ax.set_xticks(x, [r["config"] for r in rows])
        ax.set_ylabel("seconds")
        ax.set_title(name)
        ax.legend()
    fig.suptitle("default minimemserve bench: real runs against the simulator (CPU step model)")
    fig.savefig(path, dpi=100)


def simulate_runs(runs, points, contention, fitted, args, out: Path) -> list[dict]:
    """The summary of each real run ``(repeat, config)`` simulated with the calibrations
    before and after it."""
    predicted = []
    for (k, c), before, after in zip(runs, points, points[1:]):
        setup = cpu_setup(fitted, **bracket(before, after, contention), scheduler=args.scheduler)
        predicted.append(
            run_sim(
                setup,
                [c],
                num_sessions=args.sessions,
                rate=args.rate,
                seed=args.seed,
                out_dir=out / "sim" / f"{c}-{k}",
                verbose=False,
            )["summaries"][c]
        )
    return predicted


def main() -> None:
    """Fit (or load), run for real, simulate, compare."""
    args = parse_args()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    configs = [c.strip() for c in args.configs.split(",") if c.strip()]
    t0 = time.perf_counter()
    if args.cpu_model:
        fitted = FittedStepModel.load(args.cpu_model)
    else:
        fitted = fit_steps()
        fitted.save(out / "sim_cpu_steps.json")
    load_before = os.getloadavg()
    # each configuration in turn, repeated; a calibration before the first real run and after
    # each, and each real run simulated with the two around it
    runs = [(k, c) for k in range(args.repeats) for c in configs]
    points, measured, records = [calibrate(fitted)], [], {c: [] for c in configs}
    for k, c in runs:
        summary, recs = real_run(c, args, out / "real" / f"{c}-{k}")
        measured.append(summary)
        records[c] += [r | {"repeat": k} for r in recs]
        points.append(calibrate(fitted))
    load_after = os.getloadavg()
    print(f"load average (1, 5, 15 min) before the real runs {load_before}, after {load_after}")
    factors = [p["contention"] for p in points]
    contention = Contention(**{k: float(np.median([f[k] for f in factors])) for k in factors[0]})
    predicted = simulate_runs(runs, points, contention, fitted, args, out)
    mean = lambda summaries, c: {
        key: float(np.mean([s[key] for (_, ck), s in zip(runs, summaries) if ck == c]))
        for key, _ in METRICS
    }
    real = {c: mean(measured, c) for c in configs}
    sim = {c: mean(predicted, c) for c in configs}
    rows = compare(real, sim)
    ranks = report(rows, real, sim, records)
    plot(rows, out / "sim_validate.png")
    result = {
        "rows": rows,
        "rankings": ranks,
        "step_model": fitted.__dict__,
        "calibrations": points,
        "runs": [
            {"repeat": k, "config": c, "measured": m, "predicted": p}
            for (k, c), m, p in zip(runs, measured, predicted)
        ],
        "load_average": {"before": load_before, "after": load_after},
        "wall_s": time.perf_counter() - t0,
    }
    (out / "sim_validate.json").write_text(json.dumps(result, indent=1))
    print(f"wrote {out / 'sim_validate.json'}, {out / 'sim_validate.png'}")


if __name__ == "__main__":
    main()
