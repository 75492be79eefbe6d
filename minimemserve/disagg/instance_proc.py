"""The process of one serving instance: an engine with a role, behind an RPC node.

``instance_main(spec)`` is the entry point the launcher spawns. It builds the engine
(colocated, prefill or decode, with the matching recipe), puts the hbm pool tensor in
shared memory so peers on this host can write KV into it one-sided, reports ``Ready`` to
the frontend, and then loops: answer control messages, step the engine while it has
work, push finished outputs (and hand-offs) to the frontend, send heartbeats.

What each instance holds for a peer is tracked (``grants``: blocks it allocated for the
peer's transfers and references the peer has not returned yet), so when the frontend
reports the peer dead, every such block is released and nothing leaks.
"""

from __future__ import annotations

import contextlib
import os
import signal
import sys
import time
from collections import Counter, OrderedDict
from dataclasses import dataclass
from typing import Any

import torch

from minimemserve.config import EngineConfig
from minimemserve.disagg.control import Abort, AllocReply, AllocRequest, Commit, Heartbeat
from minimemserve.disagg.recipes import DecodeRecipe, PrefillRecipe, release
from minimemserve.disagg.remote import (
    LOOPBACK,
    Accept,
    FreeMem,
    Handoff,
    Info,
    Output,
    PeerDown,
    Peers,
    Probe,
    ProbeReply,
    PushPrefix,
    Query,
    Ready,
    RemotePeer,
    RemotePool,
    RpcNode,
    Shutdown,
    Submit,
    output_to_dict,
    params_from_dict,
    request_from_dict,
)
from minimemserve.disagg.transport import SharedPoolTensor, attach
from minimemserve.errors import InstanceDied, InvalidRequest, TransferError
from minimemserve.mempool.pool import MemPool
from minimemserve.request import Request
from minimemserve.request import Status as _Status

ROLES = ("colocated", "prefill", "decode")
FRONTEND = "frontend"
# How long an idle instance blocks on its socket before checking its parent and heartbeat.
IDLE_POLL_S = 0.02
# How often the loop checks that the launching process still exists.
PARENT_CHECK_S = 0.5
# Hand-offs remembered per prefill instance; far more than can be in flight at once.
HANDOFF_MEMORY = 65_536
# Default heartbeat period; the frontend declares an instance dead after many missed beats.
DEFAULT_HEARTBEAT_S = 0.5


@dataclass(frozen=True)
class InstanceSpec:
    """Start-up arguments of one instance process (passed once, at spawn)."""

    name: str
    role: str
    config: str
    model_dir: str
    frontend: str
    engine_config: EngineConfig
    device: str = "cpu"
    dtype: str = "float32"
    num_threads: int = 1
    host: str = LOOPBACK
    port: int = 0
    timeout_s: float = 30.0
    heartbeat_s: float = DEFAULT_HEARTBEAT_S
    parent_pid: int = 0
    shared_pool: bool = False  # colocated: hbm pool in shared memory, for prefix transfers

    def __post_init__(self) -> None:
        if self.role not in ROLES:
            raise ValueError(f"role must be one of {ROLES}, got {self.role!r}")
        if self.num_threads < 1:
            raise ValueError(f"num_threads must be >= 1, got {self.num_threads}")


class SharedMemPool(MemPool):
    """A MemPool whose hbm tier tensor lives in shared memory (CPU) or is IPC-exported (CUDA).

    :attr:`shared` is the segment; publish ``shared.handle.to_dict()`` to peers.
    """

    def __init__(self, layout, num_blocks: int, **kw: Any) -> None:
        """As ``MemPool``; the hbm tier's tensor is made in shared memory (dram stays private)."""
        made: list[SharedPoolTensor] = []

        def factory(shape, dtype, device) -> torch.Tensor:
            if made:  # the dram tier: private host memory, pinned when CUDA is present
                pin = torch.cuda.is_available() and kw.get("pin_memory") is not False
                return torch.zeros(shape, dtype=dtype, device=device, pin_memory=pin)
            made.append(SharedPoolTensor.create(tuple(shape), dtype, device))
            return made[0].tensor  # [num_blocks, L, 2, block_size, n_kv_heads, head_dim]

        super().__init__(layout, num_blocks, tensor_factory=factory, **kw)
        self.shared = made[0]

    def close_shared(self) -> None:
        """Unlink the shared segment (mappings already made stay valid until dropped)."""
        self.shared.close()


