"""``LLM.generate`` end to end on Llama-2-7B's shape with random weights: output tokens/s at
batch 1 and 64, eager (``enforce_eager=True``) against the decode CUDA graphs.

    python bench/gpu_generate.py --out DIR            # CUDA, bf16 (about a minute on an H200)
    python bench/gpu_generate.py --dry-run --out DIR  # CPU: a tiny model, the plumbing only

No checkpoint is read: a directory holds Llama-2-7B's ``config.json`` and the package's
8000-piece tokenizer, and ``random_model`` builds the weights on the device (it stands in
for the engine's checkpoint loader). The LM
head's rows past the tokenizer's pieces are zero, so greedy decoding (a random model's
logits have a positive maximum) only emits tokens the tokenizer can decode; the whole
32000-row product still runs. Each run: prompts of ``PROMPT_TOKENS`` random ids, greedy,
``OUTPUT_TOKENS`` new tokens each (EOS ignored), timed around one ``generate`` call after a
warm-up call; output tokens/s counts the new tokens over that time (prefill included).
Output: ``gpu_generate.json``.
"""

from __future__ import annotations

import argparse
import gc
import json
import shutil
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import minimemserve.engine as engine_module
from minimemserve import LLM, SamplingParams
from minimemserve.model.llama import LlamaModel
from minimemserve.model.tokenizer import Tokenizer

DATA = Path(__file__).resolve().parents[1] / "minimemserve" / "data"
TOKENIZER = DATA / "sharegpt-8000.model"
SIZES_7B = dict(
    vocab_size=32000,
    hidden_size=4096,
    intermediate_size=11008,
    num_hidden_layers=32,
    num_attention_heads=32,
    num_key_value_heads=32,
    max_position_embeddings=4096,
)
DRY_SIZES = dict(SIZES_7B, hidden_size=64, intermediate_size=128, num_hidden_layers=2)
DRY_SIZES |= dict(num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512)
INIT_STD = 0.02  # Llama's initialiser range: keeps random activations finite in bf16
BATCHES = (1, 64)
PROMPT_TOKENS = 128
OUTPUT_TOKENS = 128
KV_BYTES = 16 << 30  # 64 x 256 tokens need 8 GiB of 7B bf16 KV; room for the warm-up too


def write_config_dir(sizes: dict, path: Path) -> Path:
    """A checkpoint directory without weights: ``config.json`` and ``tokenizer.model``."""
    config = dict(sizes, architectures=["LlamaForCausalLM"], model_type="llama")
    config |= dict(rms_norm_eps=1e-5, bos_token_id=1, eos_token_id=2, torch_dtype="bfloat16")
    (path / "config.json").write_text(json.dumps(config))
    shutil.copy(TOKENIZER, path / "tokenizer.model")
    return path


def random_model(model_dir, model_config, device, dtype, load_format=None) -> LlamaModel:
    """The engine's model with random weights built on ``device`` (no checkpoint), whatever
    ``load_format`` says; unlike ``load_format="dummy"``, LM-head rows past the tokenizer's
    pieces are zero (see the module's docstring)."""
    with torch.device(device):
        model = LlamaModel(model_config)
    pieces = Tokenizer.from_dir(model_dir).vocab_size
    gen = torch.Generator(device).manual_seed(0)  # the same weights for every engine
    with torch.no_grad():
        for name, p in model.named_parameters():
            if not name.endswith("norm.weight"):
                p.normal_(0.0, INIT_STD, generator=gen)
        model.lm_head.weight[pieces:] = 0.0  # tokens the tokenizer cannot decode never win
    return model.to(dtype=dtype).eval()


