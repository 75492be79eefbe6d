"""Benchmark workloads: multi-turn sessions of requests, and their Poisson arrivals.

A workload is a list of :class:`Session`. A session is an ordered list of :class:`Turn`;
the benchmark driver submits a session's turns one after another, each when the previous
one has finished. How a turn's prompt is built depends on the session:

* chained sessions (ShareGPT, ReAct-like): the prompt of turn k is the prompt of turn k-1
  plus the engine's **own** output of turn k-1 plus the user tokens of turn k, so the KV of
  both the prefill and the decode phase of earlier turns can be reused;
* unchained sessions (LooGLE-like): every turn is an independent request
  ``prefix + user tokens``; only the shared prefix (the document) is common.

Output lengths are fixed per turn (``max_tokens``) and meant to be run with ``ignore_eos``,
so the prompt lengths of later turns are known when the workload is built and every
session fits in the model's context. :func:`build_prompt` is the one place that builds a
turn's prompt; the driver and the tests both use it.

Token ids come from the model's tokenizer (any object with ``encode(text, add_bos)``);
the synthetic workloads tokenize seeded pseudo-words, so they are valid for any vocabulary.
"""

from __future__ import annotations

import math
import random
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol

from minimemserve.sharegpt import iter_sharegpt

# ShareGPT conversations read before the seeded shuffle; the qualifying sessions are drawn
# from these, so a different seed gives a different sample of the same (fast to read) head.
SHAREGPT_SCAN_LIMIT = 4000
# LooGLE-like: a document takes this fraction of the context (min, max) ...
LOOGLE_DOC_FRACTION = (0.55, 0.75)
# ... and is shared by this many questions (LooGLE has about 8 per long document).
LOOGLE_QUESTIONS_PER_DOC = 8
# LooGLE-like question length in tokens (min, max): short questions over a long document.
LOOGLE_QUESTION_TOKENS = (12, 48)
# LooGLE-like answers are short.
LOOGLE_OUTPUT_TOKENS = (8, 32)
# ReAct-like: the shared few-shot prefix is ~1.5-2k tokens of a 4k-context Llama-2,
# i.e. this fraction of the context.
REACT_PREFIX_FRACTION = 0.4
# ReAct-like: at most 7 thought/action/observation steps per question.
REACT_MAX_STEPS = 7
# ReAct-like: a thought + action is at most 100 tokens ...
REACT_MAX_OUTPUT_TOKENS = 100
REACT_MIN_OUTPUT_TOKENS = 20
# ... and a tool observation / the question is this long (min, max) in tokens.
REACT_OBSERVATION_TOKENS = (16, 64)
# ShareGPT defaults: turns per session and the cap on a turn's output, sized for the tiny
# model's 2k context on a CPU.
SHAREGPT_MAX_TURNS = 6
SHAREGPT_MAX_OUTPUT_TOKENS = 48
# Syllables the synthetic text is made of; any tokenizer splits them into a few pieces.
_SYLLABLES = tuple(
    "ka lo mi ren tas vo dun pe shi gar ul bre no fit zel ar ion qua the sto mer lin dak ope "
    "ri sal tum".split()
)


class TokenizerLike(Protocol):
    """What workloads need from a tokenizer."""

    def encode(self, text: str, add_bos: bool = True) -> list[int]:
        """Token ids of ``text``, with the BOS id first when ``add_bos``."""
        ...


@dataclass(frozen=True)
class Turn:
    """One request of a session: the user tokens it appends and how many tokens it generates."""

    session_id: str
    turn_index: int
    user_tokens: tuple[int, ...]
    max_tokens: int
    user_text: str | None = None  # the text ``user_tokens`` came from, when there is one

    def __post_init__(self) -> None:
        if not self.user_tokens:
            raise ValueError(f"turn {self.session_id}/{self.turn_index} has no user tokens")
        if self.max_tokens < 1:
            raise ValueError(
                f"turn {self.session_id}/{self.turn_index}: max_tokens must be >= 1, "
                f"got {self.max_tokens}"
            )


