"""The roofline's checks (``minimemserve sim --anchors``, and the measured steps
``sim --calibrate`` fits): :func:`calibrate` compares the roofline's predicted step times
with ``bench/gpu_steps.py`` measurements, :func:`anchors` with published ones
(:data:`ANCHORS`)."""

from __future__ import annotations

import json
import re
from pathlib import Path

from minimemserve.errors import ConfigError
from minimemserve.model.config import ModelConfig
from minimemserve.sim.profiles import (
    HardwareProfile,
    RooflineStepModel,
    StepShape,
    load_model_shape,
)

# Published step and request times of known GPU deployments, with their sources.
ANCHORS = Path(__file__).resolve().parent / "data" / "anchors.json"
_PREFILL_NAME = re.compile(r"prefill (\d+)x(\d+)(?: after (\d+) cached)?")
_MIXED_NAME = re.compile(r"mixed (\d+)x(\d+)")


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


def anchors(path: str | Path = ANCHORS) -> list[dict]:
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
