"""Micro-benchmark of the Triton attention kernels against the copy ceiling and PyTorch SDPA.

    python bench/attention_kernels.py [--out DIR] [--quick]   # GPU: full sweep (~3 min on an H200),
                                                    # --quick: bf16 only (~1 min); CPU: smoke check

- ceiling: a device-to-device copy of 2 GiB, measured first in the same run; its bytes read
  plus written per second are the bandwidth the decode kernel is compared with (on an H200
  about 4.3 TB/s against the 4.8 TB/s of the spec sheet, which is kept as a second column).
- decode: ``paged_decode`` at real batch x context points (every point reads well over the
  L2's 60 MB per launch, so neither launch overhead nor L2 hits dominate) over an aggregated
  pool with shuffled block tables, launched as the backend does (planned once, launched per
  layer); achieved GB/s = (K/V bytes read + q/out bytes) / time.
- prefill: ``prefix_prefill`` over 2 x 4k-token sequences with 0 / 50 / 90 % of the tokens
  cached; achieved TFLOP/s = 4 * D * H * (visible keys summed over queries) / time.
- baselines: ``torch.nn.functional.scaled_dot_product_attention`` on the same data laid out
  contiguously (``[B, H, S, D]``) with its backend pinned (the first of flash, cuDNN,
  memory-efficient, math that accepts the call; its name is recorded), and flash-attn's
  ``flash_attn_func`` when flash-attn is importable; timed side by side in the same run.

Model shapes: Llama-2-7B (32 heads) and Llama-2-13B (40 heads) attention, both MHA with
head_dim 128, block size 16, two layers in the pool (the kernels read layer 0 through the
aggregated strides). Timing: CUDA events, warm-up, median of repeats.
Output: a table and ``kernels.json`` (in ``--out``, default ``bench/results``), with the
targets and whether they were met: Llama-2-7B decode >= 80 % of the copy ceiling at batch
64 x 4k in bf16; prefix prefill >= 90 % of SDPA's TFLOP/s at 4k tokens without a prefix.
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import random
import statistics
import sys
from pathlib import Path

import torch

if not torch.cuda.is_available():  # the interpreter must be on before triton is imported
    os.environ.setdefault("TRITON_INTERPRET", "1")

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch.nn.functional as F
from tqdm import tqdm

from minimemserve.blocks.layout import KVLayout, layer_views
from triton_kernels import (
    launch_decode,
    launch_prefill,
    paged_decode,
    plan_decode,
    plan_prefill,
    prefix_prefill,
)

RESULTS = Path(__file__).resolve().parent / "results"
# (substring of the device name, HBM bytes/s, dense 16-bit tensor FLOP/s) from vendor sheets
PEAKS = [
    ("H200", 4.8e12, 989e12),
    ("H100", 3.35e12, 989e12),
    ("A100", 2.0e12, 312e12),
    ("L40S", 0.864e12, 362e12),
    ("A10", 0.6e12, 125e12),
]
HEAD_DIM, BLOCK_SIZE, LAYERS = 128, 16, 2
HEADS = 32  # the CPU smoke check's query heads
# attention shapes: model -> (query heads, KV heads); Llama-2-7B and -13B are MHA
MODELS = {"llama2-7b": (32, 32), "llama2-13b": (40, 40)}
# (batch, context): 256 MiB (7B) to 4 GiB of K/V read per launch
DECODE_POINTS = ((1, 16384), (8, 4096), (32, 4096), (64, 4096), (128, 2048), (256, 1024))
QUICK_DECODE = ((1, 16384), (8, 4096), (64, 4096), (256, 1024))
PREFILL_TOKENS = 4096
PREFILL_BATCH = 2
PREFILL_CACHED = (0.0, 0.5, 0.9)
QUICK_CACHED = (0.0, 0.5)
WARMUP, REPEATS, INNER = 3, 9, 5
COPY_BYTES = 2 * 2**30  # device-to-device copy measured as the practical bandwidth ceiling
# targets: (batch, context) and share of the HBM peak for decode; share of SDPA for prefill
DECODE_TARGET = (64, 4096, 80.0)
PREFILL_TARGET = 90.0
TARGET_DTYPE = "bfloat16"
TARGET_MODEL = "llama2-7b"
# SDPA's backends in the order they are tried; the first that accepts a call is pinned
SDPA_ORDER = ("FLASH_ATTENTION", "CUDNN_ATTENTION", "EFFICIENT_ATTENTION", "MATH")


def pinned_sdpa(*args, **kwargs):
    """``(backend name, fn)``: ``fn()`` runs SDPA on these arguments with only that backend
    enabled, the first of SDPA_ORDER that accepts them (so what is timed is what is named)."""
    from torch.nn.attention import SDPBackend, sdpa_kernel

    for name in SDPA_ORDER:
        backend = getattr(SDPBackend, name, None)
        if backend is None:
            continue

        def fn(backend=backend):
            with sdpa_kernel(backend):
                return F.scaled_dot_product_attention(*args, **kwargs)

        try:
            fn()
        except RuntimeError:
            continue
        return name.lower(), fn
    raise RuntimeError("no SDPA backend accepts these inputs")


def flash_attn_func():
    """flash-attn's ``flash_attn_func``, or None where flash-attn is not importable."""
    try:
        from flash_attn import flash_attn_func as fa
    except ImportError:
        return None
    return fa


