"""``minimemserve explain``: watch the MemPool calls a configuration makes.

Caching and disaggregation are the same pool calls composed differently (the recipe table in
:mod:`minimemserve.recipes`). This runs a two-turn conversation on a deployment in this
process and records, in order, every call on every instance's pool (with the block ids it
took or gave, what it matched, indexed and sent) and every recipe hook that made calls; two
configurations print side by side, turn by turn. Calls outside a hook are the local
scheduler's allocations, which every configuration shares."""

from __future__ import annotations

import argparse
import itertools
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path

from .errors import MiniMemServeError
from .llm import LLM
from .recipes import Hook, Recipe
from .sampling import SamplingParams

TURNS = (
    "Explain how a memory pool serves a cache.",
    "And how does it hand a request to another instance?",
)
WIDTH = 64  # characters of one configuration's column
# tier moves a call can cause (eviction, offload to dram, onload back): shown after its line
MOVES = ("evicted_blocks", "offloaded_blocks", "onloaded_blocks")


@dataclass
class Event:
    """One line of a trace: a turn starting (``kind`` "turn"), a recipe hook of
    ``instance`` ("hook", ``ops`` its pool calls by recipe name) or a call on its pool
    (``kind`` the method's name), ``depth`` calls deep."""

    depth: int
    instance: str
    kind: str
    text: str = ""
    ops: tuple[str, ...] = ()
    n: int = 0  # blocks asked, for alloc_mem


def _ids(blocks: Sequence[int]) -> str:
    """``[3-5, 9]``: block ids with ascending runs folded."""
    runs: list[str] = []
    for _, grp in itertools.groupby(enumerate(blocks), key=lambda p: p[1] - p[0]):
        run = [b for _, b in grp]
        runs.append(str(run[0]) if len(run) == 1 else f"{run[0]}-{run[-1]}")
    return "[" + ", ".join(runs) + "]"


def _toks(tokens) -> str:
    return f"{len(tokens)} tok"


def _peer(dst) -> str:
    return f"->{getattr(dst, 'instance_id', '?')}"


# call name -> what its line says, from (args, result)
DESCRIBE: dict[str, Callable[[tuple, object], str]] = {
    "alloc_mem": lambda a, r: f"alloc_mem({a[0]}) -> {_ids(r)}",
    "free_mem": lambda a, r: f"free_mem({_ids(a[0])})",
    "match": lambda a, r: f"match({_toks(a[0])}) -> {_ids(r)} hit",
    "insert": lambda a, r: f"insert({_toks(a[0])}, {_ids(a[1])}) -> {r} new",
    "delete": lambda a, r: f"delete({_toks(a[0])}) -> {r} dropped",
    "transfer": lambda a, r: f"transfer({_peer(a[0])}, {_ids(a[1])}) -> {_ids(r)}",
    "transfer_with_insert": lambda a, r: (
        f"transfer_with_insert({_peer(a[0])}, {_toks(a[1])}, {_ids(a[2])}) -> {_ids(r)}"
    ),
    "send_cached": lambda a, r: f"send_cached({_peer(a[0])}, {_toks(a[1])}) -> {_ids(r)}",
    "recv_alloc": lambda a, r: f"recv_alloc({a[1]}) -> matched {_ids(r[0])}, new {_ids(r[1])}",
    "recv_copy": lambda a, r: f"recv_copy({_ids(a[0])} <- {_ids(a[2])})",
    "recv_commit": lambda a, r: (
        f"recv_commit({_ids(a[1])})"
        if a[0] is None
        else f"recv_commit({_toks(a[0])}, {_ids(a[1])})"
    ),
    "recv_abort": lambda a, r: f"recv_abort({_ids(a[0])})",
}


class _HookTrace:
    """A recipe that records each hook it runs with pool calls, then runs it."""

    def __init__(self, recipe: Recipe, instance: str, trace: PoolTrace) -> None:
        self.recipe = recipe
        self.instance = instance
        self.trace = trace

    def __getattr__(self, name: str):
        return getattr(self.recipe, name)

    def run(self, hook: Hook, pool, req, peers=None):
        """``Recipe.run``, recorded as one hook event with the calls below it."""
        ops = getattr(self.recipe, hook.value)
        if not ops:
            return self.recipe.run(hook, pool, req, peers)
        text = f"{hook.value}: {', '.join(ops)}"
        return self.trace.nested(
            Event(self.trace.depth, self.instance, "hook", text, ops),
            lambda: self.recipe.run(hook, pool, req, peers),
        )


