"""A hardware profile fitted to measured steps of this engine on one machine.

``minimemserve sim --calibrate STEPS.json --write PROFILE.json`` reads the steps
``bench/gpu_steps.py`` measured (prefills with and without a cached prefix, decode batches,
a mixed step: their median times and the host time of ``prepare``) and fits the roofline's
terms (:class:`~.profiles.RooflineStepModel`) to them, starting from a shipped profile
(``--hardware``, default H200):

- host overhead per step: the median measured ``prepare`` time (the host work a step does
  before its first kernel), taken as measured;
- host overhead per layer (kernel launches, which overlap the device's work);
- matmul (GEMM) efficiency by the step's token count, at :data:`MATMUL_POINTS`;
- memory efficiency (weights and activations streamed), prefill attention efficiency, and
  the efficiency of attention's KV reads.

Every :data:`HOLD_OUT_EVERY`-th measured shape is held out of the fit; the error on those is
reported, and the profile written is the one fitted without them. Terms the steps do not
decide (a matmul size no step reaches, say) stay near the base profile's: the fit minimises
the mean squared relative error plus a small pull (:data:`PRIOR_WEIGHT`) toward the base.
``--hardware PROFILE.json`` then simulates with the fitted profile.
"""

from __future__ import annotations

import json
import math
import statistics
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, replace
from pathlib import Path

from minimemserve.errors import ConfigError
from minimemserve.model.config import ModelConfig
from minimemserve.sim.profiles import HardwareProfile, RooflineStepModel, StepShape

from .roofline import steps_shape

# Every HOLD_OUT_EVERY-th measured shape (from the third on) is kept out of the fit.
HOLD_OUT_EVERY = 4
# Step sizes (tokens) at which the matmul efficiency is fitted, interpolated between.
MATMUL_POINTS = (1, 16, 64, 256, 1024, 4096)
# Pull of each term (in log space) toward the base profile's, against the mean squared
# relative error of the steps: small, so only terms the steps leave free stay put.
PRIOR_WEIGHT = 1e-4
# Pattern search in log space: the first step (x2 or /2), halved until this small.
SEARCH_START = math.log(2.0)
SEARCH_END = 1e-3
# The layer overhead a search starts from when the base profile has none (microseconds): a
# few kernel launches of about 5 us each per layer.
LAYER_OVERHEAD_START_US = 30.0
# The profile a fit starts from when the one named has no GPU terms (``--hardware cpu``).
BASE_PROFILE = "h200"
_DTYPE_BYTES = {"bfloat16": 2, "float16": 2, "float32": 4}


@dataclass(frozen=True)
class MeasuredStep:
    """One measured step: its shape name, :class:`StepShape`, median seconds, model shape."""

    name: str
    shape: StepShape
    seconds: float
    model: ModelConfig
    dtype_bytes: int


def read_steps(paths: Sequence[str | Path]) -> tuple[list[MeasuredStep], float, str]:
    """The steps of ``bench/gpu_steps.py`` results (several models may be given), the median
    host ``prepare`` seconds, and the device they ran on."""
    steps, prepare, devices = [], [], set()
    for path in paths:
        try:
            report = json.loads(Path(path).read_text())
            model = ModelConfig(**report["model"])
            rows = report["steps"]
            dtype_bytes = _DTYPE_BYTES.get(report.get("dtype"), 2)
            for row in rows:
                seconds = float(row["step_ms_median"]) / 1e3
                steps.append(
                    MeasuredStep(row["shape"], steps_shape(row), seconds, model, dtype_bytes)
                )
                prepare.append(float(row["prepare_us_median"]) / 1e6)
        except (OSError, json.JSONDecodeError, KeyError, TypeError, ValueError) as e:
            raise ConfigError(f"{path}: not a bench/gpu_steps.py result ({e})") from None
        devices.add(str(report.get("device", "?")))
    if len(steps) < 2 or not all(s.seconds > 0 for s in steps):
        raise ConfigError(f"{', '.join(map(str, paths))}: need two or more timed steps")
    return steps, statistics.median(prepare), " + ".join(sorted(devices))