def device_peaks(device: torch.device) -> tuple[str, float | None, float | None]:
    """Device name and its HBM bytes/s and 16-bit FLOP/s, or None where unknown."""
    name = torch.cuda.get_device_name(device)
    for key, bw, flops in PEAKS:
        if key in name:
            return name, bw, flops
    return name, None, None


def time_cuda(fn) -> float:
    """Median seconds of one ``fn()``, after WARMUP calls, by CUDA events around INNER calls
    in a row (so the host's launch time hides behind the GPU's queue), over REPEATS."""
    for _ in range(WARMUP):
        fn()
    times = []
    for _ in range(REPEATS):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for _ in range(INNER):
            fn()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) / 1e3 / INNER)
    return statistics.median(times)


def paged_pool(seq_lens: list[int], n_kv: int, dtype: torch.dtype, device, seed: int = 0):
    """Random aggregated pool, layer-0 views and shuffled block tables for ``seq_lens``."""
    layout = KVLayout(LAYERS, BLOCK_SIZE, n_kv, HEAD_DIM)
    need = [layout.num_blocks_for(n) for n in seq_lens]
    num_blocks = sum(need) + 1
    pool = torch.empty(layout.pool_shape(num_blocks), dtype=dtype, device=device)
    pool.normal_()
    ids = list(range(1, num_blocks))
    random.Random(seed).shuffle(ids)
    tables, i = [], 0
    for n in need:
        tables.append(ids[i : i + n])
        i += n
    width = max(need)
    bt = torch.tensor([t + [0] * (width - len(t)) for t in tables], dtype=torch.int32)
    k_cache, v_cache = layer_views(pool, layout, 0)
    return pool, k_cache, v_cache, tables, bt.to(device)


def contiguous(cache: torch.Tensor, tables: list[list[int]], length: int) -> torch.Tensor:
    """``[B, n_kv, length, D]`` copy of the sequences' K or V (equal lengths)."""
    idx = torch.tensor(tables, device=cache.device)  # [B, nb]
    return cache[idx].flatten(1, 2)[:, :length].transpose(1, 2).contiguous()


