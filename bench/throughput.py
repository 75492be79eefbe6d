"""Offline generation throughput: minimemserve vs HF transformers ``generate``, side by side.

Same tiny preset model, the same ShareGPT prompts (first human message of each
conversation, at its real length, cut only where prompt + output would pass the context),
a fixed number of output tokens per prompt (EOS ignored), greedy decoding, fp32 on the
CPU with the same number of torch threads for both. HF runs batched
``generate`` with left padding at a few batch sizes and keeps its best; minimemserve runs
``LLM(config="PD").generate`` on all prompts at once. Each side is warmed up, then the
sides are timed in turn, ``--repeats`` rounds; the median is reported.

    python bench/throughput.py                     # 64 prompts x 128 tokens
    python bench/throughput.py --prompt-tokens 256 # prompts cut to 256 tokens
    python bench/throughput.py --quick             # 8 prompts x 32 tokens
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time
from pathlib import Path

import torch
from tqdm.auto import tqdm

from minimemserve import LLM, SamplingParams
from minimemserve.bench.data import iter_sharegpt
from minimemserve.bench.presets import preset_dir
from minimemserve.model.config import ModelConfig
from minimemserve.model.tokenizer import Tokenizer

# HF pads on the left with this id; the attention mask hides it, so any valid id works.
HF_PAD_ID = 0
RESULTS = Path(__file__).resolve().parent / "results" / "throughput.json"


def sharegpt_prompts(tokenizer: Tokenizer, n: int, max_prompt_tokens: int) -> list[list[int]]:
    """Token ids of the first human message of the first ``n`` ShareGPT conversations."""
    prompts = []
    for conv in iter_sharegpt():
        msgs = conv["conversations"]
        if msgs and msgs[0]["from"] == "human" and msgs[0]["value"].strip():
            prompts.append(tokenizer.encode(msgs[0]["value"], add_bos=True)[:max_prompt_tokens])
            if len(prompts) == n:
                return prompts
    raise ValueError(f"ShareGPT has only {len(prompts)} usable prompts, {n} asked")


def hf_generate(model, prompts: list[list[int]], new_tokens: int, batch_size: int) -> int:
    """Greedy batched ``generate`` with left padding; returns the output tokens produced."""
    produced = 0
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


def ours_generate(llm: LLM, prompts: list[list[int]], new_tokens: int) -> int:
    """``LLM.generate`` on every prompt at once; returns the output tokens produced."""
    params = SamplingParams(max_tokens=new_tokens, temperature=0.0, ignore_eos=True)
    outs = llm.generate(prompts, params)
    bad = [o.error for o in outs if o.finish_reason == "error"]
    if bad:
        raise RuntimeError(f"{len(bad)} requests failed, first: {bad[0]}")
    return sum(len(o.token_ids) for o in outs)


def interleaved(fns: dict[str, object], repeats: int) -> dict[str, tuple[float, int]]:
    """``{name: (median seconds, output tokens)}``; each repeat runs every fn once, in turn.

    Interleaving keeps a drift in machine load from favouring whichever side ran last.
    """
    times: dict[str, list[float]] = {name: [] for name in fns}
    tokens: dict[str, int] = {}
    with tqdm(total=repeats * len(fns), desc="timed runs") as bar:
        for _ in range(repeats):
            for name, fn in fns.items():
                bar.set_postfix_str(name)
                start = time.perf_counter()
                tokens[name] = fn()
                times[name].append(time.perf_counter() - start)
                bar.update(1)
    return {name: (statistics.median(times[name]), tokens[name]) for name in fns}


def main(argv: list[str] | None = None) -> dict:
    """Run the comparison, print the table, write ``bench/results/throughput.json``."""
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--prompts", type=int, default=64)
    p.add_argument(
        "--prompt-tokens",
        type=int,
        default=None,
        help="cut prompts to this many tokens (default: what fits the context with the output)",
    )
    p.add_argument("--output-tokens", type=int, default=128)
    p.add_argument(
        "--hf-batch-sizes",
        default="4,8,16",
        help="HF batch sizes to try; its best is the baseline (%(default)s; 32 is best for "
        "prompts cut to 256 tokens)",
    )
    p.add_argument("--repeats", type=int, default=2, help="timed rounds (median)")
    p.add_argument("--threads", type=int, default=os.cpu_count() or 1)
    p.add_argument("--model", default=None, help="checkpoint dir (default: tiny preset)")
    p.add_argument(
        "--max-num-batched-tokens",
        type=int,
        default=2048,
        help="minimemserve token budget per step",
    )
    p.add_argument("--quick", action="store_true", help="8 prompts x 32 tokens, HF batch 8")
    p.add_argument("--out", default=str(RESULTS))
    args = p.parse_args(argv)
    if args.quick:
        args.prompts, args.output_tokens, args.hf_batch_sizes = 8, 32, "8"
    torch.set_num_threads(args.threads)
    model_dir = Path(args.model) if args.model else preset_dir("tiny")
    tokenizer = Tokenizer.from_dir(model_dir)
    if args.prompt_tokens is None:
        context = ModelConfig.from_hf(model_dir).max_position_embeddings
        args.prompt_tokens = context - args.output_tokens
    prompts = sharegpt_prompts(tokenizer, args.prompts, args.prompt_tokens)

    from transformers import LlamaForCausalLM

    hf = LlamaForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    llm = LLM(
        model_dir,
        config="PD",
        max_num_seqs=max(64, args.prompts),
        max_num_batched_tokens=args.max_num_batched_tokens,
    )
    batch_sizes = [int(b) for b in args.hf_batch_sizes.split(",")]
    fns = {
        f"hf{bs}": (lambda bs=bs: hf_generate(hf, prompts, args.output_tokens, bs))
        for bs in batch_sizes
    }
    fns["ours"] = lambda: ours_generate(llm, prompts, args.output_tokens)
    for bs in batch_sizes:  # warm-up, not timed
        hf_generate(hf, prompts[:2], 4, bs)
    ours_generate(llm, prompts[:2], 4)
    runs = interleaved(fns, args.repeats)
    hf_runs = {bs: runs[f"hf{bs}"] for bs in batch_sizes}
    ours_time, ours_tokens = runs["ours"]
    best_bs = max(hf_runs, key=lambda b: hf_runs[b][1] / hf_runs[b][0])

    rows = [(f"HF generate, batch {bs}", t, n, n / t) for bs, (t, n) in hf_runs.items()]
    rows.append(("minimemserve LLM(PD)", ours_time, ours_tokens, ours_tokens / ours_time))
    hf_best = hf_runs[best_bs][1] / hf_runs[best_bs][0]
    ratio = (ours_tokens / ours_time) / hf_best
    print(
        f"{args.prompts} ShareGPT prompts (<= {args.prompt_tokens} tokens) x "
        f"{args.output_tokens} output tokens, greedy, fp32, {args.threads} threads, "
        f"median of {args.repeats}"
    )
    print(f"{'engine':<26} | {'time s':>8} | {'out tokens':>10} | {'tokens/s':>9}")
    print("-" * 27 + "+" + "-" * 10 + "+" + "-" * 12 + "+" + "-" * 10)
    for name, t, n, tps in rows:
        print(f"{name:<26} | {t:8.2f} | {n:10d} | {tps:9.1f}")
    print(f"minimemserve / HF (best batch {best_bs}): {ratio:.2f}x")
    result = {
        "model_dir": str(model_dir),
        "prompts": args.prompts,
        "prompt_tokens": [len(x) for x in prompts],
        "output_tokens": args.output_tokens,
        "threads": args.threads,
        "repeats": args.repeats,
        "hf": {
            str(bs): {"time_s": t, "tokens": n, "tokens_per_s": n / t}
            for bs, (t, n) in hf_runs.items()
        },
        "hf_best_batch": best_bs,
        "ours": {
            "time_s": ours_time,
            "tokens": ours_tokens,
            "tokens_per_s": ours_tokens / ours_time,
            "max_num_batched_tokens": args.max_num_batched_tokens,
        },
        "ratio": ratio,
    }
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=1))
    from plotting import grouped_bars

    labels = [f"HF batch {b}" for b in result["hf"]] + ["minimemserve"]
    rates = [v["tokens_per_s"] for v in result["hf"].values()] + [ours_tokens / ours_time]
    grouped_bars(
        out.with_suffix(".png"),
        f"offline throughput ({ratio:.2f}x HF's best)",
        labels,
        {"output tokens/s": rates},
        "tokens/s",
    )
    print(f"wrote {out} and {out.with_suffix('.png')}")
    return result


if __name__ == "__main__":
    main()