# --------------------------------------------------------------------------- the terms


def _terms(hw: HardwareProfile) -> dict[str, float]:
    """The fitted terms of ``hw`` by name (efficiencies, and the layer overhead in us)."""
    e = hw.efficiency
    terms = {
        "layer_overhead_us": max(hw.layer_overhead_us, LAYER_OVERHEAD_START_US),
        "memory": e["memory"],
        "attention": e["attention"],
        "attention_read": e.get("attention_read", e["memory"]),
    }
    return terms | {f"matmul@{t}": hw.matmul_efficiency(t) for t in MATMUL_POINTS}


def _profile(base: HardwareProfile, terms: dict[str, float], step_s: float) -> HardwareProfile:
    """``base`` with ``terms`` and a per-step host overhead of ``step_s`` seconds."""
    efficiency = {k: terms.get(k, v) for k, v in base.efficiency.items()}
    efficiency["attention_read"] = terms["attention_read"]
    return replace(
        base,
        efficiency=efficiency,
        step_overhead_ms=step_s * 1e3,
        layer_overhead_us=terms["layer_overhead_us"],
        matmul_by_tokens={str(t): terms[f"matmul@{t}"] for t in MATMUL_POINTS},
    )


def _from_log(names: Sequence[str], x: Sequence[float]) -> dict[str, float]:
    """Terms from their logs; efficiencies are capped at 1."""
    return {
        n: math.exp(v) if n == "layer_overhead_us" else min(1.0, math.exp(v))
        for n, v in zip(names, x)
    }


def relative_errors(hw: HardwareProfile, steps: Sequence[MeasuredStep]) -> list[float]:
    """``predicted / measured - 1`` of every step on ``hw``."""
    models: dict[tuple, RooflineStepModel] = {}
    out = []
    for s in steps:
        key = (s.model, s.dtype_bytes)
        if key not in models:
            models[key] = RooflineStepModel(hw, s.model, 1, s.dtype_bytes)
        out.append(models[key].step_time(s.shape) / s.seconds - 1)
    return out


def _search(loss: Callable[[list[float]], float], x0: list[float]) -> list[float]:
    """Pattern search: first each coordinate alone over a coarse grid (x1/64 to x64: a term
    can start where the loss is flat, as launch overhead hidden under the device's work),
    then moves of one coordinate by +-step while the loss drops, the step halved when no
    move helps."""
    x, best, step = list(x0), loss(x0), SEARCH_START
    for i in range(len(x)):
        for k in range(-3, 4):
            y = x[:i] + [x0[i] + k * math.log(4.0)] + x[i + 1 :]
            if (value := loss(y)) < best:
                x, best = y, value
    while step > SEARCH_END:
        moved = False
        for i in range(len(x)):
            for d in (step, -step):
                y = x[:i] + [x[i] + d] + x[i + 1 :]
                if (value := loss(y)) < best:
                    x, best, moved = y, value, True
                    break
        if not moved:
            step /= 2
    return x


@dataclass(frozen=True)
class Calibration:
    """A fitted profile and how well it predicts: mean |relative error| on the fitted steps
    and on the held-out ones (None when too few were measured to hold any out), and one row
    per step (name, measured ms, base and fitted prediction ms, held out or not)."""

    profile: HardwareProfile
    fit_error: float
    held_out_error: float | None
    rows: list[dict]


