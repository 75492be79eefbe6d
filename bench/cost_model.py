"""Fit the prefill cost model on this engine and device, and check it on held-out prefills.

    python bench/cost_model.py                  # tiny preset, fp32, CPU, 1 torch thread
    python bench/cost_model.py --threads 2 --lengths 64 256 1024 --repeats 5

- Profiles real prefill steps of a PD-CC engine (the cached prefix is really matched in
  the pool) for every prompt length x cached fraction; linear layers and the attention
  backend are timed by hooks, ``other`` is the rest of the step (median-total repeat).
- Fits ``CostModel`` on every other sample (alternating through the grid, lengths outer)
  and reports the relative error of ``exec(x, y)`` against the measured step time on the
  other half, per operator class too. The model saved in the JSON is refitted on all
  samples; the half-fit is saved beside it.
- ``transfer(n)`` is fitted from ``bench/results/transfer.json`` (bench/transfer.py) when
  it is there: its shm, one-send-per-aggregated-block, load-1 row.

Prints the coefficients and a table; writes ``bench/results/cost_model.json`` (the model
loads with ``CostModel.load``) and ``cost_model.png`` (predicted vs measured, and
``exec(x, y)`` curves).
"""

from __future__ import annotations

import argparse
import json
import math
import os
import platform
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from minimemserve.config import EngineConfig
from minimemserve.engine import Engine
from minimemserve.presets import preset_dir
from minimemserve.scheduler.cost_model import CostModel, OpSample
from minimemserve_lab.harness.profile import load_transfer_samples, profile

RESULTS = Path(__file__).resolve().parent / "results"
# The tiny preset holds 2048 positions: the longest prompt leaves room for one output token.
DEFAULT_LENGTHS = (64, 128, 256, 512, 1024, 1536, 2047)
DEFAULT_FRACTIONS = (0.0, 0.25, 0.5, 0.75, 0.9)
CURVE_FRACTIONS = (0.0, 0.5, 0.9)
PARTS = ("linear", "attention", "other")


def parse_args() -> argparse.Namespace:
    """Command-line options; at least two (length, fraction) points are required."""
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--lengths", type=int, nargs="+", default=list(DEFAULT_LENGTHS))
    p.add_argument("--fractions", type=float, nargs="+", default=list(DEFAULT_FRACTIONS))
    p.add_argument("--repeats", type=int, default=3, help="runs per point (median kept)")
    p.add_argument("--threads", type=int, default=1, help="torch CPU threads")
    p.add_argument("--device", default="cpu")
    p.add_argument("--dtype", default="float32")
    p.add_argument("--model", default=None, help="checkpoint dir (default: tiny preset)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--transfer-json", type=Path, default=RESULTS / "transfer.json")
    p.add_argument("--out", type=Path, default=RESULTS / "cost_model.json")
    a = p.parse_args()
    if len(a.lengths) * len(a.fractions) < 2:
        p.error("need at least two (length, fraction) points: one to fit, one to check")
    return a


def build_engine(args: argparse.Namespace) -> Engine:
    """A PD-CC engine whose token budget takes the longest prompt in one step."""
    longest = max(args.lengths)
    block_size = EngineConfig().block_size
    blocks = 2 * math.ceil((longest + 1) / block_size) + 4  # a prompt and its cached prefix
    cfg = EngineConfig(max_num_batched_tokens=longest, num_blocks=blocks, seed=args.seed)
    model_dir = args.model or preset_dir("tiny")
    return Engine(
        model_dir, config="PD-CC", device=args.device, dtype=args.dtype, engine_config=cfg
    )


def measured(s: OpSample) -> dict[str, float]:
    """Measured seconds of each part (linear, attention, other) of a sample."""
    return {"linear": s.linear_s, "attention": s.attention_s, "other": s.other_s}


def rel_errors(model: CostModel, samples: list[OpSample]) -> dict[str, dict[str, float]]:
    """Mean and max relative error of each part and of the total over ``samples``."""
    errs: dict[str, list[float]] = {k: [] for k in (*PARTS, "total")}
    for s in samples:
        pred = model.parts(s.x, s.y)
        for k, v in measured(s).items():
            errs[k].append(abs(pred[k] - v) / v)
        errs["total"].append(abs(sum(pred.values()) - s.total_s) / s.total_s)
    return {k: {"mean": statistics.fmean(v), "max": max(v)} for k, v in errs.items()}


def print_report(model: CostModel, half: CostModel, samples, fit_idx, errors) -> None:
    """Print the coefficients, every sample against the half-fit's prediction, and the
    half-fit's relative errors."""
    print("\ncoefficients (fitted on all samples; seconds):")
    print(f"  linear     a*n + b:               {_coefs(model.linear)}")
    print(f"  attention  a*x²y + b*x² + c*x + d: {_coefs(model.attention)}")
    print(f"  other      a*n + b:               {_coefs(model.other)}")
    print(
        f"  transfer   a*bytes + b:           {_coefs(model.transfer_coef)}"
        f"  (kv bytes/token {model.kv_bytes_per_token})"
    )
    head = (
        f"{'x':>5} {'y':>6} {'new':>5} {'linear':>8} {'attn':>8} {'other':>8} {'total':>8} "
        f"{'pred':>8} {'err':>7}  set"
    )
    print("\nmeasured vs predicted by the half-fit (ms):")
    print(head)
    print("-" * len(head))
    for i, s in enumerate(samples):
        pred = half.exec(s.x, s.y)
        err = (pred - s.total_s) / s.total_s
        print(
            f"{s.x:>5} {s.y:>6.3f} {s.new_tokens:>5} {s.linear_s * 1e3:>8.2f} "
            f"{s.attention_s * 1e3:>8.2f} {s.other_s * 1e3:>8.2f} {s.total_s * 1e3:>8.2f} "
            f"{pred * 1e3:>8.2f} {err:>+7.1%}  {'fit' if i in fit_idx else 'held-out'}"
        )
    print("\nrelative error of the half-fit (mean / max):")
    print(f"{'':>10} " + " ".join(f"{k:>17}" for k in (*PARTS, "total")))
    for split, e in errors.items():
        cells = " ".join(f"{e[k]['mean']:>8.1%} /{e[k]['max']:>7.1%}" for k in (*PARTS, "total"))
        print(f"{split:>10} {cells}")