@dataclass(frozen=True)
class Session:
    """An ordered list of turns submitted one after another.

    ``prefix_tokens`` come before the first turn (a shared few-shot prefix, a document).
    With ``chain_outputs`` the prompt of a turn is the previous prompt plus the engine's own
    previous output plus the turn's user tokens; without it every turn is an independent
    request ``prefix_tokens + user_tokens``.
    """

    id: str
    turns: tuple[Turn, ...]
    prefix_tokens: tuple[int, ...] = ()
    chain_outputs: bool = True

    def __post_init__(self) -> None:
        if not self.turns:
            raise ValueError(f"session {self.id} has no turns")
        for i, turn in enumerate(self.turns):
            if turn.turn_index != i or turn.session_id != self.id:
                raise ValueError(
                    f"session {self.id}: turn {i} is labelled {turn.session_id}/{turn.turn_index}"
                )

    def planned_lengths(self) -> list[tuple[int, int]]:
        """``(prompt_tokens, output_tokens)`` per turn when every turn outputs ``max_tokens``."""
        lengths = []
        history = len(self.prefix_tokens)
        for turn in self.turns:
            if self.chain_outputs:
                prompt = history + len(turn.user_tokens)
                history = prompt + turn.max_tokens
            else:
                prompt = len(self.prefix_tokens) + len(turn.user_tokens)
            lengths.append((prompt, turn.max_tokens))
        return lengths

    def max_total_tokens(self) -> int:
        """The largest ``prompt + output`` over the session's turns."""
        return max(p + o for p, o in self.planned_lengths())


def build_prompt(session: Session, turn_index: int, history: Sequence[int] = ()) -> list[int]:
    """The prompt token ids of turn ``turn_index``.

    ``history`` is, for a chained session, the previous turn's prompt followed by the
    engine's output of that turn (ignored for turn 0 and for unchained sessions).
    """
    if not 0 <= turn_index < len(session.turns):
        raise ValueError(f"session {session.id} has no turn {turn_index}")
    turn = session.turns[turn_index]
    if session.chain_outputs and turn_index > 0:
        if not history:
            raise ValueError(
                f"turn {session.id}/{turn_index} of a chained session needs the "
                "previous prompt and output as history"
            )
        return [*history, *turn.user_tokens]
    return [*session.prefix_tokens, *turn.user_tokens]


def total_turns(sessions: Iterable[Session]) -> int:
    """Number of requests a workload issues."""
    return sum(len(s.turns) for s in sessions)


def workload_args(given: Mapping[str, Any], defaults: Mapping[str, Any]) -> dict[str, Any]:
    """``defaults`` (what a run's workload is made of: its name, sessions, rate, seed, ...)
    updated with ``given``; an argument that is not one of them is a TypeError naming it."""
    if unknown := sorted(set(given) - set(defaults)):
        raise TypeError(f"unknown workload argument(s) {unknown}; known: {list(defaults)}")
    return dict(defaults) | dict(given)


def poisson_arrivals(rate: float, n: int, seed: int) -> list[float]:
    """Arrival offsets in seconds of ``n`` sessions arriving as a Poisson process at ``rate``/s.

    The first session arrives at 0 and the gaps are exponential with mean ``1 / rate``;
    ``rate = inf`` makes every session arrive at 0.
    """
    if n < 0:
        raise ValueError(f"number of arrivals must be >= 0, got {n}")
    if not rate > 0:
        raise ValueError(f"arrival rate must be > 0 sessions/s, got {rate}")
    if math.isinf(rate):
        return [0.0] * n
    rng = random.Random(seed)
    offsets, t = [], 0.0
    for i in range(n):
        if i > 0:
            t += rng.expovariate(rate)
        offsets.append(t)
    return offsets


def _check_positive(**values: int) -> None:
    for name, value in values.items():
        if value < 1:
            raise ValueError(f"{name} must be >= 1, got {value}")


# --------------------------------------------------------------------------- ShareGPT


def _message_pairs(conversation: list[dict[str, Any]]) -> list[tuple[str, str]]:
    """(human message, gpt reply) pairs from the start of a conversation, while they alternate."""
    messages = list(conversation)
    while messages and messages[0]["from"] != "human":
        messages.pop(0)
    pairs = []
    for i in range(0, len(messages) - 1, 2):
        human, gpt = messages[i], messages[i + 1]
        if human["from"] != "human" or gpt["from"] != "gpt" or not gpt["value"].strip():
            break
        pairs.append((human["value"], gpt["value"]))
    return pairs


def _format_user(text: str) -> str:
    return f"USER: {text}\nASSISTANT:"


