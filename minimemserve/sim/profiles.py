"""What the simulator models instead of running: step times and KV links.

A step is described by its :class:`StepShape` (prefill chunks, decode rows, sampled rows),
read from the batch the real local scheduler chose. Two step-time models price it:

- :class:`FittedStepModel`, least squares over features of measured steps of this engine
  on this CPU (:func:`fit_cpu_steps` measures them): step overhead, linear-layer tokens,
  prefill attention pairs, decode KV tokens, rows;
- :class:`RooflineStepModel`, per operator from a :class:`HardwareProfile` and a model shape:
  linear layers and LM head as ``max(FLOPs / compute, weight bytes / bandwidth)``, prefill
  attention by its FLOPs, paged decode attention by the KV bytes it reads, two tensor-parallel
  all-reduces per layer over NVLink, and a fixed per-step overhead.

:class:`Link` prices a transfer by mode (by-layer, by-request, by-request-aggregated) and
bandwidth; one link carries one transfer at a time. Profiles and model shapes ship as JSON
under ``minimemserve/sim/data``; any other file can be given by path."""

from __future__ import annotations

import json
import math
import multiprocessing as mp
import time
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import Any

import torch
from tqdm.auto import tqdm

from minimemserve.engine import Engine
from minimemserve.errors import ConfigError
from minimemserve.model.config import ModelConfig
from minimemserve.request import Request
from minimemserve.sampling import SamplingParams

DATA_DIR = Path(__file__).resolve().parent / "data"
GB = 1e9  # profiles give bandwidths in GB/s (decimal, as datasheets do)
TRANSFER_MODES = ("by_layer", "by_request", "by_request_aggregated")
# Feature names of FittedStepModel, in coefficient order.
FEATURES = ("step", "tokens", "prefill_pairs", "decode_kv_tokens", "prefill_rows", "rows")
# Elementwise work per token per layer (RMSNorm x2, rotary, SiLU-mul, two residual adds):
# about ten reads or writes of the hidden state.
ELEMENTWISE_PASSES = 10
# Two all-reduces per layer under tensor parallelism (after attention, after the MLP).
ALLREDUCES_PER_LAYER = 2
_FIT_FORMAT = "minimemserve.sim.fitted_steps/2"
# The efficiencies every hardware profile gives (a calibrated one adds "attention_read").
REQUIRED_EFFICIENCIES = ("matmul", "attention", "memory", "allreduce")


def _read_json(path: Path, what: str) -> dict:
    try:
        data = json.loads(path.read_text())
    except (OSError, json.JSONDecodeError) as e:
        raise ConfigError(f"cannot read {what} file {path}: {e}") from None
    if not isinstance(data, dict):
        raise ConfigError(f"{what} file {path} must hold a JSON object")
    return data


def _resolve(name_or_path: str | Path, kind: str) -> Path:
    """A shipped data file by name (``h800``, ``llama2-13b``) or any file by path."""
    path = Path(name_or_path)
    if path.is_file():
        return path
    shipped = DATA_DIR / kind / f"{str(name_or_path).lower()}.json"
    if shipped.is_file():
        return shipped
    names = sorted(p.stem for p in (DATA_DIR / kind).glob("*.json"))
    what = {"hardware": "hardware", "models": "model"}[kind]
    raise ConfigError(f"unknown {what} {str(name_or_path)!r}: not a file, nor one of {names}")


def _positive(what: str, value: Any) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise ConfigError(f"{what} must be a number, got {value!r}")
    if not (math.isfinite(value) and value > 0):
        raise ConfigError(f"{what} must be finite and > 0, got {value!r}")
    return float(value)


def load_model_shape(name_or_dir: str | Path) -> ModelConfig:
    """A model's shape: a shipped name (``llama2-7b``/``-13b``/``-70b``), a JSON file of
    ``config.json`` fields, or a Hugging Face checkpoint directory."""
    path = Path(name_or_dir)
    if path.is_dir():
        return ModelConfig.from_hf(path)
    data = _read_json(_resolve(name_or_dir, "models"), "model shape")
    fields = set(ModelConfig.__dataclass_fields__)
    try:
        return ModelConfig(**{k: v for k, v in data.items() if k in fields})
    except TypeError as e:
        raise ConfigError(f"model shape {name_or_dir}: {e}") from None