class SafePrefillRecipe(PrefillRecipe):
    """The prefill recipe, with transfer failures handled.

    A failed transfer leaves the request's blocks on this instance (nothing was handed
    over); the next live decode instance is tried, and when none is left the request ends
    here with ``finish_reason="error"`` and its blocks released.
    """

    def __init__(self, cache_level: int, pick_decode, on_peer_failed) -> None:
        """``on_peer_failed(name, reason)`` hears of a decode instance that stopped answering."""
        super().__init__(cache_level, pick_decode)
        self.on_peer_failed = on_peer_failed

    def after_prefill(self, pool, req: Request) -> bool:
        """Hand off as the prefill recipe does, trying the next decode instance after a failed
        transfer; with none left, release the blocks here, end the request with an error."""
        excluded: list[str] = []
        req.extra["excluded_decodes"] = excluded
        try:
            while True:
                try:
                    return super().after_prefill(pool, req)
                except TransferError as e:
                    target = req.extra.pop("decode_target", None)
                    if target is None:  # no decode instance to try
                        req.error = f"{type(e).__name__}: {e}"
                        break
                    excluded.append(target)
                    if not _is_remote_failure(e):
                        self.on_peer_failed(target, str(e))
                    req.error = f"{type(e).__name__}: {e}"
        finally:
            req.extra.pop("excluded_decodes", None)
        release(pool, req, cache=self.caching)
        req.finish_reason = "error"
        return False


def _is_remote_failure(e: TransferError) -> bool:
    """The peer answered with an error (it is alive), as opposed to not answering."""
    from minimemserve.disagg.control import RemoteError

    return isinstance(e, RemoteError)


class SafeDecodeRecipe(DecodeRecipe):
    """The decode recipe; when sending decode-phase KV back fails, the request still
    succeeds (its tokens are final) and its blocks are released here."""

    def on_finish(self, pool, req: Request) -> None:
        """As the decode recipe; a failed send back is noted in ``req.extra["cache_back_error"]``
        and the blocks are released here."""
        try:
            super().on_finish(pool, req)
        except TransferError as e:
            req.extra["cache_back_error"] = str(e)
            release(pool, req, cache=self.caching)


