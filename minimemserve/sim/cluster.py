"""The simulated cluster: the engine's own scheduling, pools and recipes in virtual time.

Every instance is a :class:`SimEngine`: the real ``Engine`` (its ``LocalScheduler``, recipe
hooks, ``Engine.schedule`` and ``Engine.postprocess``) over a :class:`SimPool`, a real
``MemPool`` on PyTorch's ``meta`` device (block accounting, radix index and tiers, no
storage). Only the forward pass and the data movement are replaced: a step is split into its
schedule (at the step's start) and its postprocess (at its end), the clock advancing by the
step model's time; a transfer (a :class:`Transfer`) takes its link's time, one at a time per
link, between the control calls its receiver answers between steps where the topology says
so, and a handed-off request reaches its decode instance when it has landed; a prefill
instance's hand-offs move while its next step computes (``handoff="overlap"``, that step
ending once both have) or after the step that prefilled them (``"inline"``). New requests
go through the runtimes' ``Frontend``: routed by the global scheduler, whose prompt trees
follow what entry instances report they cache. Output tokens are deterministic stand-ins (a
hash of request id and position), so a request's prompt and output lengths, cache hits and
transfers are those of a real run."""

from __future__ import annotations

import collections
import functools
import heapq
import itertools
import math
import zlib
from array import array
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass

import numpy as np
import torch

from minimemserve.blocks.layout import KVLayout
from minimemserve.config import Deployment, parse_config_name
from minimemserve.deployment import DeploymentSpec
from minimemserve.engine import Checked, Engine, EngineParts, StepPlan, check_once, tightest
from minimemserve.errors import ConfigError
from minimemserve.mempool import KVReceiver, MemPool, push_cached
from minimemserve.model.config import ModelConfig
from minimemserve.parallel import TPShard
from minimemserve.recipes import Role
from minimemserve.request import Request, RequestOutput
from minimemserve.sampling import SamplingParams
from minimemserve.scheduler.frontend import Frontend

from .profiles import Link, StepShape, TierLink
from .replay import Replay
from .runs import DecodeRun, DecodeRuns
from .tiers import TierPrices, sim_chain

# The control calls of a transfer, before and after its copy, where a receiver answers them
# between its steps (the process runtime): a hand-off probes, allocates, [copies], commits and
# hands the request over; a send-back or prefix push allocates, [copies], commits and frees.
HANDOFF_CALLS, RETURN_CALLS = (2, 2), (1, 2)
# Lowest stand-in output token id: 0-2 are <unk>, <s> and </s> in Llama vocabularies.
FIRST_OUTPUT_TOKEN = 3
# A stand-in token steps its request id's hash by this (a prime) per position.
TOKEN_STEP = 7919


class Transfer:
    """One transfer in flight: its ``steps`` left (``CALL``: a control call the receiver
    answers; a number: the copy, that many seconds on the link), run in order; ``done``
    callbacks run when it completes."""

    CALL = None

    def __init__(
        self,
        src: SimInstance,
        dst: SimInstance,
        copy_s: float,
        calls: tuple[int, int],
        streamed_tail_s: float | None = None,
    ) -> None:
        self.src = src
        self.dst = dst
        # by layer, sent from the step that computed it: the copy overlapped that step and
        # ends at most its last layer's copy after it
        self.streamed_tail_s = streamed_tail_s
        self.steps = collections.deque([self.CALL] * calls[0] + [copy_s] + [self.CALL] * calls[1])
        self.done: list[Callable[[], None]] = []


def _moving(inst: SimInstance) -> list[Transfer]:
    """The transfers ``inst`` sends that have not landed yet, in order."""
    return [t for t in inst.sending if t.steps]


def _meta(shape: tuple[int, ...], dtype: torch.dtype, where: torch.device) -> torch.Tensor:
    """A tier's tensor with no storage (a simulated dram tier is on ``meta`` too)."""
    return torch.empty(shape, dtype=dtype, device="meta")


