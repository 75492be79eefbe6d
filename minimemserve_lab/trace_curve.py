"""The cache-hit curve of a trace: MemPool alone replays its prompts at each capacity.

No timing and no model: one ``MemPool`` on the ``meta`` device per capacity does, per request
in arrival order, what a caching instance does (``match``, ``alloc_mem`` of the rest, which
evicts cached blocks LRU-first, ``insert``, ``free_mem``), and the hit rate is the prompt
tokens ``match`` served over all prompt tokens. One pool block is one trace block: the
prompts are synthesised at length scale :data:`CURVE_LENGTH_SCALE` (16 tokens per 512-token
trace block), so the pool holds 16-token blocks, capacities are divided by the same scale and
the 145M prompt tokens of the conversation trace replay in seconds; hits are counted in the
trace's tokens (a hit block is 512, the last partial one its own length). This is the LRU
analysis Mooncake published (FAST'25, Fig. 9), done by the pool the engine uses.
"""

from __future__ import annotations

import json
import math
import time
from collections.abc import Sequence
from pathlib import Path

from minimemserve.blocks.layout import KVLayout
from minimemserve.errors import ConfigError
from minimemserve.mempool import MemPool
from minimemserve.workloads.trace import TRACE_BLOCK, Trace, load_trace

# Trace tokens per pool token in the curve: one 16-token pool block per 512-token trace block.
CURVE_LENGTH_SCALE = 32
# Synthesised token ids range over this many values (any vocabulary works for the index).
CURVE_VOCAB = 1 << 31
# Mooncake's published points on the conversation trace (FAST'25, Table 2 and Fig. 9): the
# LRU hit rate at unlimited capacity, and a 3M-token cache reaching 41 % of it.
MOONCAKE_MAX_HIT = 0.40
MOONCAKE_POINTS = ((3e6, 0.41 * MOONCAKE_MAX_HIT),)


def parse_capacities(text: str) -> list[float]:
    """``"1e4,1e5,..."`` as capacities in tokens (each > 0)."""
    try:
        caps = [float(c) for c in text.split(",") if c.strip()]
    except ValueError:
        raise ConfigError(f"--cache-curve takes comma-separated token counts: {text!r}") from None
    if not caps or not all(0 < c < math.inf for c in caps):
        raise ConfigError(f"--cache-curve capacities must be finite and > 0, got {text!r}")
    return caps


def replay_hit_rate(trace: Trace, capacity_tokens: float | None) -> float:
    """Prompt tokens served from a MemPool of ``capacity_tokens`` trace tokens (None:
    unlimited) over all prompt tokens, the trace replayed in order; the pool is audited."""
    bs, scale = trace.block_tokens, trace.length_scale
    per_block = TRACE_BLOCK // scale  # pool tokens per trace block
    if bs != per_block:
        raise ValueError(f"the curve needs one pool block per trace block, not {bs} tokens")
    if capacity_tokens is None:
        blocks = sum(len(r.hash_ids) for r in trace.requests)  # never full
    else:
        blocks = int(capacity_tokens // TRACE_BLOCK)
    if blocks < 1:
        raise ValueError(f"capacity {capacity_tokens:g} tokens is less than one trace block")
    pool = MemPool(KVLayout(1, bs, 1, 1), blocks, device="meta")
    hit = total = 0
    for req in trace.requests:
        toks = trace.prompt(req, CURVE_VOCAB)
        whole = min(len(toks) // bs, pool.capacity())  # a prompt longer than the pool: its head
        got = pool.match(toks)
        fresh = pool.alloc_mem(whole - len(got))
        pool.insert(toks[: whole * bs], got + fresh)
        pool.free_mem(got + fresh)
        original = req.input_length * scale  # in trace tokens, as the file gives it
        hit += min(len(got) * TRACE_BLOCK, original)
        total += original
    pool.check()
    return hit / total


def cache_curve(
    trace_path: str | Path | None,
    capacities: Sequence[float],
    out_dir: str | Path,
    window: tuple[int, int | None] = (0, None),
    progress: bool = True,
    max_context: int | None = None,
    max_output_tokens: int | None = None,
) -> dict:
    """The hit rate at each capacity (tokens) and unlimited; writes ``cache_curve.json`` and
    ``cache_curve.png`` (Mooncake's published points beside ours) to ``out_dir``. With
    ``max_context``, only the requests whose scaled prompt and output (capped at
    ``max_output_tokens``) fit it, as ``minimemserve trace`` writes them for a server."""
    trace = load_trace(trace_path, window=window, length_scale=CURVE_LENGTH_SCALE)
    if max_context is not None:
        trace = trace.limited(max_context, max_output_tokens)
    t0 = time.perf_counter()
    points = []
    for cap in sorted(capacities):
        points.append({"capacity_tokens": cap, "hit_rate": replay_hit_rate(trace, cap)})
        if progress:
            p = points[-1]
            print(f"capacity {cap:.3g} tokens: hit rate {p['hit_rate']:.4f}", flush=True)
    top = replay_hit_rate(trace, None)
    result = {
        "trace": str(trace.path),
        "requests": len(trace.requests),
        "max_context": max_context,
        "prompt_tokens": trace.prompt_tokens() * CURVE_LENGTH_SCALE,
        "pool_block_tokens": trace.block_tokens,
        "length_scale": CURVE_LENGTH_SCALE,
        "curve": points,
        "max_hit_rate": top,
        "mooncake": {"max_hit_rate": MOONCAKE_MAX_HIT, "points": MOONCAKE_POINTS},
        "wall_s": time.perf_counter() - t0,
    }
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    path = out / "cache_curve.json"
    path.write_text(json.dumps(result, indent=1))
    png = out / "cache_curve.png"
    plot_curve(result, png)
    result["files"] = [str(path), str(png)]
    if progress:
        print(f"unlimited: hit rate {top:.4f} ({result['wall_s']:.1f} s); wrote {path}, {png}")
    return result


def plot_curve(result: dict, png: Path) -> None:
    """Our hit rate against capacity, with Mooncake's published points."""
    from matplotlib.figure import Figure  # lazy: slow to import, only plots need it

    fig = Figure(figsize=(7, 4.5), layout="tight")
    ax = fig.subplots()
    caps = [p["capacity_tokens"] for p in result["curve"]]
    ax.plot(caps, [p["hit_rate"] for p in result["curve"]], marker="o", label="MemPool (LRU)")
    ax.axhline(result["max_hit_rate"], ls="--", color="C0", label="MemPool, unlimited")
    m = result["mooncake"]
    ax.axhline(m["max_hit_rate"], ls=":", color="C3", label="Mooncake, unlimited (Fig. 9)")
    xs, ys = zip(*m["points"])
    ax.plot(xs, ys, "s", color="C3", label="Mooncake, 3M tokens (41 % of max)")
    ax.set_xscale("log")
    ax.set_xlabel("cache capacity (tokens)")
    ax.set_ylabel("prompt tokens served from cache")
    ax.set_title(f"{Path(result['trace']).name}: {result['requests']} requests")
    ax.legend(fontsize=8)
    fig.savefig(png, dpi=100)
