"""Every family the registry loads, against transformers: tiny random Llama-3 (llama3 RoPE
scaling, GQA), Qwen2 (nonzero q/k/v biases) and Qwen3 (q/k norm, GQA, head_dim unlike hidden /
heads) checkpoints give HF's logits over the paged pool and HF's greedy tokens under PD, PD-CC,
1P1D-CC and at TP 2; ``bench`` and ``serve`` run on each with an HF ``tokenizer.json`` and its
chat template; a family registered from this file (one class, one call) runs too."""

from __future__ import annotations

import contextlib
import json
import math
import socket
import subprocess
import sys
import time
import urllib.request

import pytest
import torch
from helpers import hf_greedy, our_model

from minimemserve import LLM, SamplingParams
from minimemserve.attention.base import SeqSlice
from minimemserve.attention.torch_backend import TorchAttention
from minimemserve.blocks.layout import KVLayout
from minimemserve.errors import CheckpointError, ConfigError
from minimemserve.model import Family, ModelConfig, load_weights, registry
from minimemserve.model.layers import CausalLM
from minimemserve.model.tokenizer import Tokenizer
from minimemserve_lab.harness.driver import run_bench

ATOL = 1e-4  # fp32, max abs difference of logits
LLAMA3_ROPE = {
    "rope_type": "llama3",
    "factor": 8.0,
    "low_freq_factor": 1.0,
    "high_freq_factor": 4.0,
    "original_max_position_embeddings": 64,  # short, so the tiny context spans every band
}
FAMILIES = {
    "llama3": dict(family="llama", num_key_value_heads=1, rope_scaling=LLAMA3_ROPE),
    "qwen2": dict(family="qwen2", num_key_value_heads=2, tie_word_embeddings=True),
    "qwen3": dict(family="qwen3", num_key_value_heads=2, head_dim=32),
}
GREEDY = SamplingParams(temperature=0.0, ignore_eos=True, max_tokens=8)
ENGINE = dict(num_blocks=96, block_size=4, max_num_batched_tokens=24)
SERVE_START_S = 180.0


def _prompts(n: int = 3, seed: int = 0) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(3, 512, (9 + 11 * i,), generator=g).tolist() for i in range(n)]


@pytest.mark.parametrize("name", FAMILIES)
def test_logits_over_the_paged_pool_match_hf(tiny_llama_factory, hf_model_from_dir, name):
    model_dir = tiny_llama_factory(**FAMILIES[name])
    hf = hf_model_from_dir(model_dir)
    cfg, model = our_model(model_dir)
    assert type(model).__name__ == {"llama3": "LlamaModel"}.get(name, name.title() + "Model")
    tokens = torch.tensor(_prompts(1, seed=3)[0] + _prompts(1, seed=4)[0] * 3)  # 36 tokens
    with torch.no_grad():
        ref = hf(tokens[None]).logits[0]  # [S, V]
    layout = KVLayout(cfg.num_hidden_layers, 4, cfg.num_key_value_heads, cfg.head_dim)
    pool = torch.zeros(layout.pool_shape(layout.num_blocks_for(len(tokens)) + 5))
    table = torch.randperm(pool.shape[0])[: layout.num_blocks_for(len(tokens))].tolist()
    backend = TorchAttention(pool, layout, cfg.num_attention_heads, cfg.head_dim**-0.5)
    half = len(tokens) // 2
    with torch.no_grad():  # a prefill, then a chunk over the cached prefix
        got = [
            model.compute_logits(
                model(tokens[a:b], backend, backend.prepare([SeqSlice(table, a, b - a)]))
            )
            for a, b in ((0, half), (half, len(tokens)))
        ]
    err = (torch.cat(got) - ref).abs().max().item()
    assert err < ATOL, f"max abs logit error {err:.2e}"


def test_the_biases_and_norms_are_real(tiny_llama_factory):
    """The Qwen2 checkpoint's biases are nonzero and the Qwen3 one holds q/k norms."""
    qwen2 = load_weights(
        tiny_llama_factory(**FAMILIES["qwen2"]),
        ModelConfig.from_hf(tiny_llama_factory(**FAMILIES["qwen2"])),
    )
    bias = qwen2["model.layers.0.self_attn.k_proj.bias"]
    assert bias.shape == (2 * 16,) and bias.abs().min() > 0
    qwen3_dir = tiny_llama_factory(**FAMILIES["qwen3"])
    qwen3 = load_weights(qwen3_dir, ModelConfig.from_hf(qwen3_dir))
    assert qwen3["model.layers.1.self_attn.q_norm.weight"].shape == (32,)
    assert qwen3["model.layers.0.self_attn.q_proj.weight"].shape == (4 * 32, 64)


@pytest.mark.parametrize("config", ["PD", "PD-CC", "1P1D-CC"])
@pytest.mark.parametrize("name", FAMILIES)
def test_greedy_tokens_equal_hf_generate(tiny_llama_factory, hf_model_from_dir, name, config):
    model_dir = tiny_llama_factory(**FAMILIES[name])
    prompts = _prompts()
    expected = hf_greedy(hf_model_from_dir(model_dir), prompts, GREEDY.max_tokens)
    with LLM(model_dir, config=config, **ENGINE) as llm:
        assert [r.token_ids for r in llm.generate(prompts, GREEDY)] == expected
        again = llm.generate(prompts, GREEDY)  # PD-CC and 1P1D-CC: served from the cache
        assert [r.token_ids for r in again] == expected
        llm.engine.check_pools()


