"""CPU launches need triton imported with TRITON_INTERPRET=1, and say so when it was not."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
SCRIPT = """
import torch
from triton_kernels import interpreter_ready, store_kv
assert not interpreter_ready()
cache = torch.zeros(2, 4, 1, 16)
x = torch.ones(1, 1, 16)
try:
    store_kv(cache, cache.clone(), x, x, torch.tensor([1]))
except RuntimeError as e:
    print("refused:", e)
"""


def test_cpu_launch_without_interpreter_is_refused_clearly():
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["CUDA_VISIBLE_DEVICES"] = ""
    res = subprocess.run(
        [sys.executable, "-c", SCRIPT],
        cwd=REPO,
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert res.returncode == 0, res.stderr
    assert "refused:" in res.stdout and "TRITON_INTERPRET=1" in res.stdout
