#!/usr/bin/env bash
# Creates .venv and installs minimemserve with its test, benchmark, server, NIXL and Ray extras.
# On a machine without CUDA the CPU build of torch is installed first, so that the
# bare `torch` requirement is already satisfied and no multi-GB CUDA build is fetched.
set -euo pipefail
cd "$(dirname "$0")/.."
python3 -m venv .venv
. .venv/bin/activate
python -m pip install -q --upgrade pip
if ! python -c "import torch" 2>/dev/null; then
    if command -v nvidia-smi >/dev/null 2>&1; then
        python -m pip install -q torch
    else
        python -m pip install -q "torch==${MINIMEMSERVE_CPU_TORCH:-2.13.0}"
    fi
fi
python -m pip install -q -e ".[dev,bench,serve,nixl,ray]"
