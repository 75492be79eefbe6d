"""Step times and tokens/s of Llama-2-7B or -13B with random bf16 weights on one GPU.

    python bench/gpu_steps.py --model 7b --out DIR    # CUDA: the grid below (<1 min on an H200)
    python bench/gpu_steps.py --model 13b --out DIR
    python bench/gpu_steps.py --dry-run --out DIR     # CPU: a tiny model, one shape per kind

The model is Llama-2-7B's or -13B's exact shape (MHA, head_dim 128, SwiGLU, RMSNorm, RoPE,
4096 positions) with random weights: the weights do not change a step's time, and no
checkpoint has to be written or read. The KV pool is a MemPool on the device, as large as
the memory left allows; every step goes through the attention backend's ``prepare`` and the
model's forward, as in the engine.

Shapes: prefills (one or more sequences, with and without a cached prefix), decodes (batch
1-256 x context, every batch at the contexts the pool holds) and one mixed step (a prefill
chunk beside running decodes). A step is timed from ``prepare`` to the logits of its last
tokens, synchronised, after warm-up; median and P99 of the repeats, plus the host time of
``prepare`` alone. Each decode shape runs twice: eagerly, and as the engine runs it, through
the decode CUDA graphs (``DecodeGraphs``, captured once for buckets up to 256). One more step
of each runs under ``torch.profiler``: the GPU-busy time (the union of the device's kernel
and copy intervals) and the kernels launched, per step and per layer. ``step_ms_median`` is
what the engine runs (graphs where they serve the shape). Output: ``gpu_steps_<model>.json``,
which ``minimemserve sim --calibrate`` reads (the simulator's H200 profile against these
measurements).
"""

from __future__ import annotations

import argparse
import json
import math
import statistics
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from minimemserve.attention import make_backend
from minimemserve.attention.base import SeqSlice
from minimemserve.blocks.layout import KVLayout
from minimemserve.decode_graphs import DecodeGraphs
from minimemserve.mempool import MemPool
from minimemserve.model.config import ModelConfig
from minimemserve.model.llama import LlamaModel
from minimemserve.sim.profiles import DATA_DIR

# Llama-2's published shapes (both MHA), as the simulator ships them
GPU_MODELS = {
    size: json.loads((DATA_DIR / "models" / f"llama2-{size}.json").read_text())
    for size in ("7b", "13b")
}
DRY_MODEL = dict(
    vocab_size=256,
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=1024,
)
INIT_STD = 0.02  # Llama's initialiser range: keeps random activations finite in bf16
BLOCK_SIZE = 16
HEADROOM_BYTES = 10 * 2**30  # left free beside the pool: activations, logits, the allocator
MAX_POOL_BYTES = 100 * 2**30
DECODE_BATCHES = (1, 8, 32, 64, 128, 256)
DECODE_CONTEXTS = (512, 2048)
WARMUP, REPEATS = 2, 10


@dataclass(frozen=True)
class Shape:
    """One step: prefills (cached, new tokens each) first, then ``decodes`` at ``context``."""

    name: str
    prefills: tuple[tuple[int, int], ...] = ()
    decodes: int = 0
    context: int = 0


def gpu_shapes(max_kv_tokens: int) -> list[Shape]:
    """The grid on CUDA: prefill sizes, prefix reuse, decode batch x context (each batch at
    the contexts a pool of ``max_kv_tokens`` holds, else the longest multiple of 128 it
    does), one mixed step."""
    shapes = [
        Shape("prefill 1x512", ((0, 512),)),
        Shape("prefill 1x2048", ((0, 2048),)),
        Shape("prefill 1x4096", ((0, 4096),)),
        Shape("prefill 4x1024", ((0, 1024),) * 4),
        Shape("prefill 1x512 after 3072 cached", ((3072, 512),)),
        Shape("prefill 4x256 after 2048 cached", ((2048, 256),) * 4),
    ]
    for batch in DECODE_BATCHES:
        contexts = [c for c in DECODE_CONTEXTS if batch * c <= max_kv_tokens]
        longest = max_kv_tokens // batch // 128 * 128
        for context in contexts or ([longest] if longest else []):
            shapes.append(Shape(f"decode {batch}x{context}", decodes=batch, context=context))
    if 512 + 63 * 2048 <= max_kv_tokens:
        shapes.append(Shape("mixed 1x512 + 63 decodes x2048", ((0, 512),), 63, 2048))
    return shapes