class SimPool(MemPool):
    """A ``MemPool`` on the ``meta`` device that reports each transfer it sends:
    ``on_send(src, dst, blocks_sent)`` books it and returns its :class:`Transfer`; with
    ``prices`` its tier moves add up in ``move_s``, the seconds the next step waits for."""

    def __init__(
        self,
        layout: KVLayout,
        num_blocks: int,
        *,
        on_send,
        reached=lambda pool: None,
        prices: Callable[[tuple[str, ...]], TierPrices] | None = None,
        **kw,
    ) -> None:
        super().__init__(layout, num_blocks, **kw | {"device": "meta", "tensor_factory": _meta})
        self.on_send: Callable[[SimPool, MemPool, int], Transfer] = on_send
        self.reached: Callable[[MemPool], None] = reached  # before a peer touches a pool
        self.last: Transfer | None = None  # the transfer sent from here last
        self.prices = prices(self.tiers) if prices is not None else None
        self.move_s = 0.0

    def copy_tier(self, dst: str, dst_ids: list[int], src: str, src_ids: list[int]) -> None:
        """No data to copy: the move's time is booked."""
        if self.prices is not None:
            self.move_s += self.prices.seconds(src, dst, len(dst_ids) * self.block_bytes)

    def take_move_s(self) -> float:
        """The tier moves' seconds booked since the last call."""
        s, self.move_s = self.move_s, 0.0
        return s

    def _booked(self, dst: KVReceiver, send: Callable[[], list[int]]) -> list[int]:
        """Run ``send`` (a ``MemPool`` send to ``dst``, both pools caught up first) and book
        its link time when it sent: :attr:`last` is then its :class:`Transfer`."""
        self.reached(self)
        self.reached(dst)
        before, sends = self.counters["sent_blocks"], self.counters["transfers_sent"]
        got = send()
        if self.counters["transfers_sent"] != sends:
            self.last = self.on_send(self, dst, self.counters["sent_blocks"] - before)
        return got

    def transfer(self, dst: KVReceiver, src_blocks: Sequence[int]) -> list[int]:
        """``MemPool.transfer``, its link time booked."""
        send = super().transfer
        return self._booked(dst, lambda: send(dst, src_blocks))

    def transfer_with_insert(
        self, dst: KVReceiver, tokens: Sequence[int], src_blocks: Sequence[int]
    ) -> list[int]:
        """``MemPool.transfer_with_insert``, its link time booked."""
        send = super().transfer_with_insert
        return self._booked(dst, lambda: send(dst, tokens, src_blocks))

    def send_cached(self, dst: KVReceiver, tokens: Sequence[int]) -> list[int]:
        """``MemPool.send_cached``, its link time booked when something was sent."""
        send = super().send_cached
        return self._booked(dst, lambda: send(dst, tokens))


class _TokenIds:
    """The tokenizer of a simulated engine: prompts are token ids already, outputs have no text."""

    @staticmethod
    def prompt_ids(prompt: Sequence[int]) -> Sequence[int]:
        """The ids (the cluster builds prompts of ints, a replay as an int64 array: no
        conversion)."""
        if isinstance(prompt, str):
            raise ConfigError("the simulator takes prompts as token ids, not text")
        if type(prompt) is list or (type(prompt) is array and prompt.typecode == "q"):
            return prompt  # read, never changed
        return list(prompt)

    @staticmethod
    def decode(ids: Sequence[int]) -> None:
        """No text in a simulation."""
        return None


