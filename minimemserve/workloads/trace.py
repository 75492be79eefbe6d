"""Production traces in Mooncake's release format: one JSON object per line.

Each line is a request: ``timestamp`` (milliseconds from the trace's start), ``input_length``
and ``output_length`` (tokens) and ``hash_ids``, one id per :data:`TRACE_BLOCK`-token block
of the prompt (the last block may be partial). Equal ids at equal positions mean a shared
prefix; the release has no text. :func:`load_trace` reads and checks a file (a bad line is
refused with its number and field) and applies three options: a window of requests, a time
scale (arrival times are multiplied by it: 0.5 replays twice as fast) and a length scale
(every length is divided by it, so a trace of 12k-token prompts fits the tiny model on a CPU).

Prompt tokens are synthesised per hash id (:meth:`Trace.prompt`): token ``i`` of a block is a
hash of the block's id and ``i``, so equal ids give equal tokens, hence equal KV blocks at
any block size of the engine that divides the trace's block, and different ids differ from
their first token. The last block is cut to the input length. Outputs are the trace's
lengths, run with ``ignore_eos``.
"""

from __future__ import annotations

import json
import math
from array import array
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, replace
from pathlib import Path

import numpy as np

from minimemserve.errors import ConfigError

from .sessions import Session, Turn

# Tokens per hash id in Mooncake's release.
TRACE_BLOCK = 512
# Where the shared traces live, relative to a folder above the repository (CI clones the
# repository with ``shared/`` beside it).
SHARED_TRACE = Path("shared") / "traces" / "mooncake" / "conversation_trace.jsonl"
# Token ids 0-2 are <unk>, <s> and </s> in Llama vocabularies: synthesised tokens avoid them.
FIRST_TOKEN = 3
_MASK = (1 << 64) - 1


def default_trace_path() -> Path:
    """The conversation trace: ``shared/traces/mooncake/conversation_trace.jsonl`` in the
    first folder above this package that has it; a clear error when none has."""
    here = Path(__file__).resolve()
    for folder in here.parents:
        candidate = folder / SHARED_TRACE
        if candidate.is_file():
            return candidate
    raise FileNotFoundError(
        f"no {SHARED_TRACE} in any folder above {here.parents[2]}: clone the repository with "
        "shared/ beside it, or pass the trace file's path"
    )


@dataclass(frozen=True)
class TraceRequest:
    """One request of a trace, after the window and scales: its ``line`` in the file, its
    ``arrival`` in seconds from the window's first request, its lengths in (scaled) tokens
    and its prompt's ``hash_ids``."""

    line: int
    arrival: float
    input_length: int
    output_length: int
    hash_ids: tuple[int, ...]

    @property
    def session_id(self) -> str:
        """The conversation a request is taken to belong to: its first two block ids (the
        release has no session ids; the first block is the same in every request of the
        conversation trace, a system prompt, and the second starts the conversation)."""
        return "trace-" + "-".join(map(str, self.hash_ids[:2]))


