"""One engine instance: model + MemPool + local scheduler + the recipe of its role.

A step is ``schedule → run model → postprocess``: the scheduler picks who computes how many
tokens, the runner turns that into tensors, postprocess checks stops and runs the hooks."""

from __future__ import annotations

import functools
import hashlib
import itertools
import logging
import time
from array import array
from collections.abc import Callable, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

import numpy as np
import torch

from .attention import make_backend
from .attention.base import SeqSlice
from .config import Deployment, EngineConfig, parse_config_name, resolve_dtype
from .decode_graphs import DecodeGraphs, graph_memory_bytes, run_step
from .errors import ConfigError, InvalidRequest, PoolExhausted, SamplingError
from .memory import DEFAULT_CPU_KV_BYTES, PROVIDERS, MemoryPlan
from .mempool import MemPool, PoolAccountingError
from .mempool.chain import default_chain
from .model.config import ModelConfig
from .model.layers import CausalLM
from .model.loader import dummy_model, load_weights, read_checkpoint
from .model.registry import build_model
from .parallel import SingleRank, TPGroup, TPShard
from .recipes import Hook, Outcome, Peers, Recipe
from .request import Request, RequestOutput, Status, TokenDelta
from .sampling import SamplingParams, adjust_logits, sample, token_logprobs
from .scheduler.local import LocalScheduler

logger = logging.getLogger(__name__)


@dataclass
class StepPlan:
    """What :meth:`Engine.schedule` decided: the ``(request, tokens)`` batch, requests that
    can never get blocks, and outputs already finished (hand-offs that failed)."""

    batch: list[tuple[Request, int]]
    failed: list[Request]
    done: list[RequestOutput]


class ModelRunner:
    """Turns a scheduled batch into one forward pass and the sampled tokens. ``graphs``
    (CUDA) serves the decode steps it can."""

    def __init__(
        self,
        model: CausalLM,
        backend,
        device: torch.device,
        group=None,
        graphs: DecodeGraphs | None = None,
    ):
        self.model = model
        self.backend = backend
        self.device = device
        self.group = group or SingleRank()  # tensor-parallel ranks that run each step too
        self.graphs = graphs
        self._thread: ThreadPoolExecutor | None = None

    def forward(self, batch: list[tuple[Request, int]], generator: torch.Generator) -> tuple:
        """:meth:`run`, a failure of the pass failing each of its rows (the engine lives)."""
        try:
            return self.run(batch, generator) if batch else ([], {})
        except Exception as e:
            return [None] * len(batch), {r: f"{type(e).__name__}: {e}" for r, _ in batch}

    def start(self, batch: list[tuple[Request, int]], generator: torch.Generator) -> Future:
        """:meth:`forward` on the runner's own thread (made on first use), while the caller
        does other work; on a tensor-parallel instance, whose ranks share one control channel
        with the caller's transfers, the pass runs now and the future is done."""
        if not isinstance(self.group, SingleRank):
            done = Future()
            done.set_result(self.forward(batch, generator))
            return done
        if self._thread is None:
            cuda = self.device.type == "cuda"
            init = functools.partial(torch.cuda.set_device, self.device) if cuda else None
            self._thread = ThreadPoolExecutor(1, "forward", initializer=init)
        return self._thread.submit(self.forward, batch, generator)

    def close(self) -> None:
        """Stop the runner's thread, if it made one."""
        if self._thread is not None:
            self._thread.shutdown()

    @torch.inference_mode()
    def run(
        self, batch: list[tuple[Request, int]], generator: torch.Generator
    ) -> tuple[list[int | None], dict[Request, str]]:
        """A token per row of ``batch`` that finished its pending tokens (None for the others),
        and the requests whose logits allowed no token, with why."""
        slices, ids, last_rows, sample_for = [], [], [], []
        for req, n in sorted(batch, key=lambda rn: rn[1] == 1):  # prefill chunks first
            start = req.num_computed
            slices.append(SeqSlice(req.blocks, start, n))
            ids.extend(req.tokens[start : start + n])
            if start + n == req.num_tokens:
                last_rows.append(len(ids) - 1)
                sample_for.append(req)
        with self.group.step(slices, ids, last_rows):  # other TP ranks run this step too
            logits = run_step(  # [B, vocab] fp32, B = len(sample_for)
                self.model, self.backend, self.graphs, slices, ids, last_rows, self.device
            )
        eos = self.model.cfg.eos_token_ids
        tokens, bad = _sample(logits, sample_for, generator, eos) if sample_for else ([], {})
        by_req = dict(zip(map(id, sample_for), tokens))
        return [by_req.get(id(req)) for req, _ in batch], bad