class SimEngine(Engine):
    """``Engine`` without a model (its :class:`EngineParts` a :class:`SimPool`, on the
    cluster's virtual clock): :meth:`begin_step` schedules (the step's start), :meth:`end_step`
    postprocesses with stand-in tokens when the step model says the step ends."""

    _pending: StepPlan | None = None
    streams = False  # nobody reads token deltas here: first tokens come from end_step

    @functools.cached_property
    def _eos(self) -> set[int]:
        return set(self.model_config.eos_token_ids)

    @functools.cached_property
    def _span(self) -> int:
        return self.model_config.vocab_size - FIRST_OUTPUT_TOKEN  # stand-in token ids

    @functools.cached_property
    def _stand_ins(self) -> StandInTable | None:
        """The table stand-in tokens are sliced from (None where it cannot be built)."""
        return StandInTable.build(self._span, self._eos, self.max_model_len)

    @functools.cached_property
    def _starts(self) -> dict[str, int]:
        return {}  # request id -> its first stand-in token's entry in the table (or its hash)

    def begin_step(self) -> StepShape | None:
        """Schedule one step and, when hand-offs overlap steps, send the parked requests
        (their transfers move while it computes); its shape, or None when there is nothing
        to do."""
        plan = self.schedule()
        if self.overlap:
            plan.done.extend(self.send_parked())
        if not (plan.batch or plan.failed or plan.done or self.handoffs):
            return None
        self._pending = plan
        return StepShape.of_batch(plan.batch)

    def end_step(self) -> tuple[list[RequestOutput], list[str]]:
        """Postprocess the step begun last with stand-in tokens, at the clock's time: the
        finished requests, and the ids of those that got their first token."""
        plan, self._pending = self._pending, None
        tokens: list[int | None] = []
        first = []
        table, span, starts = self._stand_ins, self._span, self._starts
        for r, n in plan.batch:
            if r.num_computed + n != len(r.tokens):
                tokens.append(None)
                continue
            pos = len(r.tokens) - r.num_prompt
            start = starts[r.request_id] if r.request_id in starts else self._start(r)
            if table is None:
                tokens.append(stand_in_token(start, pos, span, self._eos))
            else:
                tokens.append(table.tokens[(start + pos) % span])
            if pos == 0:
                first.append(r.request_id)
        return self.postprocess(plan, tokens, {}), first

    def end_run_step(self, k: int, ending: list[int]) -> tuple[list[RequestOutput], list[str]]:
        """End the step begun last, the ``k``-th of decodes alone (a decode run's, already
        counted) that end only the requests of its rows ``ending``: what ``k`` rounds of
        :meth:`end_step` would leave, the other rows' tokens made at once
        (:meth:`decode_ahead`), the ending ones' last through :meth:`end_step` (outputs and
        hooks; the other rows' tokens touch nothing it does)."""
        plan, self._pending = self._pending, None
        if not ending:
            self.decode_ahead(plan.batch, k)
            return [], []
        ends = set(ending)
        self.decode_ahead([row for i, row in enumerate(plan.batch) if i not in ends], k)
        last = [plan.batch[i] for i in ending]
        if k > 1:
            self.decode_ahead(last, k - 1)
        self._pending = StepPlan(last, [], [])
        return self.end_step()

    def step(self) -> list[RequestOutput]:
        """``begin_step`` and ``end_step`` with no time between."""
        return self.end_step()[0] if self.begin_step() is not None else []

    def _start(self, req: Request) -> int:
        """Where ``req``'s stand-in tokens start in the table (without one, its id's hash)."""
        start = self._starts.get(req.request_id)
        if start is None:
            start = zlib.crc32(req.request_id.encode())
            if self._stand_ins is not None:
                start = self._stand_ins.start(start)
            self._starts[req.request_id] = start
        return start

    def decode_ahead(self, batch: Sequence[tuple[Request, int]], k: int) -> None:
        """What ``k`` decode steps of ``batch`` leave behind when none ends a request: each
        request computed ``k`` more tokens and holds ``k`` more stand-in tokens, as ``k``
        rounds of :meth:`end_step` would leave it (its blocks are the caller's to grow)."""
        table, span = self._stand_ins, self._span
        for req, _ in batch:
            tokens, start = req.tokens, self._starts.get(req.request_id)
            pos = len(tokens) - req.num_prompt
            if start is None:
                start = self._start(req)
            if table is None:
                tokens.extend(stand_in_tokens(start, pos, k, span, self._eos))
            else:  # one slice, whole: k never exceeds the context, the table's overhang
                at = 8 * ((start + pos) % span)  # int64 tokens: 8 bytes each
                tokens.frombytes(table.raw[at : at + 8 * k])
            req.num_computed += k
            req.metrics.output_tokens = pos + k


def stand_in_token(base: int, position: int, span: int, eos: set[int]) -> int:
    """The stand-in output token at ``position`` of a request whose id hashes to ``base``:
    the hash stepped by the position, within the ``span`` ids from :data:`FIRST_OUTPUT_TOKEN`,
    never an ``eos`` id."""
    return _past_eos(FIRST_OUTPUT_TOKEN + (base + TOKEN_STEP * position) % span, span, eos)


def _past_eos(tok: int, span: int, eos: set[int]) -> int:
    """``tok``, or the first id after it (within the span, wrapping) that is not in ``eos``."""
    while tok in eos:
        tok = FIRST_OUTPUT_TOKEN + (tok + 1 - FIRST_OUTPUT_TOKEN) % span
    return tok


def stand_in_tokens(base: int, position: int, n: int, span: int, eos: set[int]) -> list[int]:
    """:func:`stand_in_token` at ``n`` positions from ``position``."""
    return [stand_in_token(base, p, span, eos) for p in range(position, position + n)]


@dataclass(frozen=True)
class StandInTable:
    """Stand-in tokens as slices of one table. :func:`stand_in_token` at position ``p`` of a
    hash ``base`` depends on ``(base + TOKEN_STEP * p) % span`` alone; where ``TOKEN_STEP`` is
    invertible mod ``span`` that is ``TOKEN_STEP * (start + p) % span`` with ``start = base /
    TOKEN_STEP mod span``, so with ``tokens[q]`` the token of ``TOKEN_STEP * q % span`` a
    request's ``k`` tokens from position ``p`` are ``tokens[(start + p) % span:][:k]``: one
    copy, not ``k`` hashes. The table runs ``longest`` entries past ``span``, so no slice of
    up to ``longest`` tokens (an engine's context) wraps."""

    tokens: array  # int64
    span: int
    longest: int
    inverse: int  # of TOKEN_STEP, mod span

    @functools.cached_property
    def raw(self) -> memoryview:
        """``tokens``' bytes (a slice of them copies nothing until it lands)."""
        return memoryview(self.tokens).cast("B")

    @classmethod
    def build(cls, span: int, eos: set[int], longest: int) -> StandInTable | None:
        """The table, or None where ``TOKEN_STEP`` is not invertible mod ``span``."""
        if math.gcd(TOKEN_STEP, span) != 1:
            return None
        q = np.arange(span + longest, dtype=np.int64)
        raw = FIRST_OUTPUT_TOKEN + (TOKEN_STEP * q) % span
        tokens = raw.copy()
        for stop in eos:  # stand_in_token steps past a stop id: so does the table's entry
            if FIRST_OUTPUT_TOKEN <= stop < FIRST_OUTPUT_TOKEN + span:
                tokens[raw == stop] = _past_eos(stop, span, eos)
        return cls(array("q", tokens.tobytes()), span, longest, pow(TOKEN_STEP, -1, span))

    def start(self, base: int) -> int:
        """The entry of position 0 of a request whose id hashes to ``base``."""
        return base * self.inverse % self.span