def _coefs(c) -> str:
    return "  ".join(f"{v:+.4e}" for v in c)


def plot(path: Path, half: CostModel, samples: list[OpSample], fit_idx: set[int]) -> Path:
    """Predicted vs measured step time, and exec(x, y) curves over the measured points."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(11, 4.5))
    for label, keep, marker in (("fit", True, "o"), ("held-out", False, "x")):
        pts = [s for i, s in enumerate(samples) if (i in fit_idx) == keep]
        ax1.scatter(
            [s.total_s * 1e3 for s in pts],
            [half.exec(s.x, s.y) * 1e3 for s in pts],
            marker=marker,
            label=label,
        )
    lo = min(s.total_s for s in samples) * 1e3 * 0.8
    hi = max(s.total_s for s in samples) * 1e3 * 1.25
    ax1.plot([lo, hi], [lo, hi], color="grey", linestyle="--", linewidth=1)
    ax1.set_xscale("log")
    ax1.set_yscale("log")
    ax1.set_xlabel("measured prefill step (ms)")
    ax1.set_ylabel("predicted exec(x, y) (ms)")
    ax1.set_title("half-fit: predicted vs measured")
    ax1.legend()

    longest = max(s.x for s in samples)
    xs = list(range(1, longest + 1, max(1, longest // 200)))
    for f in CURVE_FRACTIONS:
        (line,) = ax2.plot(xs, [half.exec(x, f) * 1e3 for x in xs], label=f"exec(x, {f})")
        near = [s for s in samples if abs(s.y - f) < 0.05]
        ax2.scatter([s.x for s in near], [s.total_s * 1e3 for s in near], color=line.get_color())
    ax2.set_xlabel("prompt tokens x")
    ax2.set_ylabel("ms")
    ax2.set_title("exec(x, y) curves; dots: measured with y within 0.05")
    ax2.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return path


def main() -> None:
    """Profile prefills, fit on half and on all samples, print the report, write JSON and a
    plot."""
    args = parse_args()
    torch.set_num_threads(args.threads)
    start = time.perf_counter()
    engine = build_engine(args)
    samples = profile(
        engine, args.lengths, args.fractions, repeats=args.repeats, seed=args.seed, progress=True
    )
    engine.pool.check()
    fit_idx = set(range(0, len(samples), 2))
    train = [s for i, s in enumerate(samples) if i in fit_idx]
    test = [s for i, s in enumerate(samples) if i not in fit_idx]

    transfer: list[tuple[int, float]] = []
    if args.transfer_json.is_file():
        transfer = load_transfer_samples(args.transfer_json)
    elem = torch.empty((), dtype=engine.dtype).element_size()
    kv_bytes = engine.pool.layout.block_bytes(elem) // engine.pool.block_size
    kw = dict(transfer_samples=transfer, kv_bytes_per_token=kv_bytes, device=str(engine.device))
    half = CostModel.fit(train, **kw)
    model = CostModel.fit(samples, **kw)
    errors = {"fit": rel_errors(half, train), "held-out": rel_errors(half, test)}
    print_report(model, half, samples, fit_idx, errors)

    result = {
        "model": model.to_dict(),
        "model_half": half.to_dict(),
        "config": {k: (str(v) if isinstance(v, Path) else v) for k, v in vars(args).items()},
        "machine": {
            "cpus": os.cpu_count(),
            "platform": platform.platform(),
            "torch": torch.__version__,
            "device": str(engine.device),
            "attention": engine.backend.name,
        },
        "errors_half_fit": errors,
        "transfer_samples": transfer,
        "samples": [
            {**vars(s), "new_tokens": s.new_tokens, "split": "fit" if i in fit_idx else "held-out"}
            for i, s in enumerate(samples)
        ],
        "notes": [
            "times in seconds; each sample is the repeat with the median total step time",
            "other = whole engine step (schedule, metadata, model, sampling, postprocess) "
            "minus linear layers minus attention backend",
            "model: fitted on all samples; model_half: fitted on even-indexed samples, "
            "errors are the half-fit's on both halves",
            "transfer: shm by_request_aggregated load-1 row of transfer.json, if present",
        ],
        "wall_s": time.perf_counter() - start,
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=2))
    png = plot(args.out.with_suffix(".png"), half, samples, fit_idx)
    print(f"\nwrote {args.out} and {png} ({result['wall_s']:.0f} s)")


if __name__ == "__main__":
    main()
