"""Offline generation throughput: minimemserve vs HF transformers, side by side, with a roofline.

Same tiny preset model and the same prompts for every engine, two prompt mixes: ``sharegpt``
(the first human message of each ShareGPT conversation at its real length, cut only where
prompt + output would pass the context) and ``short`` (those messages cut to 400 tokens,
keeping those of at least 16). A fixed number of output tokens per prompt (EOS ignored),
greedy decoding, fp32 on the CPU with the same number of torch threads for every engine.

Engines: minimemserve ``LLM(config="PD").generate`` on all prompts at once; HF ``generate``
with left padding on prompts sorted by length (little padding) at a few batch sizes; HF
``generate_batch`` (continuous batching, transformers >= 5) with ``sdpa`` and ``paged|sdpa``
attention. Each engine is warmed up, then every engine runs once per round, ``--repeats``
rounds; the median is reported.

Roofline: the FLOPs the model needs for the mix (the linear layers of every prompt token and
of every fed-back output token, causal attention over the real context, the LM head only
where a token is sampled; padding and recomputation not counted, so the count is the same for
every engine) divided by each engine's time, against the fp32 GEMM rate measured here on the
model's own linear shapes.

    python bench/throughput.py            # 64 prompts x 64 tokens, both mixes
    python bench/throughput.py --quick    # 16 prompts x 16 tokens, one HF batch size
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time
from pathlib import Path

import torch
import torch.nn.functional as F
from tqdm.auto import tqdm

from minimemserve import LLM, SamplingParams
from minimemserve.model.config import ModelConfig
from minimemserve.model.tokenizer import Tokenizer
from minimemserve.presets import preset_dir
from minimemserve.sharegpt import iter_sharegpt

# HF pads on the left with this id; the attention mask hides it, so any valid id works.
HF_PAD_ID = 0
RESULTS = Path(__file__).resolve().parent / "results" / "throughput.json"
SHORT_RANGE = (16, 400)  # prompt tokens of the short mix
# HF generate_batch attention implementations tried; the faster one is kept.
HF_CB_IMPLS = ("sdpa", "paged|sdpa")
GEMM_TOKENS = (64, 512, 2048)  # token counts of the GEMM rate probe; its best is the peak


def sharegpt_prompts(
    tokenizer: Tokenizer, n: int, max_tokens: int, min_tokens: int = 1
) -> list[list[int]]:
    """Token ids of the first human message of ShareGPT conversations, cut to ``max_tokens``,
    the first ``n`` with at least ``min_tokens``."""
    prompts = []
    for conv in iter_sharegpt():
        msgs = conv["conversations"]
        if msgs and msgs[0]["from"] == "human" and msgs[0]["value"].strip():
            ids = tokenizer.encode(msgs[0]["value"], add_bos=True)[:max_tokens]
            if len(ids) >= min_tokens:
                prompts.append(ids)
            if len(prompts) == n:
                return prompts
    raise ValueError(f"ShareGPT has only {len(prompts)} usable prompts, {n} asked")


def model_flops(cfg: ModelConfig, prompts: list[list[int]], new_tokens: int) -> dict[str, float]:
    """FLOPs the mix needs: linear layers, attention (QK and PV) and the sampled LM heads."""
    h, d, layers = cfg.hidden_size, cfg.head_dim, cfg.num_hidden_layers
    q, kv, inter = cfg.num_attention_heads * d, cfg.num_key_value_heads * d, cfg.intermediate_size
    per_token = 2 * layers * (h * (q + 2 * kv) + q * h + h * 2 * inter + inter * h)
    fed = [len(p) + new_tokens - 1 for p in prompts]  # tokens through the layers, per prompt
    return {
        "linear": per_token * sum(fed),
        "attention": 4 * layers * q * sum(n * (n + 1) // 2 for n in fed),  # causal
        "lm_head": 2 * h * cfg.vocab_size * new_tokens * len(prompts),
    }


def gemm_rate(cfg: ModelConfig, repeats: int = 5) -> dict[str, float]:
    """fp32 GFLOP/s of ``F.linear`` over the model's linear shapes, per token count."""
    d = cfg.head_dim
    q, kv = cfg.num_attention_heads * d, cfg.num_key_value_heads * d
    h, inter = cfg.hidden_size, cfg.intermediate_size
    shapes = [(h, q + 2 * kv), (q, h), (h, 2 * inter), (inter, h), (h, cfg.vocab_size)]
    rates = {}
    for m in GEMM_TOKENS:
        flops, secs = 0, 0.0
        for k, n in shapes:
            x, w = torch.randn(m, k), torch.randn(n, k)
            F.linear(x, w)  # warm-up
            times = []
            for _ in range(repeats):
                start = time.perf_counter()
                F.linear(x, w)
                times.append(time.perf_counter() - start)
            flops, secs = flops + 2 * m * k * n, secs + statistics.median(times)
        rates[str(m)] = flops / secs / 1e9
    return rates


