"""Token deltas and logprobs in one process: contiguous, in order, equal to the final output."""

from __future__ import annotations

import pytest
import torch
from helpers import assert_pool_clean

from minimemserve import LLM, SamplingParams


def _drive(engine, rids):
    streamed: dict[str, list[int]] = {r: [] for r in rids}
    lps: dict[str, list] = {r: [] for r in rids}
    outs = {}
    while engine.has_unfinished():
        for out in engine.step():
            outs[out.request_id] = out
        for d in engine.take_deltas():
            assert d.start == len(streamed[d.request_id])
            streamed[d.request_id] += d.token_ids
            lps[d.request_id] += d.logprobs or []
    return streamed, lps, outs


@pytest.mark.parametrize("config", ["PD", "PD-CC", "1P1D", "1P1D-CC"])
def test_deltas_are_the_output_in_order(tiny_llama_dir, config):
    llm = LLM(tiny_llama_dir, config=config, num_blocks=64)
    params = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True, logprobs=2)
    rids = [llm.engine.add_request(list(range(5, 5 + n)), params) for n in (20, 37)]
    streamed, lps, outs = _drive(llm.engine, rids)
    for rid in rids:
        out = outs[rid]
        assert len(out.token_ids) == 6 and streamed[rid] == out.token_ids[: len(streamed[rid])]
        assert len(streamed[rid]) >= 5  # every token but possibly the last streamed first
        assert len(out.logprobs) == 6 and lps[rid] == out.logprobs[: len(lps[rid])]
        for tok, (lp, alts) in zip(out.token_ids, out.logprobs):
            assert len(alts) == 2 and alts[0][0] == tok  # greedy: the chosen is the most likely
            assert lp == pytest.approx(alts[0][1]) and lp <= 0.0 and alts[1][1] <= lp
    for pool in llm.pools:
        assert_pool_clean(pool)


def test_logprobs_match_hf(tiny_llama_dir, hf_model_from_dir):
    """The chosen token's logprob is log_softmax of HF's logits at that position."""
    llm = LLM(tiny_llama_dir, config="PD", num_blocks=64)
    prompt = list(range(3, 30))
    params = SamplingParams(max_tokens=3, temperature=0.0, ignore_eos=True, logprobs=0)
    out = llm.generate([prompt], params)[0]
    with torch.no_grad():
        logits = hf_model_from_dir(tiny_llama_dir)(torch.tensor([prompt + out.token_ids])).logits[0]
    for i, (tok, (lp, alts)) in enumerate(zip(out.token_ids, out.logprobs)):
        ref = torch.log_softmax(logits[len(prompt) - 1 + i], -1)[tok].item()
        assert alts == [] and lp == pytest.approx(ref, abs=1e-4)
