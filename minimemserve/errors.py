"""Exceptions raised by minimemserve. Bad request values are `ValueError` subclasses."""

import reprlib
from collections.abc import Sequence


def shown(value: object) -> str:
    """A short repr of a bad value for an error message (even of a too-long-to-print int)."""
    try:
        return reprlib.repr(value)
    except ValueError:  # Python refuses to print an int of more than 4300 digits
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
    """Some batch rows' logits (NaN, +inf or only -inf) allow no token. ``rows`` lists them;
    ``tokens`` holds every row's token (None for those), so only they fail."""

    def __init__(self, message: str, rows: Sequence[int] = (), tokens: Sequence = ()) -> None:
        super().__init__(message)
        self.rows = list(rows)
        self.tokens = list(tokens)


class RemoteError(TransferError):
    """A peer's handler failed; ``peer``, ``op`` and ``kind`` (its exception class) say which."""

    def __init__(self, peer: str, op: str, kind: str, message: str) -> None:
        super().__init__(f"peer {peer} failed {op}: {kind}: {message}")
        self.peer = peer
        self.op = op
        self.kind = kind
        self.remote_message = message