@dataclass(frozen=True)
class Trace:
    """The requests of a trace file, in arrival order; ``block_tokens`` tokens per hash id
    (:data:`TRACE_BLOCK` divided by the length scale)."""

    path: Path
    requests: tuple[TraceRequest, ...]
    block_tokens: int
    length_scale: int = 1
    time_scale: float = 1.0

    def prompt(self, req: TraceRequest, vocab_size: int) -> array:
        """``req``'s prompt: ``block_tokens`` synthesised tokens per hash id in
        ``[FIRST_TOKEN, vocab_size)``, the last block cut to the input length."""
        if vocab_size <= FIRST_TOKEN:
            raise ConfigError(f"vocab_size must be > {FIRST_TOKEN}, got {vocab_size}")
        ids = np.asarray(req.hash_ids, dtype=np.uint64)[:, None]
        pos = np.arange(self.block_tokens, dtype=np.uint64)[None, :]
        mixed = _splitmix64(ids * np.uint64(TRACE_BLOCK) + pos)  # one per (block, position)
        toks = mixed % np.uint64(vocab_size - FIRST_TOKEN) + np.uint64(FIRST_TOKEN)
        return array("q", toks.astype(np.int64).ravel()[: req.input_length].tobytes())

    def write(self, path: str | Path) -> int:
        """Write the trace as it is here (window and scales applied) in Mooncake's format, for
        a client that reads it (aiperf's ``mooncake_trace``): timestamps in whole milliseconds
        from the window's first request (the format's integers: some readers refuse a
        fraction), the scaled lengths, and the hash ids as they are, each now standing for
        ``block_tokens`` tokens (that client's ``--isl-block-size``: its prompts then share
        prefixes as the replay's do). Returns how many requests it wrote."""
        with Path(path).open("w", encoding="utf-8") as f:
            for r in self.requests:
                line = {
                    "timestamp": round(r.arrival * 1e3),
                    "input_length": r.input_length,
                    "output_length": r.output_length,
                    "hash_ids": list(r.hash_ids),
                }
                f.write(json.dumps(line) + "\n")
        return len(self.requests)

    @property
    def duration(self) -> float:
        """Seconds from the first arrival to the last."""
        return self.requests[-1].arrival if self.requests else 0.0

    def prompt_tokens(self) -> int:
        """Prompt tokens over the trace."""
        return sum(r.input_length for r in self.requests)

    def limited(self, max_context: int, max_output_tokens: int | None = None) -> Trace:
        """This trace with outputs capped at ``max_output_tokens`` and without the requests
        whose prompt and output exceed ``max_context`` tokens (a model's context)."""
        cap = max_output_tokens or math.inf
        out = []
        for r in self.requests:
            n = int(min(r.output_length, cap))
            if r.input_length + n <= max_context:
                out.append(replace(r, output_length=n))
        if not out:
            raise ConfigError(f"no request of {self.path} fits in {max_context} tokens")
        return replace(self, requests=tuple(out))


def _splitmix64(x: np.ndarray) -> np.ndarray:
    """SplitMix64's finaliser, elementwise on uint64 (wrapping): a well-mixed hash."""
    with np.errstate(over="ignore"):
        x = x + np.uint64(0x9E3779B97F4A7C15)
        x = (x ^ (x >> np.uint64(30))) * np.uint64(0xBF58476D1CE4E5B9)
        x = (x ^ (x >> np.uint64(27))) * np.uint64(0x94D049BB133111EB)
        return x ^ (x >> np.uint64(31))


class TraceError(ConfigError):
    """A trace file that cannot be read; the message names the file, line and field."""


def _int_field(obj: dict, name: str, least: int, where: str) -> int:
    value = obj.get(name)
    if isinstance(value, bool) or not isinstance(value, int):
        raise TraceError(f"{where}: field {name!r} must be an integer, got {value!r:.60}")
    if value < least:
        raise TraceError(f"{where}: field {name!r} must be >= {least}, got {value}")
    return value