def stand_in_answer(request_id: str, n: int, model_config: ModelConfig) -> list[int]:
    """The ``n`` tokens a simulated engine answers request ``request_id`` with (the
    dataset's answer of a finite run's turn, as it builds the next turn's prompt)."""
    base, span = zlib.crc32(request_id.encode()), model_config.vocab_size - FIRST_OUTPUT_TOKEN
    eos = set(model_config.eos_token_ids)
    return [stand_in_token(base, i, span, eos) for i in range(n)]


@dataclass(eq=False)
class SimInstance:
    """One simulated instance as peers see it (``name``, ``pool``, ``accept``)."""

    name: str
    role: str
    engine: SimEngine
    cluster: SimCluster
    index: int
    busy: bool = False  # a step is under way (control calls wait for its end)
    busy_s: float = 0.0  # seconds in steps so far
    prefill_busy_s: float = 0.0  # of them, in steps with prefill work
    # decode rows so far, their sum of each step's decode batch size (a row-weighted mean
    # batch, over decode_rows) and of the KV lengths they attend to
    decode_rows: int = 0
    decode_batch_sum: int = 0
    decode_context_sum: int = 0
    prefilling: bool = False  # that step has prefill work
    step_began: float = 0.0
    step_ends: float = 0.0
    run: DecodeRun | None = None  # quiet decode steps booked ahead
    # a landed run's steps whose tokens the step under way ends with, and the rows it ends
    owed: tuple[int, list[int]] | None = None

    def __post_init__(self) -> None:
        self.pool = self.engine.pool
        self.incoming: list[Request] = []  # handed over, KV still on the wire
        self.sending: collections.deque[Transfer] = collections.deque()  # the engine waits
        self.asked: list[Transfer] = []  # transfers whose next call waits for this step's end
        self.beside: list[Transfer] = []  # hand-offs begun with the step: it ends after them

    def counters(self) -> tuple[float, float, int, int, int]:
        """Its work so far: busy seconds, of them with prefill work, decode rows, their batch
        sum and KV length sum."""
        return (
            self.busy_s,
            self.prefill_busy_s,
            self.decode_rows,
            self.decode_batch_sum,
            self.decode_context_sum,
        )

    def accept(self, req: Request) -> None:
        """Take over ``req`` once the transfer that was just booked lands."""
        req.decode_instance = self.name
        self.incoming.append(req)
        src = self.cluster.by_name[req.prefill_instance].pool
        src.last.done.append(functools.partial(self.cluster._deliver, self, req))


@dataclass(frozen=True)
class Contention:
    """How many times longer a step takes while another instance is in a step than alone, by
    the kind of each (decodes only, or with prefill work): instances sharing one machine's
    cores and memory. All 1 where each instance has its own device."""

    decode_beside_decode: float = 1.0
    prefill_beside_decode: float = 1.0
    decode_beside_prefill: float = 1.0
    prefill_beside_prefill: float = 1.0

    def __post_init__(self) -> None:
        for name, c in asdict(self).items():
            if not (isinstance(c, (int, float)) and math.isfinite(c) and c >= 1.0):
                raise ConfigError(f"contention {name} must be a finite number >= 1, got {c!r}")

    @classmethod
    def uniform(cls, factor: float) -> Contention:
        """The same factor for every pair of kinds."""
        return cls(factor, factor, factor, factor)

    def factor(self, prefilling: bool, beside_prefilling: bool) -> float:
        """The factor of a step (with prefill work or not) beside one (with it or not)."""
        mine = "prefill" if prefilling else "decode"
        theirs = "prefill" if beside_prefilling else "decode"
        return getattr(self, f"{mine}_beside_{theirs}")

    @property
    def any(self) -> bool:
        """Whether any pair of kinds slows down."""
        return any(c != 1.0 for c in asdict(self).values())