@pytest.mark.parametrize("name", FAMILIES)
def test_tensor_parallel_2_equals_hf_generate(tiny_llama_factory, hf_model_from_dir, name):
    model_dir = tiny_llama_factory(**FAMILIES[name])
    prompts = _prompts()
    expected = hf_greedy(hf_model_from_dir(model_dir), prompts, GREEDY.max_tokens)
    with LLM(model_dir, config="PD-CC", tensor_parallel_size=2, **ENGINE) as llm:
        assert [r.token_ids for r in llm.generate(prompts, GREEDY)] == expected
        llm.engine.check_pools()


def test_a_family_from_outside_the_package_registers_and_runs(
    tiny_llama_factory, hf_model_from_dir, tmp_path, monkeypatch
):
    """One class and one registration: a checkpoint naming the new architecture loads with it
    (here: Llama's math under another name, whose forward passes are counted)."""

    class CountingLlama(CausalLM):
        forwards = 0

        def forward(self, input_ids, backend, md):
            type(self).forwards += 1
            return super().forward(input_ids, backend, md)

    source = tiny_llama_factory()
    for file in source.iterdir():
        (tmp_path / file.name).write_bytes(file.read_bytes())
    raw = json.loads((tmp_path / "config.json").read_text())
    raw["architectures"] = ["CountingLlamaForCausalLM"]
    raw["model_type"] = "counting-llama"
    (tmp_path / "config.json").write_text(json.dumps(raw))
    with pytest.raises(CheckpointError, match="CountingLlamaForCausalLM.*LlamaForCausalLM"):
        LLM(tmp_path, num_blocks=32)

    monkeypatch.setattr(registry, "_FAMILIES", dict(registry._FAMILIES))  # undone after
    registry.register(Family("counting", ("CountingLlamaForCausalLM",), CountingLlama))
    prompts = _prompts(2)
    expected = hf_greedy(hf_model_from_dir(source), prompts, GREEDY.max_tokens)
    with LLM(tmp_path, config="PD-CC", num_blocks=64) as llm:
        assert [r.token_ids for r in llm.generate(prompts, GREEDY)] == expected
    assert CountingLlama.forwards > 0
    with pytest.raises(ConfigError, match="already"):
        registry.register(Family("other", ("CountingLlamaForCausalLM",), CountingLlama))


def _with_fast_tokenizer(model_dir, hf_tokenizer_files, out):
    """A copy of ``model_dir`` with the HF ``tokenizer.json`` and its chat template in place of
    the sentencepiece model, as Qwen and Llama-3 checkpoints ship."""
    for src in (*model_dir.iterdir(), *hf_tokenizer_files.iterdir()):
        if src.name != "tokenizer.model":
            (out / src.name).write_bytes(src.read_bytes())
    return out


@pytest.mark.parametrize("name", FAMILIES)
def test_bench_runs_on_each_family(tiny_llama_factory, hf_tokenizer_files, tmp_path, name):
    model_dir = _with_fast_tokenizer(
        tiny_llama_factory(**FAMILIES[name]), hf_tokenizer_files, tmp_path
    )
    result = run_bench(
        configs=("PD-CC", "1P1D-CC"),
        workload="sharegpt",
        num_sessions=1,
        rate=math.inf,
        max_turns=2,
        max_output_tokens=4,
        model_dir=model_dir,
        out_dir=tmp_path / "out",
        progress=False,
    )
    for config in ("PD-CC", "1P1D-CC"):
        records = result["records"][config]
        assert len(records) == 2 and all(r["error"] is None for r in records)
        assert records[1]["cached_tokens"] > 0  # the second turn reuses the first's KV


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _post(url: str, body: dict) -> dict:
    req = urllib.request.Request(
        url, json.dumps(body).encode(), {"content-type": "application/json"}
    )
    with urllib.request.urlopen(req, timeout=60) as r:
        return json.loads(r.read())


@pytest.mark.parametrize("name", FAMILIES)
def test_serve_answers_a_chat_on_each_family(
    tiny_llama_factory, hf_tokenizer_files, tmp_path, name
):
    pytest.importorskip("fastapi")
    model_dir = _with_fast_tokenizer(
        tiny_llama_factory(**FAMILIES[name]), hf_tokenizer_files, tmp_path
    )
    port = _free_port()
    flags = f"--port {port} --num-blocks 64 --config PD-CC --served-model-name m".split()
    cmd = [sys.executable, "-m", "minimemserve.cli", "serve", "--model", str(model_dir), *flags]
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + SERVE_START_S
        while True:
            assert proc.poll() is None, proc.stdout.read().decode()[-3000:]
            with contextlib.suppress(OSError):
                urllib.request.urlopen(url + "/health", timeout=5).close()
                break
            assert time.monotonic() < deadline, "the server did not start"
            time.sleep(0.3)
        messages = [{"role": "user", "content": "Pack for a hike?"}]
        body = {"model": "m", "messages": messages, "max_tokens": 4, "temperature": 0}
        answer = _post(url + "/v1/chat/completions", body)
        tok = Tokenizer.from_dir(model_dir)
        chatml = "<|im_start|>user\nPack for a hike?<|im_end|>\n<|im_start|>assistant\n"
        assert answer["usage"]["prompt_tokens"] == len(tok.encode(chatml))  # the template's
        assert answer["usage"]["completion_tokens"] >= 1
        assert isinstance(answer["choices"][0]["message"]["content"], str)
    finally:
        proc.terminate()
        proc.wait(30)
