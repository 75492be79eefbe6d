"""scripts/gpu-check.sh runs end to end as a dry run on a machine without a GPU.

The dry run skips what needs CUDA and replaces the rest by its CPU form (test collection,
the kernels' interpreter check, a tiny model's steps), so the script's plumbing (stages,
time budget, logs, JSON, the summary) is exercised in seconds.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
SCRIPT = REPO / "scripts" / "gpu-check.sh"


def test_gpu_check_dry_run(tmp_path):
    env = dict(os.environ, GPU_CHECK_DRY_RUN="1", GPU_CHECK_PYTHON=sys.executable)
    res = subprocess.run(
        ["bash", str(SCRIPT), str(tmp_path)], cwd=REPO, env=env, capture_output=True,
        text=True, timeout=180,
    )  # fmt: skip
    assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-3000:]
    stages = dict(
        line.split("\t")[:2] for line in (tmp_path / "stages.tsv").read_text().splitlines()
    )
    for name in ("env", "gpu-tests", "kernels", "model-steps", "bench-options"):
        assert stages.get(name) == "ok", stages
    assert stages["bench4"].startswith("skipped (dry run")
    summary = (tmp_path / "summary.txt").read_text()
    assert "DRY RUN" in summary and "target not measured" in summary
    assert json.loads((tmp_path / "env.json").read_text())["dry_run"] is True
    assert json.loads((tmp_path / "kernels.json").read_text())["interpreter_check_ok"]
    steps = json.loads((tmp_path / "gpu_steps.json").read_text())
    assert steps["dry_run"] and all(s["logits_finite"] for s in steps["steps"])
    cmd = (tmp_path / "bench4.cmd").read_text()
    assert "--device cuda" in cmd and "--runtime process" in cmd
    assert "collected" in (tmp_path / "gpu-tests.log").read_text()