# --------------------------------------------------------------------------- hardware


@dataclass(frozen=True)
class Link:
    """A KV path between two instances: ``gb_per_s`` GB/s, ``latency_us`` per copy call,
    ``setup_us`` per transfer (the control round trips around the copy); with
    ``sender_blocks`` the sender's engine waits for the copy (a CPU one-sided write)."""

    gb_per_s: float
    latency_us: float
    sender_blocks: bool = False
    setup_us: float = 0.0

    def __post_init__(self) -> None:
        _positive("link gb_per_s", self.gb_per_s)
        for f in ("latency_us", "setup_us"):
            v = getattr(self, f)
            if isinstance(v, bool) or not (isinstance(v, (int, float)) and v >= 0):
                raise ConfigError(f"link {f} must be a number >= 0, got {v!r}")

    def calls(self, mode: str, num_blocks: int, num_layers: int) -> int:
        """Copies one transfer of ``num_blocks`` aggregated blocks takes in ``mode``."""
        if mode == "by_layer":
            return num_layers
        if mode == "by_request":
            return 2 * num_layers * num_blocks
        if mode == "by_request_aggregated":
            return num_blocks
        raise ConfigError(f"unknown transfer mode {mode!r}; choose one of {TRANSFER_MODES}")

    def seconds(self, nbytes: int, calls: int) -> float:
        """Time to move ``nbytes`` in ``calls`` copies."""
        return (self.setup_us + calls * self.latency_us) * 1e-6 + nbytes / (self.gb_per_s * GB)


@dataclass(frozen=True)
class TierLink:
    """The path between a MemPool tier and the tier above it, per GPU: GB/s moving a block up
    (a hit promoted toward hbm) and down (a block demoted), whether the engine's step waits
    for a move down (a disk's writes are queued off the step path), and the figures' source."""

    up_gb_per_s: float
    down_gb_per_s: float
    down_waits: bool = True
    source: str = ""

    def __post_init__(self) -> None:
        _positive("tier up_gb_per_s", self.up_gb_per_s)
        _positive("tier down_gb_per_s", self.down_gb_per_s)


# Per GPU, for a profile that names none: an 8-GPU PCIe 4.0 node with four NVMe data drives
# (the DGX A100's, the class of Mooncake's A800 nodes).
DEFAULT_TIERS = {
    "dram": TierLink(
        25.0,
        25.0,
        source="PCIe 4.0 x16 per GPU: 31.5 GB/s each way (PCI-SIG); pinned copies reach ~80 %",
    ),
    "disk": TierLink(
        3.5,
        1.9,
        down_waits=False,
        source="4 x 3.84 TB U.2 NVMe per 8-GPU node (DGX A100 datasheet), each 7.0 GB/s "
        "sequential read and 3.8 GB/s write (Samsung PM1733 datasheet): 28 / 15.2 GB/s per node",
    ),
}