def sharegpt_sessions(
    tokenizer: TokenizerLike,
    num_sessions: int,
    max_turns: int,
    max_context: int,
    max_output_tokens: int,
    seed: int,
    scan_limit: int = SHAREGPT_SCAN_LIMIT,
    conversations: Iterable[dict[str, Any]] | None = None,
) -> list[Session]:
    """Real multi-turn ShareGPT conversations as chained sessions.

    The first ``scan_limit`` conversations are shuffled with ``seed``; the first
    ``num_sessions`` that keep at least two turns are taken. Turn k sends the k-th human
    message (``"USER: ... ASSISTANT:"``); its output length is the token length of the real
    gpt reply, capped at ``max_output_tokens``. A session stops at ``max_turns`` turns or
    before the turn whose prompt + output would exceed ``max_context``.
    ``conversations`` replaces the dataset (for tests); by default it is read with
    :func:`minimemserve.sharegpt.iter_sharegpt`.
    """
    _check_positive(
        num_sessions=num_sessions,
        max_turns=max_turns,
        max_context=max_context,
        max_output_tokens=max_output_tokens,
    )
    if max_turns < 2:
        raise ValueError(
            f"ShareGPT sessions are multi-turn: max_turns must be >= 2, got {max_turns}"
        )
    if conversations is None:
        conversations = iter_sharegpt(limit=scan_limit)
    pool = [c for c in conversations if len(_message_pairs(c["conversations"])) >= 2]
    random.Random(seed).shuffle(pool)

    sessions: list[Session] = []
    for conv in pool:
        sid = f"sharegpt-{len(sessions)}"
        turns: list[Turn] = []
        context = 0
        for k, (human, gpt) in enumerate(_message_pairs(conv["conversations"])[:max_turns]):
            text = _format_user(human)
            user = tuple(tokenizer.encode(text, add_bos=(k == 0)))
            output = min(len(tokenizer.encode(gpt, add_bos=False)), max_output_tokens)
            if not user or output < 1 or context + len(user) + output > max_context:
                break
            turns.append(Turn(sid, k, user, output, user_text=text))
            context += len(user) + output
        if len(turns) >= 2:
            sessions.append(Session(sid, tuple(turns)))
            if len(sessions) == num_sessions:
                return sessions
    raise ValueError(
        f"only {len(sessions)} of {num_sessions} ShareGPT sessions with >= 2 turns "
        f"fit in {max_context} tokens among {len(pool)} multi-turn conversations"
    )


# --------------------------------------------------------------------------- synthetic


@dataclass
class _TextMaker:
    """Seeded pseudo-word text, cut to an exact number of tokens."""

    tokenizer: TokenizerLike
    rng: random.Random
    _tokens_per_word: float = field(default=2.0)

    def words(self, n: int) -> str:
        """``n`` words of one to three syllables each."""
        sizes = self.rng.choices((1, 2, 3), k=n)
        syllables = iter(self.rng.choices(_SYLLABLES, k=sum(sizes)))
        return " ".join("".join(next(syllables) for _ in range(k)) for k in sizes)

    def tokens(self, n: int, label: str = "") -> tuple[int, ...]:
        """Exactly ``n`` token ids (no BOS) of fresh pseudo-text, starting with ``label``."""
        ids: list[int] = []
        words = max(4, int(n / self._tokens_per_word) + 4)
        while True:
            ids = self.tokenizer.encode(f"{label} {self.words(words)}".strip(), add_bos=False)
            if len(ids) >= n:
                self._tokens_per_word = max(0.5, len(ids) / words)
                return tuple(ids[:n])
            words *= 2


def _bos(tokenizer: TokenizerLike) -> tuple[int, ...]:
    """The BOS id(s) the tokenizer puts in front of a prompt (empty if it adds none)."""
    with_bos = tokenizer.encode("a", add_bos=True)
    without = tokenizer.encode("a", add_bos=False)
    return tuple(with_bos[: len(with_bos) - len(without)])


def loogle_like(
    tokenizer: TokenizerLike,
    num_docs: int,
    max_context: int,
    seed: int,
    questions_per_doc: int = LOOGLE_QUESTIONS_PER_DOC,
    max_output_tokens: int = LOOGLE_OUTPUT_TOKENS[1],
) -> list[Session]:
    """Synthetic LooGLE-like sessions: one long document shared by several short questions.

    Each session is one document (``prefix_tokens``, 55-75% of ``max_context``) and
    ``questions_per_doc`` independent single-turn questions over it (``chain_outputs`` is
    False), answered in 8-32 tokens (capped at ``max_output_tokens``).
    """
    _check_positive(
        num_docs=num_docs,
        max_context=max_context,
        questions_per_doc=questions_per_doc,
        max_output_tokens=max_output_tokens,
    )
    rng = random.Random(seed)
    maker = _TextMaker(tokenizer, rng)
    bos = _bos(tokenizer)
    lo_q, hi_q = LOOGLE_QUESTION_TOKENS
    lo_o, hi_o = min(LOOGLE_OUTPUT_TOKENS[0], max_output_tokens), max_output_tokens
    if len(bos) + 1 + hi_q + hi_o > max_context:
        raise ValueError(f"max_context {max_context} is too small for a LooGLE-like document")
    sessions = []
    for d in range(num_docs):
        sid = f"loogle-{d}"
        doc_len = int(max_context * rng.uniform(*LOOGLE_DOC_FRACTION))
        doc_len = max(1, min(doc_len, max_context - len(bos) - hi_q - hi_o))
        prefix = bos + maker.tokens(doc_len, label=f"Document {d}.")
        turns = tuple(
            Turn(
                sid,
                q,
                maker.tokens(rng.randint(lo_q, hi_q), label=f"Question {q}:"),
                rng.randint(lo_o, hi_o),
            )
            for q in range(questions_per_doc)
        )
        sessions.append(Session(sid, turns, prefix_tokens=prefix, chain_outputs=False))
    return sessions


