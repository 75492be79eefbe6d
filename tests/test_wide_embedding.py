"""A checkpoint whose embedding has more rows than its tokenizer has entries (as Qwen2.5's
152,064 rows over 151,665 tokens): the ids beyond the tokenizer are the model's own output,
never an input error. They stay in ``token_ids``, have no text, and every request finishes,
in one process and across processes; no instance dies and the pools balance."""

from __future__ import annotations

import pytest
import torch

from minimemserve import LLM, SamplingParams
from minimemserve.config import EngineConfig
from minimemserve.disagg.runtime import ProcessCluster
from minimemserve.model.tokenizer import Tokenizer

BEYOND = (520, 600, 639)  # ids the tokenizer has no entry for
# A bias on ids beyond the tokenizer, so greedy and sampled runs emit them among others.
BIAS = {t: 4.0 for t in BEYOND}
MAX_TOKENS = 12
PARAMS = [
    SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0, ignore_eos=True),
    SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0, ignore_eos=True, logit_bias=BIAS),
    SamplingParams(
        max_tokens=MAX_TOKENS, temperature=1.0, seed=7, ignore_eos=True, logit_bias=BIAS
    ),
    SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0, logit_bias={600: 100.0}, logprobs=2),
]


def prompts(n: int) -> list[list[int]]:
    g = torch.Generator().manual_seed(5)
    return [torch.randint(3, 500, (7 + 6 * i,), generator=g).tolist() for i in range(n)]


def check_outputs(outs, tok: Tokenizer) -> None:
    """Every output ran to its length, its text is that of the ids the tokenizer has, and
    ids beyond the tokenizer were generated."""
    for out in outs:
        assert out.finish_reason == "length" and len(out.token_ids) == MAX_TOKENS, out
        assert out.text == tok.decode([t for t in out.token_ids if t < tok.vocab_size])
    beyond = [t for o in outs for t in o.token_ids if t >= tok.vocab_size]
    assert beyond, "no id beyond the tokenizer was generated: the test shows nothing"
    assert all(t == 600 for t in outs[-1].token_ids) and outs[-1].text == ""


def test_ids_beyond_the_tokenizer_decode_to_nothing(wide_embedding_dir):
    tok = Tokenizer.from_dir(wide_embedding_dir)
    assert tok.decode([600]) == "" and tok.decode([5, 600, 7]) == tok.decode([5, 7])
    assert tok.id_to_piece(600) == ""


@pytest.mark.parametrize("config", ["PD", "PD-CC", "1P1D-CC"])
def test_generated_ids_beyond_the_tokenizer_finish_in_process(wide_embedding_dir, config):
    llm = LLM(wide_embedding_dir, config=config, num_blocks=64)
    outs = llm.generate(prompts(len(PARAMS)), PARAMS)
    check_outputs(outs, llm.tokenizer)
    assert len(outs[-1].logprobs) == MAX_TOKENS
    llm.engine.check_pools(require_idle=True)
    assert llm.generate(prompts(1), PARAMS[0])[0].token_ids == outs[0].token_ids


def test_generated_ids_beyond_the_tokenizer_finish_across_processes(wide_embedding_dir):
    cfg = EngineConfig(num_blocks=64)
    with ProcessCluster.of(wide_embedding_dir, "1P1D-CC", engine=cfg, timeout_s=10) as c:
        rids = [c.add_request(p, s) for p, s in zip(prompts(len(PARAMS)), PARAMS)]
        outs = {o.request_id: o for o in c.run_until_done(timeout_s=120)}
        check_outputs([outs[r] for r in rids], Tokenizer.from_dir(wide_embedding_dir))
        assert not c.dead and c.num_reruns == 0
        c.check_pools(require_idle=True)