@dataclass(frozen=True)
class HardwareProfile:
    """One accelerator kind and its node: peak dense FLOP/s of the serving dtype, HBM
    bandwidth and capacity, links (``nvlink`` inside a node, ``network`` between nodes),
    achieved fractions of peak (``efficiency``), a fixed per-step overhead, and the fraction
    of memory left to weights plus KV."""

    name: str
    peak_tflops: float
    hbm_gb_per_s: float
    hbm_gb: float
    gpus_per_node: int
    links: dict[str, Link]
    efficiency: dict[str, float]
    step_overhead_ms: float
    kv_memory_fraction: float = 0.9
    note: str = ""
    # terms ``minimemserve sim --calibrate`` fits (minimemserve_lab.calibration): host time per
    # layer of a step (kernel launches, which overlap the device's work: a step costs the
    # larger of the two), and the matmul efficiency by a step's tokens ({tokens: efficiency},
    # interpolated in log(tokens); empty: efficiency["matmul"] at every size)
    layer_overhead_us: float = 0.0
    matmul_by_tokens: dict[str, float] = field(default_factory=dict)
    # the MemPool tiers below hbm, by name: each one's link to the tier above it, per GPU
    tiers: dict[str, TierLink] = field(default_factory=lambda: dict(DEFAULT_TIERS))

    def __post_init__(self) -> None:
        for f in ("peak_tflops", "hbm_gb_per_s", "hbm_gb", "gpus_per_node"):
            _positive(f"hardware {self.name}: {f}", getattr(self, f))
        efficiencies = {k: self.efficiency.get(k) for k in REQUIRED_EFFICIENCIES}
        for key, e in (efficiencies | self.efficiency).items():
            if not (isinstance(e, (int, float)) and 0 < e <= 1):
                raise ConfigError(f"hardware {self.name}: efficiency.{key} must be in (0, 1]")
        self._check_calibrated()
        if not 0 < self.kv_memory_fraction <= 1:
            raise ConfigError(f"hardware {self.name}: kv_memory_fraction must be in (0, 1]")
        if "nvlink" not in self.links:
            raise ConfigError(f"hardware {self.name}: links must include 'nvlink'")

    def _check_calibrated(self) -> None:
        for tokens, e in self.matmul_by_tokens.items():
            if not (str(tokens).isdigit() and int(tokens) >= 1 and isinstance(e, int | float)):
                raise ConfigError(f"hardware {self.name}: matmul_by_tokens needs tokens >= 1")
            if not 0 < e <= 1:
                raise ConfigError(f"hardware {self.name}: matmul_by_tokens.{tokens} not in (0, 1]")
        lo = self.layer_overhead_us
        if isinstance(lo, bool) or not (isinstance(lo, int | float) and 0 <= lo < math.inf):
            raise ConfigError(f"hardware {self.name}: layer_overhead_us must be >= 0, got {lo!r}")

    @classmethod
    def load(cls, name_or_path: str | Path) -> HardwareProfile:
        """A shipped profile (``a100-80g``, ``a800``, ``h100``, ``h800``, ``h200``) or a file."""
        path = _resolve(name_or_path, "hardware")
        d = _read_json(path, "hardware profile")
        try:
            links = {k: Link(**v) for k, v in d.pop("links", {}).items()}
            tiers = {k: TierLink(**v) for k, v in d.pop("tiers", {}).items()}
            return cls(links=links, tiers=DEFAULT_TIERS | tiers, **d)
        except TypeError as e:
            raise ConfigError(f"hardware profile {path}: {e}") from None

    def matmul_efficiency(self, tokens: int) -> float:
        """The matmul efficiency of a step of ``tokens`` tokens."""
        if not self.matmul_by_tokens:
            return self.efficiency["matmul"]
        points = sorted((int(t), e) for t, e in self.matmul_by_tokens.items())
        x = math.log(max(tokens, 1))
        for (t0, e0), (t1, e1) in zip(points, points[1:]):
            if tokens < t1:
                w = (x - math.log(t0)) / (math.log(t1) - math.log(t0))
                return e0 + min(max(w, 0.0), 1.0) * (e1 - e0)
        return points[-1][1]

    def link(self, same_node: bool) -> Link:
        """The link between two instances, in one node or across nodes."""
        return (
            self.links["nvlink"] if same_node else self.links.get("network", self.links["nvlink"])
        )


# --------------------------------------------------------------------------- step shapes