def _sample(logits: torch.Tensor, reqs: list[Request], generator, eos: Sequence[int]) -> tuple:
    """A token per row of ``logits`` for ``reqs`` (logprobs, of the unadjusted logits, recorded
    where asked), and the requests whose row allowed none. Penalties, ``logit_bias`` and
    ``min_tokens`` adjust the logits first; greedy rows without logprobs cost one
    device-to-host copy for the whole batch."""
    params, done = [r.params for r in reqs], [r.num_output for r in reqs]
    history = lambda i: reqs[i].tokens[reqs[i].num_prompt :]
    adjusted = adjust_logits(logits, params, history, eos)
    if all(r.params.greedy and r.logprobs is None for r in reqs):
        tokens = greedy_tokens(adjusted)
        if None not in tokens:
            return tokens, {}
    bad: dict[Request, str] = {}
    try:
        tokens = sample(adjusted, params, done, generator)
    except SamplingError as e:  # those rows fail alone; the others keep their token
        tokens, bad = e.tokens, {reqs[i]: f"SamplingError: {e}" for i in e.rows}
    if want := [i for i, r in enumerate(reqs) if r.logprobs is not None and tokens[i] is not None]:
        ks = [reqs[i].params.logprobs for i in want]
        for i, lp in zip(want, token_logprobs(logits[want], [tokens[i] for i in want], ks)):
            reqs[i].logprobs.append(lp)
    return tokens, bad


def greedy_tokens(logits: torch.Tensor) -> list[int | None]:
    """The argmax of each row of ``logits`` ``[B, V]`` in one device-to-host copy; None for a
    row whose maximum is not finite (``sample`` then names the rows)."""
    best = logits.argmax(dim=-1)  # [B]
    finite = torch.isfinite(logits.amax(dim=-1))  # NaN anywhere in a row makes its max NaN
    return [t if t >= 0 else None for t in torch.where(finite, best, -1).tolist()]


def kv_identity(model_dir: str | Path | None, cfg: EngineConfig) -> str:
    """What a persistent KV tier must match to reuse its blocks: the checkpoint (its path,
    config and weight files' sizes) and how its weights were made."""
    path = Path(model_dir).resolve()
    digest = hashlib.sha256((path / "config.json").read_bytes())
    for f in sorted(path.glob("*.safetensors")):
        digest.update(f"{f.name}:{f.stat().st_size}".encode())
    weights = f"dummy seed {cfg.seed}" if cfg.load_format == "dummy" else cfg.load_format
    return f"{path} {digest.hexdigest()[:16]} {weights}"


def _load_model(model_dir: Path, model_config: ModelConfig, device, dtype, load_format: str):
    """The checkpoint's model (random weights of its shapes for ``load_format="dummy"``) on
    ``device`` in ``dtype``, for inference."""
    if load_format == "dummy":
        return dummy_model(build_model, model_config, device, dtype)
    model = build_model(model_config)
    model.load_hf_weights(load_weights(model_dir, model_config))
    return model.to(device=device, dtype=dtype).eval()


def model_bytes(model_config: ModelConfig, dtype: torch.dtype) -> int:
    """Bytes of the model's weights in ``dtype`` (a tied LM head counted once)."""
    return model_config.num_parameters() * dtype.itemsize


def _largest_step(model, cfg: EngineConfig, shard: TPShard, provider, device, dtype) -> int:
    """The peak bytes (``provider.peak_during``) of the largest step the scheduler can pick:
    a full token budget at the end of the longest context, logits for every sequence slot.
    Every position of its block table is one scratch block: what it reads is garbage, what
    it allocates is what a real step allocates."""
    max_len = cfg.model_len(model.cfg)
    tokens = min(cfg.max_num_batched_tokens, max_len - 1)
    layout = shard.kv_layout(cfg.block_size)
    pool = MemPool(layout, 1, device=device, dtype=dtype)
    table = pool.alloc_mem(1) * layout.num_blocks_for(max_len)
    scale = model.cfg.head_dim**-0.5
    backend = make_backend(cfg.attention, pool.kv("hbm"), layout, shard.heads, scale)
    ids = torch.zeros(tokens, dtype=torch.long, device=device)  # [T]
    rows = torch.full((min(cfg.max_num_seqs, tokens),), tokens - 1, device=device)  # [B]

    @torch.inference_mode()
    def step() -> None:
        md = backend.prepare([SeqSlice(table, max_len - tokens, tokens)])
        hidden = model(ids, backend, md)  # [T, hidden]
        torch.softmax(model.compute_logits(hidden[rows]), dim=-1)  # [B, vocab], as sampling

    peak = provider.peak_during(device, step)
    pool.free_mem(table[:1])
    return peak


