"""The OpenAI-compatible HTTP server (``minimemserve serve``; needs the ``serve`` extra:
FastAPI, uvicorn, prometheus_client). The application is in ``minimemserve.server.app``."""

from __future__ import annotations

import argparse

from ..disagg.membership import MAX_RESTARTS
from ..disagg.rpc import LOOPBACK
from ..options import ENGINE_FLAGS, add_deployment_arguments, add_engine_arguments

# The DeploymentSpec and EngineConfig fields ``serve`` takes as options.
SERVE_FIELDS = (
    "model",
    "config",
    "device",
    "dtype",
    "runtime",
    "policy",
    "num_colocated",
    "transport",
    "cluster_host",
    "instances",
    "key",
    "ray_address",
    "placement",
    "max_restarts",
    "kv_load_failure_policy",
)
SERVE_ENGINE_FLAGS = tuple(f for f in ENGINE_FLAGS if f != "attention")

# Choices in flight at once; more is "overloaded" (503), not an unbounded queue, and one
# request asking for more than this could never start (400).
DEFAULT_MAX_PENDING = 1024


def add_arguments(p: argparse.ArgumentParser) -> argparse.ArgumentParser:
    """The options of ``minimemserve serve``."""
    p.add_argument(
        "--served-model-name",
        default=None,
        help="model id clients send (default: 'tiny' for the preset, else the --model dir's name)",
    )
    p.add_argument("--host", default=LOOPBACK, help="address to bind (default: loopback only)")
    p.add_argument("--port", type=int, default=8000)
    # a server replaces a dead instance under Ray as under the process runtime
    add_deployment_arguments(
        p, SERVE_FIELDS, config="PD-CC", runtime="process", max_restarts=MAX_RESTARTS
    )
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