def react_like(
    tokenizer: TokenizerLike,
    num_questions: int,
    max_context: int,
    seed: int,
    max_steps: int = REACT_MAX_STEPS,
    max_output_tokens: int = REACT_MAX_OUTPUT_TOKENS,
) -> list[Session]:
    """Synthetic ReAct-like sessions: a shared few-shot prefix, then thought/action steps.

    Every session starts with the same few-shot prefix (40% of ``max_context``, the ~1.5-2k
    tokens of a 4k-context model). Step 0 sends the question; each later step sends a tool
    observation after the engine's own thought + action (20-100 tokens, capped at
    ``max_output_tokens``), so the context grows. A question takes 2 to ``max_steps`` steps,
    fewer if the context runs out.
    """
    _check_positive(
        num_questions=num_questions,
        max_context=max_context,
        max_steps=max_steps,
        max_output_tokens=max_output_tokens,
    )
    rng = random.Random(seed)
    maker = _TextMaker(tokenizer, rng)
    prefix = _bos(tokenizer) + maker.tokens(
        int(max_context * REACT_PREFIX_FRACTION), label="Examples of solving tasks step by step."
    )
    lo_obs, hi_obs = REACT_OBSERVATION_TOKENS
    lo_out = min(REACT_MIN_OUTPUT_TOKENS, max_output_tokens)
    if len(prefix) + hi_obs + max_output_tokens > max_context:
        raise ValueError(f"max_context {max_context} is too small for a ReAct-like question")
    sessions = []
    for q in range(num_questions):
        sid = f"react-{q}"
        steps = rng.randint(min(2, max_steps), max_steps)
        turns: list[Turn] = []
        context = len(prefix)
        for k in range(steps):
            label = f"Question {q}:" if k == 0 else "Observation:"
            user = maker.tokens(rng.randint(lo_obs, hi_obs), label=label)
            output = rng.randint(lo_out, max_output_tokens)
            if context + len(user) + output > max_context:
                break
            turns.append(Turn(sid, k, user, output))
            context += len(user) + output
        sessions.append(Session(sid, tuple(turns), prefix_tokens=prefix))
    return sessions


WORKLOADS = ("sharegpt", "loogle", "react")


def make_workload(
    name: str,
    tokenizer: TokenizerLike,
    num_sessions: int,
    max_context: int,
    seed: int,
    max_turns: int | None = None,
    max_output_tokens: int | None = None,
) -> list[Session]:
    """Build workload ``name`` (one of :data:`WORKLOADS`) with each workload's defaults.

    ``max_turns`` is the turns per ShareGPT session, the questions per LooGLE document or the
    steps per ReAct question; ``None`` takes the workload's default.
    """
    if name == "sharegpt":
        return sharegpt_sessions(
            tokenizer,
            num_sessions,
            max_turns or SHAREGPT_MAX_TURNS,
            max_context,
            max_output_tokens or SHAREGPT_MAX_OUTPUT_TOKENS,
            seed,
        )
    if name == "loogle":
        return loogle_like(
            tokenizer,
            num_sessions,
            max_context,
            seed,
            questions_per_doc=max_turns or LOOGLE_QUESTIONS_PER_DOC,
            max_output_tokens=max_output_tokens or LOOGLE_OUTPUT_TOKENS[1],
        )
    if name == "react":
        return react_like(
            tokenizer,
            num_sessions,
            max_context,
            seed,
            max_steps=max_turns or REACT_MAX_STEPS,
            max_output_tokens=max_output_tokens or REACT_MAX_OUTPUT_TOKENS,
        )
    raise ValueError(f"unknown workload {name!r}; choose one of {', '.join(WORKLOADS)}")