def pool_blocks(
    cfg: EngineConfig,
    shard: TPShard,
    device: torch.device,
    dtype: torch.dtype,
    *,
    model: CausalLM | None = None,
    owns_weights: bool = True,
    graphs: int = 0,
) -> int:
    """The hbm blocks of an instance holding ``shard`` of its model: ``num_blocks``, else as
    many as ``kv_memory_bytes`` holds, else, on a device with memory accounting
    (:data:`~.memory.PROVIDERS`), what its share leaves (:class:`~.memory.MemoryPlan`) after
    its weights (``owns_weights``: not another engine's), the peak of ``model``'s largest step
    (measured here; None: a tensor-parallel instance, sized before its ranks load) and
    ``graphs``, the bytes of CUDA graphs captured before the pool exists; else
    DEFAULT_CPU_KV_BYTES."""
    model_config = shard.cfg
    layout = shard.kv_layout(cfg.block_size)
    block_bytes = layout.block_bytes(dtype.itemsize)
    if cfg.num_blocks is not None:
        return cfg.num_blocks
    provider = PROVIDERS.get(device.type)
    if cfg.kv_memory_bytes is not None or provider is None:
        budget = cfg.kv_memory_bytes or DEFAULT_CPU_KV_BYTES
        if (n := budget // block_bytes) <= 0:
            raise ConfigError(f"a KV budget of {budget} bytes holds no {block_bytes}-byte block")
        return n
    peak = 0
    if model is not None:
        peak = _largest_step(model, cfg, shard, provider, device, dtype)
    plan = MemoryPlan(
        device=str(device),
        device_bytes=provider.total(device),
        share=cfg.device_share,
        instances=cfg.instances_on_device,
        weights=model_bytes(model_config, dtype) // shard.size if owns_weights else 0,
        activations=peak,
        block_bytes=block_bytes,
        graphs=graphs,
        context=getattr(provider, "context_bytes", 0),
    )
    return plan.blocks(least=layout.num_blocks_for(cfg.model_len(model_config)))


@dataclass
class EngineParts:
    """What an engine computes with, made by :func:`build_parts` (or by hand: the simulator's
    engines have a pool and no model): the checkpoint's config and tokenizer, the pool, the
    model runner (None: the engine's owner computes the steps) and the tensor-parallel ranks
    that run each step with rank 0."""

    model_config: ModelConfig
    tokenizer: Any
    pool: MemPool
    runner: ModelRunner | None = None
    tp: SingleRank | TPGroup = field(default_factory=SingleRank)


def build_parts(
    model_dir: str | Path | None,
    cfg: EngineConfig,
    tp: int,
    *,
    device: torch.device,
    dtype: torch.dtype,
    instance_id: str = "0",
    pool_factory: Callable[..., MemPool] | None = None,
    share: Engine | None = None,
) -> EngineParts:
    """Build an engine's parts, in order: read the checkpoint's config and tokenizer, load its
    weights (random ones under ``load_format="dummy"``; ``share``'s, an engine in this process
    whose read-only weights are reused; ``tp`` > 1: rank 0's shard, the other ranks in their
    own processes), size the pool (:func:`pool_blocks`, after the CUDA graphs' bytes), make
    the pool (``pool_factory``), pick the attention backend and capture the decode graphs."""
    if share is not None:
        model_config, tokenizer = share.model_config, share.tokenizer
    else:
        model_config, tokenizer = read_checkpoint(model_dir)
    shard = TPShard(0, tp, model_config)  # rank 0's heads and KV heads: all of them at TP 1
    graph_batch = cfg.decode_graph_batch(device)
    max_len = cfg.model_len(model_config)
    graph_bytes = 0  # counted before the pool is sized
    if graph_batch:
        graph_bytes = graph_memory_bytes(
            shard.local_config(), graph_batch, max_len, cfg.block_size, dtype.itemsize
        )
    if tp > 1:
        if cfg.load_format != "auto":
            raise ConfigError("load_format 'dummy' is for instances of one rank")
        num_blocks = pool_blocks(cfg, shard, device, dtype, graphs=graph_bytes)
        sized = replace(cfg, num_blocks=num_blocks)  # what every rank builds
        group = TPGroup(model_dir, shard, sized, device, dtype)
        model = group.model
    else:
        group = SingleRank()
        owns = share is None
        if owns:
            model = _load_model(Path(model_dir), model_config, device, dtype, cfg.load_format)
        else:
            model = share.model
        num_blocks = pool_blocks(
            cfg, shard, device, dtype, model=model, owns_weights=owns, graphs=graph_bytes
        )
    layout = shard.kv_layout(cfg.block_size)
    below: dict = {"dram_blocks": cfg.dram_blocks}
    if cfg.disk_blocks:
        if tp > 1:
            raise ConfigError("a disk tier is for instances of one rank")
        if cfg.disk_dir is None:
            raise ConfigError("disk_blocks needs disk_dir: the directory its files go in")
        below = {
            "tiers": default_chain(
                cfg.dram_blocks, cfg.disk_blocks, str(Path(cfg.disk_dir) / instance_id)
            ),
            "model": kv_identity(model_dir, cfg),
        }
    pool = group.make_pool(pool_factory or MemPool)(
        layout, num_blocks, device=device, dtype=dtype, instance_id=instance_id, **below
    )
    scale = model_config.head_dim**-0.5
    backend = make_backend(cfg.attention, pool.kv("hbm"), layout, shard.heads, scale)
    graphs = None
    if graph_batch and hasattr(backend, "plan_graph"):  # the backends that can be captured
        graphs = DecodeGraphs(model, backend, graph_batch, max_len, capture=True)
    runner = ModelRunner(model, backend, device, group, graphs)
    return EngineParts(model_config, tokenizer, pool, runner, group)


def check_request(
    prompt: str | Sequence[int],
    params: SamplingParams,
    tokenizer,
    vocab: int,
    max_model_len: int,
    block_size: int,
    hbm_blocks: int,
) -> list[int]:
    """Token ids of ``prompt``, or a ``ValueError``/``PoolExhausted`` naming what is wrong with
    the request: its parameters, a token outside the vocabulary, a prompt the context cannot
    hold, more KV blocks (of ``block_size`` tokens) than the pool's ``hbm_blocks`` in all.
    ``vocab`` is the model's vocabulary."""
    if not isinstance(params, SamplingParams):
        raise InvalidRequest(f"params must be SamplingParams, got {type(params).__name__}")
    ids = tokenizer.prompt_ids(prompt)
    lowest, highest = _id_range(ids) if ids else (0, 0)
    if not (0 <= lowest and highest < vocab):
        bad = next(t for t in ids if not 0 <= t < vocab)
        raise InvalidRequest(f"token id {bad!r} is outside the vocabulary [0, {vocab})")
    if bad := [t for t, _ in params.logit_bias if t >= vocab]:
        raise InvalidRequest(
            f"SamplingParams.logit_bias: token id {bad[0]} is outside the vocabulary [0, {vocab})"
        )
    if len(ids) >= max_model_len:
        raise InvalidRequest(
            f"prompt too long: {len(ids)} tokens, the context holds {max_model_len} "
            "(prompt plus at least one generated token)"
        )
    need = -(-min(len(ids) + params.max_tokens, max_model_len) // block_size)
    if need > hbm_blocks:
        raise PoolExhausted(
            f"request needs {need} KV blocks but the pool has only {hbm_blocks} in all; "
            "give the engine more KV memory or ask for fewer tokens"
        )
    return ids


@dataclass(frozen=True, slots=True)
class Checked:
    """A prompt :func:`check_request` accepted: its token ``ids``, for ``params``, under
    ``limits`` (vocabulary, context length, block size, pool blocks). Handed on as the prompt
    (to ``add_request``, to the instance a cluster routes it to), it is not checked again
    where no limit is tighter: a request is checked once on its way through a deployment."""

    ids: Sequence[int]
    params: SamplingParams
    limits: tuple[int, int, int, int]

    def holds(self, params: SamplingParams, limits: tuple[int, int, int, int]) -> bool:
        """Whether this check stands for ``params`` under ``limits`` (each at least as large:
        ids below a smaller vocabulary, a prompt within a shorter context and fewer blocks of
        smaller size, are within larger ones)."""
        if self.params is not params:
            return False
        return self.limits is limits or all(c <= o for c, o in zip(self.limits, limits))


def check_once(
    prompt: str | Sequence[int] | Checked,
    params: SamplingParams,
    tokenizer,
    limits: tuple[int, int, int, int],
) -> Checked:
    """``prompt`` checked by :func:`check_request` under ``limits`` (vocabulary, context
    length, block size, pool blocks), unless it is a :class:`Checked` that holds for them."""
    if type(prompt) is Checked:
        if prompt.holds(params, limits):
            return prompt
        prompt = prompt.ids
    return Checked(check_request(prompt, params, tokenizer, *limits), params, limits)


def tightest(limits: Sequence[tuple[int, int, int, int]]) -> tuple[int, int, int, int]:
    """The limits a request must meet to fit every one of ``limits`` (each the smallest)."""
    return tuple(map(min, zip(*limits)))  # type: ignore[return-value]


def _id_range(ids: Sequence[int]) -> tuple[int, int]:
    """The smallest and largest of ``ids``: an int64 array's by numpy (``min`` and ``max``
    would box every token, at twice a list's cost)."""
    if type(ids) is array and ids.typecode == "q":
        view = np.frombuffer(ids, dtype=np.int64)
        return int(view.min()), int(view.max())
    return min(ids), max(ids)


def new_request(
    rid: str,
    ids: Sequence[int],
    params: SamplingParams,
    arrival: float,
    max_model_len: int,
    instance_id: str,
) -> Request:
    """A request of validated ``ids`` to be prefilled on ``instance_id``, its length capped by
    ``max_tokens`` and the context (the one place the cap is set)."""
    req = Request(rid, ids, params, arrival_time=arrival)
    req.max_total_tokens = min(len(ids) + params.max_tokens, max_model_len)
    req.prefill_instance = instance_id
    return req


# How Engine builds its parts from a checkpoint (build_parts' options), with their defaults.
BUILD_OPTIONS = {
    "device": "cpu",
    "dtype": "float32",
    "instance_id": "0",
    "pool_factory": None,
    "share_model_with": None,
}


class Engine:
    """A ``Serving`` instance over one MemPool. ``model_dir`` is a checkpoint, whose parts
    :func:`build_parts` builds (on ``device`` in ``dtype``, the pool made by ``pool_factory``
    and named ``instance_id``, the weights of ``share_model_with`` reused), or
    :class:`EngineParts` built already (the simulator's have no model, then those five are
    theirs). ``role`` picks the recipe of ``config``'s milestone (default: its only role);
    ``peers`` serve the recipe's transfer calls; ``clock`` stamps requests' times (seconds).
    Without a model an engine schedules and postprocesses but cannot run a step: its owner
    computes tokens and calls :meth:`schedule` and :meth:`postprocess`."""

    streams = True  # keep each step's new tokens for take_deltas()

    def __init__(
        self,
        model_dir: str | Path | EngineParts,
        *,
        config: str | Deployment = "PD",
        role: str | None = None,
        peers: Peers | None = None,
        engine_config: EngineConfig | None = None,
        clock: Callable[[], float] = time.perf_counter,
        **build: Any,
    ):
        """``build``: how :func:`build_parts` builds the parts (:data:`BUILD_OPTIONS`:
        ``device`` "cpu", ``dtype`` "float32", ``instance_id`` "0", ``pool_factory``,
        ``share_model_with``); unused when ``model_dir`` is parts built already."""
        if unknown := sorted(set(build) - set(BUILD_OPTIONS)):
            raise TypeError(f"Engine() got unexpected keyword argument(s) {unknown}")
        role, recipe = _role_recipe(config, role)
        cfg = engine_config or EngineConfig()
        parts = model_dir
        if not isinstance(parts, EngineParts):
            b = BUILD_OPTIONS | build
            tp = cfg.tp_size(role)
            if tp > 1 and b["share_model_with"] is not None:
                raise ConfigError(f"a tensor-parallel instance (size {tp}) loads its own shard")
            parts = build_parts(
                model_dir,
                cfg,
                tp,
                device=torch.device(b["device"]),
                dtype=resolve_dtype(b["dtype"]),
                instance_id=b["instance_id"],
                pool_factory=b["pool_factory"],
                share=b["share_model_with"],
            )
        pool = parts.pool
        self.role = role
        self.recipe = recipe
        self.peers = peers
        self.config = cfg
        self.model_config = parts.model_config
        self.tokenizer = parts.tokenizer
        self.pool = pool
        self.runner = parts.runner
        self.tp = parts.tp
        self.clock = clock
        self.device = pool.device
        self.dtype = pool.dtype
        self.max_model_len = cfg.model_len(parts.model_config)
        # what a request must fit: vocabulary, context length, block size, pool blocks
        vocab = parts.model_config.vocab_size
        self.limits = (vocab, self.max_model_len, pool.block_size, pool.capacity())
        self.scheduler = LocalScheduler(
            pool, recipe, cfg.max_num_seqs, cfg.max_num_batched_tokens, cfg.scheduler, clock
        )
        self.generator = torch.Generator().manual_seed(cfg.seed)
        self.requests: dict[str, Request] = {}
        self.handoffs: list[Request] = []  # prefilled here, decoding elsewhere; the owner drains
        # hand-offs wait for the next step and move while it runs (see step())
        self.overlap = cfg.handoff == "overlap" and recipe.hands_off
        self.deltas: dict[str, TokenDelta] = {}  # tokens since the last take_deltas()
        self._ids = itertools.count()

    @property
    def model(self) -> CausalLM | None:
        """The model the steps run (None for an engine without one)."""
        return None if self.runner is None else self.runner.model

    @property
    def backend(self):
        """The attention backend the steps run (None for an engine without a model)."""
        return None if self.runner is None else self.runner.backend

    def validate(self, prompt: str | Sequence[int] | Checked, params: SamplingParams) -> Checked:
        """``prompt`` checked (its token ids in ``.ids``), or a ``ValueError``/``PoolExhausted``
        naming the problem; a :class:`Checked` that holds here already is returned as it is."""
        return check_once(prompt, params, self.tokenizer, self.limits)

    def add_request(
        self,
        prompt: str | Sequence[int],
        params: SamplingParams,
        request_id: str | None = None,
        arrival_time: float | None = None,
        session_id: str | None = None,
    ) -> str:
        """Validate and queue a request; returns its id (one instance: ``session_id`` routes
        nothing)."""
        ids = self.validate(prompt, params).ids
        rid = request_id if request_id is not None else f"req-{next(self._ids)}"
        if rid in self.requests:
            raise InvalidRequest(f"request id {rid!r} is already in use")
        arrival = self.clock() if arrival_time is None else arrival_time
        req = new_request(rid, ids, params, arrival, self.max_model_len, self.pool.instance_id)
        self.requests[rid] = req
        self.scheduler.add(req)
        return rid

    def add_prefilled(self, req: Request) -> None:
        """Queue a request that arrives with its KV in this pool (after a transfer)."""
        self.requests[req.request_id] = req
        self.scheduler.add(req)

    def abort(self, request_id: str) -> RequestOutput | None:
        """Stop a request and release its blocks; returns its output, or None if unknown."""
        if (req := self.requests.get(request_id)) is None:
            return None
        self.scheduler.remove(req)
        return self._finish(req, Hook.FINISH, "abort")

    def take_deltas(self) -> list[TokenDelta]:
        """Tokens sampled since the last call, per request still running or handed off here."""
        out, self.deltas = list(self.deltas.values()), {}
        return out

    def load(self) -> dict[str, dict]:
        """``{instance id: {"role", "waiting", "running"}}`` (parked requests count as running:
        their sum is :meth:`num_load`)."""
        s = self.scheduler
        running = len(s.running) + len(s.parked)
        return {
            self.pool.instance_id: {
                "role": self.role,
                "waiting": len(s.waiting),
                "running": running,
            }
        }

    def num_load(self, arriving: Sequence[Request] = ()) -> int:
        """An instance's load, the one definition every runtime uses: requests waiting,
        running or parked here, and ``arriving`` (handed here, KV on its way)."""
        s = self.scheduler
        return len(s.waiting) + len(s.running) + len(s.parked) + len(arriving)

    def offer(
        self, blocks: int, tokens: Sequence[int], arriving: Sequence[Request] = ()
    ) -> tuple[int, int] | None:
        """What a decode instance offers a hand-off that may grow to ``blocks`` blocks:
        ``(load, cached tokens of tokens)`` if it has room beside ``arriving``, else None."""
        if not self.has_room(blocks, arriving):
            return None
        return self.num_load(arriving), self.pool.cached_prefix_len(tokens)

    def has_unfinished(self) -> bool:
        """Whether any request still waits or runs here."""
        return self.scheduler.has_unfinished()

    def has_room(self, blocks: int, arriving: Sequence[Request] = ()) -> bool:
        """Whether a request that may grow to ``blocks`` blocks fits beside the growth every
        request here (and ``arriving``) may still need: a decode instance's admission."""
        bs = self.pool.layout.block_size  # layout.num_blocks_for inlined: a sum over requests
        growth = sum(
            max(0, -(-r.max_total_tokens // bs) - len(r.blocks))
            for r in (*self.requests.values(), *arriving)
        )
        return self.pool.num_available() - growth >= blocks

    def check_pools(self, require_idle: bool = True) -> dict[str, dict]:
        """Audit this instance's pool (see ``minimemserve.serving.Serving.check_pools``)."""
        self.pool.check()
        stats = self.pool.stats()
        held = {t: stats[t]["referenced"] for t in self.pool.tiers if stats[t]["referenced"]}
        if require_idle and held:
            raise PoolAccountingError(
                f"instance {self.pool.instance_id}: blocks still referenced after every request "
                f"finished: {held}"
            )
        return {self.pool.instance_id: {"pool": stats}}

    def pool_stats(self) -> dict[str, dict]:
        """``{instance id: MemPool.stats()}``."""
        return {self.pool.instance_id: self.pool.stats()}

    def close(self) -> None:
        """Stop the tensor-parallel workers and the runner's thread, if any; let the pool's
        stores finish (a disk tier writes what it has queued)."""
        self.tp.close()
        if self.runner is not None:
            self.runner.close()
        self.pool.close()

    def step(self) -> list[RequestOutput]:
        """One iteration: schedule → run model → postprocess. Returns finished requests.
        Under ``handoff="overlap"`` the requests prefilled by the step before are handed off
        while the model runs (see :meth:`ModelRunner.start`); the step ends when both have."""
        if self.runner is None:
            raise RuntimeError("this engine has no model: its owner computes the steps")
        plan = self.schedule()
        if not (self.overlap and self.scheduler.parked):
            return self.postprocess(plan, *self.runner.forward(plan.batch, self.generator))
        running = self.runner.start(plan.batch, self.generator)
        plan.done.extend(self.send_parked())
        return self.postprocess(plan, *running.result())

    def schedule(self) -> StepPlan:
        """Pick this step's batch; parked requests are handed on first where room appeared,
        unless hand-offs overlap the step (then its owner calls :meth:`send_parked` while the
        step runs)."""
        done = [] if self.overlap else self.send_parked()
        batch, failed = self.scheduler.schedule()
        return StepPlan(batch, failed, done)

    def postprocess(
        self, plan: StepPlan, tokens: list[int | None], bad: dict[Request, str]
    ) -> list[RequestOutput]:
        """Take the step's sampled ``tokens`` (None: no token for that row yet), end the
        requests in ``bad`` with their error, run stops and hooks; the finished requests."""
        done = list(plan.done)
        now = self.clock()
        for req in plan.failed:
            done += self._guarded(self._finish, req, Hook.FAILURE, "error")
        for (req, n), tok in zip(plan.batch, tokens):
            if req in bad:  # its KV of this step may be garbage: release it uncached
                req.error = bad[req]
                self.scheduler.remove(req)
                done += self._guarded(self._finish, req, Hook.FAILURE, "error", now)
            else:
                done += self._guarded(self._advance, req, n, tok, now)
        return done

    def _advance(self, req: Request, n: int, tok: int | None, now: float) -> list[RequestOutput]:
        """``req`` computed ``n`` more tokens and sampled ``tok`` (None: not yet): record it,
        then stop, hand off or keep going; its output if it finished."""
        req.num_computed += n
        if tok is None:
            return []
        req.tokens.append(tok)
        req.metrics.output_tokens = len(req.tokens) - req.num_prompt  # num_output
        if self.streams:
            _record_delta(self.deltas, req, tok)
        req.metrics.first_token_time = req.metrics.first_token_time or now
        if (reason := self._stop_reason(req, tok)) is not None:
            self.scheduler.remove(req)
            return [self._finish(req, Hook.FINISH, reason, now)]
        if not req.prefilled:
            req.prefilled = True
            if self.overlap:  # handed off while the next step runs
                self.scheduler.park(req)
            else:
                return self._prefilled(req)
        return []

    def _guarded(self, fn: Callable[..., object], req: Request, *args) -> list[RequestOutput]:
        """``fn(req, *args)``'s outputs (one or a list); if it raises, ``req`` alone ends with
        ``finish_reason="error"`` and the reason, logged: one request's post-processing never
        fails the step for the others, nor the instance."""
        try:
            out = fn(req, *args)
        except Exception as e:
            return [self._fail(req, e)]
        return out if isinstance(out, list) else [out]

    def _fail(self, req: Request, error: Exception) -> RequestOutput:
        """End ``req`` after ``error`` in its post-processing: release its blocks uncached and
        output its tokens without text (the text may be what failed)."""
        req.error = (
            f"post-processing failed on {self.pool.instance_id}: {type(error).__name__}: {error}"
        )
        logger.error("request %s: %s", req.request_id, req.error, exc_info=error)
        self.scheduler.remove(req)
        try:
            self.recipe.run(Hook.FAILURE, self.pool, req, self.peers)
        except Exception as again:  # the blocks it held stay held: the pool audit shows them
            logger.error("request %s: releasing its blocks failed: %r", req.request_id, again)
        return self._close(req, "error", self.clock(), "")

    def _prefilled(self, req: Request) -> list[RequestOutput]:
        """Run the prefilled hook: keep decoding, hand off, park (decode side full) or fail."""
        outcome = self.recipe.run(Hook.PREFILLED, self.pool, req, self.peers)
        if outcome is Outcome.LATER:
            if req.status is not Status.PARKED:
                self.scheduler.park(req)
            return []
        if outcome is not Outcome.KEEP:
            self.scheduler.remove(req)
        if outcome is Outcome.HANDED_OFF:
            self.requests.pop(req.request_id, None)
            req.status = Status.FINISHED
            self.handoffs.append(req)
        elif outcome is Outcome.FAILED:
            return [self._finish(req, Hook.FAILURE, "error")]
        return []

    def send_parked(self) -> list[RequestOutput]:
        """Hand off parked requests in arrival order while decode instances have room; the
        outputs of those that failed."""
        done: list[RequestOutput] = []
        parked = self.scheduler.parked
        while parked and (head := parked[0]).status is Status.PARKED:
            done += self._guarded(self._prefilled, head)
            if parked and parked[0] is head:
                break  # still no room: the rest wait behind it
        return done

    def _stop_reason(self, req: Request, tok: int) -> str | None:
        p = req.params
        if tok in p.stop_token_ids or (not p.ignore_eos and tok in self.model_config.eos_token_ids):
            return "stop"
        n = len(req.tokens)  # num_tokens, without the property: this runs per token
        if n - req.num_prompt >= p.max_tokens or n >= req.max_total_tokens:
            return "length"
        return None

    def _finish(
        self, req: Request, hook: Hook, reason: str, now: float | None = None
    ) -> RequestOutput:
        req.finish_reason = reason
        if reason == "error" and not req.error:  # every failed output says where, at least
            req.error = f"failed on {self.pool.instance_id} without a recorded cause"
        self.recipe.run(hook, self.pool, req, self.peers)
        now = self.clock() if now is None else now
        return self._close(req, reason, now, self.tokenizer.decode(req.output_token_ids))

    def _close(self, req: Request, reason: str, now: float, text: str) -> RequestOutput:
        """Forget ``req`` (its blocks already released) and return its output."""
        req.finish_reason = reason
        req.status = Status.FINISHED
        req.metrics.finish_time = now
        self.requests.pop(req.request_id, None)
        self.deltas.pop(req.request_id, None)  # the output carries every token
        return req.to_output(text)


def _record_delta(deltas: dict[str, TokenDelta], req: Request, tok: int) -> None:
    """Add ``req``'s new token ``tok`` (and its logprobs) to its delta in ``deltas``."""
    d = deltas.get(req.request_id)
    if d is None:
        lps = None if req.logprobs is None else []
        d = deltas[req.request_id] = TokenDelta(req.request_id, req.num_output - 1, [], lps)
    d.token_ids.append(tok)
    if d.logprobs is not None and req.logprobs:
        d.logprobs.append(req.logprobs[-1])


def _role_recipe(config: str | Deployment, role: str | None) -> tuple[str, Recipe]:
    """``role`` (default: the only one of ``config``'s milestone) and its recipe."""
    milestone = parse_config_name(config).milestone
    roles = milestone.roles
    if role is None and len(roles) == 1:
        role = roles[0]
    if role not in roles:
        raise ConfigError(
            f"config {config!r} has roles {list(roles)}: give one of them as role= (or run "
            "the whole deployment with minimemserve.LLM or a cluster)"
        )
    return role, milestone.recipes[role]
