"""Prefix-index micro-benchmark: the block radix tree against vLLM-style hash chains.

The baseline is written here: a block's key is the hash of (its parent block's key, its
tokens), one dict maps key -> block id, and a lookup walks the prompt block by block.
Two variants: Python's builtin ``hash`` of a tuple, and ``hashlib.sha256`` over the parent
digest and the block's int64 bytes (collision-proof, as vLLM's default now is).

For each prompt length, every index holds the same background of other prompts plus
the target prompt. Measured:

- match: longest cached prefix of the target, which is fully cached;
- insert: a new prompt (sharing nothing), undone after each timing.

Every index receives the prompt as an ``array('q')``, the radix tree's native token type;
the ``radix (list)`` row passes a Python list, so its time includes the conversion. The
``radix (8 turns)`` row caches the target as 8 growing turns (8 nodes on its path), as a
multi-turn conversation leaves it. The ``MemPool`` row is the engine's own pool call on the
same radix index: ``match`` of the ``array('q')`` a request holds, which takes a reference
on every block and updates the evictable count (its ``free_mem`` is the untimed undo), and
``insert`` of held blocks (undone with ``delete``). ``MemPool (cycle)`` times ``match`` and
``free_mem`` together, as a request that hits the cache and finishes does.

    python bench/index.py            # 1k, 8k and 32k-token prompts, block size 16
    python bench/index.py --quick

Prints a table and writes bench/results/index.json.
"""

from __future__ import annotations

import argparse
import gc
import hashlib
import json
import platform
import random
import statistics
import time
from array import array
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from tqdm.auto import tqdm

from minimemserve.blocks.layout import KVLayout
from minimemserve.mempool import MemPool
from minimemserve.mempool.radix import RadixTree

RESULTS = Path(__file__).resolve().parent / "results" / "index.json"
BLOCK_SIZE = 16
LENGTHS = (1024, 8192, 32768)
VOCAB = 32000  # Llama-2's vocabulary
BACKGROUND = 16  # other cached prompts, so dicts and trees are not trivially small
TURNS = 8  # growing turns of the multi-turn variant
WARMUP = 20
# Seconds of timing per cell; the repeat count follows from a first estimate.
CELL_BUDGET_S = 0.5
QUICK_CELL_BUDGET_S = 0.1
MIN_REPS, MAX_REPS = 50, 2000
TARGET_LENGTH = 8192
TARGET_MATCH_US = 50.0  # radix match of a fully cached 8k-token prompt
TARGET_POOL_MATCH_US = 20.0  # MemPool.match of the same prompt, references taken
TARGET_SPEEDUP = 5.0  # over the sha256 chain, same prompt


class HashChainIndex:
    """vLLM-style block index: key(block) = H(key(parent), tokens of the block)."""

    def __init__(self, block_size: int, kind: str) -> None:
        """``kind`` is "builtin" (``hash`` of a tuple) or "sha256"."""
        if kind not in ("builtin", "sha256"):
            raise ValueError(f"unknown hash kind {kind!r}")
        self.block_size = block_size
        self.blocks: dict = {}
        self._key = self._builtin_keys if kind == "builtin" else self._sha256_keys

    def _builtin_keys(self, tokens: array):
        bs = self.block_size
        parent = None
        for start in range(0, len(tokens) - len(tokens) % bs, bs):
            parent = hash((parent, tuple(tokens[start : start + bs])))
            yield parent

    def _sha256_keys(self, tokens: array):
        bs = self.block_size
        parent = b""
        sha256 = hashlib.sha256
        for start in range(0, len(tokens) - len(tokens) % bs, bs):
            parent = sha256(parent + tokens[start : start + bs].tobytes()).digest()
            yield parent

    def match(self, tokens: array) -> list[int]:
        """Block ids of the longest cached prefix."""
        out = []
        blocks = self.blocks
        for key in self._key(tokens):
            b = blocks.get(key)
            if b is None:
                break
            out.append(b)
        return out

    def insert(self, tokens: array, values: list[int]) -> list:
        """Add the blocks not cached yet; return the keys added (to undo the insert)."""
        added = []
        blocks = self.blocks
        for key, v in zip(self._key(tokens), values):
            if key not in blocks:
                blocks[key] = v
                added.append(key)
        return added

    def remove(self, keys: list) -> None:
        """Undo an insert."""
        for key in keys:
            del self.blocks[key]


def random_prompt(rng: random.Random, n: int) -> array:
    """``n`` random token ids below the vocabulary size, as ``array('q')``."""
    return array("q", (rng.randrange(VOCAB) for _ in range(n)))