@dataclass(frozen=True)
class Topology:
    """Where instances sit: ``gpus_per_instance`` (TP) GPUs each, ``gpus_per_node`` per node;
    ``link(a, b)`` is the link between instance indices ``a`` and ``b``. With
    ``calls_wait_for_steps`` a transfer's control calls (:data:`HANDOFF_CALLS`,
    :data:`RETURN_CALLS`) are each answered when the receiver is not in a step, as a
    process-runtime instance answers its socket between steps and while it waits on a call
    itself; the sender waits for them. A step that starts while another instance is in a step
    takes longer by ``contention`` (a :class:`Contention`, or one factor for every kind of
    step): instances sharing one machine's cores and memory."""

    intra: Link
    inter: Link
    gpus_per_instance: int = 1
    gpus_per_node: int = 1 << 30  # one node unless told
    calls_wait_for_steps: bool = False
    contention: Contention | float = Contention()
    # each MemPool tier's link to the tier above it, per GPU (None: tier moves cost no time)
    tiers: dict[str, TierLink] | None = None

    def __post_init__(self) -> None:
        if not isinstance(self.contention, Contention):
            object.__setattr__(self, "contention", Contention.uniform(self.contention))

    def link(self, a: int, b: int) -> Link:
        """The link between instances ``a`` and ``b``."""
        g, n = self.gpus_per_instance, self.gpus_per_node
        return self.intra if a * g // n == b * g // n else self.inter


def scaled_deployment(config: str | Deployment, instances: int) -> tuple[Deployment, int]:
    """``config``'s deployment on ``instances`` instances and its colocated count: colocated
    configs take all, ``xPyD`` ones are repeated to fill them (e.g. 1P1D on 4 = 2P2D)."""
    d = parse_config_name(config)
    if d.milestone.roles == (Role.COLOCATED,):
        return d, instances
    per = sum(d.counts)
    if instances % per:
        raise ConfigError(f"{config} needs a multiple of {per} instances, {instances} given")
    k = instances // per
    return Deployment(d.name, d.milestone, tuple(c * k for c in d.counts)), instances


class Network:
    """The paths between a simulated deployment's instances: each transfer's control calls
    (answered between the receiver's steps when the topology says so) and its copies, one at
    a time per directed link, at the topology's link speeds in ``transfer_mode``."""

    def __init__(self, cluster: SimCluster, topology: Topology, transfer_mode: str) -> None:
        self.cluster = cluster
        self.topology = topology
        self.transfer_mode = transfer_mode
        self.links: dict[tuple[int, int], float] = {}  # (src, dst) -> busy until
        self.transfers = 0

    def send(self, src: SimPool, dst: MemPool, blocks: int) -> Transfer:
        """Book a transfer of ``blocks`` blocks from ``src`` to ``dst`` and start it (or queue
        it behind the transfers its sender waits for)."""
        a, b = self.cluster.by_pool[id(src)], self.cluster.by_pool[id(dst)]
        link = self.topology.link(a.index, b.index)
        layout = src.layout
        nbytes = blocks * layout.block_bytes(src.dtype.itemsize) / self.topology.gpus_per_instance
        copies = link.calls(self.transfer_mode, blocks, layout.num_layers) if blocks else 1
        calls = (0, 0)
        if self.topology.calls_wait_for_steps:
            calls = HANDOFF_CALLS if b.role == Role.DECODE else RETURN_CALLS
        tail = None
        if self.transfer_mode == "by_layer" and a.step_ends == self.cluster.now:
            tail = link.seconds(nbytes / layout.num_layers, 1)
        t = Transfer(a, b, link.seconds(nbytes, copies), calls, tail)
        self.transfers += 1
        # a hand-off by request holds its sender's step loop as the runtime's does (the step
        # after it, or the one it overlaps); layers streamed from the step that computed them
        # do not
        handoff = b.role == Role.DECODE and tail is None and self.transfer_mode != "by_layer"
        if not (link.sender_blocks or any(calls) or handoff):
            self.advance(t)
            return t
        a.sending.append(t)  # the engine waits, one transfer at a time
        if len(a.sending) == 1:
            self.advance(t)
        return t

    def advance(self, t: Transfer) -> None:
        """Run ``t``'s next steps: a call is answered now unless the receiver is in a step (then
        at its end); the copy takes its time once the link is free."""
        while t.steps:
            if t.steps[0] is Transfer.CALL:
                self.cluster.catch_up(t.dst)
                if t.dst.busy:
                    t.dst.asked.append(t)
                    return
                t.steps.popleft()
                continue
            key = (t.src.index, t.dst.index)
            copy, free = t.steps.popleft(), self.links.get(key, 0.0)
            if t.streamed_tail_s is None:
                end = max(self.cluster.now, free) + copy
            else:
                end = max(max(t.src.step_began, free) + copy, self.cluster.now + t.streamed_tail_s)
            self.links[key] = end
            self.cluster.at(end, self.advance, (t,))
            return
        for fn in t.done:
            fn()
        if t.src.sending and t.src.sending[0] is t:
            t.src.sending.popleft()
            if t.src.sending:
                self.advance(t.src.sending[0])
            else:
                self.cluster.dirty[t.src] = None

    def answer(self, inst: SimInstance) -> None:
        """``inst``'s step ended: it answers one waiting call of each transfer. A transfer that
        completes lands before ``inst`` steps again; one with calls left asks again once it has
        (a receiver with work is in its next step by then)."""
        asked, inst.asked = inst.asked, []
        for t in asked:
            t.steps.popleft()
            if t.steps and t.steps[0] is Transfer.CALL:
                self.cluster.at(self.cluster.now, self.advance, (t,))
            else:
                self.advance(t)


