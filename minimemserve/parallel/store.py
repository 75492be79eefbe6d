"""The torch.distributed store ranks meet in, listening on one host only: the tensor-parallel
ranks of an instance, and the KV pair groups of the process runtime
(:mod:`minimemserve.disagg.transports`)."""

from __future__ import annotations

import socket
from datetime import timedelta

import torch.distributed as dist

LOOPBACK = "127.0.0.1"  # the ranks of an instance share one host; the store listens nowhere else


class HostStore:
    """A ``TCPStore`` listening on ``host`` only (by itself it listens on every interface), on
    ``port`` (0: a free one, then read :attr:`port`): where torch.distributed ranks meet. It has
    no authentication (see the README)."""

    def __init__(self, host: str, timeout_s: float, port: int = 0) -> None:
        family = socket.AF_INET6 if ":" in host else socket.AF_INET
        with socket.socket(family, socket.SOCK_STREAM) as sock:
            sock.bind((host, port))
            sock.listen(128)
            self.port = sock.getsockname()[1]
            self.store = dist.TCPStore(
                host,
                self.port,
                is_master=True,
                wait_for_workers=False,
                timeout=timedelta(seconds=timeout_s),
                master_listen_fd=sock.fileno(),
            )
            sock.detach()  # the store owns the socket now, and closes it

    def close(self) -> None:
        self.store = None
