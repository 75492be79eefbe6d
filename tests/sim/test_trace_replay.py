"""A trace replayed by its timestamps on the simulated Mooncake-scale cluster (small traces)."""

from __future__ import annotations

import json

import pytest

from minimemserve.cli import main
from minimemserve.errors import ConfigError
from minimemserve.workloads.trace import TRACE_BLOCK, load_trace
from minimemserve_lab.trace_replay import fig10, meets_slo, replay_trace, trace_setup

from .test_trace_curve import _conversations


@pytest.fixture
def small_trace(tmp_path):
    rows = _conversations(40, seed=3)
    path = tmp_path / "t.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def test_fig10_replays_every_request_and_balances_the_pools(small_trace):
    trace = load_trace(small_trace)
    rows = {r["policy"]: r for r in fig10(trace, ("round_robin", "prompt_tree"), progress=False)}
    for r in rows.values():
        assert r["requests"] == 40 and r["errors"] == 0
        assert len(r["prefill_load_s"]) == 10 and r["tbt_p90"] is None  # one-token outputs
        assert 0 < r["ttft_p50"] <= r["ttft_p99"]
    # conversations come back to the instance holding their history
    assert rows["prompt_tree"]["hit_rate"] > rows["round_robin"]["hit_rate"]


def test_a_dram_tier_holds_what_hbm_evicts(small_trace):
    trace = load_trace(small_trace)
    tiny = trace_setup("prompt_tree", instances=1, dram_tokens=0)
    longest = max(len(r.hash_ids) for r in trace.requests) + 1
    tiny.num_blocks = longest * TRACE_BLOCK // tiny.engine_config.block_size  # hbm: one prompt
    without = replay_trace(tiny, "PD-CC", trace, 1, False)["hit_rate"]
    tiered = trace_setup("prompt_tree", instances=1, dram_tokens=200 * TRACE_BLOCK)
    tiered.num_blocks = tiny.num_blocks
    with_dram = replay_trace(tiered, "PD-CC", trace, 1, False)["hit_rate"]
    assert with_dram > without


def test_slo_rule():
    row = {"errors": 0, "ttft_p90": 2.0, "tbt_p90": None}
    assert meets_slo(row)
    assert not meets_slo(row | {"tbt_p90": 0.5})
    assert not meets_slo(row | {"ttft_p90": 100.0})


def test_cli_fig10_and_layout_sweep(small_trace, tmp_path):
    out = tmp_path / "out"
    base = ["sim", "--trace", str(small_trace), "--out", str(out), "--no-progress"]
    assert main([*base, "--fig10", "--trace-window", "12"]) == 0
    res = json.loads((out / "trace_fig10.json").read_text())
    assert res["requests"] == 12
    assert [r["policy"] for r in res["fig10"]][-1] == "prompt_tree_local"
    argv = [*base, "--configs", "PD-CC,1P1D-CC", "--sweep", "1,50", "--trace-window", "12"]
    assert main(argv) == 0
    res = json.loads((out / "trace_layouts.json").read_text())
    assert {(r["config"], r["load"]) for r in res["rows"]} == {
        (c, x) for c in ("PD-CC", "1P1D-CC") for x in (1, 50)
    }
    assert set(res["capacity"]) == {"PD-CC", "1P1D-CC"}
    assert (out / "trace_layouts.png").stat().st_size > 0
    with pytest.raises(ConfigError, match="loads"):
        main([*base, "--sweep", "1,x"])
