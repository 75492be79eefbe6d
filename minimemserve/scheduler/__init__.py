"""Schedulers: the local one batches requests inside an instance; the global one routes
requests between instances."""

from .local import LocalScheduler

__all__ = ["LocalScheduler"]
