"""The package surface: light import, lazy heavy names, clear errors for unknown ones."""

from __future__ import annotations

import subprocess
import sys

import pytest

import minimemserve


def test_import_is_light_and_heavy_names_load_on_use():
    code = (
        "import sys, minimemserve\n"
        "assert 'minimemserve.disagg.runtime' not in sys.modules\n"
        "assert 'zmq' not in sys.modules\n"
        "from minimemserve import ProcessCluster, GlobalScheduler, CostModel, MemPool, Engine\n"
        "assert 'minimemserve.disagg.runtime' in sys.modules\n"
    )
    subprocess.run([sys.executable, "-c", code], check=True)


def test_every_public_name_resolves():
    for name in minimemserve.__all__:
        assert getattr(minimemserve, name) is not None, name
    with pytest.raises(AttributeError, match="no attribute 'Nope'"):
        minimemserve.Nope  # noqa: B018
