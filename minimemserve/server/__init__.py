"""The OpenAI-compatible HTTP server (``minimemserve serve``; needs the ``serve`` extra:
FastAPI, uvicorn, prometheus_client). The application is in ``minimemserve.server.app``."""

from __future__ import annotations

import argparse

from ..disagg.rpc import LOOPBACK
from ..options import ENGINE_FLAGS, add_engine_arguments

# The EngineConfig fields ``serve`` takes as options.
SERVE_ENGINE_FLAGS = tuple(f for f in ENGINE_FLAGS if f != "attention")

# Choices in flight at once; more is "overloaded" (503), not an unbounded queue, and one
# request asking for more than this could never start (400).
DEFAULT_MAX_PENDING = 1024


def _add_cluster_arguments(p: argparse.ArgumentParser) -> None:
    """How the deployment's instances run: routing, runtime, joining, transport."""
    p.add_argument(
        "--policy", default="prompt_tree", help="global scheduler policy (process runtime)"
    )
    p.add_argument(
        "--runtime",
        default="process",
        choices=["process", "inprocess"],
        help="one process per instance (default), or every instance in this one",
    )
    p.add_argument("--num-colocated", type=int, default=2, help="instances of a PD/PD-CC config")
    p.add_argument(
        "--instances",
        default=None,
        help="HOST:PORT,... of `minimemserve instance` processes to join instead of spawning "
        "(their roles make the deployment; needs --key)",
    )
    p.add_argument("--key", default=None, help="cluster key file (minimemserve keygen)")
    p.add_argument(
        "--cluster-host",
        default=LOOPBACK,
        help="address the control plane binds; instances on other hosts must reach it",
    )
    p.add_argument(
        "--transport",
        default="auto",
        choices=["auto", "shm", "gloo"],
        help="KV transport between instances (auto: shared memory within a host, else gloo)",
    )


def add_arguments(p: argparse.ArgumentParser) -> argparse.ArgumentParser:
    """The options of ``minimemserve serve``."""
    p.add_argument("--model", default=None, help="HF checkpoint dir (default: the tiny preset)")
    p.add_argument("--served-model-name", default=None, help="model id (default: the dir name)")
    p.add_argument("--config", default="PD-CC", help="PD, PD-CC, 1P1D, 1P1D-CC, xPyD[-CC...]")
    p.add_argument("--host", default=LOOPBACK, help="address to bind (default: loopback only)")
    p.add_argument("--port", type=int, default=8000)
    _add_cluster_arguments(p)
    p.add_argument("--device", default="cpu")
    p.add_argument("--dtype", default="float32", choices=["float32", "float16", "bfloat16"])
    add_engine_arguments(p, SERVE_ENGINE_FLAGS)  # tensor parallelism: with --runtime inprocess
    p.add_argument(
        "--max-pending",
        type=int,
        default=DEFAULT_MAX_PENDING,
        help="choices in flight before new requests get 503",
    )
    p.add_argument(
        "--api-key",
        default=None,
        help="require `Authorization: Bearer KEY` on /v1 (or set MINIMEMSERVE_API_KEY)",
    )
    p.add_argument("--log-level", default="warning")
    return p