class PoolTrace:
    """The pool calls and recipe hooks of the engines it :meth:`watch`\\es, in order."""

    def __init__(self) -> None:
        self.events: list[Event] = []
        self.depth = 0

    def nested(self, event: Event, fn: Callable[[], object]):
        """Record ``event``, run ``fn`` one level deeper; its result."""
        self.events.append(event)
        self.depth += 1
        try:
            return fn()
        finally:
            self.depth -= 1

    def watch(self, engine) -> None:
        """Record ``engine``'s pool calls and recipe hooks from now on (wrappers on this one
        engine's pool and recipe: nothing else changes)."""
        pool = engine.pool
        for call, describe in DESCRIBE.items():
            setattr(pool, call, self._wrap(pool, call, describe, getattr(pool, call)))
        hooks = _HookTrace(engine.recipe, pool.instance_id, self)
        engine.recipe = engine.scheduler.recipe = hooks

    def _wrap(self, pool, call: str, describe, fn: Callable):
        def traced(*args, **kwargs):
            n = args[0] if call == "alloc_mem" else 0
            event = Event(self.depth, pool.instance_id, call, call, n=n)
            before = [pool.counter(m) for m in MOVES]
            try:
                out = self.nested(event, lambda: fn(*args, **kwargs))
            except Exception as e:
                event.text = f"{call}: raised {type(e).__name__}"
                raise
            moved = [pool.counter(m) - b for m, b in zip(MOVES, before)]
            tiers = ", ".join(f"{m.split('_')[0]} {k}" for m, k in zip(MOVES, moved) if k)
            event.text = describe(args, out) + (f" ({tiers})" if tiers else "")
            return out

        return traced

    def turn(self, text: str) -> None:
        """Mark the start of a turn."""
        self.events.append(Event(0, "", "turn", text))


def run_conversation(
    config: str,
    model_dir: str | Path | None = None,
    max_tokens: int = 6,
    **engine: int,
) -> tuple[list[Event], list[list[int]]]:
    """Run :data:`TURNS` as one conversation (the second prompt holds the first and its
    answer) on ``config`` in this process, greedy; the trace and each turn's output tokens.
    ``engine``: ``EngineConfig`` fields (default: blocks of 8 tokens, 64 of them). Every
    pool balances after it (``check_pools``)."""
    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
    trace, outputs = PoolTrace(), []
    engine = {"block_size": 8, "num_blocks": 64} | engine
    with LLM(model_dir, config=config, **engine) as llm:
        for inst in llm.engine.instances:
            trace.watch(inst.engine)
        ids: list[int] = []
        for i, text in enumerate(TURNS):
            ids = ids + llm.tokenizer.encode(text, add_bos=not ids)
            trace.turn(f"turn {i + 1}: {len(ids)} prompt tokens")
            (out,) = llm.generate([ids], params)
            outputs.append(out.token_ids)
            ids = ids + out.token_ids
        llm.engine.check_pools()
    return trace.events, outputs


def _line(e: Event) -> str:
    if e.kind == "turn":
        return f"-- {e.text} --"
    return f"{e.instance:<3}{'  ' * e.depth}{e.text}"


def render(traces: dict[str, list[Event]], width: int = WIDTH) -> str:
    """The traces side by side, one column per configuration, aligned at each turn."""
    cols = list(traces)
    turns = {c: _split_turns(traces[c]) for c in cols}
    lines = ["  ".join(f"{c:<{width}}" for c in cols).rstrip()]
    for parts in zip(*(turns[c] for c in cols)):
        for row in itertools.zip_longest(*parts, fillvalue=None):
            cells = ["" if e is None else _line(e)[:width] for e in row]
            lines.append("  ".join(f"{cell:<{width}}" for cell in cells).rstrip())
    return "\n".join(lines)


def _split_turns(events: list[Event]) -> list[list[Event]]:
    out: list[list[Event]] = []
    for e in events:
        if e.kind == "turn" or not out:
            out.append([])
        out[-1].append(e)
    return out


def add_arguments(ap: argparse.ArgumentParser) -> argparse.ArgumentParser:
    """The options of ``minimemserve explain``."""
    ap.add_argument("--config", default="1P1D-CC", help="the configuration to watch")
    ap.add_argument(
        "--compare",
        default=None,
        help="a second configuration, printed beside it (default: PD-CC, or PD for PD-CC); "
        "'none' prints one column",
    )
    ap.add_argument("--model", default=None, help="HF checkpoint dir (default: the tiny preset)")
    ap.add_argument("--max-tokens", type=int, default=6, help="tokens generated per turn")
    ap.add_argument("--block-size", type=int, default=8, help="tokens per KV block")
    ap.add_argument("--num-blocks", type=int, default=64, help="hbm blocks per instance")
    ap.add_argument(
        "--dram-blocks", type=int, default=0, help="dram blocks per instance (offload tier)"
    )
    ap.add_argument("--width", type=int, default=WIDTH, help="characters per column")
    return ap


def main(args: argparse.Namespace) -> int:
    """Run the conversation on each configuration and print the traces side by side."""
    compare = args.compare or ("PD" if args.config == "PD-CC" else "PD-CC")
    configs = [args.config] + ([] if compare.lower() == "none" else [compare])
    traces, outputs = {}, {}
    sizes = {"block_size": args.block_size, "num_blocks": args.num_blocks}
    try:
        for config in dict.fromkeys(configs):
            traces[config], outputs[config] = run_conversation(
                config, args.model, args.max_tokens, dram_blocks=args.dram_blocks, **sizes
            )
    except (MiniMemServeError, ValueError) as e:  # a bad configuration name or size
        raise SystemExit(f"minimemserve explain: {e}") from None
    print(render(traces, args.width))
    same = len({tuple(map(tuple, o)) for o in outputs.values()}) == 1
    print(f"\ngreedy tokens {'the same' if same else 'DIFFER'} under {', '.join(traces)}")
    return 0
