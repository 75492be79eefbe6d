"""``minimemserve explain``: watch the MemPool calls a configuration makes.

Caching and disaggregation are the same pool calls composed differently (the recipe table in
:mod:`minimemserve.recipes`). This runs a two-turn conversation on a deployment in this
process and records, in order, every call on every instance's pool (with the block ids it
took or gave, what it matched, indexed and sent) and every recipe hook that made calls; two
configurations print side by side, turn by turn, the rows where their calls differ marked,
with a legend and a summary per configuration (prompt tokens, tokens the cache served, blocks
sent between instances). Calls outside a hook are the local scheduler's allocations, which
every configuration shares; calls given nothing to do (``alloc_mem(0)``) are recorded but not
shown."""

from __future__ import annotations

import argparse
import difflib
import itertools
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
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
LABEL = 36  # characters of a summary row's label
MARK = "*"  # before a row whose calls differ between the configurations
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
    n: int = 0  # blocks asked, for alloc_mem; prompt tokens, for a turn
    empty: bool = False  # a call given nothing to do: recorded, not shown
    facts: dict[str, int] = field(default_factory=dict)  # what it adds to the summary


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


# calls given nothing to do (a transfer whose blocks the receiver all had allocates none)
EMPTY: dict[str, Callable[[tuple], bool]] = {
    "alloc_mem": lambda a: a[0] == 0,
    "free_mem": lambda a: not a[0],
    "transfer": lambda a: not a[1],
    "recv_copy": lambda a: not a[0],
    "recv_abort": lambda a: not a[0],
}

