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
