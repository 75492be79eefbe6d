"""Every instance of a deployment in one process, stepped in turn.

KV moves between instances only through the recipes' MemPool calls (a plain tensor copy
here). A new request goes where the ``Frontend`` routes it among the entry-role instances,
as in the process runtime and the simulator (its prompt trees follow what each entry pool
caches; under ``prompt_tree`` the instance holding most of the prompt may first
send it over); a prefilled one goes to the decode instance holding the most of it."""

from __future__ import annotations

import functools
import itertools
import time
from pathlib import Path

import torch

from .config import Deployment, EngineConfig
from .engine import Checked, Engine, check_once, tightest
from .mempool import push_cached
from .recipes import Role
from .request import Request, RequestOutput, TokenDelta
from .sampling import SamplingParams
from .scheduler.frontend import Frontend
from .scheduler.global_scheduler import DEFAULT_TTL_S, Cost, Route


class Instance:
    """One engine with a name and a role, as peers see it (``.pool``, ``.accept``)."""

    def __init__(self, name: str, role: str, engine: Engine):
        self.name = name
        self.role = role
        self.engine = engine
        self.pool = engine.pool

    def accept(self, req: Request) -> None:
        """Take over a request whose KV was just transferred into this pool."""
        req.decode_instance = self.name
        self.engine.add_prefilled(req)