def bench_decode(batch: int, ctx: int, dtype, device, heads: int, kv_heads: int) -> dict:
    """Time ``paged_decode`` and pinned SDPA on contiguous K/V, ``batch`` x ``ctx`` tokens;
    returns ms and GB/s of each."""
    pool, k_cache, v_cache, tables, bt = paged_pool([ctx] * batch, kv_heads, dtype, device)
    q = torch.randn(batch, heads, HEAD_DIM, dtype=dtype, device=device)
    lens = torch.full((batch,), ctx, dtype=torch.int32, device=device)
    scale = HEAD_DIM**-0.5
    plan = plan_decode(k_cache, batch, heads, ctx)  # once per step in the backend
    out = torch.empty_like(q)
    t = time_cuda(lambda: launch_decode(plan, q, k_cache, v_cache, bt, lens, out, scale))
    kc, vc = contiguous(k_cache, tables, ctx), contiguous(v_cache, tables, ctx)
    q4 = q.unsqueeze(2)  # [B, H, 1, D]
    sdpa_name, sdpa = pinned_sdpa(q4, kc, vc, enable_gqa=heads != kv_heads)
    t_sdpa = time_cuda(sdpa)
    elem = q.element_size()
    moved = 2 * batch * ctx * kv_heads * HEAD_DIM * elem + 2 * q.numel() * elem
    del pool, kc, vc
    return {
        "batch": batch,
        "context": ctx,
        "num_splits": plan.num_splits,
        "ms": t * 1e3,
        "gbps": moved / t / 1e9,
        "sdpa_backend": sdpa_name,
        "sdpa_ms": t_sdpa * 1e3,
        "sdpa_gbps": moved / t_sdpa / 1e9,
    }


def copy_gbps(device) -> float:
    """Bytes read plus written per second by a device-to-device copy of ``COPY_BYTES``."""
    src = torch.empty(COPY_BYTES, dtype=torch.uint8, device=device)
    dst = torch.empty_like(src)
    t = time_cuda(lambda: dst.copy_(src))
    return 2 * COPY_BYTES / t / 1e9


def bench_prefill(cached: float, dtype, device, heads: int) -> dict:
    """Time ``prefix_prefill``, pinned SDPA and flash-attn (if importable) with a fraction
    ``cached`` of the tokens cached; returns ms and TFLOP/s of each and the max error
    against SDPA (MHA: ``heads`` query and KV heads)."""
    ctx = int(PREFILL_TOKENS * cached) // BLOCK_SIZE * BLOCK_SIZE
    new = PREFILL_TOKENS - ctx
    b = PREFILL_BATCH
    pool, k_cache, v_cache, tables, bt = paged_pool([PREFILL_TOKENS] * b, heads, dtype, device)
    q = torch.randn(b * new, heads, HEAD_DIM, dtype=dtype, device=device)
    k = torch.randn(b * new, heads, HEAD_DIM, dtype=dtype, device=device)
    v = torch.randn_like(k)
    qsl = torch.arange(0, b + 1, dtype=torch.int32, device=device) * new
    ctx_t = torch.full((b,), ctx, dtype=torch.int32, device=device)
    scale = HEAD_DIM**-0.5

    plan = plan_prefill(k_cache, b, heads, new)  # once per step in the backend
    out = torch.empty_like(q)

    def run():
        launch_prefill(plan, q, k, v, k_cache, v_cache, bt, qsl, ctx_t, out, scale)
        return out

    t = time_cuda(run)
    # SDPA over the same keys laid out contiguously: prefix from the pool, then the new tokens
    kn = k.view(b, new, heads, HEAD_DIM).transpose(1, 2)  # [B, H, new, D]
    vn = v.view(b, new, heads, HEAD_DIM).transpose(1, 2)
    kc = torch.cat([contiguous(k_cache, tables, ctx), kn], 2).contiguous()
    vc = torch.cat([contiguous(v_cache, tables, ctx), vn], 2).contiguous()
    qc = q.view(b, new, heads, HEAD_DIM).transpose(1, 2).contiguous()
    if ctx == 0:
        sdpa_name, sdpa = pinned_sdpa(qc, kc, vc, is_causal=True)
    else:
        qpos = torch.arange(ctx, PREFILL_TOKENS, device=device)
        mask = torch.arange(PREFILL_TOKENS, device=device)[None, :] <= qpos[:, None]
        sdpa_name, sdpa = pinned_sdpa(qc, kc, vc, attn_mask=mask)
    t_sdpa = time_cuda(sdpa)
    ref = sdpa().transpose(1, 2).reshape(b * new, heads, HEAD_DIM)
    err = (run().float() - ref.float()).abs().max().item()
    visible = sum(ctx + i + 1 for i in range(new))  # keys seen, summed over one sequence's queries
    flops = 4 * HEAD_DIM * heads * visible * b
    fa, t_fa = flash_attn_func(), None
    if fa is not None:  # [B, S, H, D]; causal aligned to the end of the keys (flash-attn >= 2.1)
        qf, kf, vf = (x.transpose(1, 2).contiguous() for x in (qc, kc, vc))
        t_fa = time_cuda(lambda: fa(qf, kf, vf, causal=True))
    return {
        "cached": cached,
        "context": ctx,
        "new": new,
        "ms": t * 1e3,
        "tflops": flops / t / 1e12,
        "sdpa_backend": sdpa_name,
        "sdpa_ms": t_sdpa * 1e3,
        "sdpa_tflops": flops / t_sdpa / 1e12,
        "max_abs_err_vs_sdpa": err,
        "flash_attn_ms": t_fa and t_fa * 1e3,
        "flash_attn_tflops": t_fa and flops / t_fa / 1e12,
    }