def kv_capacity(layout: KVLayout, dtype: torch.dtype, device: torch.device) -> int:
    """Tokens of KV the device's free memory holds after HEADROOM_BYTES (MAX_POOL_BYTES at
    most), in whole blocks."""
    torch.cuda.empty_cache()  # the fp32 weights the model was built in are free, not cached
    free, _ = torch.cuda.mem_get_info(device)
    pool_bytes = min(MAX_POOL_BYTES, free - HEADROOM_BYTES)
    per_block = math.prod(layout.pool_shape(1)) * torch.empty((), dtype=dtype).element_size()
    return max(0, pool_bytes // per_block) * layout.block_size


def dry_shapes() -> list[Shape]:
    """One small shape per kind, for the CPU dry run."""
    return [
        Shape("prefill 1x32", ((0, 32),)),
        Shape("prefill 1x16 after 32 cached", ((32, 16),)),
        Shape("decode 4x64", decodes=4, context=64),
        Shape("mixed 1x16 + 3 decodes x48", ((0, 16),), 3, 48),
    ]


def build_model(sizes: dict, device: torch.device, dtype: torch.dtype) -> LlamaModel:
    """A random-weight model straight on the device (no checkpoint)."""
    cfg = ModelConfig(**sizes)
    with torch.device(device):
        model = LlamaModel(cfg)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if not name.endswith("norm.weight"):
                p.normal_(0.0, INIT_STD)
    return model.to(dtype=dtype).eval()


def step_slices(shape: Shape, pool: MemPool) -> tuple[list[SeqSlice], list[list[int]]]:
    """The step's slices over freshly allocated pool blocks (returned to be freed)."""
    held, slices = [], []
    runs = [(c, n) for c, n in shape.prefills] + [(shape.context - 1, 1)] * shape.decodes
    for cached, new in runs:
        blocks = pool.alloc_mem(pool.layout.num_blocks_for(cached + new))
        held.append(blocks)
        slices.append(SeqSlice(blocks, cached, new))
    return slices, held


def timed(step, sync, warmup: int, repeats: int) -> list[float]:
    """Wall times (ms) of ``repeats`` synchronised calls of ``step`` after ``warmup``."""
    times = []
    for i in range(warmup + repeats):
        sync()
        t0 = time.perf_counter()
        step()
        sync()
        if i >= warmup:
            times.append((time.perf_counter() - t0) * 1e3)
    return sorted(times)


def profile_step(step, device) -> tuple[float | None, int | None]:
    """GPU-busy ms (union of the device's kernel and copy intervals) and kernel launches of
    one call of ``step``, from ``torch.profiler``; (None, None) off CUDA."""
    if device.type != "cuda":
        return None, None
    activities = [torch.profiler.ProfilerActivity.CUDA]
    torch.cuda.synchronize(device)
    try:
        with torch.profiler.profile(activities=activities) as prof:
            step()
            torch.cuda.synchronize(device)
    except RuntimeError as e:  # a profiler that fails costs its two numbers, not the run
        print(f"profiler failed: {e}", file=sys.stderr)
        return None, None
    spans = {
        (e.time_range.start, e.time_range.end, e.name)
        for e in prof.events()
        if e.device_type == torch.autograd.DeviceType.CUDA
    }
    kernels = sum(1 for _, _, name in spans if not name.startswith(("Memcpy", "Memset")))
    busy, end = 0.0, float("-inf")
    for start, stop, _ in sorted(spans):  # union of intervals, in us
        busy += max(0.0, stop - max(start, end))
        end = max(end, stop)
    return busy / 1e3, kernels


def time_shape(model, backend, graphs, pool, shape: Shape, device, warmup, repeats) -> dict:
    """Median and P99 step time of ``shape`` (ms) eagerly and, for a decode shape ``graphs``
    serve, through them; GPU-busy time and kernels of each; host time of ``prepare`` (us)."""
    slices, held = step_slices(shape, pool)
    tokens = sum(s.num_new for s in slices)
    ids = torch.randint(0, model.cfg.vocab_size, (tokens,), device=device)
    ids_host = ids.tolist()
    last, end = [], 0
    for s in slices:
        end += s.num_new
        last.append(end - 1)
    rows = torch.tensor(last, device=device)
    sync = torch.cuda.synchronize if device.type == "cuda" else lambda: None
    out = {}

    def eager():
        md = backend.prepare(slices)
        out["logits"] = model.compute_logits(model(ids, backend, md)[rows])

    with torch.inference_mode():
        eager_ms = timed(eager, sync, warmup, repeats)
        prepare_us = [1e3 * ms for ms in timed(lambda: backend.prepare(slices), sync, 1, repeats)]
        busy, kernels = profile_step(eager, device)
        graph_ms, graph_busy, graph_kernels = [], None, None
        served = not shape.prefills and graphs is not None and graphs.bucket(shape.decodes)
        if served:  # decodes only, within the largest bucket
            replay = lambda: out.__setitem__("graph_logits", graphs.run(slices, ids_host))
            graph_ms = timed(replay, sync, warmup, repeats)
            graph_busy, graph_kernels = profile_step(replay, device)
    for blocks in held:
        pool.free_mem(blocks)
    p99 = lambda ms: ms[min(len(ms) - 1, round(0.99 * (len(ms) - 1)))] if ms else None
    engine_ms = graph_ms or eager_ms  # what the engine runs for this shape
    layers = model.cfg.num_hidden_layers
    return {
        "shape": shape.name,
        "prefill_tokens": sum(n for _, n in shape.prefills),
        "cached_tokens": sum(c for c, _ in shape.prefills),
        "decodes": shape.decodes,
        "context": shape.context,
        "step_ms_median": statistics.median(engine_ms),
        "step_ms_p99": p99(engine_ms),
        "eager_ms_median": statistics.median(eager_ms),
        "eager_ms_p99": p99(eager_ms),
        "graph_ms_median": statistics.median(graph_ms) if graph_ms else None,
        "graph_ms_p99": p99(graph_ms),
        "gpu_busy_ms": busy,
        "graph_gpu_busy_ms": graph_busy,
        "kernels": kernels,
        "kernels_per_layer": None if kernels is None else kernels / layers,
        "graph_kernels": graph_kernels,
        "prepare_us_median": statistics.median(prepare_us),
        "tokens_per_s": tokens / (statistics.median(engine_ms) / 1e3),
        "logits_finite": bool(torch.isfinite(out["logits"]).all()),
        "graph_logits_finite": bool(torch.isfinite(out["graph_logits"]).all())
        if "graph_logits" in out
        else None,
    }


def run(dry: bool, backend_name: str | None, model_name: str = "7b", progress=None) -> dict:
    """Build the model and pool, time every shape; the report dict (``progress(report)``
    after every shape, if given)."""
    device = torch.device("cpu" if dry else "cuda")
    dtype = torch.float32 if dry else torch.bfloat16
    sizes = DRY_MODEL if dry else GPU_MODELS[model_name]
    model = build_model(sizes, device, dtype)
    cfg = model.cfg
    layout = KVLayout(cfg.num_hidden_layers, BLOCK_SIZE, cfg.num_key_value_heads, cfg.head_dim)
    shapes = dry_shapes() if dry else gpu_shapes(kv_capacity(layout, dtype, device))
    runs = [[c + n for c, n in s.prefills] + [s.context] * s.decodes for s in shapes]
    need = max(sum(layout.num_blocks_for(n) for n in r) for r in runs)
    pool = MemPool(layout, need + 16, device=device, dtype=dtype)
    backend = make_backend(
        backend_name, pool.kv("hbm"), layout, cfg.num_attention_heads, cfg.head_dim**-0.5
    )
    graphs = None  # the engine's decode graphs (the CPU runs them eagerly, for the plumbing)
    if hasattr(backend, "plan_graph"):
        batch = max(s.decodes for s in shapes)
        context = cfg.max_position_embeddings
        graphs = DecodeGraphs(model, backend, batch, context, capture=device.type == "cuda")
    warmup, repeats = (1, 1) if dry else (WARMUP, REPEATS)
    results: list[dict] = []
    params = sum(p.numel() for p in model.parameters())
    report = {
        "device": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
        "dry_run": dry,
        "model_name": "dry-run tiny" if dry else f"llama2-{model_name}",
        "backend": backend.name,
        "graphs": None if graphs is None else list(graphs.graphs) or "run eagerly (no CUDA)",
        "graph_memory_bytes": None if graphs is None else graphs.memory_bytes,
        "dtype": str(dtype).removeprefix("torch."),
        "model": sizes,
        "parameters": params,
        "block_size": BLOCK_SIZE,
        "warmup": warmup,
        "repeats": repeats,
        "steps": results,
    }
    for shape in shapes:
        results.append(time_shape(model, backend, graphs, pool, shape, device, warmup, repeats))
        if progress is not None:
            progress(report)
    return report


def print_report(report: dict) -> None:
    """One line per shape: engine, eager and graph medians, GPU-busy time, kernels."""
    print(
        f"{report['device']}: {report['model_name']}, {report['parameters'] / 1e9:.2f}B "
        f"parameters, {report['dtype']}, {report['backend']} attention, graphs "
        f"{report['graphs']}"
    )
    f = lambda x, spec: "-" if x is None else format(x, spec)
    print(
        f"{'shape':34}{'eager ms':>9}{'busy ms':>8}{'kernels':>8}{'/layer':>7}"
        f"{'graph ms':>9}{'busy ms':>8}{'kernels':>8}{'prep us':>8}{'tok/s':>9}"
    )
    for r in report["steps"]:
        print(
            f"{r['shape']:34}{r['eager_ms_median']:>9.2f}{f(r['gpu_busy_ms'], '.2f'):>8}"
            f"{f(r['kernels'], 'd'):>8}{f(r['kernels_per_layer'], '.1f'):>7}"
            f"{f(r['graph_ms_median'], '.2f'):>9}{f(r['graph_gpu_busy_ms'], '.2f'):>8}"
            f"{f(r['graph_kernels'], 'd'):>8}{r['prepare_us_median']:>8.0f}"
            f"{r['tokens_per_s']:>9.0f}"
        )


def main() -> None:
    """Parse options, run, print and write ``gpu_steps.json`` under ``--out``."""
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default=str(Path(__file__).resolve().parent / "results"))
    ap.add_argument(
        "--model", default="7b", choices=sorted(GPU_MODELS), help="Llama-2 shape (default: 7b)"
    )
    ap.add_argument("--dry-run", action="store_true", help="tiny model on the CPU")
    ap.add_argument("--backend", default=None, help="attention backend (default: the device's)")
    args = ap.parse_args()
    if not args.dry_run and not torch.cuda.is_available():
        raise SystemExit("gpu_steps needs a CUDA device (use --dry-run on the CPU)")
    out = Path(args.out) / f"gpu_steps_{args.model}.json"
    out.parent.mkdir(parents=True, exist_ok=True)

    def write(report: dict) -> None:  # after every shape: a run cut short keeps what it had
        tmp = out.with_name(f".{out.name}.tmp")
        tmp.write_text(json.dumps(report, indent=2))
        tmp.replace(out)

    report = run(args.dry_run, args.backend, args.model, progress=write)
    print_report(report)
    write(report)
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
