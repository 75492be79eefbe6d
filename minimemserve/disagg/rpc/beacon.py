"""Heartbeats from a thread: the :class:`Beacon` each process runs, so its peers hear it while
it is busy, blocked in a call or idle."""

from __future__ import annotations

import contextlib
import threading

import zmq

from .auth import Codec, Stream
from .messages import Heartbeat


class Beacon:
    """Pushes a :class:`Heartbeat` signed as ``name`` to every target, each ``period_s``, from a
    thread with its own sockets (an RpcNode is not thread-safe): the targets hear from this
    process whether it is busy, blocked in a call or idle."""

    def __init__(
        self, name: str, codec: Codec, period_s: float, curve: tuple[bytes, bytes] | None = None
    ) -> None:
        """Start the thread; add targets with :meth:`add`."""
        self.name = name
        self.codec = codec
        self.period_s = period_s
        self._curve = curve
        self._targets: dict[str, str] = {}  # peer -> address, as wanted
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name=f"beacon-{name}", daemon=True)
        self._thread.start()

    def add(self, peer: str, address: str) -> None:
        """Beat towards ``peer`` at ``address`` from now on."""
        with self._lock:
            self._targets[peer] = address

    def remove(self, peer: str) -> None:
        """Stop beating towards ``peer``."""
        with self._lock:
            self._targets.pop(peer, None)

    def _run(self) -> None:
        ctx = zmq.Context()
        ctx.setsockopt(zmq.LINGER, 0)
        ctx.setsockopt(zmq.SNDHWM, 4)  # a stopped peer queues a few beats, not a backlog
        socks: dict[str, tuple[str, zmq.Socket]] = {}
        stream = Stream()
        try:
            while not self._stop.wait(self.period_s):
                with self._lock:
                    wanted = dict(self._targets)
                for peer in [p for p in socks if socks[p][0] != wanted.get(p)]:
                    socks.pop(peer)[1].close(linger=0)
                for peer, address in wanted.items():
                    if peer not in socks:
                        sock = ctx.socket(zmq.DEALER)
                        if self._curve is not None:
                            sock.curve_serverkey = self._curve[0]
                            sock.curve_publickey, sock.curve_secretkey = self._curve
                        sock.connect(address)
                        socks[peer] = (address, sock)
                    beat = stream.envelope("push", 0, self.name, peer, Heartbeat())
                    with contextlib.suppress(zmq.ZMQError):
                        socks[peer][1].send(self.codec.encode(beat), zmq.NOBLOCK)
        finally:
            for _, sock in socks.values():
                sock.close(linger=0)
            ctx.term()

    def close(self) -> None:
        """Stop the thread and close its sockets. Idempotent."""
        self._stop.set()
        self._thread.join(5.0)