class SimCluster(DecodeRuns, Replay):
    """Every instance of one deployment in virtual time (see the module docstring).
    ``step_time(shape)`` prices a step; ``topology`` prices transfers in ``transfer_mode``;
    ``spec`` gives every instance's engine settings and the global scheduler's policy and
    cost model, as in the process runtime. ``num_blocks`` KV blocks per instance, of
    ``dtype`` (bytes sent count in it). ``decode_times(rows, contexts)``, where given, is
    the ``step_time`` of ``rows`` decodes attending to each of ``contexts`` KV tokens in all,
    without building the shapes (decode runs price many)."""

    def __init__(
        self,
        config: str,
        *,
        model_config: ModelConfig,
        step_time: Callable,
        topology: Topology,
        spec: DeploymentSpec,
        num_blocks: int,
        dtype: torch.dtype,
        instances: int = 2,
        transfer_mode: str = "by_request_aggregated",
        decode_times: Callable[[int, Sequence[int]], list[float]] | None = None,
    ) -> None:
        engine_config = spec.engine
        self.deployment, colocated = scaled_deployment(config, instances)
        self.model = model_config
        self.step_time = step_time
        self.decode_times = decode_times
        self.topology = topology
        self.contended = topology.contention.any  # read at every step's start
        self.net = Network(self, topology, transfer_mode)
        self.now = 0.0
        self.stopped = False  # the last replay ended at its window's end (unstable)
        self._seq = itertools.count()
        self._events = []
        self.marks: list[tuple[float, dict[str, tuple]]] = []  # see replay's window
        self.steps = 0
        self.run_steps = 0  # of them, stepped in decode runs (see _start_run)
        # instance-seconds in steps, in steps with prefill work, and decode-seconds held up
        self.busy_s = self.prefill_busy_s = self.decode_stall_s = 0.0
        self.instances = self._make_instances(
            colocated, model_config, engine_config, num_blocks, dtype
        )
        self.by_name = {i.name: i for i in self.instances}
        self.by_pool = {id(i.pool): i for i in self.instances}
        milestone = self.deployment.milestone
        self.entry = [i for i in self.instances if i.role == milestone.roles[0]]
        self.frontend = Frontend(
            [i.name for i in self.entry],
            self._push_prefix,
            policy=spec.policy,
            block_size=engine_config.block_size,
            cost_model=spec.cost_model,
            caching=milestone.entry_caches,
            clock=self.clock,
        )
        self.scheduler = self.frontend.scheduler
        for inst in self.entry:  # the prompt trees follow what entry instances cache
            self.frontend.follow(inst.name, inst.pool)
        # instances to try to start, and those parked behind full decode instances: dicts, so
        # they are taken in a fixed order (a set of objects would follow memory addresses)
        self.dirty: dict[SimInstance, None] = {}
        self._blocked: dict[SimInstance, None] = {}

    def _make_instances(
        self, colocated, model_config, engine_config, num_blocks, dtype
    ) -> list[SimInstance]:
        """The deployment's instances, each a simulated engine over a ``SimPool``."""
        layout = TPShard(0, 1, model_config).kv_layout(engine_config.block_size)
        links, gpus = self.topology.tiers, self.topology.gpus_per_instance
        prices = None if links is None else functools.partial(TierPrices, links, gpus=gpus)
        out = []
        for i, (name, role) in enumerate(self.deployment.instances(colocated=colocated)):
            cfg = engine_config
            pool = SimPool(
                layout,
                num_blocks,
                on_send=self.net.send,
                reached=self._reached,
                prices=prices,
                dtype=dtype,
                instance_id=name,
                tiers=sim_chain(cfg.dram_blocks, cfg.disk_blocks, links, gpus, self.clock),
            )
            eng = SimEngine(
                EngineParts(model_config, _TokenIds(), pool),
                config=self.deployment,
                role=role,
                peers=self,
                engine_config=engine_config,
                clock=self.clock,
            )
            out.append(SimInstance(name, role, eng, self, i))
        return out

    def _reached(self, pool: MemPool) -> None:
        """A peer touches ``pool``: its instance catches up first (:meth:`catch_up`)."""
        self.catch_up(self.by_pool[id(pool)])

    # ---- what recipes need (Peers) -----------------------------------------------------------
    def decodes(self) -> dict[str, SimInstance]:
        """The decode instances, by name (simulated ones do not die)."""
        return {i.name: i for i in self.instances if i.role == Role.DECODE}

    def decodes_down(self) -> dict[str, str]:
        """None is down."""
        return {}

    def offer(self, peer: SimInstance, blocks: int, tokens) -> tuple[int, int] | None:
        """Its load and cached prefix of ``tokens`` if it has room for ``blocks`` blocks (KV
        on the wire to it counted). A run of decodes there changes none of it (each block it
        takes shrinks what its request may still grow by as much) until it evicts, or where
        a dram tier's onload room counts (:meth:`_touched`)."""
        if self._touched(peer):
            self.catch_up(peer)
        return peer.engine.offer(blocks, tokens, peer.incoming)

    def prefill_pool(self, req: Request) -> MemPool:
        """The pool of the instance that prefilled ``req``."""
        inst = self.by_name[req.prefill_instance]
        self.catch_up(inst)
        return inst.pool

    def peer_failed(self, name: str, error: Exception) -> None:
        """Simulated peers do not fail."""

    # ---- time ---------------------------------------------------------------------------------
    def clock(self) -> float:
        """Virtual seconds since the start."""
        return self.now

    def at(self, t: float, fn: Callable, args: tuple = ()) -> None:
        """Run ``fn(*args)`` at virtual time ``t`` (not before now)."""
        heapq.heappush(self._events, (max(t, self.now), next(self._seq), fn, args))

    def settle(self, until: float = math.inf) -> None:
        """Run every booked event in time order (those up to ``until``), starting steps as
        instances free up."""
        while self._events and self._events[0][0] <= until:
            self.now, _, fn, args = heapq.heappop(self._events)
            fn(*args)
            if self.dirty:
                self._kick()

    def _deliver(self, inst: SimInstance, req: Request) -> None:
        self.catch_up(inst)
        inst.incoming.remove(req)
        inst.engine.add_prefilled(req)
        self.dirty[inst] = None

    def _kick(self) -> None:
        """Start a step on every idle instance that has work. Steps are priced once all that
        start at this instant have begun, so each sees the others in a step."""
        started = []
        while self.dirty:
            inst = next(iter(self.dirty))
            del self.dirty[inst]
            if inst.busy or inst.sending or not inst.engine.has_unfinished():
                continue
            inst.busy, inst.step_began = True, self.now
            shape = inst.engine.begin_step()
            inst.beside = list(inst.sending)  # hand-offs that move while the step computes
            inst.prefilling = bool(shape and shape.prefills)
            if shape is None:  # parked behind full decode instances: wait for one to free
                inst.busy = False
                self._blocked[inst] = None
                continue
            started.append((inst, shape))
        priced = []
        for inst, shape in started:
            seconds = self._step_time(shape) * self._slowdown(inst) if shape.tokens else 0.0
            seconds += inst.pool.take_move_s()  # the step's tier moves: it waits for them
            inst.step_ends = self.now + seconds
            priced.append((inst, shape, seconds))
        for inst, shape, seconds in priced:  # each sees the others' steps begun
            if self.run_ahead and not self.contended and not shape.prefills:
                if self._start_run(inst, shape, seconds):
                    continue
            self._count_step(inst, shape, seconds)
            self.at(inst.step_ends, self._end_step, (inst,))
            if shape.prefills:
                self._count_stall(inst, shape, seconds)

    def _step_time(self, shape: StepShape) -> float:
        """``step_time(shape)``, by ``decode_times`` for decodes alone that all sample."""
        rows = len(shape.decodes)
        if shape.prefills or shape.sampled != rows or self.decode_times is None:
            return self.step_time(shape)
        return self.decode_times(rows, (sum(shape.decodes),))[0]

    def _count_step(self, inst: SimInstance, shape: StepShape, seconds: float) -> None:
        """Count a step's time and its decode rows."""
        self._count(inst, seconds, len(shape.decodes), sum(shape.decodes))

    def _count(self, inst: SimInstance, seconds: float, decodes: int, context: int) -> None:
        """Count a step of ``seconds`` with ``decodes`` decode rows attending to ``context``
        KV tokens in all."""
        self.steps += 1
        self.busy_s += seconds
        inst.busy_s += seconds
        if decodes:
            inst.decode_rows += decodes
            inst.decode_batch_sum += decodes * decodes
            inst.decode_context_sum += context

    def _count_steps(
        self, inst: SimInstance, seconds: Sequence[float], decodes: int, contexts: Sequence[int]
    ) -> None:
        """:meth:`_count` of each step of a run (one count per step, its seconds added one by
        one as ``_count`` adds them: the same sums to the last bit)."""
        if not seconds:
            return
        busy, inst_busy = self.busy_s, inst.busy_s
        for s in seconds:
            busy += s
            inst_busy += s
        self.busy_s, inst.busy_s = busy, inst_busy
        self.steps += len(seconds)
        if decodes:
            inst.decode_rows += decodes * len(seconds)
            inst.decode_batch_sum += decodes * decodes * len(seconds)
            inst.decode_context_sum += sum(contexts)

    def _count_stall(self, inst: SimInstance, shape: StepShape, seconds: float) -> None:
        """A step with prefill work: its time, and what it holds up the requests decoding on
        ``inst`` (the whole step for those left out of it, its prefill part for the others)."""
        self.prefill_busy_s += seconds
        inst.prefill_busy_s += seconds
        decoding = sum(1 for r in inst.engine.scheduler.running if r.prefilled)
        alone = 0.0  # the decodes' part, priced only where there are some (prefill_first: none)
        if shape.decodes:
            alone = self.step_time(StepShape((), shape.decodes, len(shape.decodes)))
        self.decode_stall_s += decoding * (seconds - alone)

    def _slowdown(self, inst: SimInstance) -> float:
        """How many times longer the step ``inst`` starts takes than alone: by the contention
        of its kind beside the others in a step (beside prefill work if any has it)."""
        if not self.contended:
            return 1.0
        others = [j for j in self.instances if j is not inst and j.busy]
        if not others:
            return 1.0
        return self.topology.contention.factor(inst.prefilling, any(j.prefilling for j in others))

    def answer_of(self, request_id: str, n: int) -> list[int]:
        """The ``n`` tokens the engine will answer ``request_id`` (:func:`stand_in_answer`)."""
        return stand_in_answer(request_id, n, self.model)

    def _push_prefix(self, src_name: str, dst_name: str, prompt: Sequence[int]) -> int:
        """``src`` pushes its cached prefix of ``prompt`` to ``dst`` (``mempool.push_cached``,
        booked as ``src``'s last transfer): the tokens now cached there from it."""
        return push_cached(self.by_name[src_name].pool, self.by_name[dst_name].pool, prompt)

    def validate(self, prompt, params: SamplingParams) -> Checked:
        """Checked once, against the tightest limits of every instance (as in one process);
        the instance it is routed to takes it as it is."""
        return check_once(prompt, params, self.instances[0].engine.tokenizer, self.limits)

    @functools.cached_property
    def limits(self) -> tuple:
        """The tightest limits of every instance, once (an instance's never change)."""
        return tightest([inst.engine.limits for inst in self.instances])

    def _end_step(self, inst: SimInstance) -> None:
        """``inst``'s step computed; it ends once the transfers it began have landed (the
        hand-offs of the step before, when they overlap steps), answering calls meanwhile."""
        inst.busy = False
        if beside := [t for t in inst.beside if t.steps]:
            self.net.answer(inst)
            beside[-1].done.append(functools.partial(self._end_step, inst))
            return
        inst.beside = []
        if inst.owed is not None:
            outs, first = inst.engine.end_run_step(*inst.owed)
            inst.owed = None
        else:
            outs, first = inst.engine.end_step()
        self.frontend.report(started=first)  # the frontend sees a first token as it streams
        handoffs = [req.request_id for req in inst.engine.handoffs]
        inst.engine.handoffs.clear()
        self.net.answer(inst)
        self.dirty[inst] = None
        report = functools.partial(self._report, outs, handoffs)
        if moving := _moving(inst):  # the step's transfers go first (the runtime reports after)
            moving[-1].done.append(report)
            self._ended.update((out.request_id, out) for out in outs)
        else:
            report()

    def _report(self, outs: list[RequestOutput], handoffs: list[str]) -> None:
        """What a step's end tells the frontend: its hand-offs and finished requests."""
        if outs and self._blocked:
            self.dirty |= self._blocked
            self._blocked.clear()
        # hand-offs, then the step's outputs together, before next turns are sent
        self.frontend.report(handoffs, outputs=outs)
        for out in outs:
            self._collect(out)

    def check_pools(self) -> None:
        """Audit every instance's pool; every block must be free or cached once all finished.
        A stopped run's unfinished requests still hold theirs: its audit checks each pool's
        invariants (the stop changed no pool) without requiring them idle."""
        for inst in self.instances:
            inst.engine.check_pools(require_idle=not self.stopped)
