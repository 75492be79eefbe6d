"""Where a Ray deployment's instances go: the plan that gives every instance one node with room
for all its ranks, before anything is reserved.

Plain data, no Ray: the runtime (:mod:`~.ray_runtime`) feeds it the live nodes Ray reports."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from ..errors import ConfigError


@dataclass(frozen=True)
class NodeView:
    """A live Ray node as placement sees it: its id, resources and labels."""

    id: str
    resources: Mapping[str, float]
    labels: Mapping[str, str]

    def has(self, pin: str | None) -> bool:
        """Whether the node may hold a role pinned to ``pin`` (a resource, or ``key=value``)."""
        if pin is None:
            return True
        key, eq, value = pin.partition("=")
        return self.labels.get(key) == value if eq else self.resources.get(pin, 0) > 0


@dataclass(frozen=True)
class Wanted:
    """One instance to place: its name, role, ranks and the resources of one rank."""

    name: str
    role: str
    ranks: int
    bundle: Mapping[str, float]


def plan_nodes(
    wanted: Sequence[Wanted],
    nodes: Sequence[NodeView],
    placement: str = "pack",
    pin: Mapping[str, str] | None = None,
) -> dict:
    """``{instance name: node id}``: every instance on one node with room for all its ranks
    (and its role's ``pin``), packed or spread as ``placement`` says; raises ConfigError
    naming the first instance that fits nowhere and what each node has left."""
    pin = pin or {}
    free = {n.id: dict(n.resources) for n in nodes}
    held = dict.fromkeys(free, 0)
    plan = {}
    for w in wanted:
        need = {k: v * w.ranks for k, v in w.bundle.items()}
        fits = [
            n.id
            for n in nodes
            if n.has(pin.get(w.role)) and all(free[n.id].get(k, 0) >= v for k, v in need.items())
        ]
        if not fits:
            raise ConfigError(_unplaced(w, need, nodes, free, pin.get(w.role)))
        # pack: the node already holding most; spread: the one holding fewest (first wins ties)
        sign = -1 if placement == "pack" else 1
        node = min(fits, key=lambda n: sign * held[n])
        plan[w.name] = node
        held[node] += 1
        for k, v in need.items():
            free[node][k] -= v
    return plan


def _unplaced(w: Wanted, need: dict, nodes: Sequence[NodeView], free: dict, pin) -> str:
    keys = sorted(need)
    left = "; ".join(
        f"{n.id[:8]}: "
        + ", ".join(f"{k} {free[n.id].get(k, 0):g}" for k in keys)
        + ("" if n.has(pin) else f" (not {pin})")
        for n in nodes
    )
    want = ", ".join(f"{k} {v:g}" for k, v in sorted(need.items()))
    where = f" with {pin}" if pin else ""
    return (
        f"cannot place {w.role} instance {w.name}: its {w.ranks} rank(s) need {want} on one "
        f"node{where}; free per node: {left or 'no live node'}"
    )