def hf_generate(model, prompts: list[list[int]], new_tokens: int, batch_size: int) -> int:
    """Greedy batched ``generate`` with left padding, prompts sorted by length; returns the
    output tokens produced."""
    produced = 0
    prompts = sorted(prompts, key=len)
    for start in range(0, len(prompts), batch_size):
        batch = prompts[start : start + batch_size]
        width = max(len(p) for p in batch)
        ids = torch.full((len(batch), width), HF_PAD_ID, dtype=torch.long)  # [B, width]
        mask = torch.zeros((len(batch), width), dtype=torch.long)  # [B, width]
        for i, p in enumerate(batch):
            ids[i, width - len(p) :] = torch.tensor(p)
            mask[i, width - len(p) :] = 1
        with torch.inference_mode():
            out = model.generate(
                input_ids=ids,
                attention_mask=mask,
                do_sample=False,
                max_new_tokens=new_tokens,
                min_new_tokens=new_tokens,
                pad_token_id=HF_PAD_ID,
            )  # [B, width + new_tokens]
        produced += (out.shape[1] - width) * len(batch)
    return produced


def hf_generate_batch(model, prompts, new_tokens: int, budget: int, warmup: bool = False) -> int:
    """Greedy continuous batching (``generate_batch``); returns the output tokens produced."""
    from transformers import GenerationConfig
    from transformers.generation.configuration_utils import ContinuousBatchingConfig

    gen = GenerationConfig(
        max_new_tokens=new_tokens,
        min_new_tokens=new_tokens,
        do_sample=False,
        eos_token_id=-1,  # EOS ignored
        pad_token_id=HF_PAD_ID,
    )
    cb = ContinuousBatchingConfig(max_batch_tokens=budget, auto_switch_to_flash=False)
    with torch.inference_mode():
        outs = model.generate_batch(
            prompts, generation_config=gen, continuous_batching_config=cb, warmup=warmup
        )
    produced = [len(o.generated_tokens) for o in outs.values()]
    if len(produced) != len(prompts) or min(produced) != new_tokens:
        raise RuntimeError(f"generate_batch returned {len(produced)} outputs, {produced[:4]}...")
    return sum(produced)


def ours_generate(llm: LLM, prompts: list[list[int]], new_tokens: int) -> int:
    """``LLM.generate`` on every prompt at once; returns the output tokens produced."""
    params = SamplingParams(max_tokens=new_tokens, temperature=0.0, ignore_eos=True)
    outs = llm.generate(prompts, params)
    bad = [o.error for o in outs if o.finish_reason == "error"]
    if bad:
        raise RuntimeError(f"{len(bad)} requests failed, first: {bad[0]}")
    return sum(len(o.token_ids) for o in outs)


def interleaved(fns: dict[str, object], repeats: int, desc: str) -> dict[str, tuple[float, int]]:
    """``{name: (median seconds, output tokens)}``; each repeat runs every fn once, in turn.

    Interleaving keeps a drift in machine load from favouring whichever side ran last.
    """
    times: dict[str, list[float]] = {name: [] for name in fns}
    tokens: dict[str, int] = {}
    with tqdm(total=repeats * len(fns), desc=desc) as bar:
        for _ in range(repeats):
            for name, fn in fns.items():
                bar.set_postfix_str(name)
                start = time.perf_counter()
                tokens[name] = fn()
                times[name].append(time.perf_counter() - start)
                bar.update(1)
    return {name: (statistics.median(times[name]), tokens[name]) for name in fns}


