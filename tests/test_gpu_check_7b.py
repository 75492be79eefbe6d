"""scripts/gpu-check-7b.sh: it stops at once without a GPU, and its dry run (every stage in its
CPU form, the tiny model in place of Llama-2-7B) gets through every stage and leaves only the
files that come back from the GPU machine."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
SCRIPT = REPO / "scripts" / "gpu-check-7b.sh"
RETURNED = {"summary.txt", "gpu_steps_7b.json", "profile_7b.json", "logs.tgz"}
MAX_FILES = 8  # what comes back from the machine's $OUT


def _env(**extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("GPU_CHECK", "DRY"))}
    return env | {"GPU_CHECK_PYTHON": sys.executable, "PYTHONPATH": ""} | extra


def test_no_gpu_says_so_in_one_line_and_stops(tmp_path):
    if shutil.which("nvidia-smi"):
        pytest.skip("this machine has nvidia-smi")
    began = time.monotonic()
    res = subprocess.run(
        ["bash", str(SCRIPT), str(tmp_path / "out")],
        cwd=REPO,
        env=_env(),
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert res.returncode == 2 and time.monotonic() - began < 10
    out = (res.stdout + res.stderr).strip()
    assert len(out.splitlines()) == 1 and "no GPU" in out, out
    assert not (tmp_path / "out").exists()


@pytest.mark.slow
def test_the_dry_run_gets_through_every_stage(tmp_path):
    out = tmp_path / "out"
    res = subprocess.run(
        ["bash", str(SCRIPT), str(out)],
        cwd=REPO,
        env=_env(DRY="1", GPU_CHECK_7B_WORKLOADS="loogle", TMPDIR=str(tmp_path)),
        capture_output=True,
        text=True,
        timeout=900,
    )
    summary = (out / "summary.txt").read_text()
    assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-3000:]
    stages = [
        "imports",
        "tiny-process",
        "steps-7b",
        "calibrate",
        "rate-loogle",
        "bench-loogle",
        "compare-loogle",
    ]
    for name in stages:
        assert any(line.split()[:1] == [name] and "ok" in line for line in summary.splitlines())
    files = {p.name for p in out.iterdir()}
    assert files == RETURNED | {"e2e_tiny.json", "e2e_loogle.json"} and len(files) <= MAX_FILES
    assert "DRY RUN" in summary and "mean |error|" in summary and "hand-offs" in summary
    assert "simulated / measured" in summary
    profile = json.loads((out / "profile_7b.json").read_text())
    assert profile["matmul_by_tokens"] and "attention_read" in profile["efficiency"]
    bench = json.loads((out / "e2e_loogle.json").read_text())
    assert set(bench["summaries"]) == {"PD", "PD-CC", "1P1D", "1P1D-CC"}
    assert all(s["errors"] == 0 for s in bench["summaries"].values())
    handed = [r for r in bench["records"]["1P1D"] if r["handoff_bytes"]]
    assert handed and all(r["handoff_seconds"] > 0 for r in handed)
    tiny = json.loads((out / "e2e_tiny.json").read_text())  # the process runtime's hand-offs
    assert tiny["setup"]["runtime"]["kind"] == "process"
    assert [r for r in tiny["records"]["1P1D"] if r["handoff_bytes"] and r["handoff_seconds"]]
