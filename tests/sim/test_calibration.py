"""``minimemserve sim --calibrate``: a profile fitted to measured steps. Steps synthesised
from a known profile (with noise) must be fitted back: low error on the held-out shapes, the
identifiable terms recovered, and the written profile simulates through ``--hardware``."""

from __future__ import annotations

import dataclasses
import json
import random

import pytest

from minimemserve.cli import main
from minimemserve.errors import ConfigError
from minimemserve.sim import HardwareProfile, RooflineStepModel, load_model_shape
from minimemserve_lab.calibration import calibrate, read_steps
from minimemserve_lab.roofline import steps_shape

# What bench/gpu_steps.py measures on Llama-2-7B (its names and fields)
PREFILLS = {
    "prefill 1x512": 512,
    "prefill 1x2048": 2048,
    "prefill 1x4096": 4096,
    "prefill 4x1024": 4096,
    "prefill 1x512 after 3072 cached": 512,
    "prefill 4x256 after 2048 cached": 1024,
    "prefill 1x128": 128,
    "prefill 2x64 after 512 cached": 128,
}
DECODES = [(b, c) for b in (1, 8, 32, 64, 128, 256) for c in (512, 2048)]
PREPARE_US = 250.0
NOISE = 0.02  # measured steps scatter about 2 % around the truth


def _truth() -> HardwareProfile:
    """An H200 as a machine might really be: launch-bound small steps, GEMMs below the
    datasheet at small sizes, slower KV reads than weight reads."""
    h200 = HardwareProfile.load("h200")
    efficiency = h200.efficiency | {"memory": 0.72, "attention": 0.4, "attention_read": 0.55}
    return dataclasses.replace(
        h200,
        efficiency=efficiency,
        step_overhead_ms=PREPARE_US / 1e3,
        layer_overhead_us=250.0,  # eager decode steps are host-bound
        matmul_by_tokens={"1": 0.1, "16": 0.2, "64": 0.35, "256": 0.5, "1024": 0.62, "4096": 0.7},
    )


def _steps_json(path, profile: HardwareProfile, seed: int = 0) -> dict:
    rng = random.Random(seed)
    shapes = [{"shape": n, "decodes": 0, "context": 0} for n in PREFILLS]
    shapes += [{"shape": f"decode {b}x{c}", "decodes": b, "context": c} for b, c in DECODES]
    shapes.append({"shape": "mixed 1x512 + 63 decodes x2048", "decodes": 63, "context": 2048})
    model = load_model_shape("llama2-7b")
    roof = RooflineStepModel(profile, model, 1, 2)
    for s in shapes:
        ms = roof.step_time(steps_shape(s)) * 1e3 * (1 + rng.uniform(-NOISE, NOISE))
        s |= {"step_ms_median": ms, "prepare_us_median": PREPARE_US * rng.uniform(0.9, 1.1)}
    sizes = {k: getattr(model, k) for k in json.loads(json.dumps(_sizes()))}
    report = {"device": "synthetic H200", "dtype": "bfloat16", "model": sizes, "steps": shapes}
    path.write_text(json.dumps(report))
    return report


def _sizes() -> list[str]:
    return [
        "vocab_size",
        "hidden_size",
        "intermediate_size",
        "num_hidden_layers",
        "num_attention_heads",
        "num_key_value_heads",
        "max_position_embeddings",
    ]


def test_the_fit_recovers_a_known_profile_and_predicts_held_out_shapes(tmp_path, capsys):
    truth = _truth()
    steps = tmp_path / "gpu_steps_7b.json"
    _steps_json(steps, truth)
    cal = calibrate([steps], "h200", write=str(tmp_path / "fitted.json"))
    out = capsys.readouterr().out
    held = [r for r in cal.rows if r["held_out"]]
    assert len(held) >= 5 and "(held out)" in out and "held out" in cal.profile.note
    assert cal.held_out_error is not None and cal.held_out_error < 0.04
    assert cal.fit_error < 0.03
    base_error = sum(abs(r["base_ms"] / r["measured_ms"] - 1) for r in held) / len(held)
    assert base_error > 3 * cal.held_out_error  # the shipped profile is further off
    fitted = HardwareProfile.load(tmp_path / "fitted.json")
    assert fitted == cal.profile
    assert fitted.step_overhead_ms == pytest.approx(PREPARE_US / 1e3, rel=0.1)
    assert fitted.layer_overhead_us == pytest.approx(truth.layer_overhead_us, rel=0.25)
    for term in ("memory", "attention_read"):
        assert fitted.efficiency[term] == pytest.approx(truth.efficiency[term], rel=0.15)
    for tokens in ("256", "1024", "4096"):  # sizes where steps are compute-bound
        assert fitted.matmul_by_tokens[tokens] == pytest.approx(
            truth.matmul_by_tokens[tokens], rel=0.2
        )


def test_a_fitted_profile_simulates_through_hardware(tmp_path, capsys):
    steps = tmp_path / "steps.json"
    _steps_json(steps, _truth())
    profile = tmp_path / "profile.json"
    assert main(["sim", "--calibrate", str(steps), "--write", str(profile)]) == 0
    assert "mean |error|" in capsys.readouterr().out
    out = tmp_path / "sim"
    args = ["sim", "--hardware", str(profile), "--model", "llama2-7b", "--gpus", "2", "--tp", "1"]
    args += ["--configs", "PD,1P1D", "--workload", "loogle", "--sessions", "2", "--rate", "1"]
    args += ["--max-turns", "2", "--max-output-tokens", "8", "--out", str(out), "--no-progress"]
    assert main(args) == 0
    result = json.loads((out / "sim_loogle.json").read_text())
    assert "fitted" in json.dumps(result)


def test_bad_steps_are_named(tmp_path):
    path = tmp_path / "steps.json"
    path.write_text("[]")
    with pytest.raises(ConfigError, match="not a bench/gpu_steps.py result"):
        read_steps([path])
    path.write_text(json.dumps({"model": {"vocab_size": 8}, "steps": []}))
    with pytest.raises(ConfigError, match="not a bench/gpu_steps.py result"):
        read_steps([path])