def run_mode(model_dir: Path, eager: bool, device: str, dtype: str, dry: bool) -> dict:
    """Output tokens/s of one engine (eager or with graphs) at every batch of ``BATCHES``."""
    kv = dict(num_blocks=512) if dry else dict(kv_memory_bytes=KV_BYTES)
    config = dict(max_num_seqs=max(BATCHES), enforce_eager=eager, **kv)
    llm = LLM(model_dir, device=device, dtype=dtype, **config)
    runner = llm.engine.instances[0].engine.runner  # the one colocated instance of PD
    out_tokens = 4 if dry else OUTPUT_TOKENS
    prompt_tokens = 16 if dry else PROMPT_TOKENS
    params = SamplingParams(max_tokens=out_tokens, temperature=0.0, ignore_eos=True)
    gen = torch.Generator().manual_seed(0)
    rows = []
    for batch in BATCHES:
        prompts = torch.randint(3, 8000, (batch, prompt_tokens), generator=gen).tolist()
        llm.generate(prompts[:1], SamplingParams(max_tokens=2, temperature=0.0))  # warm-up
        if device == "cuda":
            torch.cuda.synchronize()
        t0 = time.perf_counter()
        outs = llm.generate(prompts, params)
        seconds = time.perf_counter() - t0
        new = sum(len(o.token_ids) for o in outs)
        rows.append(
            {
                "batch": batch,
                "output_tokens": new,
                "seconds": seconds,
                "output_tokens_per_s": new / seconds,
                "tokens": [o.token_ids for o in outs],
            }
        )
    graphs = getattr(runner, "graphs", None)
    llm.close()
    return {
        "mode": "eager" if eager else "graphs",
        "graphs_captured": None if graphs is None else sorted(graphs.graphs),
        "runs": rows,
    }


def run(dry: bool) -> dict:
    """Both modes at every batch; the report dict."""
    device, dtype = ("cpu", "float32") if dry else ("cuda", "bfloat16")
    engine_module._load_model = random_model  # the stand-in loader (see the docstring)
    with tempfile.TemporaryDirectory() as tmp:
        model_dir = write_config_dir(DRY_SIZES if dry else SIZES_7B, Path(tmp))
        modes = []
        for eager in (True, False):
            modes.append(run_mode(model_dir, eager, device, dtype, dry))
            gc.collect()  # the engine's reference cycles hold its weights, pool and graphs
            if device == "cuda":
                torch.cuda.empty_cache()
    eager_runs, graph_runs = (m["runs"] for m in modes)
    for e, g in zip(eager_runs, graph_runs):  # same prompts, same greedy decoding
        same = sum(a == b for a, b in zip(e.pop("tokens"), g.pop("tokens")))
        g["same_tokens_as_eager"] = f"{same} of {e['batch']}"
        g["speedup"] = g["output_tokens_per_s"] / e["output_tokens_per_s"]
    return {
        "device": torch.cuda.get_device_name() if device == "cuda" else "cpu",
        "dry_run": dry,
        "model": "dry-run tiny" if dry else "llama2-7b shape, random weights",
        "dtype": dtype,
        "prompt_tokens": PROMPT_TOKENS,
        "modes": modes,
    }


def main() -> None:
    """Parse options, run, print and write ``gpu_generate.json`` under ``--out``."""
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default=str(Path(__file__).resolve().parent / "results"))
    ap.add_argument("--dry-run", action="store_true", help="tiny model on the CPU")
    args = ap.parse_args()
    if not args.dry_run and not torch.cuda.is_available():
        raise SystemExit("gpu_generate needs a CUDA device (use --dry-run on the CPU)")
    report = run(args.dry_run)
    for m in report["modes"]:
        for r in m["runs"]:
            extra = f", {r['same_tokens_as_eager']} same as eager" if "speedup" in r else ""
            print(
                f"{m['mode']:7} batch {r['batch']:3}: {r['output_tokens_per_s']:9.1f} output "
                f"tok/s ({r['output_tokens']} tokens in {r['seconds']:.2f} s{extra})"
            )
    out = Path(args.out) / "gpu_generate.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(report, indent=2))
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
