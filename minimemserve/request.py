"""A request's state inside an engine, and what the engine hands back."""

from __future__ import annotations

import enum
import time
from array import array
from collections.abc import Sequence
from dataclasses import dataclass

from .sampling import SamplingParams


class Status(enum.Enum):
    """Where a request is in its life on one instance."""

    WAITING = "waiting"  # not admitted, or preempted and waiting to recompute
    RUNNING = "running"
    PARKED = "parked"  # prefilled, waiting for a decode instance with room
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
    # its KV's move from the prefill to the decode instance: bytes, and seconds from the
    # receiver's allocation through the copy to its commit
    handoff_bytes: int = 0
    handoff_seconds: float = 0.0
    preemptions: int = 0
    first_scheduled_time: float | None = None  # first admitted to a batch
    prefill_instance: str = ""  # the instance that computed the prompt
    decode_instance: str = ""  # the instance it was handed to for decoding, if any

    @property
    def queue_time(self) -> float | None:
        """Arrival until first scheduled."""
        t = self.first_scheduled_time
        return None if t is None else t - self.arrival_time

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


# A sampled token's log-probability and the ``k`` most likely tokens with theirs (raw logits).
TokenLogprob = tuple[float, list[tuple[int, float]]]


def logprobs_fit(lps: list[TokenLogprob] | None, tokens: int, k: int | None, vocab: int) -> bool:
    """Whether ``lps`` (from another process) can be the logprobs of ``tokens`` sampled
    tokens asked with ``logprobs=k`` (None: none asked, none given): one entry per token, at
    most ``k`` alternatives each,
    their ids in the vocabulary, every value a log-probability (<= 0)."""
    if lps is None or k is None:
        return lps is None and k is None
    if len(lps) != tokens:
        return False
    return all(
        lp <= 0 and len(alts) <= k and all(0 <= t < vocab and v <= 0 for t, v in alts)
        for lp, alts in lps
    )


@dataclass
class TokenDelta:
    """Tokens a request generated since its last delta: output positions ``start`` on, with
    their logprobs when the request asked for them. ``Serving.take_deltas`` returns these."""

    request_id: str
    start: int
    token_ids: list[int]
    logprobs: list[TokenLogprob] | None = None


@dataclass
class RequestOutput:
    """The result of one finished request."""

    request_id: str
    prompt_token_ids: list[int]
    token_ids: list[int]
    text: str | None
    finish_reason: str  # "length" | "stop" | "abort" | "error"
    metrics: RequestMetrics
    error: str | None = None
    logprobs: list[TokenLogprob] | None = None  # one per output token, when asked for


class Request:
    """Mutable state of one request on one instance. ``tokens`` (prompt, then output) is an
    ``array('q')``; KV covers ``tokens[:num_computed]`` in ``blocks`` (one reference held each).
    A step computes some ``num_pending`` tokens; once none is pending, a token is sampled."""

    def __init__(
        self,
        request_id: str,
        prompt_token_ids: Sequence[int],
        params: SamplingParams,
        arrival_time: float | None = None,
    ) -> None:
        self.request_id = request_id
        self.params = params
        arrival = time.perf_counter() if arrival_time is None else arrival_time
        self.tokens = array("q", prompt_token_ids)
        self.num_prompt = len(self.tokens)
        self.blocks: list[int] = []
        self.num_computed = 0
        self.status = Status.WAITING
        self.max_total_tokens = 0  # prompt + output cap (context length, max_tokens)
        self.finish_reason: str | None = None
        self.error: str | None = None
        self.prefilled = False  # the first token has been sampled (the prefilled hook ran)
        self.logprobs: list[TokenLogprob] | None = None if params.logprobs is None else []
        self.metrics = RequestMetrics(arrival, prompt_tokens=self.num_prompt)

    @property
    def arrival_time(self) -> float:
        """When the request arrived (its metrics hold it)."""
        return self.metrics.arrival_time

    @property
    def prefill_instance(self) -> str:
        """The instance that computed the prompt (its metrics hold it)."""
        return self.metrics.prefill_instance

    @prefill_instance.setter
    def prefill_instance(self, name: str) -> None:
        self.metrics.prefill_instance = name

    @property
    def decode_instance(self) -> str:
        """The instance it was handed to for decoding, if any (its metrics hold it)."""
        return self.metrics.decode_instance

    @decode_instance.setter
    def decode_instance(self, name: str) -> None:
        self.metrics.decode_instance = name

    @property
    def prompt_token_ids(self) -> list[int]:
        """The prompt."""
        return self.tokens[: self.num_prompt].tolist()

    @property
    def output_token_ids(self) -> list[int]:
        """The tokens generated so far."""
        return self.tokens[self.num_prompt :].tolist()

    @property
    def num_output(self) -> int:
        """How many tokens were generated so far."""
        return len(self.tokens) - self.num_prompt

    @property
    def num_tokens(self) -> int:
        """Prompt plus output length."""
        return len(self.tokens)

    @property
    def num_pending(self) -> int:
        """Tokens whose KV still has to be computed before the next token can be sampled."""
        return len(self.tokens) - self.num_computed

    def to_output(self, text: str | None) -> RequestOutput:
        """Freeze into a ``RequestOutput``."""
        return RequestOutput(
            request_id=self.request_id,
            prompt_token_ids=self.prompt_token_ids,
            token_ids=self.output_token_ids,
            text=text,
            finish_reason=self.finish_reason or "error",
            metrics=self.metrics,
            error=self.error,
            logprobs=self.logprobs,
        )