def _parse_line(text: str, where: str) -> tuple[float, int, int, tuple[int, ...]]:
    """``(timestamp ms, input length, output length, hash ids)`` of one line, checked."""
    try:
        obj = json.loads(text)
    except json.JSONDecodeError as e:
        raise TraceError(f"{where}: not JSON ({e.msg})") from None
    if not isinstance(obj, dict):
        raise TraceError(f"{where}: expected a JSON object, got {type(obj).__name__}")
    ts = obj.get("timestamp")
    if isinstance(ts, bool) or not isinstance(ts, (int, float)) or not 0 <= ts < math.inf:
        raise TraceError(f"{where}: field 'timestamp' must be a number >= 0, got {ts!r:.60}")
    inp = _int_field(obj, "input_length", 1, where)
    out = _int_field(obj, "output_length", 1, where)
    ids = obj.get("hash_ids")
    if not isinstance(ids, list) or not all(
        isinstance(h, int) and not isinstance(h, bool) and 0 <= h < 1 << 48 for h in ids
    ):
        raise TraceError(f"{where}: field 'hash_ids' must be a list of ids in [0, 2**48)")
    if len(ids) != -(-inp // TRACE_BLOCK):
        raise TraceError(
            f"{where}: field 'hash_ids' has {len(ids)} ids but input_length {inp} is "
            f"{-(-inp // TRACE_BLOCK)} blocks of {TRACE_BLOCK}"
        )
    return float(ts), inp, out, tuple(ids)


def _lines(path: Path) -> Iterator[tuple[int, str]]:
    try:
        with path.open(encoding="utf-8") as f:
            for number, text in enumerate(f, 1):
                if text.strip():
                    yield number, text
    except (OSError, UnicodeDecodeError) as e:
        raise TraceError(f"cannot read trace {path}: {e}") from None


def _check_options(window: tuple[int, int | None], time_scale: float, length_scale: int) -> None:
    start, stop = window
    if not isinstance(start, int) or start < 0 or (stop is not None and stop <= start):
        raise ConfigError(f"trace window must be start >= 0 and stop > start, got {window}")
    if not (isinstance(time_scale, (int, float)) and 0 < time_scale < math.inf):
        raise ConfigError(f"time scale must be a finite number > 0, got {time_scale!r}")
    if not isinstance(length_scale, int) or length_scale < 1 or TRACE_BLOCK % length_scale:
        raise ConfigError(
            f"length scale must be an integer dividing {TRACE_BLOCK} (1, 2, 4, ... "
            f"{TRACE_BLOCK}), got {length_scale!r}"
        )


def load_trace(
    path: str | Path | None = None,
    window: tuple[int, int | None] = (0, None),
    time_scale: float = 1.0,
    length_scale: int = 1,
) -> Trace:
    """Read a trace file (default: :func:`default_trace_path`): requests ``window`` =
    ``(start, stop)`` (indices among the file's requests, ``stop`` None for all), arrivals
    times ``time_scale`` from the window's first, lengths divided by ``length_scale`` (a
    divisor of :data:`TRACE_BLOCK`, rounded up). Raises :class:`TraceError` naming the line
    and field of a bad request; timestamps must not decrease."""
    _check_options(window, time_scale, length_scale)
    path = Path(path) if path is not None else default_trace_path()
    start, stop = window
    requests, t0, last = [], None, -math.inf
    for i, (number, text) in enumerate(_lines(path)):
        where = f"{path}, line {number}"
        ts, inp, out, ids = _parse_line(text, where)
        if ts < last:
            raise TraceError(f"{where}: field 'timestamp' {ts:g} is before the previous {last:g}")
        last = ts
        if i < start or (stop is not None and i >= stop):
            continue
        t0 = ts if t0 is None else t0
        arrival = (ts - t0) / 1e3 * time_scale
        n_in, n_out = -(-inp // length_scale), -(-out // length_scale)
        requests.append(TraceRequest(number, arrival, n_in, n_out, ids))
    if not requests:
        raise TraceError(f"trace {path} has no request in the window {window}")
    return Trace(path, tuple(requests), TRACE_BLOCK // length_scale, length_scale, time_scale)


class TracePrompt(Sequence[int]):
    """A request's prompt made when read (:meth:`Trace.prompt`): a trace's prompts stay
    small until sent (the conversation trace's 145M tokens would not fit as Python ints)."""

    def __init__(self, trace: Trace, req: TraceRequest, vocab_size: int) -> None:
        self.trace = trace
        self.req = req
        self.vocab_size = vocab_size

    def tokens(self) -> array:
        """The token ids."""
        return self.trace.prompt(self.req, self.vocab_size)

    def __len__(self) -> int:
        return self.req.input_length

    def __getitem__(self, i):
        return self.tokens()[i]

    def __iter__(self) -> Iterator[int]:
        return iter(self.tokens())


def trace_sessions(
    trace: Trace, vocab_size: int
) -> tuple[list[Session], list[tuple[int, int, float]]]:
    """The trace as sessions, one per conversation (:attr:`TraceRequest.session_id`), each
    request an independent turn (its prompt holds the history), and the schedule ``(session
    index, turn, arrival)`` of every request in arrival order (the simulator's open replay)."""
    turns: dict[str, list[Turn]] = {}
    schedule = []
    for req in trace.requests:
        sid = req.session_id
        mine = turns.setdefault(sid, [])
        mine.append(Turn(sid, len(mine), TracePrompt(trace, req, vocab_size), req.output_length))
        schedule.append((sid, len(mine) - 1, req.arrival))
    index = {sid: i for i, sid in enumerate(turns)}
    sessions = [Session(sid, tuple(ts), chain_outputs=False) for sid, ts in turns.items()]
    return sessions, [(index[sid], k, t) for sid, k, t in schedule]


def parse_window(text: str) -> tuple[int, int | None]:
    """``"START:STOP"`` (either may be empty) or ``"N"`` (the first N) as a window."""
    try:
        if ":" not in text:
            return 0, int(text)
        a, b = text.split(":", 1)
        return int(a) if a else 0, int(b) if b else None
    except ValueError:
        raise ConfigError(f"a trace window is START:STOP or N, got {text!r}") from None