class InstanceServer:
    """One instance: engine, RPC node, peers, and the loop that drives them."""

    def __init__(self, spec: InstanceSpec) -> None:
        """Build the engine and bind the control socket (does not announce itself yet)."""
        from minimemserve.engine import Engine

        self.spec = spec
        self.name = spec.name
        self.stopping = False
        self.inbox: list[Request | tuple[list[int], Any, str, float]] = []
        self.grants: dict[str, Counter[int]] = {}
        self.xfers: dict[tuple[str, str], list[int]] = {}
        self.remotes: dict[str, RemotePeer] = {}
        self.decodes: list[str] = []
        # recent hand-offs (request id -> decode instance), so the frontend can find the
        # requests a dead decode instance held even if our Handoff notice is still in flight
        self.handed: OrderedDict[str, str] = OrderedDict()
        self._last_beat = 0.0
        self._last_parent_check = 0.0
        level = self._cache_level(spec.config)
        recipe = None
        pool_factory = None
        if spec.role == "prefill":
            recipe = SafePrefillRecipe(level, self._pick_decode, self._peer_failed)
            pool_factory = SharedMemPool
        elif spec.role == "decode":
            recipe = SafeDecodeRecipe(level, self._prefill_pool_of)
            pool_factory = SharedMemPool
        elif spec.shared_pool:
            pool_factory = SharedMemPool
        self.engine = Engine(
            spec.model_dir,
            config=spec.config,
            device=spec.device,
            dtype=spec.dtype,
            engine_config=spec.engine_config,
            recipe=recipe,
            instance_id=spec.name,
            pool_factory=pool_factory,
        )
        self.pool = self.engine.pool
        self.node = RpcNode(
            spec.name,
            self._handle,
            host=spec.host,
            port=spec.port,
            timeout_s=spec.timeout_s,
            on_wait=self._heartbeat,
        )
        self.node.connect(FRONTEND, spec.frontend)

    @staticmethod
    def _cache_level(config: str) -> int:
        from minimemserve.config import parse_config_name

        return parse_config_name(config).cache_level

    # ---- recipe callbacks -----------------------------------------------------------------
    def _pick_decode(self, req: Request) -> RemotePeer:
        excluded = req.extra.get("excluded_decodes", ())
        live = [d for d in self.decodes if d not in self.node.dead and d not in excluded]
        if not live:
            gone = ", ".join(f"{d}: {self.node.dead.get(d, 'refused')}" for d in self.decodes)
            raise InstanceDied(f"no live decode instance to continue the request ({gone})")
        best = live[0]
        if len(live) > 1:
            tokens = req.all_token_ids[: req.num_computed]
            scores = {}
            for d in live:
                try:
                    rep = self.remotes[d].pool.probe(tokens)
                except TransferError:
                    continue
                scores[d] = (rep.cached, -rep.load)
            if scores:
                best = max(scores, key=scores.__getitem__)
        req.extra["decode_target"] = best
        return self.remotes[best]

    def _prefill_pool_of(self, req: Request) -> RemotePool:
        name = req.extra.get("prefill_instance")
        peer = self.remotes.get(name)
        if peer is None:
            raise InstanceDied(f"prefill instance {name!r} is unknown here")
        return peer.pool

    def _peer_failed(self, name: str, reason: str) -> None:
        if name not in self.node.dead:
            self._peer_down(name, f"stopped answering: {reason}")

    # ---- control messages -----------------------------------------------------------------
    def _handle(self, sender: str, msg: Any) -> Any:
        if isinstance(msg, AllocRequest):
            matched, new = self.pool.recv_alloc(msg.tokens, msg.num_blocks)
            self._grant(sender, matched + new)
            self.xfers[(sender, msg.req_id)] = matched + new
            return AllocReply(msg.req_id, matched, new)
        if isinstance(msg, Commit):
            self.xfers.pop((sender, msg.req_id), None)
            self.pool.recv_commit(msg.tokens, msg.blocks)
            return None
        if isinstance(msg, Abort):
            blocks = self.xfers.pop((sender, msg.req_id), None)
            held = self._ungrant(sender, msg.blocks if blocks is None else blocks)
            self.pool.recv_abort(held)
            return None
        if isinstance(msg, FreeMem):
            self.pool.free_mem(self._ungrant(sender, msg.blocks))
            return None
        if isinstance(msg, Accept):
            req = request_from_dict(msg.request)
            held = self._ungrant(sender, req.blocks)
            if len(held) != len(req.blocks):
                self.pool.free_mem(held)
                raise ValueError(f"request {req.request_id} arrived with blocks not sent here")
            self.inbox.append(req)
            return None
        if isinstance(msg, Probe):
            sched = self.engine.scheduler
            load = len(sched.waiting) + len(sched.running) + len(self.inbox)
            return ProbeReply(self.pool.cached_prefix_len(msg.tokens), load)
        if isinstance(msg, Submit):
            return self._submit(msg.request)
        if isinstance(msg, Query):
            return Info(self._query(msg.what, msg.args))
        if isinstance(msg, Peers):
            self._connect_peers(msg.peers)
            return None
        if isinstance(msg, PushPrefix):
            return Info({"tokens": self._push_prefix(msg.tokens, msg.to)})
        if isinstance(msg, PeerDown):
            self._peer_down(msg.name, msg.reason)
            return Info({"handed": [r for r, d in self.handed.items() if d == msg.name]})
        if isinstance(msg, Shutdown):
            self.stopping = True
            return None
        if isinstance(msg, Heartbeat):
            return None
        raise ValueError(f"{self.name} does not handle {type(msg).__name__}")

    def _push_prefix(self, tokens: list[int], to: str) -> int:
        """Send this pool's cached prefix of ``tokens`` to peer ``to`` (indexed there);
        returns the tokens it covers."""
        peer = self.remotes.get(to)
        if peer is None or to in self.node.dead:
            raise InstanceDied(f"{self.name} has no live peer {to!r} to send a prefix to")
        blocks = self.pool.match(tokens)  # whole blocks, never the last token
        if not blocks:
            return 0
        n = len(blocks) * self.pool.block_size
        try:
            got = self.pool.transfer_with_insert(peer.pool, tokens[:n], blocks)
            peer.pool.free_mem(got)  # the peer's index keeps its own reference
        finally:
            self.pool.free_mem(blocks)
        return n

    def _grant(self, peer: str, blocks: list[int]) -> None:
        self.grants.setdefault(peer, Counter()).update(blocks)

    def _ungrant(self, peer: str, blocks: list[int]) -> list[int]:
        """Remove ``blocks`` from what ``peer`` holds here; returns those it really held."""
        held = self.grants.get(peer, Counter())
        out = []
        for b in blocks:
            if held[b] > 0:
                held[b] -= 1
                out.append(b)
        return out

    def _peer_down(self, name: str, reason: str) -> None:
        self.node.dead.setdefault(name, reason)
        held = self.grants.pop(name, Counter())
        for key in [k for k in self.xfers if k[0] == name]:
            del self.xfers[key]
        blocks = list(held.elements())
        if blocks:
            self.pool.free_mem(blocks)

    def _submit(self, d: dict) -> None:
        params = params_from_dict(d["params"])
        ids = self.engine.validate(list(d["prompt_token_ids"]), params)
        rid = d["request_id"]
        if rid in self.engine.requests or any(_inbox_id(x) == rid for x in self.inbox):
            raise InvalidRequest(f"request id {rid!r} is already in use on {self.name}")
        self.inbox.append((ids, params, rid, float(d["arrival_time"])))

    def _query(self, what: str, args: dict) -> dict:
        if what == "stats":
            return {
                "pool": self.pool.stats(),
                "requests": len(self.engine.requests) + len(self.inbox),
                "grants": {p: sum(c.values()) for p, c in self.grants.items()},
                "dead_peers": dict(self.node.dead),
            }
        if what == "check":
            try:
                self.pool.check()
                ok, error = True, None
            except AssertionError as e:
                ok, error = False, str(e)
            return {"ok": ok, "error": error, "pool": self.pool.stats()}
        if what == "validate":
            ids = self.engine.validate(list(args["prompt"]), params_from_dict(args["params"]))
            return {"ids": ids}
        raise ValueError(f"unknown query {what!r}")

    def _connect_peers(self, peers: list[dict]) -> None:
        for p in peers:
            name = p["name"]
            if name == self.name:
                continue
            self.node.connect(name, p["address"])
            if p.get("handle") is None:
                continue
            kv = attach(p["handle"])
            pool = RemotePool(self.node, name, kv, self.pool.layout, self.pool.dtype)
            self.remotes[name] = RemotePeer(name, p["role"], pool)
            if p["role"] == "decode":
                self.decodes.append(name)

    # ---- the loop -------------------------------------------------------------------------
    def announce(self) -> None:
        """Tell the frontend where this instance listens and how to map its pool."""
        shared = getattr(self.pool, "shared", None)
        handle = shared.handle.to_dict() if shared is not None else None
        self.node.push(FRONTEND, Ready(self.name, self.node.address, handle, os.getpid()))

    def _heartbeat(self) -> None:
        now = time.monotonic()
        if now - self._last_beat >= self.spec.heartbeat_s:
            self._last_beat = now
            self.node.try_push(FRONTEND, Heartbeat(self.name, time.time()))

    def _admit(self) -> None:
        inbox, self.inbox = self.inbox, []
        for item in inbox:
            if isinstance(item, Request):
                self.engine.add_prefilled(item)
                continue
            ids, params, rid, arrival = item
            self.engine.add_request(ids, params, request_id=rid, arrival_time=arrival)
            self.engine.requests[rid].extra["prefill_instance"] = self.name

    def _flush(self, outputs) -> None:
        for out in outputs:
            self.node.try_push(FRONTEND, Output(output_to_dict(out)))
        for req in self.engine.handoffs:
            failure = req.extra.pop("handoff_error", None)
            if req.finish_reason == "error" or failure is not None:
                req.finish_reason = "error"
                req.error = req.error or failure
                req.status = _Status.FINISHED
                req.metrics.finish_time = time.perf_counter()
                out = req.to_output(self.engine.tokenizer.decode(req.output_token_ids))
                self.node.try_push(FRONTEND, Output(output_to_dict(out)))
            else:
                to = req.extra["decode_instance"]
                self.handed[req.request_id] = to
                if len(self.handed) > HANDOFF_MEMORY:
                    self.handed.popitem(last=False)
                self.node.try_push(FRONTEND, Handoff(req.request_id, to))
        self.engine.handoffs.clear()

    def run(self) -> None:
        """Serve until told to stop, or until the launching process is gone."""
        while not self.stopping:
            if not self._parent_alive():
                break  # orphaned: the frontend died without shutting us down
            self._heartbeat()
            busy = bool(self.inbox) or self.engine.has_unfinished()
            self.node.serve(0.0 if busy else IDLE_POLL_S)
            if self.stopping:
                break
            self._admit()
            if self.engine.has_unfinished():
                self._flush(self.engine.step())

    def _parent_alive(self) -> bool:
        now = time.monotonic()
        if now - self._last_parent_check < PARENT_CHECK_S:
            return True
        self._last_parent_check = now
        if not self.spec.parent_pid:
            return True
        try:
            os.kill(self.spec.parent_pid, 0)
        except ProcessLookupError:
            return False
        except PermissionError:
            pass  # exists, owned by someone else
        return True

    def close(self) -> None:
        """Release sockets and unlink the shared pool segment."""
        self.node.close()
        close_shared = getattr(self.pool, "close_shared", None)
        if close_shared is not None:
            close_shared()


def _inbox_id(item) -> str:
    return item.request_id if isinstance(item, Request) else item[2]


def _exit_on_sigterm(signum, frame) -> None:
    raise SystemExit(128 + signum)


def instance_main(spec: InstanceSpec) -> None:
    """Entry point of a spawned instance process."""
    # Ctrl-C reaches the whole process group; the frontend decides how we stop.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, _exit_on_sigterm)
    torch.set_num_threads(spec.num_threads)
    server = InstanceServer(spec)
    try:
        server.announce()
        server.run()
    finally:
        with contextlib.suppress(Exception):
            server.close()
        sys.stdout.flush()
        sys.stderr.flush()
    # Everything this process owns is released above; skip the slow interpreter teardown.
    os._exit(0)
