"""Run the kernels in Triton's interpreter when there is no GPU; share the reference.

Triton 3.9 reads ``TRITON_INTERPRET`` when ``import triton`` decorates its own library
functions (``tl.sum``, ``tl.max``...), so it must be set before the first import of triton
in the process. This file loads before the test modules of its directory.

The tests run with ``--import-mode=importlib``, which puts no test directory on
``sys.path``; this directory is added so the tests (and the backend tests) can import the
naive reference ``kernel_reference``.
"""

import os
import sys
from pathlib import Path

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

_HERE = str(Path(__file__).parent)
if _HERE not in sys.path:
    sys.path.append(_HERE)
