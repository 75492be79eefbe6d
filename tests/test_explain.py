"""``minimemserve explain``: PD-CC and 1P1D-CC make the same pool calls except those their
recipes (``MILESTONES``) list at each hook, and each hook makes exactly the calls of its
recipe's operations."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from minimemserve.blocks.layout import KVLayout
from minimemserve.cli import main
from minimemserve.config import parse_config_name
from minimemserve.explain import Event, PoolTrace, render, run_conversation
from minimemserve.mempool import MemPool
from minimemserve.recipes import Recipe

CONFIGS = ("PD-CC", "1P1D-CC")
# the pool calls each recipe operation makes on the pools (its own, or the peer's for
# send_back's release), in order; a hand-off releases the sent blocks here
CALLS = {
    "match": ("match",),
    "insert": ("insert",),
    "free": ("free_mem",),
    "transfer": ("transfer", "free_mem"),
    "transfer_with_insert": ("transfer_with_insert", "free_mem"),
    "send_back": ("transfer_with_insert", "free_mem"),
}


@pytest.fixture(scope="module")
def runs() -> dict[str, tuple[list[Event], list[list[int]]]]:
    return {config: run_conversation(config) for config in CONFIGS}


def _hooks(events: list[Event]) -> list[tuple[Event, list[str]]]:
    """Each hook event with the names of the calls made directly under it."""
    out = []
    for i, e in enumerate(events):
        if e.kind != "hook":
            continue
        below = []
        for f in events[i + 1 :]:
            if f.depth <= e.depth:
                break
            if f.depth == e.depth + 1:
                below.append(f.kind)
        out.append((e, below))
    return out


def _outside_hooks(events: list[Event]) -> list[tuple[str, int]]:
    """The turns and the calls no hook made (the local scheduler's), with their sizes."""
    out, hook_depth = [], None
    for e in events:
        if hook_depth is not None and e.depth > hook_depth:
            continue
        hook_depth = e.depth if e.kind == "hook" else None
        if e.kind != "hook":
            out.append((e.kind, e.n))
    return out


@pytest.mark.parametrize("config", CONFIGS)
def test_each_hook_makes_the_calls_its_recipe_lists(runs, config):
    deployment = parse_config_name(config)
    roles = dict(deployment.instances())
    events, _ = runs[config]
    hooks = _hooks(events)
    assert hooks
    for hook, below in hooks:
        recipe = deployment.milestone.recipes[roles[hook.instance]]
        name = hook.text.split(":")[0]
        assert hook.ops == getattr(recipe, name)
        assert below == [call for op in hook.ops for call in CALLS[op]], hook.text


def test_configurations_differ_only_in_their_recipes_calls(runs):
    (a, out_a), (b, out_b) = (runs[c] for c in CONFIGS)
    assert out_a == out_b  # the same greedy tokens
    assert _outside_hooks(a) == _outside_hooks(b)  # the scheduler's allocations, turn by turn
    hooks = {c: [h.text.split(":")[0] for h, _ in _hooks(runs[c][0])] for c in CONFIGS}
    assert hooks["PD-CC"] == hooks["1P1D-CC"] == ["arrival", "prefilled", "finish"] * 2
    moved = [e for e in b if e.kind in ("transfer_with_insert", "recv_copy")]
    assert moved and not [e for e in a if e.kind in ("transfer_with_insert", "recv_copy")]


def test_render_puts_the_configurations_side_by_side(runs):
    text = render({c: runs[c][0] for c in CONFIGS}, width=50)
    head, *rows = text.splitlines()
    assert head.split() == list(CONFIGS)
    assert sum("-- turn" in row for row in rows) == 2  # each turn once, both columns on it
    assert any("transfer_with_insert(->D0" in row for row in rows)


def test_explain_command_prints_one_configuration(capsys):
    assert main(["explain", "--config", "PD-CC", "--compare", "none", "--max-tokens", "3"]) == 0
    out = capsys.readouterr().out
    assert "C0 arrival: match" in out and "insert(" in out and "greedy tokens" in out


def test_a_call_that_moves_blocks_between_tiers_says_so():
    layout = KVLayout(num_layers=1, block_size=4, num_kv_heads=1, head_dim=2)
    pool = MemPool(layout, 2, dram_blocks=2, instance_id="C0")
    engine = SimpleNamespace(pool=pool, recipe=Recipe(), scheduler=SimpleNamespace())
    trace = PoolTrace()
    trace.watch(engine)
    blocks = pool.alloc_mem(2)
    pool.insert(list(range(8)), blocks)
    pool.free_mem(blocks)
    pool.alloc_mem(1)  # the cached tail goes to dram to make room
    assert trace.events[-1].text == "alloc_mem(1) -> [1] (offloaded 1)"
    assert [e.kind for e in trace.events] == ["alloc_mem", "insert", "free_mem", "alloc_mem"]


def test_explain_names_a_bad_configuration():
    with pytest.raises(SystemExit, match="explain: .*XYZ"):
        main(["explain", "--config", "XYZ"])
