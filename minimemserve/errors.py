"""Exceptions raised by minimemserve. Bad request values are `ValueError` subclasses."""

import reprlib


def shown(value: object) -> str:
    """A short repr of a bad value for an error message (long strings, lists and ints are
    elided; Python refuses to print an int of more than 4300 digits at all)."""
    try:
        return reprlib.repr(value)
    except ValueError:
        return f"<a {type(value).__name__} holding an integer too long to print>"


class MiniMemServeError(Exception):
    """Base class of every error minimemserve raises on purpose."""


class PoolExhausted(MiniMemServeError, RuntimeError):
    """MemPool cannot provide the blocks asked for, even after evicting cached blocks."""


class InvalidRequest(MiniMemServeError, ValueError):
    """A request carries a bad value: empty or too long prompt, bad token id, bad sampling."""


class ConfigError(MiniMemServeError, ValueError):
    """An engine or model configuration is invalid (unknown config name, bad size...)."""


class CheckpointError(MiniMemServeError, ValueError):
    """A model checkpoint directory is missing a file, has a bad shape or a foreign architecture."""


class TransferError(MiniMemServeError, RuntimeError):
    """A KV transfer between instances failed or timed out; both sides released their blocks."""


class InstanceDied(TransferError):
    """A peer instance stopped answering; requests bound to it end with this error."""


class SamplingError(MiniMemServeError, RuntimeError):
    """The logits of some batch rows hold NaN or +inf (or only -inf): no token can be drawn.

    ``rows`` lists those rows; ``tokens`` holds the token of every other row (None for the
    bad ones), so the engine can fail just the requests of the bad rows.
    """

    def __init__(
        self, message: str, rows: list[int] | None = None, tokens: list[int | None] | None = None
    ) -> None:
        super().__init__(message)
        self.rows = rows or []
        self.tokens = tokens or []