def load_cb_models(model_dir: Path, prompts, new_tokens: int, budget: int) -> tuple[dict, dict]:
    """HF models for ``generate_batch`` that ran a warm-up, by implementation, and why the
    others cannot run here."""
    from transformers import LlamaForCausalLM

    models, failed = {}, {}
    for impl in HF_CB_IMPLS:
        try:
            m = LlamaForCausalLM.from_pretrained(
                model_dir, dtype=torch.float32, attn_implementation=impl
            ).eval()
            hf_generate_batch(m, prompts[:2], 4, budget, warmup=True)
            models[impl] = m
        except Exception as e:  # reported in the table and the JSON, not fatal
            failed[impl] = f"{type(e).__name__}: {e}"[:300]
    return models, failed


def run_mix(name: str, prompts, args, hf, llm, cb_models) -> dict:
    """Time every engine on one prompt mix; returns its rows (``{engine: result}``)."""
    n_new, budget = args.output_tokens, args.max_num_batched_tokens
    fns = {
        f"HF generate, batch {bs}": (lambda bs=bs: hf_generate(hf, prompts, n_new, bs))
        for bs in args.batch_sizes
    }
    for impl, m in cb_models.items():
        fns[f"HF generate_batch, {impl}"] = lambda m=m: hf_generate_batch(m, prompts, n_new, budget)
    fns["minimemserve LLM(PD)"] = lambda: ours_generate(llm, prompts, n_new)
    for bs in args.batch_sizes:  # warm-up, not timed
        hf_generate(hf, prompts[:2], 4, bs)
    ours_generate(llm, prompts[:2], 4)
    runs = interleaved(fns, args.repeats, f"{name} mix")
    flops = model_flops(args.model_config, prompts, n_new)
    total = sum(flops.values())
    rows = {}
    for engine, (secs, tokens) in runs.items():
        rate = total / secs / 1e9
        rows[engine] = {
            "time_s": secs,
            "tokens": tokens,
            "tokens_per_s": tokens / secs,
            "gflop_per_s": rate,
            "gemm_fraction": rate / args.gemm_peak,
        }
    return {"prompt_tokens": [len(p) for p in prompts], "flops": flops, "engines": rows}


def best(rows: dict, prefix: str) -> tuple[str, float] | None:
    """The fastest engine whose name starts with ``prefix`` and its tokens/s."""
    found = [(e, r["tokens_per_s"]) for e, r in rows.items() if e.startswith(prefix)]
    return max(found, key=lambda x: x[1]) if found else None


def print_mix(name: str, mix: dict, args) -> dict:
    """Print one mix's table and its ratios; returns the ratios."""
    lens = mix["prompt_tokens"]
    gflop = sum(mix["flops"].values()) / 1e9
    print(
        f"\n{name}: {len(lens)} prompts ({min(lens)}-{max(lens)} tokens, {sum(lens)} in all) x "
        f"{args.output_tokens} output tokens; model needs {gflop:.1f} GFLOP (attention "
        f"{mix['flops']['attention'] / 1e9:.1f}); median of {args.repeats}"
    )
    print(f"{'engine':<30} | {'time s':>7} | {'tokens/s':>8} | {'GFLOP/s':>7} | {'% GEMM':>6}")
    print("-" * 31 + "+" + "-" * 9 + "+" + "-" * 10 + "+" + "-" * 9 + "+" + "-" * 7)
    for engine, r in mix["engines"].items():
        print(
            f"{engine:<30} | {r['time_s']:7.2f} | {r['tokens_per_s']:8.1f} | "
            f"{r['gflop_per_s']:7.1f} | {100 * r['gemm_fraction']:5.1f}%"
        )
    ours = mix["engines"]["minimemserve LLM(PD)"]["tokens_per_s"]
    ratios = {}
    for label, prefix in (("generate", "HF generate,"), ("generate_batch", "HF generate_batch")):
        if (b := best(mix["engines"], prefix)) is not None:
            ratios[label] = ours / b[1]
            print(f"minimemserve / {b[0]}: {ratios[label]:.2f}x")
    return ratios


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    """The command's options (``--quick`` shrinks the run)."""
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--prompts", type=int, default=64)
    p.add_argument("--output-tokens", type=int, default=64)
    p.add_argument("--mixes", default="sharegpt,short", help="%(default)s")
    p.add_argument("--hf-batch-sizes", default="8,16,32", help="HF generate batch sizes tried")
    p.add_argument("--repeats", type=int, default=1, help="timed rounds (median)")
    p.add_argument("--threads", type=int, default=os.cpu_count() or 1)
    p.add_argument("--model", default=None, help="checkpoint dir (default: tiny preset)")
    p.add_argument("--max-num-seqs", type=int, default=64, help="minimemserve batch size")
    p.add_argument(
        "--max-num-batched-tokens",
        type=int,
        default=2048,
        help="token budget per step, minimemserve and generate_batch (%(default)s)",
    )
    p.add_argument("--quick", action="store_true", help="16 prompts x 16 tokens, HF batch 16")
    p.add_argument("--out", default=str(RESULTS))
    args = p.parse_args(argv)
    if args.quick:
        args.prompts, args.output_tokens, args.hf_batch_sizes = 16, 16, "16"
    args.batch_sizes = [int(b) for b in args.hf_batch_sizes.split(",")]
    return args


