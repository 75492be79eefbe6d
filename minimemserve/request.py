"""A request's state inside an engine, and what the engine hands back."""

from __future__ import annotations

import enum
import time
from dataclasses import dataclass, field

from .sampling import SamplingParams


class Status(enum.Enum):
    """Where a request is in its life on one instance."""

    WAITING = "waiting"  # not admitted, or preempted and waiting to recompute
    RUNNING = "running"
    FINISHED = "finished"


@dataclass
class RequestMetrics:
    """Timings (seconds, ``time.perf_counter`` clock) and counters of one request."""

    arrival_time: float
    first_token_time: float | None = None
    finish_time: float | None = None
    cached_tokens: int = 0
    prompt_tokens: int = 0
    output_tokens: int = 0
    transferred_bytes: int = 0
    preemptions: int = 0

    @property
    def ttft(self) -> float | None:
        """Time to first token."""
        return None if self.first_token_time is None else self.first_token_time - self.arrival_time

    @property
    def latency(self) -> float | None:
        """Job completion time (JCT): arrival to last token."""
        return None if self.finish_time is None else self.finish_time - self.arrival_time

    @property
    def tpot(self) -> float | None:
        """Mean time per output token after the first."""
        if self.finish_time is None or self.first_token_time is None or self.output_tokens < 2:
            return None
        return (self.finish_time - self.first_token_time) / (self.output_tokens - 1)

    def as_dict(self) -> dict:
        """Plain dict with the derived timings, for JSON."""
        d = dict(self.__dict__)
        d.update(ttft=self.ttft, latency=self.latency, tpot=self.tpot)
        return d


@dataclass
class RequestOutput:
    """The result of one finished request."""

    request_id: str
    prompt_token_ids: list[int]
    token_ids: list[int]
    text: str | None
    finish_reason: str  # "length" | "stop" | "error"
    metrics: RequestMetrics
    error: str | None = None


@dataclass(eq=False)  # identity semantics: a request is hashable and equal only to itself
class Request:
    """Mutable state of one request on one instance.

    KV covers ``all_token_ids[:num_computed]`` in ``blocks`` (MemPool block ids, one
    reference held). Prefill and decode are the same thing here: each step computes some
    of the ``num_tokens - num_computed`` pending tokens, and when none is left pending a
    new token is sampled.
    """

    request_id: str
    prompt_token_ids: list[int]
    params: SamplingParams
    arrival_time: float = field(default_factory=time.perf_counter)
    output_token_ids: list[int] = field(default_factory=list)
    blocks: list[int] = field(default_factory=list)
    num_computed: int = 0
    status: Status = Status.WAITING
    max_total_tokens: int = 0  # prompt + output cap (context length, max_tokens)
    finish_reason: str | None = None
    error: str | None = None
    prefilled: bool = False  # the first token has been sampled (after_prefill hook ran)
    metrics: RequestMetrics = field(init=False)
    extra: dict = field(default_factory=dict)  # recipe-private state (peer ids, counters)

    def __post_init__(self) -> None:
        self.metrics = RequestMetrics(
            arrival_time=self.arrival_time, prompt_tokens=len(self.prompt_token_ids)
        )

    @property
    def all_token_ids(self) -> list[int]:
        """Prompt followed by the tokens generated so far."""
        return self.prompt_token_ids + self.output_token_ids

    @property
    def num_tokens(self) -> int:
        """Prompt plus output length."""
        return len(self.prompt_token_ids) + len(self.output_token_ids)

    @property
    def num_pending(self) -> int:
        """Tokens whose KV still has to be computed before the next token can be sampled."""
        return self.num_tokens - self.num_computed

    def to_output(self, text: str | None) -> RequestOutput:
        """Freeze into a ``RequestOutput``."""
        return RequestOutput(
            request_id=self.request_id,
            prompt_token_ids=list(self.prompt_token_ids),
            token_ids=list(self.output_token_ids),
            text=text,
            finish_reason=self.finish_reason or "error",
            metrics=self.metrics,
            error=self.error,
        )