def run_gpu(quick: bool, device: torch.device | None = None, progress=None) -> dict:
    """The decode and prefill sweeps on the CUDA device: the report dict (bf16 only and
    fewer points with ``quick``); ``progress(report)`` after every point, if given."""
    progress = progress or (lambda report: None)
    device = device or torch.device("cuda")
    name, peak_bw, peak_flops = device_peaks(device)
    fa = flash_attn_func()
    report = {
        "device": name,
        "peak_gbps": peak_bw and peak_bw / 1e9,
        "peak_tflops": peak_flops and peak_flops / 1e12,
        "copy_gbps": copy_gbps(device),
        "torch": torch.__version__,
        "flash_attn": "not importable" if fa is None else getattr(fa, "__module__", "flash_attn"),
        "quick": quick,
        "decode": [],
        "prefill": [],
    }
    points, cached = (QUICK_DECODE, QUICK_CACHED) if quick else (DECODE_POINTS, PREFILL_CACHED)
    dtypes = (torch.bfloat16,) if quick else (torch.float16, torch.bfloat16)
    for dtype, (model, (heads, kv_heads)) in itertools.product(dtypes, MODELS.items()):
        meta = {"model": model, "dtype": str(dtype).removeprefix("torch.")}
        for b, c in tqdm(points, desc=f"decode {model} {dtype}"):
            r = meta | bench_decode(b, c, dtype, device, heads, kv_heads)
            r["pct_copy"] = 100 * r["gbps"] / report["copy_gbps"]
            r["pct_peak"] = peak_bw and 100 * r["gbps"] * 1e9 / peak_bw
            report["decode"].append(r)
            progress(report)
            torch.cuda.empty_cache()
        for f in tqdm(cached, desc=f"prefill {model} {dtype}"):
            r = meta | bench_prefill(f, dtype, device, heads)
            r["pct_peak"] = peak_flops and 100 * r["tflops"] * 1e12 / peak_flops
            r["pct_sdpa"] = 100 * r["tflops"] / r["sdpa_tflops"]
            fa_tf = r["flash_attn_tflops"]
            r["pct_flash_attn"] = fa_tf and 100 * r["tflops"] / fa_tf
            report["prefill"].append(r)
            progress(report)
            torch.cuda.empty_cache()
    report["targets"] = targets(report)
    return report


