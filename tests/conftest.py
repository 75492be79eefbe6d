"""Shared fixtures: a small ShareGPT-trained tokenizer and tiny random Llama checkpoints.

Checkpoints are real HF directories written by ``transformers`` (config.json,
model.safetensors, tokenizer.model), built once per test session and shared.

- ``sp_tokenizer_path``: a 512-piece sentencepiece model trained on ~300 KB of ShareGPT.
- ``tiny_llama_factory(**overrides)``: path of a tiny checkpoint; the keyword arguments of
  ``write_random_llama`` override the defaults (vocab 512, hidden 64, intermediate 128,
  2 layers, 4 heads, 2 KV heads, 512 positions). Same overrides, same directory.
- ``tiny_llama_dir``: the default tiny checkpoint.
- ``hf_model_from_dir(path)``: transformers' model of the checkpoint's family, fp32,
  eval mode, ``attn_implementation="eager"`` (plain matmul + softmax, the clearest reference).

A test that leaves SIGINT otherwise than the run found it (its handler, ignored by the
kernel, or blocked) fails at teardown, and SIGINT is put back for the tests after it. A run
may find it ignored: a non-interactive shell starts a background job (``pytest &``) so.
"""

from __future__ import annotations

import json
import os
import signal
from collections.abc import Callable
from pathlib import Path

import pytest
import torch

if not torch.cuda.is_available():
    # Triton picks interpreter or compiler when `import triton` runs: set it before any test
    # module imports triton, so the kernels run on the CPU.
    os.environ.setdefault("TRITON_INTERPRET", "1")

torch.set_num_threads(2)  # the test machine has 2 cores

SP_VOCAB = 512
SP_TRAINING_CHARS = 300_000
TINY_LLAMA_DEFAULTS = dict(
    vocab_size=SP_VOCAB,
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=512,
)


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    if "docs_full" not in (config.getoption("markexpr") or ""):
        whole = pytest.mark.skip(reason="the docs' whole set: pytest -m docs_full")
        for item in items:
            if "docs_full" in item.keywords:
                item.add_marker(whole)
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA device")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


def _sigint_state() -> tuple[object, bool, bool]:
    """SIGINT as this process has it: the Python handler, whether the kernel ignores it (an
    ignored signal stays ignored in every child, across exec) and whether this thread blocks
    it."""
    ignored = False
    try:
        with open("/proc/self/status") as f:
            line = next(ln for ln in f if ln.startswith("SigIgn:"))
        ignored = bool(int(line.split()[1], 16) >> (signal.SIGINT - 1) & 1)
    except (OSError, StopIteration):  # not Linux: the Python handler and the mask only
        pass
    blocked = signal.SIGINT in signal.pthread_sigmask(signal.SIG_BLOCK, [])
    return signal.getsignal(signal.SIGINT), ignored, blocked


SIGINT_AT_START = _sigint_state()


@pytest.hookimpl(wrapper=True)
def pytest_runtest_teardown(item: pytest.Item, nextitem: pytest.Item | None):
    """Fail the test after whose teardown (its fixtures', and those of a scope it ends)
    SIGINT is not as the run found it; put SIGINT back."""
    result = yield
    now = _sigint_state()
    if now != SIGINT_AT_START:
        handler, _, blocked = SIGINT_AT_START
        if handler is not None:  # None: a handler set outside Python, which we cannot set
            signal.signal(signal.SIGINT, handler)  # also undoes an ignore set outside Python
        if not blocked:
            signal.pthread_sigmask(signal.SIG_UNBLOCK, [signal.SIGINT])
        fields = ("handler", "ignored", "blocked")
        changed = {f: (a, b) for f, a, b in zip(fields, SIGINT_AT_START, now) if a != b}
        raise AssertionError(f"{item.nodeid} left SIGINT changed (was, now): {changed}")
    return result