def time_calls(
    call: Callable[[], object], undo: Callable[[object], None] | None, budget_s: float
) -> list[float]:
    """Per-call times in µs: warm-up, then repeats sized to ``budget_s`` seconds."""

    def once() -> float:
        t0 = time.perf_counter_ns()
        out = call()
        dt = (time.perf_counter_ns() - t0) / 1e3
        if undo is not None:
            undo(out)
        return dt

    first = [once() for _ in range(WARMUP)]
    reps = int(min(MAX_REPS, max(MIN_REPS, budget_s * 1e6 / max(statistics.median(first), 1))))
    gc_was_on = gc.isenabled()
    gc.disable()  # as timeit does: collections would land in random samples
    try:
        return [once() for _ in range(reps)]
    finally:
        if gc_was_on:
            gc.enable()


def summary(times: list[float]) -> dict[str, float]:
    """Median, P99 and count of per-call times (µs)."""
    ordered = sorted(times)
    p99 = ordered[min(len(ordered) - 1, int(0.99 * len(ordered)))]
    return {"median_us": statistics.median(ordered), "p99_us": p99, "reps": len(ordered)}


@dataclass
class Indexes:
    """Every index under test, each holding the background prompts and ``target``; ``fresh``
    is a prompt none holds (what inserts add). ``pool`` holds ``held`` blocks to insert."""

    target: array
    fresh: array
    values: list[int]
    radix: RadixTree
    turns: RadixTree  # target inserted in growing turns, as a conversation does
    pool: MemPool
    held: list[int]
    chains: dict[str, HashChainIndex]


def build_indexes(n: int, rng: random.Random) -> Indexes:
    """The indexes for prompts of ``n`` tokens, filled."""
    bs = BLOCK_SIZE
    nb = n // bs
    background = [random_prompt(rng, n) for _ in range(BACKGROUND)]
    target = random_prompt(rng, n)
    fresh = random_prompt(rng, n)
    values = list(range(nb))
    radix = RadixTree(bs)
    turns = RadixTree(bs)
    for p in background:
        radix.insert(p, values)
        turns.insert(p, values)
    radix.insert(target, values)
    for k in range(1, TURNS + 1):
        cut = nb * k // TURNS
        turns.insert(target[: cut * bs], values[:cut])
    # the smallest KV geometry: the pool's bookkeeping is what is timed here
    pool = MemPool(KVLayout(1, bs, 1, 1), (BACKGROUND + 2) * nb)
    for p in background + [target]:
        blocks = pool.alloc_mem(nb)
        pool.insert(p, blocks)
        pool.free_mem(blocks)
    chains = {kind: HashChainIndex(bs, kind) for kind in ("builtin", "sha256")}
    for chain in chains.values():
        for p in background + [target]:
            chain.insert(p, values)
    return Indexes(target, fresh, values, radix, turns, pool, pool.alloc_mem(nb), chains)


def _undo_radix(tree: RadixTree, fresh: array) -> Callable[[object], None]:
    def undo(_: object) -> None:
        tree.remove(tree.match_prefix(fresh, touch=False).nodes[0])

    return undo


def index_cases(ix: Indexes) -> dict[str, tuple]:
    """name -> (match, undo of a match, insert, undo of an insert)."""
    target, fresh, values, pool = ix.target, ix.fresh, ix.values, ix.pool
    target_list, fresh_list = target.tolist(), fresh.tolist()
    cases = {
        "radix": (
            lambda: ix.radix.match_prefix(target),
            None,
            lambda: ix.radix.insert(fresh, values),
            _undo_radix(ix.radix, fresh),
        ),
        "radix (list)": (
            lambda: ix.radix.match_prefix(target_list),
            None,
            lambda: ix.radix.insert(fresh_list, values),
            _undo_radix(ix.radix, fresh),
        ),
        "radix (8 turns)": (
            lambda: ix.turns.match_prefix(target),
            None,
            lambda: ix.turns.insert(fresh, values),
            _undo_radix(ix.turns, fresh),
        ),
        "MemPool": (
            lambda: pool.match(target),
            pool.free_mem,
            lambda: pool.insert(fresh, ix.held),
            lambda _: pool.delete(fresh),
        ),
        "MemPool (cycle)": (
            lambda: pool.free_mem(pool.match(target)),
            None,
            lambda: pool.insert(fresh, ix.held),
            lambda _: pool.delete(fresh),
        ),
    }
    for kind, chain in ix.chains.items():
        cases[f"chain {kind}"] = (
            lambda c=chain: c.match(target),
            None,
            lambda c=chain: c.insert(fresh, values),
            chain.remove,
        )
    return cases


