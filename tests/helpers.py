"""Helpers shared by engine tests."""

from __future__ import annotations

import torch


def hf_greedy(hf, prompts: list[list[int]], max_new_tokens: int) -> list[list[int]]:
    """Greedy continuations from transformers' ``generate``, one prompt at a time, no EOS stop."""
    outs = []
    with torch.no_grad():
        for p in prompts:
            ids = torch.tensor([p])
            full = hf.generate(
                ids, max_new_tokens=max_new_tokens, min_new_tokens=max_new_tokens, do_sample=False
            )
            outs.append(full[0, len(p) :].tolist())
    return outs


def assert_pool_clean(pool) -> None:
    """Accounting balances and no block is still held by a request."""
    pool.check()
    for tier, s in pool.stats().items():
        if isinstance(s, dict) and "referenced" in s:
            assert s["referenced"] == 0, f"{tier}: {s['referenced']} blocks still referenced"


def sharegpt_user_turns(
    model_dir, num_sessions: int, num_turns: int, max_user_tokens: int
) -> list[list[list[int]]]:
    """User messages of real multi-turn ShareGPT conversations, as token ids.

    ``num_sessions`` conversations with at least ``num_turns`` human turns; each message is
    cut to ``max_user_tokens`` tokens so the chained prompts fit a tiny test context.
    """
    from minimemserve.data import iter_sharegpt
    from minimemserve.model.tokenizer import Tokenizer

    tok = Tokenizer.from_dir(model_dir)
    sessions = []
    for conv in iter_sharegpt():
        human = [m["value"] for m in conv["conversations"] if m.get("from") == "human"]
        human = [h for h in human if h.strip()]
        if len(human) < num_turns:
            continue
        turns = [
            tok.encode(h, add_bos=(k == 0))[:max_user_tokens]
            for k, h in enumerate(human[:num_turns])
        ]
        sessions.append(turns)
        if len(sessions) == num_sessions:
            return sessions
    raise AssertionError("not enough multi-turn ShareGPT conversations")
