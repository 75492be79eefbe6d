"""``minimemserve explain``: PD-CC and 1P1D-CC make the same pool calls except those their
recipes (``MILESTONES``) list at each hook, and each hook makes exactly the calls of its
recipe's operations; the side-by-side view puts the calls both make on one row and marks the
rest, leaves out calls given nothing to do, and its summary agrees with the engine's own
counts."""

from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace

import pytest

from minimemserve.blocks.layout import KVLayout
from minimemserve.cli import main
from minimemserve.config import parse_config_name
from minimemserve.explain import (
    MARK,
    Event,
    PoolTrace,
    legend,
    render,
    run_conversation,
    shown,
    summarize,
    summary,
)
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


def _columns(text: str, width: int) -> list[tuple[bool, str, str]]:
    """Each row of a two-column render below its head: marked, left cell, right cell."""
    _, *rows = text.splitlines()
    out = []
    for row in rows:
        assert row[:2] in (f"{MARK} ", "  "), row
        out.append((row[0] == MARK, row[2 : 2 + width].rstrip(), row[4 + width :].rstrip()))
    return out


def _call(cell: str) -> str:
    """A cell's call with its depth, without the instance making it."""
    return cell if cell.startswith("--") else cell[3:]


def test_rows_share_the_calls_both_make_and_mark_the_rest(runs):
    width = 90  # no cell cut
    rows = _columns(render({c: runs[c][0] for c in CONFIGS}, width=width), width)
    for side, config in enumerate(CONFIGS):  # every call shown once, in order
        cells = [row[1 + side] for row in rows if row[1 + side]]
        events = shown(runs[config][0])
        assert [_call(c).strip(" -") for c in cells] == [e.text for e in events]
    for marked, a, b in rows:
        assert marked == (not a or not b or _call(a) != _call(b)), (a, b)
    unmarked = [a for marked, a, _ in rows if not marked]
    allocs = [e for e in shown(runs["PD-CC"][0]) if e.kind == "alloc_mem" and e.depth == 0]
    assert allocs and all(any(e.text in a for a in unmarked) for e in allocs)  # the scheduler's
    assert sum(a.startswith("-- turn") for a in unmarked) == 2
    finishes = [(a, b) for marked, a, b in rows if "finish:" in a]
    assert len(finishes) == 2  # PD-CC's finish hook beside 1P1D-CC's, on its decode instance
    assert all("D0 finish: send_back, insert, free" == b for _, b in finishes)
    transfers = [marked for marked, a, b in rows if "transfer_with_insert" in b]
    assert transfers and all(transfers)


def test_empty_calls_are_recorded_not_shown(runs):
    events, _ = runs["1P1D-CC"]
    empty = [e for e in events if e.empty]
    assert [e.text for e in empty] == ["alloc_mem(0) -> []"]  # the send back found it cached
    assert empty[0] not in shown(events)
    assert "alloc_mem(0)" not in render({c: runs[c][0] for c in CONFIGS})
    layout = KVLayout(num_layers=1, block_size=4, num_kv_heads=1, head_dim=2)
    pool = MemPool(layout, 2, instance_id="C0")
    trace = PoolTrace()
    trace.watch(SimpleNamespace(pool=pool, recipe=Recipe(), scheduler=SimpleNamespace()))
    pool.free_mem(pool.alloc_mem(0))
    pool.free_mem(pool.alloc_mem(1))
    assert [e.text for e in shown(trace.events)] == ["alloc_mem(1) -> [0]", "free_mem([0])"]
    assert summarize(trace.events).calls == [2]


def test_summary_agrees_with_the_engine_and_the_transfers(runs):
    sums = {c: summarize(runs[c][0]) for c in CONFIGS}
    for config, s in sums.items():
        events = runs[config][0]
        turns = [e for e in events if e.kind == "turn"]
        assert s.prompt == [e.n for e in turns]
        assert s.hit == [e.facts["cached"] for e in turns]  # the requests' own metrics
        assert s.calls == [
            sum(e.kind not in ("turn", "hook") for e in part) for part in _turns(shown(events))
        ]
        # each block a transfer lands on the receiver is either copied there or found cached
        landed = [
            sum(len(_result_ids(e)) for e in part if e.kind == "transfer_with_insert")
            for part in _turns(events)
        ]
        assert [x + y for x, y in zip(s.sent, s.found)] == landed
    assert sums["PD-CC"].hit == sums["1P1D-CC"].hit and sums["PD-CC"].hit[1] > 0
    assert sum(sums["PD-CC"].sent) == 0 < sum(sums["1P1D-CC"].sent)
    text = summary({c: runs[c][0] for c in CONFIGS})
    head, *rows = text.splitlines()
    assert head.split()[-2:] == list(CONFIGS)
    hit = next(r for r in rows if r.lstrip().startswith("hit tokens"))
    h = sums["1P1D-CC"].hit
    assert f"{h[0]} + {h[1]} = {sum(h)}" in hit


def test_the_summary_in_the_reading_path_is_this_run(runs):
    """docs/reading.md shows the summary of ``explain --config 1P1D-CC --compare PD-CC``, whose
    defaults are this module's runs."""
    text = (Path(__file__).parents[1] / "docs" / "reading.md").read_text()
    shown_there = text.split("```text\n", 1)[1].split("```", 1)[0].rstrip("\n")
    assert shown_there == summary({c: runs[c][0] for c in reversed(CONFIGS)})


def _turns(events: list[Event]) -> list[list[Event]]:
    out: list[list[Event]] = []
    for e in events:
        if e.kind == "turn":
            out.append([])
        out[-1].append(e)
    return out


def _result_ids(e: Event) -> list[int]:
    """The block ids after ``->`` in a call's line, runs unfolded."""
    ids = []
    for part in e.text.split("-> [")[1].split("]")[0].split(", "):
        lo, _, hi = part.partition("-")
        ids += range(int(lo), int(hi or lo) + 1) if part else []
    return ids


def test_explain_command_prints_one_configuration(capsys):
    assert main(["explain", "--config", "PD-CC", "--compare", "none", "--max-tokens", "3"]) == 0
    out = capsys.readouterr().out
    assert "C0 arrival: match" in out and "insert(" in out and "greedy tokens" in out
    assert out.startswith(legend(1)) and f"\n{MARK} " not in out  # nothing to compare
    assert "hit tokens (matched on arrival)" in out and "blocks sent" in out


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