@dataclass(frozen=True)
class StepShape:
    """One step's work: ``prefills`` as ``(tokens already in KV, new tokens)`` per chunk,
    ``decodes`` as the KV length each single-token row attends to, ``sampled`` rows."""

    prefills: tuple[tuple[int, int], ...] = ()
    decodes: tuple[int, ...] = ()
    sampled: int = 0

    @classmethod
    def of_batch(cls, batch: Sequence[tuple[Any, int]]) -> StepShape:
        """The shape of a local scheduler's ``[(request, tokens to compute)]``."""
        prefills, decodes, sampled = [], [], 0
        for req, n in batch:
            start = req.num_computed
            if n == 1:
                decodes.append(start + 1)
            else:
                prefills.append((start, n))
            sampled += start + n == len(req.tokens)
        return cls(tuple(prefills), tuple(decodes), sampled)

    @property
    def tokens(self) -> int:
        """Tokens computed (rows through the linear layers)."""
        return sum(n for _, n in self.prefills) + len(self.decodes)

    @property
    def prefill_pairs(self) -> int:
        """Query-key pairs of the prefill chunks (causal within the chunk)."""
        return sum(n * c + n * (n + 1) // 2 for c, n in self.prefills)

    def features(self) -> list[float]:
        """The :data:`FEATURES` of this step."""
        rows = len(self.prefills) + len(self.decodes)
        return [1.0, self.tokens, self.prefill_pairs, sum(self.decodes), len(self.prefills), rows]

    @staticmethod
    def decode_features(rows: int, context: int) -> list[float]:
        """The :data:`FEATURES` of a step of ``rows`` decodes attending to ``context`` KV
        tokens in all (:meth:`features` of that shape, without building it)."""
        return [1.0, rows, 0, context, 0, rows]


# --------------------------------------------------------------------------- CPU fit


def _nonneg_lstsq(rows: list[list[float]], targets: list[float]) -> list[float]:
    """Least squares with every coefficient >= 0 (drop the most negative, refit)."""
    a_all = torch.tensor(rows, dtype=torch.float64)  # [S, K]
    b = torch.tensor(targets, dtype=torch.float64)[:, None]  # [S, 1]
    active = list(range(a_all.shape[1]))
    while True:
        a = a_all[:, active]
        norms = a.norm(dim=0).clamp_min(1e-30)  # columns span orders of magnitude
        sol = (torch.linalg.lstsq(a / norms, b, driver="gelsd").solution[:, 0] / norms).tolist()
        if min(sol) >= 0 or len(active) == 1:
            coefs = [0.0] * a_all.shape[1]
            for i, c in zip(active, sol):
                coefs[i] = max(c, 0.0)
            return coefs
        active.pop(sol.index(min(sol)))


@dataclass(frozen=True)
class FittedStepModel:
    """Step seconds = ``coefs · StepShape.features()`` (see :data:`FEATURES`), fitted to
    measured steps of this engine, times ``prefill_scale`` for a step with prefill work (the
    machine's prefill speed measured later against the fit's; 1 as fitted);
    ``relative_error`` is the fit's mean |error| / measured."""

    coefs: tuple[float, ...]
    samples: int = 0
    relative_error: float = 0.0
    device: str = "cpu"
    prefill_scale: float = 1.0

    def __post_init__(self) -> None:
        c = tuple(float(v) for v in self.coefs)
        if len(c) != len(FEATURES) or not all(math.isfinite(v) and v >= 0 for v in c):
            raise ConfigError(f"FittedStepModel needs {len(FEATURES)} finite coefs >= 0: {c}")
        object.__setattr__(self, "coefs", c)
        s = self.prefill_scale
        if not (isinstance(s, (int, float)) and math.isfinite(s) and s > 0):
            raise ConfigError(f"prefill_scale must be a finite number > 0, got {s!r}")

    def step_time(self, shape: StepShape) -> float:
        """Predicted seconds of one step."""
        seconds = sum(c * f for c, f in zip(self.coefs, shape.features()))
        return seconds * self.prefill_scale if shape.prefills else seconds

    def decode_time(self, rows: int, context: int) -> float:
        """:meth:`step_time` of ``rows`` decodes attending to ``context`` KV tokens in all."""
        return sum(c * f for c, f in zip(self.coefs, StepShape.decode_features(rows, context)))

    def decode_times(self, rows: int, contexts: Sequence[int]) -> list[float]:
        """:meth:`decode_time` of each of ``contexts``."""
        return [self.decode_time(rows, c) for c in contexts]

    def prefill_time(self, new: int, cached: int = 0) -> float:
        """Predicted seconds of a lone prefill of ``new`` tokens after ``cached`` ones."""
        return self.step_time(StepShape(((cached, new),), (), 1))

    @classmethod
    def fit(
        cls, measured: Sequence[tuple[StepShape, float]], device: str = "cpu"
    ) -> FittedStepModel:
        """Fit to ``(shape, seconds)`` pairs."""
        if len(measured) < len(FEATURES):
            raise ValueError(f"need at least {len(FEATURES)} measured steps, got {len(measured)}")
        bad = [t for _, t in measured if not (math.isfinite(t) and t > 0)]
        if bad:
            raise ValueError(f"measured step times must be finite and > 0, got {bad[:3]}")
        # each row divided by its measured time: the fit minimises the relative error it
        # reports, so the long prefills do not outweigh the decode steps a run is made of
        rows = [[f / t for f in s.features()] for s, t in measured]
        coefs = _nonneg_lstsq(rows, [1.0] * len(measured))
        model = cls(tuple(coefs), len(measured), 0.0, device)
        err = sum(abs(model.step_time(s) - t) / t for s, t in measured) / len(measured)
        return cls(model.coefs, len(measured), err, device)

    def save(self, path: str | Path) -> Path:
        """Write as JSON."""
        path = Path(path)
        path.parent.mkdir(parents=True, exist_ok=True)
        d = {"format": _FIT_FORMAT, "features": list(FEATURES), **asdict(self)}
        path.write_text(json.dumps(d, indent=1) + "\n")
        return path

    @classmethod
    def load(cls, path: str | Path) -> FittedStepModel:
        """Read what :meth:`save` wrote."""
        d = _read_json(Path(path), "fitted step model")
        if d.get("format") != _FIT_FORMAT:
            raise ConfigError(f"{path}: not a fitted step model (format {d.get('format')!r})")
        return cls(
            tuple(d["coefs"]),
            d.get("samples", 0),
            d.get("relative_error", 0.0),
            d.get("device", "cpu"),
            d.get("prefill_scale", 1.0),
        )


# Shapes timed by fit_cpu_steps: lone prefills (new tokens, cached tokens) and decode
# batches (rows, context), spanning the default benchmark's steps on the tiny preset.
FIT_PREFILLS = (
    (16, 0),
    (64, 0),
    (128, 0),
    (256, 0),
    (512, 0),
    (128, 512),
    (256, 1024),
    (512, 1024),
    (64, 1536),
    (384, 256),
)
FIT_DECODES = ((1, 128), (1, 1024), (4, 256), (8, 512), (16, 256), (16, 1024), (32, 512))
# (prefill chunk as (cached, new), decode rows, context)
FIT_MIXED = (
    ((0, 256), 8, 512),
    ((512, 64), 16, 256),
    ((0, 480), 32, 512),
    ((1024, 256), 16, 1024),
    ((256, 448), 12, 384),
)
# Several prompts prefilled in one step (as a prefill instance batches what waits): each
# prompt costs more than a decode row (its own attention, its own sampled position).
FIT_BATCHED = (
    ((0, 32),) * 3,
    ((0, 150),) * 2,
    ((0, 100),) * 3,
    ((0, 60),) * 5,
    ((256, 128), (0, 200)),
)
FIT_REPEATS = 5
FIRST_TOKEN_ID = 3  # ids 0-2 are <unk>, <s>, </s> in the presets


def _fit_shapes() -> list[StepShape]:
    shapes = [StepShape(((c, n),), (), 1) for n, c in FIT_PREFILLS]
    shapes += [StepShape((), (ctx,) * b, b) for b, ctx in FIT_DECODES]
    shapes += [StepShape((p,), (ctx,) * b, b + 1) for p, b, ctx in FIT_MIXED]
    shapes += [StepShape(chunks, (), len(chunks)) for chunks in FIT_BATCHED]
    return shapes


def _time_step(eng: Engine, shape: StepShape) -> float:
    """Seconds of one real step of ``shape`` through ``eng``'s model runner, on requests whose
    cached tokens' KV stands in the pool (allocated for it, freed after)."""
    reqs = []
    for i, (c, n) in enumerate([*shape.prefills, *((ctx - 1, 1) for ctx in shape.decodes)]):
        ids = [FIRST_TOKEN_ID + (i + j) % 997 for j in range(c + n)]
        req = Request(f"fit-{i}", ids, SamplingParams(max_tokens=1, temperature=0.0))
        req.blocks = eng.pool.alloc_mem(eng.pool.layout.num_blocks_for(c + n))
        req.num_computed = c  # KV of the first c tokens stands in the pool
        reqs.append((req, n))
    t0 = time.perf_counter()
    eng.runner.run(reqs, eng.generator)
    seconds = time.perf_counter() - t0
    for req, _ in reqs:
        eng.pool.free_mem(req.blocks)
    return seconds


def time_cpu_steps(
    model_dir: str | Path, threads: int = 1, progress: bool = True
) -> list[tuple[StepShape, float]]:
    """Time real steps (engine forward, attention backend, sampling) of ``model_dir`` on this
    CPU with ``threads`` torch threads: ``(shape, median seconds)`` per fitting shape. Each
    shape runs through the engine's model runner on requests whose KV is in the pool."""
    old = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        eng = Engine(model_dir, config="PD")
        shapes = _fit_shapes()
        times: list[list[float]] = [[] for _ in shapes]
        # FIT_REPEATS passes over all the shapes, each timed once per pass: a neighbour's burst
        # then disturbs one time of several shapes, which the median drops, not all of one
        bar = tqdm(total=FIT_REPEATS * len(shapes), desc="timing CPU steps", disable=not progress)
        for _ in range(FIT_REPEATS):
            for shape, t in zip(shapes, times):
                t.append(_time_step(eng, shape))
                bar.update()
        bar.close()
        eng.pool.check()
        measured = [(shape, sorted(t)[FIT_REPEATS // 2]) for shape, t in zip(shapes, times)]
    finally:
        torch.set_num_threads(old)
    return measured


def fit_cpu_steps(
    model_dir: str | Path, threads: int = 1, progress: bool = True, concurrent: int = 1
) -> FittedStepModel:
    """Fit a :class:`FittedStepModel` to :func:`time_cpu_steps`. With ``concurrent`` > 1, that
    many processes time the same steps at once and their times are averaged: the cores are
    then shared as they are when that many instances serve side by side."""
    if concurrent <= 1:
        measured = time_cpu_steps(model_dir, threads, progress)
    else:
        ctx = mp.get_context("spawn")
        with ctx.Pool(concurrent) as pool:
            runs = pool.starmap(time_cpu_steps, [(str(model_dir), threads, False)] * concurrent)
        measured = [
            (shape, sum(r[k][1] for r in runs) / concurrent) for k, (shape, _) in enumerate(runs[0])
        ]
    return FittedStepModel.fit(measured, device="cpu")


def with_overhead(model: FittedStepModel, per_step: float, per_row: float = 0.0) -> FittedStepModel:
    """``model`` with ``per_step`` more seconds per step and ``per_row`` per sequence in it (a
    runtime's cost around the forward pass; negative ones correct an over-estimate)."""
    step, *middle, rows = model.coefs
    return replace(model, coefs=(step + per_step, *middle, rows + per_row))


# --------------------------------------------------------------------------- roofline


class RooflineStepModel:
    """Per-operator roofline of one instance: ``tp`` GPUs of ``hw`` serving ``shape`` in a
    ``dtype_bytes``-byte dtype. ``parts`` shows each operator's seconds. ``prefill_speed`` and
    ``decode_speed`` divide a step's operator time (not its fixed cost): a prefill chunk's
    share by the first, a decode row's by the second, a step mixing both by its share of
    prefill tokens and decode rows (a sensitivity check: how much a conclusion depends on
    the profile)."""

    def __init__(
        self,
        hw: HardwareProfile,
        shape: ModelConfig,
        tp: int = 1,
        dtype_bytes: int = 2,
        prefill_speed: float = 1.0,
        decode_speed: float = 1.0,
    ):
        self.prefill_speed = _positive("prefill_speed", prefill_speed)
        self.decode_speed = _positive("decode_speed", decode_speed)
        if not isinstance(tp, int) or tp < 1:
            raise ConfigError(f"tensor parallelism must be an int >= 1, got {tp!r}")
        if shape.num_attention_heads % tp:
            raise ConfigError(f"{shape.num_attention_heads} heads do not split over TP {tp}")
        if tp > hw.gpus_per_node:
            raise ConfigError(f"TP {tp} exceeds the {hw.gpus_per_node} GPUs of a {hw.name} node")
        self.hw = hw
        self.shape = shape
        self.tp = tp
        self.dtype_bytes = dtype_bytes
        s = shape
        h = s.hidden_size
        hd = s.head_dim
        layers = s.num_hidden_layers
        q = s.num_attention_heads * hd
        kv = s.num_key_value_heads * hd
        self.linear_params = layers * (h * (q + 2 * kv) + q * h + 3 * h * s.intermediate_size)
        self.head_params = s.vocab_size * h
        self.kv_bytes_per_token = 2 * layers * kv * dtype_bytes
        self.weight_bytes = (self.linear_params + 2 * self.head_params) * dtype_bytes
        e = hw.efficiency
        self._attn_flops = hw.peak_tflops * 1e12 * e["attention"]
        self._bw = hw.hbm_gb_per_s * GB * e["memory"]
        # decode attention reads KV at its own efficiency where a calibration fitted one
        self._kv_bw = hw.hbm_gb_per_s * GB * e.get("attention_read", e["memory"])
        self._step_overhead = hw.step_overhead_ms * 1e-3
        self._layer_launch = hw.layer_overhead_us * 1e-6 * layers
        self._nvlink = hw.links["nvlink"]
        self._decode_fixed: dict[int, tuple[float, float, float]] = {}  # see decode_time

    def kv_blocks(self, block_size: int) -> int:
        """KV blocks an instance holds: its GPUs' memory share less the weights."""
        hw = self.hw
        free = self.tp * hw.hbm_gb * GB * hw.kv_memory_fraction - self.weight_bytes
        n = int(free // (self.kv_bytes_per_token * block_size))
        if n < 1:
            raise ConfigError(
                f"{self.weight_bytes / GB:.1f} GB of weights leave no KV room on {self.tp} x "
                f"{hw.name} ({hw.hbm_gb:g} GB each): raise the tensor parallelism"
            )
        return n

    def parts(self, shape: StepShape) -> dict[str, float]:
        """Seconds per operator class of one step."""
        kv_tokens = sum(shape.decodes) + sum(c for c, _ in shape.prefills)
        prefill_tokens = sum(n for _, n in shape.prefills)
        return self._parts(
            shape.tokens,
            shape.sampled,
            shape.prefill_pairs,
            kv_tokens,
            prefill_tokens,
            len(shape.decodes),
        )

    def _parts(
        self, t: int, sampled: int, pairs: int, kv_tokens: int, prefill_tokens: int, decodes: int
    ) -> dict[str, float]:
        """:meth:`parts` of a step of ``t`` tokens, ``sampled`` rows, ``pairs`` prefill
        query-key pairs, ``kv_tokens`` tokens of KV read, ``prefill_tokens`` tokens of prefill
        chunks and ``decodes`` decode rows."""
        s, tp, b = self.shape, self.tp, self.dtype_bytes
        lin_flops = 2 * (t * self.linear_params + sampled * self.head_params) / tp
        lin_bytes = (self.linear_params + self.head_params) * b / tp
        q_width = s.num_attention_heads * s.head_dim
        attn_flops = 4 * pairs * q_width * s.num_hidden_layers / tp
        kv_read = kv_tokens * self.kv_bytes_per_token
        elementwise = ELEMENTWISE_PASSES * t * s.hidden_size * s.num_hidden_layers * b
        flops = self.hw.peak_tflops * 1e12 * self.hw.matmul_efficiency(t)
        out = {
            "linear": max(lin_flops / flops, lin_bytes / self._bw),
            "attention": attn_flops / self._attn_flops + kv_read / tp / self._kv_bw,
            "elementwise": elementwise / tp / self._bw,
            "allreduce": 0.0,
        }
        if tp > 1:
            calls = ALLREDUCES_PER_LAYER * s.num_hidden_layers
            ring = 2 * (tp - 1) / tp * t * s.hidden_size * b / self.hw.efficiency["allreduce"]
            out["allreduce"] = calls * self._nvlink.seconds(ring, 1)
        if (self.prefill_speed, self.decode_speed) != (1.0, 1.0):
            p, d = prefill_tokens, decodes
            slow = (p / self.prefill_speed + d / self.decode_speed) / (p + d) if p + d else 1.0
            out = {k: v * slow for k, v in out.items()}
        # the layers' kernel launches overlap the device's work: only what exceeds it costs
        launches = self._layer_launch - sum(out.values())
        return out | {"overhead": self._step_overhead + max(0.0, launches)}

    def step_time(self, shape: StepShape) -> float:
        """Predicted seconds of one step."""
        return sum(self.parts(shape).values())

    def decode_time(self, rows: int, context: int) -> float:
        """:meth:`step_time` of ``rows`` decodes attending to ``context`` KV tokens in all."""
        return self.decode_times(rows, (context,))[0]

    def decode_times(self, rows: int, contexts: Sequence[int]) -> list[float]:
        """:meth:`decode_time` of each of ``contexts``: the same sums of the same terms, in
        the same order, those that do not read KV kept by ``rows``."""
        if (self.prefill_speed, self.decode_speed) != (1.0, 1.0):
            return [sum(self._parts(rows, rows, 0, c, 0, rows).values()) for c in contexts]
        fixed = self._decode_fixed.get(rows)
        if fixed is None:
            out = self._parts(rows, rows, 0, 0, 0, rows)
            fixed = self._decode_fixed[rows] = (out["linear"], out["elementwise"], out["allreduce"])
        linear, elementwise, allreduce = fixed
        kv, tp, bw = self.kv_bytes_per_token, self.tp, self._kv_bw
        step, launch = self._step_overhead, self._layer_launch
        out = []
        for context in contexts:
            attention = 0.0 + context * kv / tp / bw
            work = linear + attention + elementwise + allreduce  # sum(parts) but the overhead
            out.append(work + (step + max(0.0, launch - work)))
        return out

    def prefill_time(self, new: int, cached: int = 0) -> float:
        """Predicted seconds of a lone prefill of ``new`` tokens after ``cached`` ones (the
        :meth:`step_time` of that shape, without building it)."""
        pairs = new * cached + new * (new + 1) // 2  # StepShape.prefill_pairs
        return sum(self._parts(new, 1, pairs, cached, new, 0).values())


class StepCost:
    """The global scheduler's ``Cost`` from a step model (its ``prefill_time`` and
    ``decode_time``) and a link: ``exec(x, y)`` is the modelled prefill step, ``decode(x)``
    what one more sequence adds to a decode step, ``transfer(n)`` the modelled KV move of
    ``n`` tokens."""

    def __init__(self, model, link: Link, kv_bytes_per_token: int, block_size: int):
        self.model = model
        self.link = link
        self.kv_bytes_per_token = kv_bytes_per_token
        self.block_size = block_size

    def exec(self, x: int, y: float) -> float:
        """Modelled seconds to prefill ``x`` tokens of which a fraction ``y`` is cached."""
        cached = round(x * y)
        return self.model.prefill_time(max(x - cached, 1), cached)

    def decode(self, x: int) -> float:
        """Modelled seconds one more sequence of ``x`` tokens adds to a decode step."""
        one = self.model.decode_time(1, x)
        return max(0.0, self.model.decode_time(2, 2 * x) - one)

    def transfer(self, num_tokens: int) -> float:
        """Modelled seconds to move ``num_tokens`` tokens' KV (aggregated blocks)."""
        blocks = -(-num_tokens // self.block_size)
        return self.link.seconds(num_tokens * self.kv_bytes_per_token, blocks)
