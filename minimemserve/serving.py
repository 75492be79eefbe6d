"""The one serving interface of every runtime: ``Engine`` (one instance), ``InProcessCluster``
(instances in this process) and ``ProcessCluster`` (a process per instance). ``LLM``, the
benchmark driver and the server drive it without knowing which they hold."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, Protocol, runtime_checkable

from .request import RequestOutput, TokenDelta
from .sampling import SamplingParams


@runtime_checkable
class Serving(Protocol):
    """Add requests, advance, abort, audit. Outputs come back from :meth:`step`."""

    tokenizer: Any  # the model's tokenizer (``encode`` / ``decode``)

    def validate(self, prompt: str | Sequence[int], params: SamplingParams) -> Any:
        """``prompt`` checked (``engine.Checked``: its token ids in ``.ids``; ``add_request``
        takes it as the prompt and does not check it again); raises a ``ValueError`` or
        ``PoolExhausted``; queues nothing."""

    def add_request(
        self,
        prompt: str | Sequence[int],
        params: SamplingParams,
        request_id: str | None = None,
        arrival_time: float | None = None,
        session_id: str | None = None,
    ) -> str:
        """Validate and queue a request; returns its id. ``session_id`` names the conversation
        it belongs to (the ``session`` routing policy keeps a conversation on one instance)."""

    def step(self) -> list[RequestOutput]:
        """Step (or briefly await remote results); return requests finished since the last call."""

    def take_deltas(self) -> list[TokenDelta]:
        """Tokens sampled since the last call, per unfinished request, in order (for streaming;
        a finished request's remaining tokens come in its output from :meth:`step`)."""

    def load(self) -> dict[str, dict]:
        """``{instance name: {"role", "waiting", "running"}}``."""

    def abort(self, request_id: str) -> RequestOutput | None:
        """Stop a request wherever it is and release its blocks; returns its partial output
        (``finish_reason="abort"``), or None when the id is unknown or already finished."""

    def has_unfinished(self) -> bool:
        """Whether any added request has not been returned by :meth:`step` yet."""

    def check_pools(self, require_idle: bool = True) -> dict[str, dict]:
        """Audit every instance's MemPool (raises on a problem; with ``require_idle``, on a block
        referenced outside the cache index too); returns ``{instance name: {"pool": stats}}``."""

    def pool_stats(self) -> dict[str, dict]:
        """``{instance name: MemPool.stats()}``."""

    def close(self) -> None:
        """Release processes and memory (a no-op in process)."""