DECODE_TARGET_TEXT = (
    f"{TARGET_MODEL} decode {DECODE_TARGET[0]} x {DECODE_TARGET[1]} {TARGET_DTYPE}: "
    f">= {DECODE_TARGET[2]:g}% of the measured copy bandwidth"
)
PREFILL_TARGET_TEXT = (
    f"{TARGET_MODEL} prefix prefill {PREFILL_TOKENS} tokens {TARGET_DTYPE}, no prefix: "
    f">= {PREFILL_TARGET:g}% of SDPA's TFLOP/s"
)


def targets(report: dict) -> list[dict]:
    """The README's kernel targets, each with its measured value and whether it was met
    (``None`` where this run did not measure it)."""
    batch, ctx, want = DECODE_TARGET
    want_row = (batch, ctx, TARGET_DTYPE, TARGET_MODEL)
    decode = [
        r["pct_copy"]
        for r in report["decode"]
        if (r["batch"], r["context"], r["dtype"], r["model"]) == want_row
    ]
    want_row = (0.0, TARGET_DTYPE, TARGET_MODEL)
    prefill = [
        r["pct_sdpa"]
        for r in report["prefill"]
        if (r["cached"], r["dtype"], r["model"]) == want_row
    ]
    out = []
    for text, got, need in (
        (DECODE_TARGET_TEXT, decode, want),
        (PREFILL_TARGET_TEXT, prefill, PREFILL_TARGET),
    ):
        value = got[0] if got else None
        met = None if value is None else value >= need
        out.append({"target": text, "value_pct": value, "met": met})
    return out


def print_gpu(report: dict) -> None:
    """Print the decode and prefill tables of a GPU report and the targets' outcome."""
    pct = lambda x: "unknown" if x is None else f"{x:5.1f}%"
    print(
        f"\n{report['device']}: copy {report['copy_gbps']:.0f} GB/s (spec sheet "
        f"{report['peak_gbps']} GB/s), peak {report['peak_tflops']} TFLOP/s; flash-attn "
        f"{report['flash_attn']}"
    )
    print("\ndecode (paged_decode vs pinned SDPA on contiguous K/V)")
    print(
        f"{'model':11}{'dtype':9}{'batch':>6}{'ctx':>7}{'splits':>7}{'ms':>9}{'GB/s':>9}"
        f"{'of copy':>9}{'of spec':>9}{'SDPA ms':>9}{'SDPA GB/s':>11}  SDPA backend"
    )
    for r in report["decode"]:
        print(
            f"{r['model']:11}{r['dtype']:9}{r['batch']:>6}{r['context']:>7}{r['num_splits']:>7}"
            f"{r['ms']:>9.3f}{r['gbps']:>9.0f}{pct(r['pct_copy']):>9}{pct(r['pct_peak']):>9}"
            f"{r['sdpa_ms']:>9.3f}{r['sdpa_gbps']:>11.0f}  {r['sdpa_backend']}"
        )
    print(f"\nprefix prefill ({PREFILL_BATCH} x {PREFILL_TOKENS} tokens)")
    print(
        f"{'model':11}{'dtype':9}{'cached':>7}{'ms':>9}{'TFLOP/s':>9}{'of peak':>9}"
        f"{'SDPA TF/s':>11}{'of SDPA':>9}{'FA TF/s':>9}{'max err':>9}  SDPA backend"
    )
    for r in report["prefill"]:
        fa = "-" if r["flash_attn_tflops"] is None else f"{r['flash_attn_tflops']:.1f}"
        print(
            f"{r['model']:11}{r['dtype']:9}{r['cached']:>7.1f}{r['ms']:>9.3f}"
            f"{r['tflops']:>9.1f}{pct(r['pct_peak']):>9}{r['sdpa_tflops']:>11.1f}"
            f"{pct(r['pct_sdpa']):>9}{fa:>9}{r['max_abs_err_vs_sdpa']:>9.4f}"
            f"  {r['sdpa_backend']}"
        )
    print(f"\ndevice-to-device copy: {report['copy_gbps']:.0f} GB/s")
    print("\ntargets:")
    for t in report["targets"]:
        verdict = {True: "met ", False: "MISS", None: "n/a "}[t["met"]]
        print(f"  {verdict}  {t['target']}: {pct(t['value_pct'])}")


