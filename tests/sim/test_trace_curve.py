"""The cache curve (MemPool replaying a trace) against an LRU over hash ids written here."""

from __future__ import annotations

import json
import random
from collections import OrderedDict

import pytest

from minimemserve.cli import main
from minimemserve.workloads.trace import TRACE_BLOCK, default_trace_path, load_trace
from minimemserve_lab.trace_curve import CURVE_LENGTH_SCALE, parse_capacities, replay_hit_rate


def lru_hit_rate(rows: list[dict], capacity_tokens: float | None) -> float:
    """Block-level LRU over hash ids: a request hits its longest run of cached whole blocks
    from the start; then its whole blocks are cached, the first most recent."""
    cap = None if capacity_tokens is None else int(capacity_tokens // TRACE_BLOCK)
    cache: OrderedDict[int, None] = OrderedDict()
    hit = total = 0
    for r in rows:
        ids, n = r["hash_ids"], r["input_length"]
        whole = n // TRACE_BLOCK if cap is None else min(n // TRACE_BLOCK, cap)
        k = 0
        while k < whole and ids[k] in cache:
            k += 1
        hit += k * TRACE_BLOCK
        total += n
        for h in reversed(ids[:whole]):
            cache[h] = None
            cache.move_to_end(h)
        while cap is not None and len(cache) > cap:
            cache.popitem(last=False)
    return hit / total


def _conversations(n: int, seed: int) -> list[dict]:
    """A chat-like trace: a shared first block, conversations whose turns extend their history."""
    rng = random.Random(seed)
    rows, convs, next_id, t = [], [], 1, 0
    for _ in range(n):
        if convs and rng.random() < 0.6:
            ids = rng.choice(convs)
        else:
            ids = [0]
            convs.append(ids)
        grow = rng.randint(1, 6)
        ids += range(next_id, next_id + grow)
        next_id += grow
        length = (len(ids) - 1) * TRACE_BLOCK + rng.randint(1, TRACE_BLOCK)
        t += rng.randint(0, 2000)
        row = {"timestamp": t, "input_length": length, "output_length": 5, "hash_ids": list(ids)}
        rows.append(row)
    return rows


def test_curve_matches_an_independent_lru_on_a_generated_trace(tmp_path):
    rows = _conversations(300, seed=1)
    path = tmp_path / "t.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    trace = load_trace(path, length_scale=CURVE_LENGTH_SCALE)
    rates = []
    for cap in (4 * TRACE_BLOCK, 40 * TRACE_BLOCK, 400 * TRACE_BLOCK, None):
        ours, ref = replay_hit_rate(trace, cap), lru_hit_rate(rows, cap)
        assert abs(ours - ref) <= 0.03, (cap, ours, ref)
        rates.append(ours)
    assert rates == sorted(rates) and rates[-1] > 0.3  # more room, more hits


def test_cli_writes_the_curve_and_its_plot(tmp_path):
    rows = _conversations(60, seed=2)
    path = tmp_path / "t.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    argv = ["sim", "--trace", str(path), "--cache-curve", "2048,1e5", "--out", str(tmp_path)]
    assert main(argv) == 0
    res = json.loads((tmp_path / "cache_curve.json").read_text())
    assert [p["capacity_tokens"] for p in res["curve"]] == [2048, 1e5]
    assert res["max_hit_rate"] == pytest.approx(lru_hit_rate(rows, None), abs=0.03)
    assert (tmp_path / "cache_curve.png").stat().st_size > 0
    with pytest.raises(ValueError, match="cache-curve"):
        parse_capacities("1e4,x")


def test_the_curve_of_what_a_context_holds(tmp_path):
    """``--max-context`` (with ``--max-output-tokens``): the curve of the requests ``minimemserve
    trace`` writes for a server of that context, the scaled prompt and capped output within it,
    not of the whole window."""
    rows = _conversations(60, seed=2)
    path = tmp_path / "t.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    limits = ["--max-context", "200", "--max-output-tokens", "4"]
    argv = ["sim", "--trace", str(path), "--cache-curve", "1e5", *limits, "--out", str(tmp_path)]
    assert main(argv) == 0
    res = json.loads((tmp_path / "cache_curve.json").read_text())
    fitted = load_trace(path, length_scale=CURVE_LENGTH_SCALE).limited(200, 4)
    assert 0 < res["requests"] == len(fitted.requests) < len(rows)
    assert res["max_context"] == 200
    assert res["max_hit_rate"] == replay_hit_rate(fitted, None)


def test_curve_on_the_conversation_trace():
    try:
        path = default_trace_path()
    except FileNotFoundError as e:
        pytest.skip(str(e))
    rows = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
    trace = load_trace(path, length_scale=CURVE_LENGTH_SCALE)
    for cap in (3e6, None):
        assert abs(replay_hit_rate(trace, cap) - lru_hit_rate(rows, cap)) <= 0.03
