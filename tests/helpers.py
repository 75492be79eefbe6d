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