def bench_length(n: int, rng: random.Random, budget_s: float) -> dict[str, dict]:
    """Match and insert times of every index for prompts of ``n`` tokens."""
    ix = build_indexes(n, rng)
    nb = n // BLOCK_SIZE
    # every index must find the whole target
    assert len(ix.radix.match_prefix(ix.target).values) == nb
    assert len(ix.turns.match_prefix(ix.target).values) == nb
    assert ix.pool.cached_prefix_len(ix.target) == n
    assert all(len(c.match(ix.target)) == nb for c in ix.chains.values())
    out = {}
    for name, (match, match_undo, insert, insert_undo) in index_cases(ix).items():
        out[name] = {
            "match": summary(time_calls(match, match_undo, budget_s)),
            "insert": summary(time_calls(insert, insert_undo, budget_s)),
        }
    return out


def table_lines(results: dict[int, dict]) -> list[str]:
    """The table of every index at every length, each beside radix."""
    header = (
        f"{'tokens':>6} {'index':<16} {'match med':>10} {'match p99':>10} "
        f"{'insert med':>10} {'insert p99':>10} {'match ×radix':>12} {'insert ×radix':>13}"
    )
    lines = [
        f"block size {BLOCK_SIZE}, times in µs, ×radix = this index's median / radix's",
        header,
    ]
    for n, by_index in results.items():
        base = by_index["radix"]
        for name, r in by_index.items():
            m, i = r["match"], r["insert"]
            lines.append(
                f"{n:>6} {name:<16} {m['median_us']:>10.1f} {m['p99_us']:>10.1f} "
                f"{i['median_us']:>10.1f} {i['p99_us']:>10.1f} "
                f"{m['median_us'] / base['match']['median_us']:>12.1f} "
                f"{i['median_us'] / base['insert']['median_us']:>13.1f}"
            )
    return lines


def main() -> None:
    """Time every index at every prompt length; print the table and targets, write JSON and
    a plot."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="shorter timing per cell")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    budget_s = QUICK_CELL_BUDGET_S if args.quick else CELL_BUDGET_S
    rng = random.Random(args.seed)

    results: dict[int, dict] = {}
    for n in tqdm(LENGTHS, desc="prompt lengths"):
        results[n] = bench_length(n, rng, budget_s)

    lines = table_lines(results)
    at = results[TARGET_LENGTH]
    radix_match = at["radix"]["match"]["median_us"]
    pool_match = at["MemPool"]["match"]["median_us"]
    speedup = at["chain sha256"]["match"]["median_us"] / radix_match
    targets = {
        "radix_match_8k_us": radix_match,
        "radix_match_8k_ok": radix_match <= TARGET_MATCH_US,
        "pool_match_8k_us": pool_match,
        "pool_match_8k_ok": pool_match <= TARGET_POOL_MATCH_US,
        "sha256_over_radix_8k": speedup,
        "sha256_over_radix_8k_ok": speedup >= TARGET_SPEEDUP,
    }
    lines.append(
        f"target: radix match at 8k <= {TARGET_MATCH_US:.0f} µs: {radix_match:.1f} µs "
        f"({'holds' if targets['radix_match_8k_ok'] else 'MISSED'})"
    )
    lines.append(
        f"target: pool match at 8k <= {TARGET_POOL_MATCH_US:.0f} µs: {pool_match:.1f} µs "
        f"({'holds' if targets['pool_match_8k_ok'] else 'MISSED'})"
    )
    lines.append(
        f"target: >= {TARGET_SPEEDUP:.0f}x faster than the sha256 chain at 8k: {speedup:.1f}x "
        f"({'holds' if targets['sha256_over_radix_8k_ok'] else 'MISSED'})"
    )
    print("\n".join(lines))

    RESULTS.parent.mkdir(parents=True, exist_ok=True)
    plot_results(results, RESULTS.with_suffix(".png"))
    RESULTS.write_text(
        json.dumps(
            {
                "block_size": BLOCK_SIZE,
                "background_prompts": BACKGROUND,
                "python": platform.python_version(),
                "machine": platform.machine(),
                "results": {str(n): r for n, r in results.items()},
                "targets": targets,
            },
            indent=2,
        )
    )
    print(f"wrote {RESULTS}")


def plot_results(results: dict, path) -> None:
    """Bars of match time per index and prompt length (log scale)."""
    from plotting import grouped_bars

    sizes = sorted(results)
    names = list(results[sizes[0]])
    grouped_bars(
        path,
        "prefix match of a cached prompt (median, block size 16)",
        [f"{n} tokens" for n in sizes],
        {name: [results[n][name]["match"]["median_us"] for n in sizes] for name in names},
        "µs",
        log=True,
    )
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