def fit_profile(
    steps: Sequence[MeasuredStep], base: HardwareProfile, prepare_s: float
) -> Calibration:
    """Fit ``base``'s terms to ``steps`` (every :data:`HOLD_OUT_EVERY`-th held out when
    there are at least that many); the per-step overhead is ``prepare_s``."""
    held = [i % HOLD_OUT_EVERY == HOLD_OUT_EVERY - 2 for i in range(len(steps))]
    held = held if len(steps) >= HOLD_OUT_EVERY else [False] * len(steps)
    fit = [s for s, h in zip(steps, held) if not h]
    start = _terms(base)
    names = list(start)
    x0 = [math.log(v) for v in start.values()]

    def loss(x: list[float]) -> float:
        hw = _profile(base, _from_log(names, x), prepare_s)
        errors = relative_errors(hw, fit)
        prior = sum((a - b) ** 2 for a, b in zip(x, x0)) / len(x)
        return sum(e * e for e in errors) / len(errors) + PRIOR_WEIGHT * prior

    fitted = _profile(base, _from_log(names, _search(loss, x0)), prepare_s)
    fitted_err, base_err = relative_errors(fitted, steps), relative_errors(base, steps)
    rows = [
        {
            "shape": s.name,
            "measured_ms": s.seconds * 1e3,
            "base_ms": s.seconds * (1 + b) * 1e3,
            "fitted_ms": s.seconds * (1 + f) * 1e3,
            "held_out": h,
        }
        for s, f, b, h in zip(steps, fitted_err, base_err, held)
    ]
    mean_abs = lambda errs: sum(map(abs, errs)) / len(errs) if errs else None
    return Calibration(
        fitted,
        mean_abs([e for e, h in zip(fitted_err, held) if not h]),
        mean_abs([e for e, h in zip(fitted_err, held) if h]),
        rows,
    )


def write_profile(profile: HardwareProfile, path: str | Path) -> Path:
    """Write ``profile`` as JSON that ``HardwareProfile.load`` (``--hardware``) reads."""
    d = asdict(profile)  # its links too
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(d, indent=1) + "\n")
    return path


def _pct(x: float | None) -> str:
    return "-" if x is None else f"{x:.1%}"


def calibrate(
    paths: Sequence[str | Path], hardware: str = BASE_PROFILE, write: str | None = None
) -> Calibration:
    """Fit ``hardware``'s profile (for ``cpu``, the simulator's machine: BASE_PROFILE's) to
    the measured steps in ``paths``, print measured against the base and the fitted profile
    per shape and the held-out error, and write the fitted profile to ``write`` (if given)."""
    steps, prepare_s, device = read_steps([p for p in paths if p])
    base = HardwareProfile.load(BASE_PROFILE if hardware == "cpu" else hardware)
    cal = fit_profile(steps, base, prepare_s)
    note = (
        f"{base.name} fitted to {len(steps)} steps measured on {device}: mean |error| "
        f"{_pct(cal.fit_error)} on the fitted shapes, {_pct(cal.held_out_error)} held out"
    )
    cal = replace(cal, profile=replace(cal.profile, name=f"{base.name} (fitted)", note=note))
    print(f"{'shape':36}{'measured ms':>12}{base.name + ' ms':>12}{'fitted ms':>11}{'error':>8}")
    for r in cal.rows:
        err = r["fitted_ms"] / r["measured_ms"] - 1
        mark = "  (held out)" if r["held_out"] else ""
        print(
            f"{r['shape']:36}{r['measured_ms']:>12.2f}{r['base_ms']:>12.2f}{r['fitted_ms']:>11.2f}{err:>8.1%}{mark}"
        )
    p = cal.profile
    matmul = ", ".join(f"{t}: {e:.2f}" for t, e in p.matmul_by_tokens.items())
    print(
        f"fitted: step overhead {p.step_overhead_ms:.3f} ms (measured prepare), layer overhead "
        f"{p.layer_overhead_us:.1f} us, memory {p.efficiency['memory']:.2f}, attention "
        f"{p.efficiency['attention']:.2f}, attention reads {p.efficiency['attention_read']:.2f}, "
        f"matmul by tokens {{{matmul}}}"
    )
    print(f"mean |error|: {_pct(cal.fit_error)} fitted, {_pct(cal.held_out_error)} held out")
    if write:
        print(f"wrote {write_profile(p, write)}")
    return cal