def main(argv: list[str] | None = None) -> dict:
    """Run both mixes, print the tables, write ``bench/results/throughput.json`` and a plot."""
    args = parse_args(argv)
    torch.set_num_threads(args.threads)
    model_dir = Path(args.model) if args.model else preset_dir("tiny")
    tokenizer = Tokenizer.from_dir(model_dir)
    args.model_config = cfg = ModelConfig.from_hf(model_dir)
    context = cfg.max_position_embeddings - args.output_tokens
    limits = {"sharegpt": (context, 1), "short": (min(context, SHORT_RANGE[1]), SHORT_RANGE[0])}
    mixes = {
        m: sharegpt_prompts(tokenizer, args.prompts, *limits[m]) for m in args.mixes.split(",")
    }

    gemm = gemm_rate(cfg)
    args.gemm_peak = max(gemm.values())
    print("fp32 GEMM on the model's linear shapes, GFLOP/s by tokens:", gemm)
    from transformers import LlamaForCausalLM

    hf = LlamaForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    first = next(iter(mixes.values()))
    cb_models, cb_failed = load_cb_models(model_dir, first, 4, args.max_num_batched_tokens)
    for impl, why in cb_failed.items():
        print(f"HF generate_batch with {impl} cannot run here: {why}")
    llm = LLM(
        model_dir,
        config="PD",
        max_num_seqs=args.max_num_seqs,
        max_num_batched_tokens=args.max_num_batched_tokens,
    )
    result = {
        "model_dir": str(model_dir),
        "output_tokens": args.output_tokens,
        "threads": args.threads,
        "repeats": args.repeats,
        "max_num_seqs": args.max_num_seqs,
        "max_num_batched_tokens": args.max_num_batched_tokens,
        "gemm_gflop_per_s": gemm,
        "gemm_peak_gflop_per_s": args.gemm_peak,
        "generate_batch_failed": cb_failed,
        "mixes": {},
    }
    for name, prompts in mixes.items():
        result["mixes"][name] = run_mix(name, prompts, args, hf, llm, cb_models)
    print(
        f"\n{args.threads} threads, fp32, greedy, EOS ignored; % GEMM = needed GFLOP/s over the "
        f"best measured fp32 GEMM rate ({args.gemm_peak:.0f} GFLOP/s)"
    )
    for name, mix in result["mixes"].items():
        mix["ratios"] = print_mix(name, mix, args)
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=1))
    plot(out.with_suffix(".png"), result)
    print(f"wrote {out} and {out.with_suffix('.png')}")
    return result


def plot(path: Path, result: dict) -> None:
    """Output tokens/s of the best of each engine family, one group per mix."""
    from plotting import grouped_bars

    families = {
        "HF generate (best batch)": "HF generate,",
        "HF generate_batch (best)": "HF generate_batch",
        "minimemserve": "minimemserve",
    }
    mixes = result["mixes"]
    series = {
        label: [(b[1] if (b := best(m["engines"], prefix)) else None) for m in mixes.values()]
        for label, prefix in families.items()
    }
    grouped_bars(path, "offline throughput, fp32 CPU", list(mixes), series, "output tokens/s")


if __name__ == "__main__":
    main()