def run_cpu() -> dict:
    """One tiny shape of each kernel in the interpreter, checked against SDPA."""
    gen_dtype = torch.float32
    lens, n_kv = [37, 5], 2
    pool, k_cache, v_cache, tables, bt = paged_pool(lens, n_kv, gen_dtype, "cpu")
    q = torch.randn(2, 8, HEAD_DIM)
    out = paged_decode(q, k_cache, v_cache, bt, torch.tensor(lens, dtype=torch.int32), 0.1, 2)
    errs = []
    for b, n in enumerate(lens):
        kc, vc = contiguous(k_cache, [tables[b]], n), contiguous(v_cache, [tables[b]], n)
        ref = F.scaled_dot_product_attention(
            q[b : b + 1, :, None], kc, vc, scale=0.1, enable_gqa=True
        )
        errs.append((out[b] - ref[0, :, 0]).abs().max().item())
    ctx, new = 16, 21
    pool, k_cache, v_cache, tables, bt = paged_pool([ctx + new], n_kv, gen_dtype, "cpu")
    qp, kp, vp = torch.randn(new, 8, HEAD_DIM), *torch.randn(2, new, n_kv, HEAD_DIM)
    outp = prefix_prefill(
        qp, kp, vp, k_cache, v_cache, bt, torch.tensor([0, new]), torch.tensor([ctx]), 0.1
    )
    kc = torch.cat([contiguous(k_cache, tables, ctx), kp.transpose(0, 1)[None]], 2)
    vc = torch.cat([contiguous(v_cache, tables, ctx), vp.transpose(0, 1)[None]], 2)
    mask = torch.arange(ctx + new)[None, :] <= torch.arange(ctx, ctx + new)[:, None]
    ref = F.scaled_dot_product_attention(
        qp.transpose(0, 1)[None], kc, vc, attn_mask=mask, scale=0.1, enable_gqa=True
    )
    errs.append((outp - ref[0].transpose(0, 1)).abs().max().item())
    ok = max(errs) < 1e-4
    print(
        f"CPU (Triton interpreter): decode and prefix prefill match SDPA: {ok} "
        f"(max abs error {max(errs):.2e})"
    )
    print("GPU numbers (GB/s, TFLOP/s against the device peak) need a CUDA device; targets:")
    for text in (DECODE_TARGET_TEXT, PREFILL_TARGET_TEXT):
        print(f"  {text}")
    if not ok:
        raise SystemExit("kernel output differs from SDPA")
    report = {
        "device": "cpu",
        "interpreter_check_ok": ok,
        "max_abs_err": max(errs),
        "decode": [],
        "prefill": [],
    }
    report["targets"] = targets(report)  # not measurable here: value and verdict None
    return report


def main() -> None:
    """Run the GPU sweep (the interpreter check without CUDA), print it, write the JSON."""
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default=str(RESULTS), help="folder for kernels.json")
    ap.add_argument("--quick", action="store_true", help="bf16 only, fewer points")
    args = ap.parse_args()
    out = Path(args.out) / "kernels.json"
    out.parent.mkdir(parents=True, exist_ok=True)

    def write(report: dict) -> None:  # after every point: a run cut short keeps what it had
        tmp = out.with_name(f".{out.name}.tmp")
        tmp.write_text(json.dumps(report, indent=2))
        tmp.replace(out)

    report = run_gpu(args.quick, progress=write) if torch.cuda.is_available() else run_cpu()
    if torch.cuda.is_available():
        print_gpu(report)
    write(report)
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