# call name -> the summary's counts it carries, from (pool, args, result): tokens a match
# found cached, blocks copied into this pool, blocks a receiver already had
FACTS: dict[str, Callable[[object, tuple, object], dict[str, int]]] = {
    "match": lambda p, a, r: {"hit": len(r) * p.block_size},
    "recv_copy": lambda p, a, r: {"sent": len(a[0])},
    "recv_alloc": lambda p, a, r: {"found": len(r[0])},
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
            empty = call in EMPTY and EMPTY[call](args)
            event = Event(self.depth, pool.instance_id, call, call, n=n, empty=empty)
            before = [pool.counters[m] for m in MOVES]
            try:
                out = self.nested(event, lambda: fn(*args, **kwargs))
            except Exception as e:
                event.text = f"{call}: raised {type(e).__name__}"
                raise
            moved = [pool.counters[m] - b for m, b in zip(MOVES, before)]
            tiers = ", ".join(f"{m.split('_')[0]} {k}" for m, k in zip(MOVES, moved) if k)
            event.text = describe(args, out) + (f" ({tiers})" if tiers else "")
            if call in FACTS:
                event.facts = FACTS[call](pool, args, out)
            return out

        return traced

    def turn(self, text: str, prompt_tokens: int = 0) -> Event:
        """Mark the start of a turn of ``prompt_tokens`` tokens; its event."""
        self.events.append(Event(0, "", "turn", text, n=prompt_tokens))
        return self.events[-1]


def run_conversation(
    config: str,
    model_dir: str | Path | None = None,
    max_tokens: int = 6,
    **engine: int,
) -> tuple[list[Event], list[list[int]]]:
    """Run :data:`TURNS` as one conversation (the second prompt holds the first and its
    answer) on ``config`` in this process, greedy; the trace and each turn's output tokens.
    ``engine``: ``EngineConfig`` fields (default: blocks of 8 tokens, 64 of them). Each turn's
    event keeps the cached tokens its request's metrics report (``facts["cached"]``). Every
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
            turn = trace.turn(f"turn {i + 1}: {len(ids)} prompt tokens", len(ids))
            (out,) = llm.generate([ids], params)
            turn.facts["cached"] = out.metrics.cached_tokens  # as the engine counted them
            outputs.append(out.token_ids)
            ids = ids + out.token_ids
        llm.engine.check_pools()
    return trace.events, outputs


def _line(e: Event) -> str:
    if e.kind == "turn":
        return f"-- {e.text} --"
    return f"{e.instance:<3}{'  ' * e.depth}{e.text}"


def shown(events: list[Event]) -> list[Event]:
    """``events`` without the empty calls and what they made."""
    out: list[Event] = []
    skip_below = None  # the depth of an empty call whose calls are skipped too
    for e in events:
        if skip_below is not None and e.depth > skip_below:
            continue
        skip_below = e.depth if e.empty else None
        if not e.empty:
            out.append(e)
    return out


def _hook_name(e: Event) -> str:
    return e.text.split(":")[0]


def _hooks(events: list[Event]) -> list[tuple[str, int]]:
    """For each event, the hook it is made in (its name and depth; ``("", -1)`` outside)."""
    out, hooks = [], {}  # depth -> the name of the hook open there
    for e in events:
        hooks = {d: h for d, h in hooks.items() if d < e.depth}
        if e.kind == "hook":
            hooks[e.depth] = _hook_name(e)
        depth = max(hooks, default=-1)
        out.append((hooks.get(depth, ""), depth))
    return out


def _keys(events: list[Event]) -> list[tuple[str, int, str]]:
    """What a row compares: the hook a call is made in, its depth and its text (the call, its
    arguments and result), not the instance that makes it."""
    return [(hook, e.depth, e.text) for e, (hook, _) in zip(events, _hooks(events))]


Row = tuple[list[Event | None], bool]  # a row's cells, one per configuration; differs


def _align(a: list[int], b: list[int], keys: list[tuple[list, list]]) -> list[tuple]:
    """Pairs of indices into two sequences (``None`` where one side has no row), matched as
    a diff on the first of ``keys`` (each a pair of key lists), the stretches between
    matches again on the next, looser one."""
    (ka, kb), rest = keys[0], keys[1:]
    diff = difflib.SequenceMatcher(None, [ka[i] for i in a], [kb[j] for j in b], autojunk=False)
    out: list[tuple] = []
    for tag, i1, i2, j1, j2 in diff.get_opcodes():
        if tag != "equal" and rest and a[i1:i2] and b[j1:j2]:
            out += _align(a[i1:i2], b[j1:j2], rest)
        else:
            out += itertools.zip_longest(a[i1:i2], b[j1:j2])
    return out


def _rows(parts: list[list[Event]]) -> list[Row]:
    """One turn's events of each configuration as rows of cells, and whether the row's calls
    differ. Two configurations are aligned as a diff: the calls both make share a row, then
    the calls of one kind in one hook; more are zipped."""
    keys = [_keys(p) for p in parts]
    if len(parts) != 2:
        rows = zip(itertools.zip_longest(*parts), itertools.zip_longest(*keys))
        return [(list(row), len(set(key)) > 1) for row, key in rows]
    (a, b), (ka, kb) = parts, keys
    loose = [[(h, d, e.kind) for (h, d, _), e in zip(k, p)] for k, p in zip(keys, parts)]
    pairs = _align(list(range(len(a))), list(range(len(b))), [(ka, kb), tuple(loose)])
    return [
        (
            [None if i is None else a[i], None if j is None else b[j]],
            i is None or j is None or ka[i] != kb[j],
        )
        for i, j in pairs
    ]


def render(traces: dict[str, list[Event]], width: int = WIDTH) -> str:
    """The traces side by side, one column per configuration, aligned at each turn and at the
    calls they share; a row whose calls differ starts with :data:`MARK` (two or more
    columns). Empty calls are left out."""
    cols = list(traces)
    marks = len(cols) > 1
    turns = {c: _split_turns(shown(traces[c])) for c in cols}
    head = ("  " if marks else "") + "  ".join(f"{c:<{width}}" for c in cols)
    lines = [head.rstrip()]
    for parts in zip(*(turns[c] for c in cols)):
        for row, differs in _rows(list(parts)):
            cells = ["" if e is None else _line(e)[:width] for e in row]
            mark = (f"{MARK} " if differs else "  ") if marks else ""
            lines.append((mark + "  ".join(f"{cell:<{width}}" for cell in cells)).rstrip())
    return "\n".join(lines)


def _split_turns(events: list[Event]) -> list[list[Event]]:
    out: list[list[Event]] = []
    for e in events:
        if e.kind == "turn" or not out:
            out.append([])
        out[-1].append(e)
    return out


@dataclass
class Summary:
    """A trace's counts, one per turn: its prompt tokens, the tokens the arrival hook matched
    in the cache (not computed again), the blocks copied from one instance to another and
    those a receiver already had cached (not copied), and the calls shown."""

    prompt: list[int]
    hit: list[int]
    sent: list[int]
    found: list[int]
    calls: list[int]


def summarize(events: list[Event]) -> Summary:
    """The counts of a trace, turn by turn."""
    turns = _split_turns(events)
    out = Summary(*([0] * len(turns) for _ in range(5)))
    for t, part in enumerate(turns):
        visible = {id(e) for e in shown(part)}
        for e, (hook, hook_depth) in zip(part, _hooks(part)):
            out.prompt[t] += e.n if e.kind == "turn" else 0
            out.calls[t] += e.kind not in ("turn", "hook") and id(e) in visible
            out.sent[t] += e.facts.get("sent", 0)
            out.found[t] += e.facts.get("found", 0)
            if hook == "arrival" and e.kind == "match" and e.depth == hook_depth + 1:
                out.hit[t] += e.facts["hit"]
    return out


SUMMARY_ROWS = (
    ("prompt tokens", "prompt"),
    ("hit tokens (matched on arrival)", "hit"),
    ("blocks sent between instances", "sent"),
    ("blocks the receiver had cached", "found"),
    ("pool calls shown", "calls"),
)


def summary(traces: dict[str, list[Event]]) -> str:
    """Each configuration's :class:`Summary`, a column each: per turn, then in all."""
    sums = {c: summarize(events) for c, events in traces.items()}
    n = max(len(s.prompt) for s in sums.values())
    head = " + ".join(f"turn {i + 1}" for i in range(n)) + " = all"
    table = [[f"summary ({head})", *sums]]
    for label, name in SUMMARY_ROWS:
        cells = [getattr(s, name) for s in sums.values()]
        table.append([f"  {label}"] + [" + ".join(map(str, c)) + f" = {sum(c)}" for c in cells])
    width = max(len(cell) for row in table for cell in row[1:]) + 4
    return "\n".join(
        (f"{row[0]:<{LABEL}}" + "".join(f"{c:<{width}}" for c in row[1:])).rstrip() for row in table
    )


LEGEND = (
    "P0, D0, C0     the instance making the call: prefill, decode, colocated (both)",
    "arrival: ...   a recipe hook and its operations; the pool calls it made are indented",
    "alloc_mem(2)   a call at the left edge: the local scheduler's (not a recipe's)",
    "[0, 2-4]       block ids, ascending runs folded; 27 tok: a sequence of 27 tokens",
    "->D0           the instance a transfer sends to; its recv_* calls are indented below",
    "(offloaded 1)  blocks the call moved between tiers: evicted, offloaded, onloaded",
)


def legend(columns: int = 2) -> str:
    """How to read :func:`render`'s output (the mark only where there are columns to
    compare)."""
    lines = ["legend:"] + [f"  {line}" for line in LEGEND]
    if columns > 1:
        lines.append(f"  {MARK:<14} the configurations' calls differ on this row (instances aside)")
    lines.append("  not shown: calls given nothing to do, as alloc_mem(0) when all was cached")
    return "\n".join(lines)


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
    print(legend(len(traces)) + "\n")
    print(render(traces, args.width) + "\n")
    print(summary(traces))
    same = len({tuple(map(tuple, o)) for o in outputs.values()}) == 1
    print(f"\ngreedy tokens {'the same' if same else 'DIFFER'} under {', '.join(traces)}")
    return 0
