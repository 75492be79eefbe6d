"""The package surface: every public name resolves, and importing touches no device."""

from __future__ import annotations

import subprocess
import sys

import pytest

import minimemserve


def test_import_touches_no_device_and_starts_no_process():
    code = (
        "import sys, multiprocessing, minimemserve\n"
        "assert multiprocessing.active_children() == []\n"
        "import torch\n"
        "assert not torch.cuda.is_initialized()\n"
    )
    subprocess.run([sys.executable, "-c", code], check=True)


def test_every_public_name_resolves():
    for name in minimemserve.__all__:
        assert getattr(minimemserve, name) is not None, name
    with pytest.raises(AttributeError, match="no attribute 'Nope'"):
        minimemserve.Nope  # noqa: B018


# ``sys.modules[name] = None`` makes ``import name`` fail as if the package were not installed
_WITHOUT = """
import sys
for name in sys.argv[2].split(","):
    sys.modules[name] = None
import minimemserve
from minimemserve import LLM, SamplingParams
with LLM(sys.argv[1], num_blocks=32, block_size=4) as llm:
    out = llm.generate([[1, 5, 9, 13]], SamplingParams(temperature=0.0, max_tokens=3,
                                                        ignore_eos=True))
assert len(out[0].token_ids) == 3, out
try:
    from minimemserve import ProcessCluster
except ImportError as e:
    print(e)
else:
    raise SystemExit("ProcessCluster imported without " + sys.argv[2])
"""


@pytest.mark.parametrize("blocked,named", [("msgspec,zmq", "'msgspec'"), ("zmq", "'pyzmq'")])
def test_engine_works_without_the_process_runtime_packages(tiny_llama_dir, blocked, named):
    """``import minimemserve`` and ``LLM`` need neither msgspec nor pyzmq (only the process
    runtime does); ``ProcessCluster`` then says which package is missing."""
    res = subprocess.run(
        [sys.executable, "-c", _WITHOUT, str(tiny_llama_dir), blocked],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert res.returncode == 0, res.stderr[-2000:]
    assert f"needs the package {named}" in res.stdout, res.stdout