@pytest.fixture(scope="session")
def sp_tokenizer_path(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A 512-piece sentencepiece model trained on ShareGPT text (on pseudo-words where the
    ShareGPT package is not installed), once per session."""
    from minimemserve.presets import synthetic_text, train_tokenizer
    from minimemserve.sharegpt import sharegpt_text

    out = tmp_path_factory.mktemp("sp") / "tokenizer.model"
    try:
        text = sharegpt_text(SP_TRAINING_CHARS)
    except ImportError:  # no ShareGPT package (the GPU check's machine): seeded pseudo-words
        text = synthetic_text(SP_TRAINING_CHARS)
    return train_tokenizer(out, SP_VOCAB, text)


@pytest.fixture(scope="session")
def tiny_llama_factory(
    tmp_path_factory: pytest.TempPathFactory, sp_tokenizer_path: Path
) -> Callable[..., Path]:
    """Build (or reuse within the session) a tiny random Llama checkpoint directory."""
    from minimemserve.presets import write_random_llama

    built: dict[str, Path] = {}

    def make(**overrides) -> Path:
        kwargs = TINY_LLAMA_DEFAULTS | overrides
        key = json.dumps(kwargs, sort_keys=True, default=str)
        if key not in built:
            if kwargs["vocab_size"] == SP_VOCAB:
                kwargs.setdefault("tokenizer_model", sp_tokenizer_path)
            out = tmp_path_factory.mktemp("tiny_llama")
            built[key] = write_random_llama(out, **kwargs)
        return built[key]

    return make


@pytest.fixture(scope="session")
def tiny_llama_dir(tiny_llama_factory: Callable[..., Path]) -> Path:
    """The default tiny checkpoint (GQA: 4 heads, 2 KV heads)."""
    return tiny_llama_factory()


@pytest.fixture(scope="session")
def hf_model_from_dir() -> Callable[[Path], torch.nn.Module]:
    """Load transformers' model of a directory's family: fp32, eval, eager attention."""
    from transformers import AutoModelForCausalLM

    def load(path: Path) -> torch.nn.Module:
        model = AutoModelForCausalLM.from_pretrained(
            path, dtype=torch.float32, attn_implementation="eager"
        )
        return model.eval()

    return load


@pytest.fixture(autouse=True)
def every_llm_pool_balances(monkeypatch: pytest.MonkeyPatch):
    """After each test, every ``LLM`` it built must have balanced pools, and an idle one must
    hold no block outside the cache index (nothing leaked)."""
    from minimemserve.llm import LLM

    built: list[LLM] = []
    init = LLM.__init__

    def recording_init(self, *args, **kwargs):
        init(self, *args, **kwargs)
        built.append(self)

    monkeypatch.setattr(LLM, "__init__", recording_init)
    yield
    for llm in built:  # (a runtime of processes is audited by its test: check_pools)
        for pool in getattr(llm.engine, "pools", ()):
            pool.check()
            if not llm.engine.has_unfinished():
                held = {t: s["referenced"] for t, s in pool.stats().items() if "referenced" in s}
                assert not any(held.values()), f"blocks still referenced after the test: {held}"


# A ChatML template, as Qwen checkpoints ship in tokenizer_config.json.
CHATML = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n"
    "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
HF_SPECIAL_TOKENS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]


@pytest.fixture(scope="session")
def hf_tokenizer_files(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A directory with a 512-id byte-level BPE ``tokenizer.json`` (trained with the
    ``tokenizers`` library on seeded pseudo-words) and a ``tokenizer_config.json`` naming EOS
    and a ChatML chat template, as a Qwen checkpoint has them."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    from minimemserve.presets import synthetic_text

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=SP_VOCAB,
        special_tokens=HF_SPECIAL_TOKENS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
    )
    tok.train_from_iterator(synthetic_text(SP_TRAINING_CHARS), trainer)
    out = tmp_path_factory.mktemp("hf_tokenizer")
    tok.save(str(out / "tokenizer.json"))
    config = {"bos_token": None, "eos_token": "<|im_end|>", "chat_template": CHATML}
    (out / "tokenizer_config.json").write_text(json.dumps(config))
    return out


WIDE_ROWS = 640  # embedding rows of ``wide_embedding_dir``, over a 512-entry tokenizer


@pytest.fixture(scope="session")
def wide_embedding_dir(tiny_llama_factory, hf_tokenizer_files, tmp_path_factory) -> Path:
    """A Llama-3-shaped checkpoint (an HF ``tokenizer.json``) whose embedding has more rows
    (640) than its tokenizer has entries (512), as Qwen2.5's 152,064 over 151,665."""
    model_dir = tiny_llama_factory(vocab_size=WIDE_ROWS, num_key_value_heads=1)
    out = tmp_path_factory.mktemp("wide_embedding")
    for src in (*model_dir.iterdir(), *hf_tokenizer_files.iterdir()):
        (out / src.name).write_bytes(src.read_bytes())
    return out
