"""Step times of a Llama-2-shaped random bf16 model of 1.3B parameters on one GPU.

    python bench/gpu_steps.py --out DIR              # CUDA: the grid below (~1 min on an H200)
    python bench/gpu_steps.py --out DIR --dry-run    # CPU: a tiny model, one shape per kind

The model is Llama-2's architecture (MHA, head_dim 128, SwiGLU, RMSNorm, RoPE) at 24 layers
x 2048 hidden, with random weights: the weights do not change a step's time, and no
checkpoint has to be written or read. The KV pool is a MemPool on the device; every step
goes through the attention backend's ``prepare`` and the model's forward, as in the engine.

Shapes: prefills (one or more sequences, with and without a cached prefix), decodes (batch x
context) and one mixed step (a prefill chunk beside running decodes). A step is timed from
``prepare`` to the logits of its last tokens, synchronised, after warm-up; median and P99
of the repeats, plus the host time of ``prepare`` alone. Output: ``gpu_steps.json``.
"""

from __future__ import annotations

import argparse
import json
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
from minimemserve.mempool import MemPool
from minimemserve.model.config import ModelConfig
from minimemserve.model.llama import LlamaModel

# Llama-2 architecture at 1.3B parameters (Llama-2-7B halved in width, 24 layers)
GPU_MODEL = dict(
    vocab_size=32000,
    hidden_size=2048,
    intermediate_size=5504,
    num_hidden_layers=24,
    num_attention_heads=16,
    num_key_value_heads=16,
    max_position_embeddings=16384,
)
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
MAX_KV_TOKENS = 320 * 1024  # pool capacity: 60 GiB of bf16 KV at this model's 192 KiB a token
WARMUP, REPEATS = 2, 10


@dataclass(frozen=True)
class Shape:
    """One step: prefills (cached, new tokens each) first, then ``decodes`` at ``context``."""

    name: str
    prefills: tuple[tuple[int, int], ...] = ()
    decodes: int = 0
    context: int = 0


def gpu_shapes() -> list[Shape]:
    """The grid on CUDA: prefill sizes, prefix reuse, decode batch x context, one mixed step."""
    shapes = [
        Shape("prefill 1x512", ((0, 512),)),
        Shape("prefill 1x2048", ((0, 2048),)),
        Shape("prefill 1x8192", ((0, 8192),)),
        Shape("prefill 4x1024", ((0, 1024),) * 4),
        Shape("prefill 1x512 after 4096 cached", ((4096, 512),)),
        Shape("prefill 4x256 after 2048 cached", ((2048, 256),) * 4),
    ]
    for batch in (1, 8, 32, 64, 128, 256):
        for context in (1024, 4096):
            if batch * context <= MAX_KV_TOKENS:  # the pool holds the largest step
                shapes.append(Shape(f"decode {batch}x{context}", decodes=batch, context=context))
    shapes.append(Shape("mixed 1x512 + 63 decodes x2048", ((0, 512),), 63, 2048))
    return shapes


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


def time_shape(model, backend, pool, shape: Shape, device, warmup: int, repeats: int) -> dict:
    """Median and P99 step time of ``shape`` (ms), and the host time of ``prepare`` (us)."""
    slices, held = step_slices(shape, pool)
    tokens = sum(s.num_new for s in slices)
    ids = torch.randint(0, model.cfg.vocab_size, (tokens,), device=device)
    last, end = [], 0
    for s in slices:
        end += s.num_new
        last.append(end - 1)
    rows = torch.tensor(last, device=device)
    sync = torch.cuda.synchronize if device.type == "cuda" else lambda: None
    step_ms, prepare_us = [], []
    with torch.inference_mode():
        for i in range(warmup + repeats):
            sync()
            t0 = time.perf_counter()
            md = backend.prepare(slices)
            t1 = time.perf_counter()
            logits = model.compute_logits(model(ids, backend, md)[rows])
            sync()
            t2 = time.perf_counter()
            if i >= warmup:
                step_ms.append((t2 - t0) * 1e3)
                prepare_us.append((t1 - t0) * 1e6)
    for blocks in held:
        pool.free_mem(blocks)
    step_ms.sort()
    return {
        "shape": shape.name,
        "prefill_tokens": sum(n for _, n in shape.prefills),
        "cached_tokens": sum(c for c, _ in shape.prefills),
        "decodes": shape.decodes,
        "context": shape.context,
        "step_ms_median": statistics.median(step_ms),
        "step_ms_p99": step_ms[min(len(step_ms) - 1, round(0.99 * (len(step_ms) - 1)))],
        "prepare_us_median": statistics.median(prepare_us),
        "tokens_per_s": tokens / (statistics.median(step_ms) / 1e3),
        "logits_finite": bool(torch.isfinite(logits).all()),
    }


def run(dry: bool, backend_name: str | None) -> dict:
    """Build the model and pool, time every shape; the report dict."""
    device = torch.device("cpu" if dry else "cuda")
    dtype = torch.float32 if dry else torch.bfloat16
    sizes = DRY_MODEL if dry else GPU_MODEL
    model = build_model(sizes, device, dtype)
    cfg = model.cfg
    layout = KVLayout(cfg.num_hidden_layers, BLOCK_SIZE, cfg.num_key_value_heads, cfg.head_dim)
    shapes = dry_shapes() if dry else gpu_shapes()
    runs = [[c + n for c, n in s.prefills] + [s.context] * s.decodes for s in shapes]
    need = max(sum(layout.num_blocks_for(n) for n in r) for r in runs)
    pool = MemPool(layout, need + 16, device=device, dtype=dtype)
    backend = make_backend(backend_name, pool.kv("hbm"), layout, cfg.num_attention_heads,
                           cfg.head_dim**-0.5)  # fmt: skip
    warmup, repeats = (1, 2) if dry else (WARMUP, REPEATS)
    results = [time_shape(model, backend, pool, s, device, warmup, repeats) for s in shapes]
    params = sum(p.numel() for p in model.parameters())
    return {
        "device": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
        "dry_run": dry,
        "backend": backend.name,
        "dtype": str(dtype).removeprefix("torch."),
        "model": sizes,
        "parameters": params,
        "block_size": BLOCK_SIZE,
        "warmup": warmup,
        "repeats": repeats,
        "steps": results,
    }


def print_report(report: dict) -> None:
    """One line per shape."""
    print(f"{report['device']}: {report['parameters'] / 1e9:.2f}B parameters, "
          f"{report['dtype']}, {report['backend']} attention")  # fmt: skip
    print(f"{'shape':36}{'median ms':>11}{'p99 ms':>9}{'prepare us':>12}{'tok/s':>11}")
    for r in report["steps"]:
        print(f"{r['shape']:36}{r['step_ms_median']:>11.2f}{r['step_ms_p99']:>9.2f}"
              f"{r['prepare_us_median']:>12.0f}{r['tokens_per_s']:>11.0f}")  # fmt: skip


def main() -> None:
    """Parse options, run, print and write ``gpu_steps.json`` under ``--out``."""
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default=str(Path(__file__).resolve().parent / "results"))
    ap.add_argument("--dry-run", action="store_true", help="tiny model on the CPU")
    ap.add_argument("--backend", default=None, help="attention backend (default: the device's)")
    args = ap.parse_args()
    if not args.dry_run and not torch.cuda.is_available():
        raise SystemExit("gpu_steps needs a CUDA device (use --dry-run on the CPU)")
    report = run(args.dry_run, args.backend)
    print_report(report)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "gpu_steps.json").write_text(json.dumps(report, indent=2))
    print(f"wrote {out / 'gpu_steps.json'}")


if __name__ == "__main__":
    main()
