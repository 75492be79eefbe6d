"""An instance process's life, one frontend session after another.

``instance_main(spec)`` is the entry point the launcher spawns: it serves its frontend until
that closes it. ``minimemserve instance`` runs :func:`standalone_main`: an instance started on
its own (any host) that waits for a frontend's ``Hello`` and ``Join``, serves that frontend's
deployment and then waits for the next one."""

from __future__ import annotations

import logging
import os
import signal
import sys
import time

import torch

from . import rpc
from .host import host_identity, process_gone
from .instance import CLOSING, InstanceServer, SessionOver
from .instance_spec import (
    InstanceSpec,
    check_join,
    model_summary,
    spawned_options,
)

logger = logging.getLogger(__name__)

# How long a standalone instance waits between polls for a frontend.
LOBBY_POLL_S = 0.1
# How often a standalone instance cut off from its frontend tells it that it is back.
REJOIN_EVERY_S = 1.0


def _await_join(
    opts: InstanceSpec, back: InstanceSpec | None = None
) -> tuple[rpc.RpcNode, InstanceSpec]:
    """Bind the listening address and answer frontends until one joins this instance; with
    ``back`` (the session a frontend gave up on), keep telling that frontend it may rejoin."""
    summary, joined = model_summary(opts.model_dir), []
    hello = {
        "role": opts.role,
        "host": opts.host_id or host_identity(),
        "transport": opts.transport,
        "device": opts.device,
        "model": summary,
    }

    def handle(sender: str, msg: rpc.Msg) -> rpc.Msg | None:
        if sender != rpc.FRONTEND or joined:
            raise PermissionError(f"a waiting instance takes no {type(msg).__name__}")
        if not isinstance(msg, rpc.Hello | rpc.Join):  # a frontend that has not noticed yet
            raise SessionOver(f"{node.name} has no session: it waits to be joined")
        if isinstance(msg, rpc.Hello):
            return rpc.Info(hello)
        joined.append(check_join(msg, opts))
        return None

    node = rpc.RpcNode(
        "waiting",
        handle,
        host=opts.host,
        port=opts.port,
        codec=rpc.Codec(opts.key.secret),
        curve=opts.key.curve_for(opts.host),
    )
    node.any_recipient = True  # frontends address it by the name they are about to give it
    logger.info("instance (%s) waiting for a frontend at %s", opts.role, node.address)
    if back is not None:
        node.name = back.name  # the name the frontend knows, to rejoin under
        node.connect(rpc.FRONTEND, back.frontend)
    try:
        last = 0.0
        # as often as its heartbeats went: to that frontend it is alive, with no session
        every = min(REJOIN_EVERY_S, back.heartbeat_s) if back is not None else REJOIN_EVERY_S
        while not joined:
            node.serve(LOBBY_POLL_S)
            if back is not None and time.monotonic() - last > every:
                if opts.parent_pid and process_gone(opts.parent_pid):
                    raise SystemExit(f"{back.name}: the launching process is gone")
                node.try_push(rpc.FRONTEND, rpc.Rejoin())
                last = time.monotonic()
    except BaseException:
        node.close()
        raise
    return node, joined[0]


def standalone_main(opts: InstanceSpec) -> int:
    """``minimemserve instance``: wait for a frontend, serve its deployment, repeat (or stop
    after one with ``once``). Ctrl-C or SIGTERM ends it."""
    signal.signal(signal.SIGTERM, _exit_on_sigterm)
    torch.set_num_threads(opts.num_threads)
    serve_sessions(opts)
    return 0


def serve_sessions(opts: InstanceSpec, first: InstanceServer | None = None) -> None:
    """Serve one frontend's session after another: ``first``'s (a spawned instance's), then each
    one a frontend joins. After a session the frontend gave up on (it declared this instance
    dead, or went silent), wait for that frontend to join it again; after one it closed, for the
    next frontend. A spawned instance returns once its frontend closed its session, and stops
    on a crash (a ``managed`` one too); with ``once``, return after one session."""
    spawned, back = first is not None or opts.managed, None
    while True:
        server, node, first = first, None, None
        if server is None:
            node, spec = _await_join(opts, back)
            logger.info("%s: joined %s as %s", spec.name, spec.config, opts.role)
        else:
            spec = server.spec
        given_up = False
        try:
            server = server or InstanceServer(spec, node)
            server.announce()
            logger.info("%s: ready", spec.name)
            server.run()
            logger.info("%s: the frontend ended the session (%s)", spec.name, server.stop_reason)
            given_up = server.stop_reason != CLOSING
        except SessionOver as e:
            logger.warning("%s: session over: %s", spec.name, e)
            given_up = True
        except Exception as e:  # a session that failed to start or crashed: the next one
            if spawned:
                raise
            logger.error("%s: session failed: %s: %s", spec.name, type(e).__name__, e)
            given_up = True
        finally:
            (server or node).close()
        back = spec if given_up else None
        if opts.once or (spawned and not given_up):
            return


def _exit_on_sigterm(signum, frame) -> None:
    raise SystemExit(128 + signum)


def instance_main(spec: InstanceSpec) -> None:
    """Entry point of a spawned instance process: it serves its frontend until that closes it
    (or is gone); declared dead by mistake (it stalled), it waits to be joined again."""
    # Ctrl-C reaches the whole process group; the frontend decides how we stop.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, _exit_on_sigterm)
    torch.set_num_threads(spec.num_threads)
    server = InstanceServer(spec)
    try:
        serve_sessions(spawned_options(spec, server.node.address), server)
    finally:
        sys.stdout.flush()
        sys.stderr.flush()
    # Everything this process owns is released above; skip the slow interpreter teardown.
    os._exit(0)
