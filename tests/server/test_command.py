"""``minimemserve serve``'s options reach the deployment it starts."""

from __future__ import annotations

import argparse

import pytest

pytest.importorskip("fastapi")

from minimemserve.config import EngineConfig
from minimemserve.disagg import membership, ray_runtime, runtime
from minimemserve.options import deployment_options
from minimemserve.server import SERVE_FIELDS, add_arguments


class Recorded:
    """Stands in for a cluster class: keeps what it was started with."""

    started = None

    def __init__(self, spec) -> None:
        Recorded.started = spec


def _spec(*argv: str):
    args = add_arguments(argparse.ArgumentParser()).parse_args(list(argv))
    return deployment_options(args, SERVE_FIELDS, EngineConfig())


@pytest.mark.parametrize(
    "argv, restarts",
    [((), membership.MAX_RESTARTS), (("--max-restarts", "0"), 0), (("--max-restarts", "2"), 2)],
)
def test_serve_under_ray_replaces_a_dead_actor_by_default(monkeypatch, argv, restarts):
    """Ray restarts a dead instance's actor as often as the process runtime restarts a
    spawned instance in a row, unless ``--max-restarts`` says otherwise."""
    monkeypatch.setattr(ray_runtime, "RayCluster", Recorded)
    _spec("--runtime", "ray", *argv).build()
    assert Recorded.started.max_restarts == restarts


@pytest.mark.parametrize("policy", ["recompute", "fail"])
def test_the_kv_load_failure_policy_reaches_the_process_runtime(monkeypatch, policy):
    monkeypatch.setattr(runtime, "ProcessCluster", Recorded)
    _spec("--kv-load-failure-policy", policy).build()
    assert Recorded.started.kv_load_failure_policy == policy
    with pytest.raises(SystemExit):  # argparse refuses another policy
        _spec("--kv-load-failure-policy", "ignore")
