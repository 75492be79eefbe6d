"""xPyD in one process: prefill and decode engines over their own MemPools.

KV moves between instances only through MemPool's ``transfer`` / ``transfer_with_insert``
(a plain tensor copy inside one process); which calls run where is the recipe's business
(``PrefillRecipe`` / ``DecodeRecipe``). The cluster routes each request to the prefill
instance holding the longest cached prefix of its prompt (least loaded on a tie), and
its decode to the decode instance that holds the most of it.
"""

from __future__ import annotations

import itertools
from collections.abc import Sequence
from pathlib import Path

import torch

from ..config import Deployment, EngineConfig
from ..request import Request, RequestOutput
from ..sampling import SamplingParams
from .recipes import DecodeRecipe, PrefillRecipe


class Instance:
    """One engine with a role ("prefill" or "decode") and a name."""

    def __init__(self, name: str, role: str, engine):
        self.name = name
        self.role = role
        self.engine = engine

    @property
    def pool(self):
        """This instance's MemPool."""
        return self.engine.pool

    def load(self) -> int:
        """Requests waiting or running here."""
        sched = self.engine.scheduler
        return len(sched.waiting) + len(sched.running)

    def accept(self, req: Request) -> None:
        """Take over a request whose KV was just transferred into this pool."""
        req.extra["decode_instance"] = self.name
        self.engine.add_prefilled(req)


class InProcessCluster:
    """Prefill and decode instances of a disaggregated deployment, stepped in turn.

    Offers the engine API (``add_request``, ``step``, ``has_unfinished``, ``validate``,
    ``tokenizer``, ``pool``) so ``LLM`` and the benchmark drive it like one engine.
    """

    def __init__(
        self,
        model_dir: str | Path,
        deployment: Deployment,
        *,
        device: str | torch.device = "cpu",
        dtype: str | torch.dtype = "float32",
        engine_config: EngineConfig | None = None,
    ):
        from ..engine import Engine

        if deployment.colocated:
            raise ValueError(f"{deployment.name} is colocated; use Engine")
        self.deployment = deployment
        level = deployment.cache_level
        first = None

        def build(name: str, role: str, recipe) -> Instance:
            nonlocal first
            eng = Engine(
                model_dir,
                config=deployment.name,
                device=device,
                dtype=dtype,
                engine_config=engine_config,
                instance_id=name,
                recipe=recipe,
                share_model_with=first,
            )  # one copy of the weights in the process
            first = first or eng
            return Instance(name, role, eng)

        self.prefill = [
            build(f"P{i}", "prefill", PrefillRecipe(level, self._pick_decode))
            for i in range(deployment.num_prefill)
        ]
        self.decode = [
            build(f"D{i}", "decode", DecodeRecipe(level, self._prefill_pool_of))
            for i in range(deployment.num_decode)
        ]
        self.by_name = {inst.name: inst for inst in self.prefill + self.decode}
        self.tokenizer = first.tokenizer
        self._ids = itertools.count()

    # ---- routing -----------------------------------------------------------------------
    def _best(self, instances: list[Instance], tokens: Sequence[int]) -> Instance:
        return max(instances, key=lambda i: (i.pool.cached_prefix_len(tokens), -i.load()))

    def _pick_decode(self, req: Request) -> Instance:
        return self._best(self.decode, req.all_token_ids[: req.num_computed])

    def _prefill_pool_of(self, req: Request):
        return self.by_name[req.extra["prefill_instance"]].pool

    # ---- engine API ----------------------------------------------------------------------
    @property
    def instances(self) -> list[Instance]:
        """Prefill instances first, then decode instances."""
        return self.prefill + self.decode

    @property
    def pool(self):
        """The first prefill instance's MemPool."""
        return self.prefill[0].pool

    @property
    def pools(self) -> list:
        """Every instance's MemPool, prefill first."""
        return [i.pool for i in self.instances]

    def validate(self, prompt, params: SamplingParams) -> list[int]:
        """Validate against a prefill and a decode instance (both must hold the request)."""
        ids = self.prefill[0].engine.validate(prompt, params)
        self.decode[0].engine.validate(ids, params)
        return ids

    def add_request(
        self,
        prompt,
        params: SamplingParams,
        request_id: str | None = None,
        arrival_time: float | None = None,
    ) -> str:
        """Route to the prefill instance with the longest cached prefix (least loaded on ties)."""
        ids = self.validate(prompt, params)
        inst = self._best(self.prefill, ids)
        rid = request_id if request_id is not None else f"req-{next(self._ids)}"
        rid = inst.engine.add_request(ids, params, request_id=rid, arrival_time=arrival_time)
        inst.engine.requests[rid].extra["prefill_instance"] = inst.name
        return rid

    def step(self) -> list[RequestOutput]:
        """Step every instance once; handed-off requests are already queued on their D."""
        done: list[RequestOutput] = []
        for inst in self.instances:
            if inst.engine.has_unfinished():
                done.extend(inst.engine.step())
            inst.engine.handoffs.clear()  # the recipe already passed them on
        return done

    def has_unfinished(self) -> bool:
        """Whether any instance still has work."""
        return any(i.engine.has_unfinished() for i in self.instances)
