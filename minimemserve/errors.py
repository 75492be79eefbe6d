"""Exceptions raised by minimemserve. Bad request values are `ValueError` subclasses."""


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