class InProcessCluster:
    """The instances of ``deployment`` here, entry role first: a ``Serving`` and their
    ``Peers``. ``policy``, ``cost_model`` and ``ttl_s`` configure the ``GlobalScheduler`` of
    its ``Frontend``."""

    def __init__(
        self,
        model_dir: str | Path,
        deployment: Deployment,
        *,
        device: str | torch.device = "cpu",
        dtype: str | torch.dtype = "float32",
        engine_config: EngineConfig | None = None,
        policy: str = "prompt_tree",
        cost_model: Cost | None = None,
        ttl_s: float = DEFAULT_TTL_S,
    ):
        self.deployment = deployment
        self.instances: list[Instance] = []
        first = None
        ecfg = engine_config or EngineConfig()
        placed = ecfg.placed(len(deployment.instances()))  # every instance on ``device``
        for name, role in deployment.instances():
            whole = ecfg.tp_size(role) == 1  # a tensor-parallel instance loads its own shard
            eng = Engine(
                model_dir,
                config=deployment,
                role=role,
                peers=self,
                device=device,
                dtype=dtype,
                engine_config=placed,
                instance_id=name,
                share_model_with=first if whole else None,
            )
            first = first or (eng if whole else None)  # one copy of the weights in the process
            self.instances.append(Instance(name, role, eng))
        self.by_name = {inst.name: inst for inst in self.instances}
        self.entry = self.role(deployment.milestone.roles[0])
        self.tokenizer = self.instances[0].engine.tokenizer
        self._ids = itertools.count()
        self._deltas: dict[str, TokenDelta] = {}  # of requests still in flight
        self.frontend = Frontend(
            [i.name for i in self.entry],
            lambda src, dst, ids: push_cached(self.by_name[src].pool, self.by_name[dst].pool, ids),
            policy=policy,
            block_size=ecfg.block_size,
            cost_model=cost_model,
            ttl_s=ttl_s,
            caching=deployment.milestone.entry_caches,
        )
        self.scheduler = self.frontend.scheduler
        for inst in self.entry:  # the prompt trees follow what entry instances cache
            self.frontend.follow(inst.name, inst.pool)

    def role(self, role: str) -> list[Instance]:
        """The instances of ``role``."""
        return [i for i in self.instances if i.role == role]

    @property
    def pool(self):
        """The first instance's MemPool."""
        return self.instances[0].pool

    @property
    def pools(self) -> list:
        """Every instance's MemPool, entry role first."""
        return [i.pool for i in self.instances]

    def decodes(self) -> dict[str, Instance]:
        """The decode instances, by name (in one process none dies)."""
        return {i.name: i for i in self.role(Role.DECODE)}

    def decodes_down(self) -> dict[str, str]:
        """None is down."""
        return {}

    def offer(self, peer: Instance, blocks: int, tokens) -> tuple[int, int] | None:
        """Its load and cached prefix of ``tokens`` if it has room for ``blocks`` blocks."""
        return peer.engine.offer(blocks, tokens)

    def prefill_pool(self, req: Request):
        """The pool of the instance that prefilled ``req``."""
        return self.by_name[req.prefill_instance].pool

    def peer_failed(self, name: str, error: Exception) -> None:
        """In one process a failed copy is a bug, not a dead peer: nothing to mark."""

    def clock(self) -> float:
        """Wall seconds (hand-offs are timed with it)."""
        return time.perf_counter()

    def validate(self, prompt, params: SamplingParams) -> Checked:
        """Checked once, against the tightest limits of every instance (each must be able to
        hold the request); the instance it is routed to takes it as it is."""
        return check_once(prompt, params, self.entry[0].engine.tokenizer, self.limits)

    @functools.cached_property
    def limits(self) -> tuple:
        """The tightest limits of every instance, once (an instance's never change)."""
        return tightest([inst.engine.limits for inst in self.instances])

    def add_request(
        self,
        prompt,
        params: SamplingParams,
        request_id: str | None = None,
        arrival_time: float | None = None,
        session_id: str | None = None,
    ) -> str:
        """Route by the global scheduler (after the prefix push it may ask for; ``session_id``
        for the ``session`` policy) and queue."""
        checked = self.validate(prompt, params)
        ids = checked.ids
        rid = request_id if request_id is not None else f"req-{next(self._ids)}"
        if any(rid in i.engine.requests for i in self.instances):
            raise ValueError(f"request id {rid!r} is already in use")

        def send(route: Route) -> None:
            self.by_name[route.instance].engine.add_request(checked, params, rid, arrival_time)

        self.frontend.submit(rid, ids, params.max_tokens, session_id, send)
        return rid

    def step(self) -> list[RequestOutput]:
        """Step every instance with work once; handed-off requests are already queued on D."""
        done: list[RequestOutput] = []
        for inst in self.instances:
            if inst.engine.has_unfinished():
                done.extend(inst.engine.step())
            handoffs = [req.request_id for req in inst.engine.handoffs]  # already passed on
            inst.engine.handoffs.clear()
            deltas = inst.engine.take_deltas()  # in order: P's first token, then D's
            self.frontend.report(handoffs, deltas)
            for d in deltas:
                if (have := self._deltas.get(d.request_id)) is None:
                    self._deltas[d.request_id] = d
                else:
                    have.token_ids += d.token_ids
                    if have.logprobs is not None and d.logprobs is not None:
                        have.logprobs += d.logprobs
        for out in done:  # its output carries every token
            self._deltas.pop(out.request_id, None)
        self.frontend.report(outputs=done)
        return done

    def take_deltas(self) -> list[TokenDelta]:
        """Tokens of unfinished requests sampled since the last call."""
        out, self._deltas = list(self._deltas.values()), {}
        return out

    def load(self) -> dict[str, dict]:
        """Every instance's role and requests waiting and running."""
        return {k: v for i in self.instances for k, v in i.engine.load().items()}

    def abort(self, request_id: str) -> RequestOutput | None:
        """Abort ``request_id`` on whichever instance holds it."""
        self._deltas.pop(request_id, None)
        self.frontend.report(dropped=[request_id])
        for inst in self.instances:
            if (out := inst.engine.abort(request_id)) is not None:
                return out
        return None

    def has_unfinished(self) -> bool:
        """Whether any instance still has work."""
        return any(i.engine.has_unfinished() for i in self.instances)

    def check_pools(self, require_idle: bool = True) -> dict[str, dict]:
        """Audit every instance's pool."""
        return {k: v for i in self.instances for k, v in i.engine.check_pools(require_idle).items()}

    def pool_stats(self) -> dict[str, dict]:
        """Every instance's pool statistics by name."""
        return {i.name: i.pool.stats() for i in self.instances}

    def close(self) -> None:
        """Close every instance (stops tensor-parallel workers)."""
        for inst in self.instances:
            inst.engine.close()
