"""The scripts in ``examples/`` run as a reader would run them, on the tiny preset, and say
what they show: cached tokens, the pool calls of a request, a pair in processes."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
EXPECT = {
    "generate.py": "tokens cached",
    "pool_calls.py": "transfer_with_insert(->D0",
    "disaggregated.py": "the pair in processes gave the same tokens as one instance",
}


def test_every_example_is_tested():
    assert sorted(p.name for p in (ROOT / "examples").glob("*.py")) == sorted(EXPECT)


@pytest.mark.parametrize("script", sorted(EXPECT))
def test_example_runs(script):
    env = os.environ | {"PYTHONPATH": str(ROOT)}
    done = subprocess.run(
        [sys.executable, str(ROOT / "examples" / script)],
        capture_output=True,
        text=True,
        timeout=300,
        env=env,
        cwd=ROOT,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    assert EXPECT[script] in done.stdout
